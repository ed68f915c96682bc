"""AsyncLLM: the asyncio front of LLMEngine for the server.

The engine runs in its own thread (steps are blocking tensor work and must not stall the event loop).
Callers validate and tokenize on their side (LLMEngine.prepare_request is free of engine state),
then hand the prepared request to the engine thread through a command queue; outputs come back on a
per-request asyncio.Queue. A caller that goes away (client disconnect, cancellation) aborts its request,
which frees its KV blocks at the engine's next turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from arcserve.engine.engine import LLMEngine
from arcserve.outputs import RequestOutput
from arcserve.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from arcserve.engine.output_processor import RequestGroup

logger = logging.getLogger("arcserve")


def run_command(engine: LLMEngine, kind: str, arg) -> ValueError | None:
    """Apply one front-end command to the engine: "add" a prepared request or "abort" an id.
    A refused add returns its error (for the caller) instead of raising."""
    if kind == "add":
        try:
            engine.add_prepared(arg)
        except ValueError as e:
            return e
    else:
        engine.abort_request(arg)
    return None


def step_isolated(engine: LLMEngine) -> tuple[list[RequestOutput], list[str], Exception | None]:
    """One engine step: (outputs, failed group ids, error). If it raises, only the requests of the
    failed step (and of the step in flight beside it) fail: they are aborted (blocks freed) and
    returned with the error, after the outputs the step built before it failed (deliver those
    first), and the engine serves the others and the next ones."""
    try:
        return engine.step(), [], None
    except Exception as e:
        outs, ids = engine.fail_step()
        logger.exception("engine step failed; failing its %d request(s): %s", len(ids), ", ".join(ids[:8]))
        return outs, ids, e


class RequestFailed(RuntimeError):
    """The engine step that held this request raised (HTTP 500); other requests are unaffected."""

    def __init__(self, err: str) -> None:
        super().__init__(f"internal error in the engine step that held this request ({err}); "
                         "the request was stopped and its resources freed, other requests are unaffected")


class EngineOverloaded(Exception):
    """Too many requests are waiting; the caller should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    pass


class ServerShuttingDown(Exception):
    """The server is shutting down: new requests are refused and, past --shutdown-timeout, the
    unfinished ones are stopped with this error (HTTP 503)."""


class OutputQueue(asyncio.Queue):
    """A request's outputs. Streamed outputs are deltas: one that arrives while the previous is still
    unread joins it (as vLLM does), so a consumer that falls behind (a saturated event loop, a slow
    client) gets fewer, longer chunks instead of a backlog of one-token chunks, each costing the
    server a JSON encoding and a socket write."""

    def __init__(self, deltas: bool) -> None:
        super().__init__()
        self.deltas = deltas

    def _put(self, item) -> None:
        q = self._queue
        if self.deltas and q and isinstance(item, RequestOutput) and isinstance(q[-1], RequestOutput):
            q[-1] = join_deltas(q[-1], item)
        else:
            q.append(item)


