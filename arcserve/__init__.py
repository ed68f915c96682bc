"""arcserve: a pure-Python LLM inference and serving engine."""

from arcserve.beam_search import BeamSearchOutput, BeamSearchSequence
from arcserve.config import EngineArgs
from arcserve.engine.engine import LLMEngine
from arcserve.llm import LLM
from arcserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from arcserve.sampling_params import (
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "StructuredOutputsParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "RequestOutputKind",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
]
