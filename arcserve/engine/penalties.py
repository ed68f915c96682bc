"""Repetition, frequency and presence penalties, with each request's token counts kept on the device.

A penalized request gets a slot at its first sampling: a row of output-token counts [V] and a row of
prompt-token flags [V] on the device, and its three penalties. The prompt and whatever output the
host already holds are uploaded once then. After each step the sampled tokens are added to their
rows' counts on the device, so a step never needs the output so far on the host: penalized rows
sample at launch, and overlapped steps stay overlapped. (Before, every step gathered every
penalized request's whole prompt and output into arrays on the host: O(tokens) per step, more host
time than the device's step at 64-256 requests.)

The host keeps, per slot, how many output tokens its counts hold. A speculative step's tokens are
not added on the device (how many of a row's drafts survive is known only once the host reads
them); the next sampling finds the count behind and adds the missing tokens from the host, where
they are by then (the engine reads a speculative step before launching the next). A slot whose
request ended or left the running set is reused once slots run out; its counts are reset then.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from arcserve.engine.request import Request, RequestStatus
from arcserve.kernels import reference
from arcserve.platform import to_device


def flat(rows: list[int], lists: list) -> tuple[np.ndarray, np.ndarray]:
    """(row index of each element, elements) of the concatenated lists."""
    lens = np.fromiter((len(x) for x in lists), dtype=np.int64, count=len(lists))
    vals = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=int(lens.sum()))
    return np.repeat(np.asarray(rows, dtype=np.int64), lens), vals


class PenaltyState:
    """The device's counts of the penalized requests' tokens, by slot (see the module's text)."""

    def __init__(self, device: torch.device, vocab: int, apply_penalties=reference.apply_penalties,
                 slots: int | None = None) -> None:  # fmt: skip
        """slots: the table's rows, allocated now (the engine passes max_num_seqs: a step's rows
        belong to at most that many requests, and the memory is set aside at startup, see
        table_bytes); None: 8, doubled whenever every slot is taken."""
        self.device = device
        self.vocab = vocab
        self.kernel = apply_penalties  # the kernel namespace's (Triton on GPUs)
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)  # output tokens
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)  # prompt tokens
        self.params = torch.zeros(0, 3, dtype=torch.float32, device=device)  # repetition, frequency, presence
        self.params_host = np.zeros((0, 3), dtype=np.float32)
        self.owner: list[Request | None] = []
        self.free: list[int] = []  # slots without an owner (popped from the end: lowest first)
        self.counted = np.zeros(0, dtype=np.int64)  # output tokens each slot's counts hold
        self.slot_of: dict[Request, int] = {}
        # count()'s inputs from the last apply: rows (None: every row, in order), each row's first
        # flat position in the table, the host's slots
        self._last: tuple[torch.Tensor | None, torch.Tensor, np.ndarray] | None = None
        self._upload: tuple[np.ndarray, torch.Tensor] | None = None  # the last apply's indices, host and device
        self._grow(slots or 8)

    @staticmethod
    def table_bytes(slots: int, vocab: int) -> int:
        """Device memory of a table of `slots` slots: float32 counts, bool flags, three penalties."""
        return slots * (vocab * 5 + 12)

    def apply(self, logits: torch.Tensor, reqs: list[Request], rows: list[int], before: list[int],
              offsets: np.ndarray | None) -> None:  # fmt: skip
        """In place, for `rows` of the float32 logits [B, V]: the penalties of each row's request
        over its prompt and its first before[j] output tokens (tokens sampled before this step),
        plus, for a speculating row, the offsets[i] drafts before it (counted as output)."""
        slots = self._slots([reqs[i] for i in rows], before)
        R, V, dev = len(rows), self.vocab, self.device
        extra = np.zeros(0, dtype=np.int64)  # (row j, draft token t) as j * V + t
        if offsets is not None:
            ks = offsets[rows]
            j, toks = flat(np.flatnonzero(ks).tolist(), [reqs[i].spec_token_ids[:k] for i, k in zip(rows, ks.tolist()) if k])
            extra = (j * V + toks)[toks < V]
        # One upload: rows, slots, the slots' first flat positions (count()), drafts; each part starting
        # 16-byte aligned whatever R is (Triton compiles a kernel per pointer alignment). In steady
        # decoding it repeats the last step's, whose device copy is reused.
        a = R + (R & 1)
        pad = np.zeros(a - R, np.int64)
        host = np.concatenate([np.asarray(rows, np.int64), pad, slots, pad, slots * V, pad, extra])
        if self._upload is not None and np.array_equal(self._upload[0], host):
            idx = self._upload[1]
        else:
            idx = to_device(host, dev)
            self._upload = (host, idx)
        rows_d, slots_d, base_d = idx[:R], idx[a : a + R], idx[2 * a : 2 * a + R]
        if len(extra):  # the rows' own tables, each speculating row's counts with the drafts before it
            c = self.counts[slots_d]
            c.view(-1).index_add_(0, idx[3 * a :], torch.ones(len(extra), device=dev))
            self.kernel(logits, rows_d, c, self.prompt[slots_d], torch.arange(R, device=dev), self.params[slots_d])
        else:
            self.kernel(logits, rows_d, self.counts, self.prompt, slots_d, self.params)
        every = R == logits.shape[0] and rows[0] == 0 and rows[-1] == R - 1  # (rows are ascending)
        self._last = None if offsets is not None else (None if every else rows_d, base_d, slots)

    def count(self, tokens: torch.Tensor) -> None:
        """After the sampling that apply() prepared, unless it had drafts: add each row's sampled
        token to its slot's counts, on the device."""
        if self._last is None:
            return
        rows_d, base_d, slots = self._last
        self._last = None
        at = base_d + (tokens if rows_d is None else tokens[rows_d])
        self.counts.view(-1).index_add_(0, at, self._ones[: len(slots)])
        self.counted[slots] += 1  # (one row per request: no slot twice)

    def _slots(self, reqs: list[Request], before: list[int]) -> np.ndarray:
        """Each request's slot, assigned (and filled from the host) where it has none, brought up
        to its first before[j] output tokens where the device's counts are behind."""
        slots = np.empty(len(reqs), dtype=np.int64)
        fill: dict[int, tuple[Request, int, int]] = {}  # slot -> (request, tokens counted (-1: new), wanted)
        for j, (req, n) in enumerate(zip(reqs, before)):
            s = self.slot_of.get(req)
            if s is None:
                s = self._new_slot(req, reqs)
                fill[s] = (req, -1, n)
            elif s not in fill and self.counted[s] != n:
                # behind: a speculative step's tokens, read by the host since. Never ahead: a token
                # counted on the device and dropped by the host ends its request.
                if self.counted[s] > n or req.num_output_tokens < n:
                    raise AssertionError(f"request {req.request_id}: penalty counts hold {self.counted[s]} "
                                         f"output tokens, the host {req.num_output_tokens} of the {n} wanted")  # fmt: skip
                fill[s] = (req, int(self.counted[s]), n)
            slots[j] = s
        if fill:
            self._fill(fill)
        return slots

    def _new_slot(self, req: Request, busy: list[Request]) -> int:
        if not self.free:  # reclaim the slots of requests that ended or were preempted (not of this step's rows)
            rows = set(busy)
            for s, r in reversed(list(enumerate(self.owner))):
                if (r.is_finished or r.status != RequestStatus.RUNNING) and r not in rows:
                    del self.slot_of[r]
                    self.owner[s] = None
                    self.free.append(s)
        if not self.free:
            self._grow(len(self.owner))
        s = self.free.pop()
        self.owner[s] = req
        self.slot_of[req] = s
        p = req.params
        self.params_host[s] = (p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
        return s

    def _grow(self, more: int) -> None:
        old = len(self.owner)
        new = old + more
        dev = self.device

        def grown(t: torch.Tensor) -> torch.Tensor:
            z = t.new_zeros(new - old, t.shape[1])
            return z if old == 0 else torch.cat([t, z])  # (the first table: no copy of an empty one)

        self.counts, self.prompt, self.params = grown(self.counts), grown(self.prompt), grown(self.params)
        self.params_host = np.concatenate([self.params_host, np.zeros((new - old, 3), np.float32)])
        self.counted = np.concatenate([self.counted, np.zeros(new - old, np.int64)])
        self.owner += [None] * (new - old)
        self.free = list(range(new - 1, old - 1, -1)) + self.free
        self._ones = torch.ones(new, device=dev)

    def _fill(self, fill: dict[int, tuple[Request, int, int]]) -> None:
        """Bring slots up to date from the host in one upload: new slots (counted -1) are reset and
        get their prompt, penalties and output so far; others get the output tokens they lack.
        (index_fill_ and index_add_, not assignments of a Python scalar through an index, which
        copy the scalar to the device synchronously, nor index_put_ with accumulate: both made the
        host wait for the device.)"""
        V, dev = self.vocab, self.device
        new = [s for s, (_, c, _) in fill.items() if c < 0]
        # (slices of token_ids: output_token_ids would copy a request's whole output first)
        outs = [r.token_ids[r.num_prompt_tokens + max(c, 0) : r.num_prompt_tokens + n] for r, c, n in fill.values()]
        o_row, o_tok = flat(list(fill), outs)
        p_row, p_tok = flat(new, [fill[s][0].prompt_token_ids for s in new])
        # (a padded vocabulary may hold ids the model never makes)
        o_lin, p_lin = (o_row * V + o_tok)[o_tok < V], (p_row * V + p_tok)[p_tok < V]
        idx = to_device(np.concatenate([np.asarray(new, np.int64), o_lin, p_lin]), dev)
        if new:
            new_d = idx[: len(new)]
            self.counts.index_fill_(0, new_d, 0.0)
            self.prompt.index_fill_(0, new_d, False)
            self.params.index_copy_(0, new_d, to_device(self.params_host[new], dev))
        o = len(new)
        self.counts.view(-1).index_add_(0, idx[o : o + len(o_lin)], torch.ones(len(o_lin), device=dev))
        self.prompt.view(-1).index_fill_(0, idx[o + len(o_lin) :], True)
        for s, (_, _, n) in fill.items():
            self.counted[s] = n
