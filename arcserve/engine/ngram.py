"""N-gram prompt lookup: draft tokens copied from earlier in the request's own context.

The suffix of the context (its last n tokens, n from prompt_lookup_max down to prompt_lookup_min) is
looked up among the earlier tokens (prompt and generated); at the most recent earlier occurrence that
k tokens follow (else the earliest one), the tokens that followed it are the drafts. Text that
repeats or edits its prompt (code, documents, quotes) gets long runs of accepted drafts; other text
finds no match, and its requests soon pause their lookups (speculative.DraftLength).

Each request's tokens are kept in a numpy array that grows with the request (no per-step copy of the
context); the lookup compares the suffix's first token against the whole context in one vectorised
pass, then filters the candidates by the suffix's other tokens.
"""

from __future__ import annotations

import numpy as np

from arcserve.engine.request import Request


def find_drafts(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> np.ndarray:
    """Up to k tokens that followed an earlier occurrence of the longest suffix n-gram (n_max down
    to n_min) of `tokens`: the most recent one with k tokens after it, else the earliest; empty when
    there is none."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n :]
        # starts i with at least one token after the occurrence: i + n <= L - 1
        cand = np.flatnonzero(tokens[: L - n] == suffix[0])
        for j in range(1, n):
            if not len(cand):
                break
            cand = cand[tokens[cand + j] == suffix[j]]
        if len(cand):
            # the most recent occurrence followed by k tokens, else the earliest (the longest run;
            # in periodic text the most recent occurrence sits right before the end)
            full = cand[cand + n + k <= L]
            start = int(full[-1] if len(full) else cand[0]) + n
            return tokens[start : start + k]
    return tokens[:0]


class NgramProposer:
    empty_is_miss = True  # a lookup that finds nothing counts as a miss (speculative.DraftLength)

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        # request seq_no (never reused, unlike a request id) -> (buffer, tokens in it)
        self._tokens: dict[int, tuple[np.ndarray, int]] = {}

    def _context(self, req: Request) -> np.ndarray:
        buf, n = self._tokens.get(req.seq_no, (None, 0))
        L = req.num_tokens
        if buf is None or L > len(buf) or n > L:
            grown = np.empty(max(2 * L, 256), dtype=np.int64)
            grown[:L] = req.token_ids
            buf = grown
        elif L > n:
            buf[n:L] = req.token_ids[n:L]
        self._tokens[req.seq_no] = (buf, L)
        return buf[:L]

    def propose(self, wanted: list[tuple[Request, int]], running: list[Request]) -> None:
        """Set spec_token_ids of each (request, k) to up to k drafts; forget requests not running."""
        for req, k in wanted:
            req.spec_token_ids = find_drafts(self._context(req), self.n_min, self.n_max, k).tolist()
        if len(self._tokens) > len(running):
            live = {r.seq_no for r in running}
            for key in [s for s in self._tokens if s not in live]:
                del self._tokens[key]
