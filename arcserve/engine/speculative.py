"""Speculative decoding: its configuration, the acceptance rule, the per-request draft length, figures.

One step, for a decoding request that speculates (the configuration is config.SpeculativeConfig):
1. before scheduling, a proposer (ngram.py: prompt lookup; draft.py: a draft model) puts up to k draft
   tokens in `req.spec_token_ids`;
2. the scheduler schedules the request's last token plus its drafts (fewer drafts when the step's
   token budget is short), allocating KV blocks for all of them;
3. the target model runs every scheduled position in one forward, beside ordinary decodes and prefill
   chunks; the sampler samples each position j as if the drafts before it were accepted (its penalties,
   min_tokens and seeded uniform number are those of that position);
4. `accept`: the drafts are kept while each equals the token sampled at its position; the first token
   that differs, or the bonus token after k accepted drafts, ends the list. For a proposal of one token
   (prompt lookup, or a draft model's argmax) this is exactly Leviathan et al.'s rejection sampling:
   a draft d is accepted with probability p(d) = min(1, p(d) / 1), and on rejection the token comes from
   p without d, renormalised (the residual of a one-hot draft distribution); the draft model
   proposes its argmax, so both methods are one-token proposals. Greedy requests accept while the
   draft equals the argmax. So the output has the distribution
   of decoding without speculation, and a seeded request decoding by prompt lookup or by an argmax
   draft gets exactly the tokens it gets without speculation;
   Steps stay overlapped (async_scheduling) except around verifications: the engine reads the
   previous step before proposing (drafts start from the tokens on the host) and after a step that
   verified drafts (the acceptance decides the next positions);
5. the scheduler appends the accepted tokens (stopping at a stop token or max_tokens) and takes back
   the computed-token count of the rejected positions; their KV entries are overwritten later, and
   prefix-cache hashes only ever cover tokens on the host, never drafts.

The draft length rule (DraftLength) keeps speculation cheap where it does not pay: see its docstring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from arcserve.engine.request import Request


def accept(drafts: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified request gets: sampled[j] for each position while the draft there equals
    it, then the first differing sampled token (or the bonus token after the last draft).
    sampled has len(drafts) + 1 entries; the result has 1 to len(drafts) + 1."""
    n = 0
    for d, t in zip(drafts, sampled):
        if d != t:
            break
        n += 1
    return sampled[: n + 1]


@dataclass
class SpecState:
    """A request's draft-length state (DraftLength's rule)."""

    k: int  # drafts to propose at the next step
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # steps left without speculation
    backoff: int = 0  # length of the next pause


class DraftLength:
    """How many drafts a request proposes, per request, from its own acceptance:

    - it starts at k; after a verification that accepted every draft it doubles (up to k: a probe
      of one draft after a pause is back at k = 8 after three full acceptances); after one that
      accepted a drafts of more, it becomes a + 1;
    - after MISSES misses in a row (verifications that accepted nothing, or prompt lookups that
      found nothing), the request stops speculating for a pause of FIRST_PAUSE steps, doubling after
      each further miss up to MAX_PAUSE, then tries again with one draft; an accepted draft ends the
      pauses.

    With nothing ever accepted a request speculates on 2 steps, then on one step in 8, 16, 32, 64,
    64, ...: past the first hundred steps under 2% of its steps carry a failed proposal. A paused
    request needs no proposal, so its steps overlap as without speculation (engine.step).
    """

    MISSES = 2
    FIRST_PAUSE = 8
    MAX_PAUSE = 64

    def __init__(self, k: int) -> None:
        self.max_k = k

    def state(self, req: Request) -> SpecState:
        if req.spec_state is None:
            req.spec_state = SpecState(self.max_k)
        return req.spec_state

    def tick(self, req: Request) -> bool:
        """One decode step of the request: whether it speculates in it (False while paused)."""
        st = self.state(req)
        if st.pause > 0:
            st.pause -= 1
            return False
        return True

    def update(self, req: Request, proposed: int, accepted: int) -> None:
        """After a verification of `proposed` drafts (0: a lookup that found none)."""
        st = self.state(req)
        if proposed and accepted == proposed:
            st.k = min(self.max_k, 2 * st.k)
        elif proposed:
            st.k = max(1, accepted + 1)
        if accepted:
            st.misses, st.backoff = 0, 0
            return
        st.misses += 1
        if st.misses >= self.MISSES:
            st.backoff = min(self.MAX_PAUSE, st.backoff * 2) if st.backoff else self.FIRST_PAUSE
            st.pause = st.backoff
            st.k = 1


@dataclass
class SpecFigures:
    """Counters of speculative decoding, exported as arcserve:spec_decode_*."""

    num_drafts: int = 0  # verifications of a request with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos += [0] * (proposed - len(self.accepted_per_pos))
        for j in range(accepted):
            self.accepted_per_pos[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: 1 + accepted drafts per verification (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
