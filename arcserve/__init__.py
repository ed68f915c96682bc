"""arcserve: a pure-Python LLM inference and serving engine."""

from arcserve.config import EngineArgs
from arcserve.engine.engine import LLMEngine
from arcserve.llm import LLM
from arcserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from arcserve.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
]