def join_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two successive delta outputs of one request as one: each sequence's new text, tokens and
    logprobs in order; the later one's state (finish, cumulative logprob, metrics)."""
    outs = {o.index: o for o in a.outputs}
    for o in b.outputs:
        prev = outs.get(o.index)
        if prev is not None:
            o = dataclasses.replace(
                o, text=prev.text + o.text, token_ids=prev.token_ids + o.token_ids,
                logprobs=None if o.logprobs is None else (prev.logprobs or []) + o.logprobs,
            )  # fmt: skip
        outs[o.index] = o
    return dataclasses.replace(
        b, outputs=[outs[i] for i in sorted(outs)], extra={**a.extra, **b.extra},
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )  # fmt: skip


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None, start: bool = True) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (its caller's event loop, its output queue, the prepared request)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputQueue, RequestGroup]] = {}
        self._pending = 0  # sequences (n per request) handed over but not yet seen by the engine
        self._lock = threading.Lock()
        self._stop = False
        self.dead: BaseException | None = None
        self.draining = False  # shutting down: no new requests
        self.stopped = False  # past the drain's timeout (cancel_all): nothing more starts
        self._thread = threading.Thread(target=self._run, name="arcserve-engine", daemon=True)
        if start:
            self._thread.start()

    # ---- caller side (event loop) -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return self._pending + self.engine.scheduler.num_waiting

    def _num_running(self) -> int:
        return len(self.engine.scheduler.running)

    def add_request(
        self, prompt, params: SamplingParams, request_id: str, priority: int = 0, stream: bool = True
    ) -> RequestStream:
        """Validate and queue a request; iterate the returned stream for its outputs (deltas when
        `stream`, else one final output). Raises ValueError for bad input and EngineOverloaded when
        the waiting queue is full, with nothing queued."""
        return self.add_requests([(prompt, params, request_id)], priority, stream)[0]

    def add_requests(self, items: list[tuple], priority: int = 0, stream: bool = True,
                     admitted: bool = False) -> list[RequestStream]:  # fmt: skip
        """(prompt, params, request_id) items, all validated before any is queued: all or nothing.
        admitted: the items belong to a request admit() took already (a beam search's later steps):
        no drain or waiting-queue check again, until cancel_all has stopped everything."""
        self._refuse_if_dead()
        if admitted and self.stopped:
            raise ServerShuttingDown("the server shut down before this request finished (--shutdown-timeout)")
        prepared = []
        for prompt, params, request_id in items:
            kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
            prepared.append(self.engine.prepare_request(request_id, prompt, params, time.time(), priority, kind))
        if not admitted:
            self.admit(sum(g.params.n for g, _ in prepared))
        loop = asyncio.get_running_loop()
        streams = []
        with self._lock:  # (dead is set under this lock: a stream opened here is failed by _die, or never opened)
            self._refuse_if_dead()
            dup = [g.request_id for g, _ in prepared if g.request_id in self._streams]
            if dup:
                raise ValueError(f"request_id {dup[0]!r} is already in use")
            for group, _ in prepared:
                q = OutputQueue(deltas=stream)
                self._streams[group.request_id] = (loop, q, group)
                streams.append(RequestStream(self, group.request_id, q))
            self._pending += sum(g.params.n for g, _ in prepared)
        for p in prepared:
            self._submit("add", p)
        return streams

    def _refuse_if_dead(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an internal error: {self.dead!r}")

    def admit(self, new_seqs: int) -> None:
        """Whether a request of new_seqs sequences may start: not while the server drains (503), and
        503 when, with them, more than max_waiting_requests would wait. Requests the engine has not
        seen yet are not all waiting: those that find a free max_num_seqs slot start at once (unless
        the engine already holds waiting requests: then every newcomer waits)."""
        if self.draining:
            raise ServerShuttingDown("the server is shutting down and takes no new requests")
        if self.max_waiting_requests is None:
            return
        seats = self.engine.args.max_num_seqs
        most = self.max_waiting_requests + seats
        if new_seqs > most:  # could never be admitted: retrying does not help
            raise ValueError(f"n must be smaller: the request needs {new_seqs} sequences (n x prompts) and "
                             f"this server takes at most {most} at once (max_num_seqs + max_waiting_requests)")  # fmt: skip
        waiting, pending = self.num_waiting, self._pending
        if waiting > pending:  # the engine holds requests it could not start: newcomers queue behind them
            would_wait = waiting + new_seqs
        else:
            would_wait = self._num_running() + pending + new_seqs - seats
        if would_wait > self.max_waiting_requests:
            raise EngineOverloaded(f"{waiting} requests are waiting (limit {self.max_waiting_requests})")

    async def generate(self, prompt, params: SamplingParams, request_id: str, priority: int = 0,
                       stream: bool = True) -> AsyncIterator[RequestOutput]:  # fmt: skip
        s = self.add_request(prompt, params, request_id, priority, stream)
        try:
            async for out in s:
                yield out
        finally:
            s.close()

    def _release(self, request_id: str, finished: bool) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
        if not finished:
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def _submit(self, kind: str, arg) -> None:
        self._commands.put((kind, arg))
        self._wake.set()

    def cancel_all(self, err: Exception) -> int:
        """Stop every unfinished request: its caller gets `err`, the engine frees its blocks.
        Returns how many were stopped (graceful shutdown past its timeout)."""
        self.stopped = True  # (admitted requests' later parts too: a beam search's next step)
        with self._lock:
            ids = list(self._streams)
        self._deliver_all([(rid, err) for rid in ids])  # every caller first: aborts may block on a pipe
        if self.dead is None:  # (a dead engine frees nothing)
            for rid in ids:
                self.abort(rid)
        return len(ids)

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- engine thread ------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """(request id, output or error) pairs to their streams: one wake-up of each event loop for
        the lot (a wake-up writes to the loop's socket: once a step, not once a token). Outputs that
        come without their prompt (from the engine process) get it back from the request here."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for rid, item in items:
                target = self._streams.get(rid)
                if target is not None:
                    loop, q, request = target
                    if isinstance(item, RequestOutput) and item.prompt_token_ids is None:
                        item.prompt, item.prompt_token_ids = request.prompt, request.prompt_token_ids
                    by_loop.setdefault(loop, []).append((q, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":  # (one whose caller already left is added all the same: the abort its
                with self._lock:  # stream queued behind it counts it as aborted, as the engine process does)
                    self._pending -= arg[0].params.n
            err = run_command(self.engine, kind, arg)
            if err is not None:
                self._deliver(arg[0].request_id, err)

    def _die(self, err: BaseException) -> None:
        """The engine cannot go on: every open request fails at once (no client waits on a dead
        stream) and /health answers 503."""
        logger.error("the engine stopped: %r", err)
        with self._lock:  # every stream opened before this fails below; none opens after it
            self.dead = err
        self.cancel_all(EngineDeadError(f"the engine stopped: {err!r}"))

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a fault outside a step (step faults are isolated in step_isolated)
            logger.exception("engine thread failed")
            self._die(e)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            outputs, failed, err = step_isolated(self.engine)
            self._deliver_all([(out.request_id, out) for out in outputs]
                              + [(rid, RequestFailed(repr(err))) for rid in failed])  # fmt: skip


def _put_all(puts: list[tuple[OutputQueue, object]]) -> None:
    for q, item in puts:
        try:
            q.put_nowait(item)
        except Exception as e:  # (a delta that would not join): that stream fails, the others get theirs
            logger.exception("could not queue an output of a request")
            q.deltas = False
            q.put_nowait(e)


class RequestStream:
    """Outputs of one request. close() (or leaving an `async for` early) aborts it if unfinished."""

    def __init__(self, owner: AsyncLLM, request_id: str, q: asyncio.Queue):
        self.owner, self.request_id, self.q = owner, request_id, q
        self.finished = False
        self.closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self.closed:
            raise StopAsyncIteration
        try:
            item = self.q.get_nowait() if not self.q.empty() else await self.q.get()
        except BaseException:  # cancelled (client went away): abort the request
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.owner._release(self.request_id, self.finished)
