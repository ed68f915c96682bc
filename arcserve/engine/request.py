"""Request: one sequence being generated (a prompt with n > 1 becomes n Requests)."""

from __future__ import annotations

import enum
import itertools
import time

from arcserve.outputs import RequestMetrics, SampleLogprobs
from arcserve.sampling_params import SamplingParams

_SEQ = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.seq_no = next(_SEQ)  # tie-breaker for equal arrival times
        self.params = params
        self.priority = priority
        self.max_tokens = max_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Sampled tokens still on the device (overlapped steps): they count for scheduling and
        # sampling positions and reach token_ids when the host reads them, one step later.
        self.num_pending = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[bytes] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Prompt logprobs: one entry per prompt token, None for the first (it has no context).
        self.prompt_logprobs: SampleLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.num_preemptions = 0
        self.seed: int | None = None  # this sequence's seed (the request's seed + its index)
        self.sampling_row = None  # the sampler's packed form of params, made at the first sampling
        self.allowed_ids = None  # the sampler's array of params.allowed_token_ids, made likewise
        self.grammar = None  # structured outputs: this sequence's structured.Constraint (made by the engine)
        # Speculative decoding: drafts proposed for the next step (the scheduler keeps those it
        # schedules), and the draft-length state (speculative.DraftLength).
        self.spec_token_ids: list[int] = []
        self.spec_state = None
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens not yet in the KV cache, those still on the device included (1 while decoding)."""
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
