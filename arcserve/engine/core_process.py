"""The engine in its own process: AsyncLLMProcess has AsyncLLM's interface, but LLMEngine runs in a
child process, so model steps and the HTTP event loop share neither the GIL nor a core.

The parent keeps a model-less InputProcessor (tokenizer, configs, validation): requests are tokenized
and validated there, then sent as prepared Requests over a pipe. The child steps the engine and sends
back each step's RequestOutputs with the engine's figures (served by /metrics): the gauges every
step, everything at most every 0.25 s and with every step that finishes a request.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import signal
import threading
import time

from arcserve.config import EngineArgs
from arcserve.engine.async_engine import AsyncLLM, RequestFailed, run_command, step_isolated
from arcserve.engine.inputs import InputProcessor

logger = logging.getLogger("arcserve")


class EngineView(InputProcessor):
    """What the server reads of an engine that runs elsewhere: inputs and the latest figures."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        self.snapshot: dict = {}

    def get_metrics(self) -> dict:
        return self.snapshot


def _core_main(args: EngineArgs, cmd_conn, out_conn, threads: int | None, log_level: int) -> None:
    import torch

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if threads:
        torch.set_num_threads(threads)
    from arcserve.engine.engine import LLMEngine

    try:
        engine = LLMEngine(args)
    except BaseException as e:  # report startup errors (bad folder, KV cache too small) to the parent
        out_conn.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    # This process holds one engine for its whole life. Freeze what startup built (the torch modules,
    # the block pool's per-block containers: ~1M objects): a full garbage collection would otherwise
    # walk them all, tens of ms (69 ms on the CI machine) landing on some request's latency.
    gc.collect()
    gc.freeze()
    engine.grammars.warm()  # (structured outputs: the grammar engine's tokenizer, built beside the first steps)
    # From now on the server process decides when the engine stops (graceful shutdown): a SIGTERM or
    # Ctrl-C sent to the whole process group must not kill the engine under the requests still
    # finishing. (While loading, the signals still stop this process: nothing is lost then.)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_conn.send(("ready", engine.get_metrics()))
    try:
        _serve_commands(engine, cmd_conn, out_conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the parent is gone: stop quietly
        return


_FULL_FIGURES_EVERY = 0.25  # s; the full figures also go with every step that finishes a request


def _serve_commands(engine, cmd_conn, out_conn) -> None:
    last_full = 0.0

    def figures(force: bool) -> dict:
        """All figures when forced or due; else only the gauges the parent reads per request
        (admission control), which are cheap (building every histogram each step is not)."""
        nonlocal last_full
        now = time.monotonic()
        if force or now - last_full >= _FULL_FIGURES_EVERY:
            last_full = now
            return engine.get_metrics()
        st = engine.scheduler.stats()
        return {"arcserve:num_requests_running": st.num_running, "arcserve:num_requests_waiting": st.num_waiting,
                "arcserve:kv_cache_usage_perc": st.kv_cache_usage}  # fmt: skip

    while True:
        added, timeout = 0, (0 if engine.has_unfinished_requests() else 0.5)
        while cmd_conn.poll(timeout):
            timeout = 0
            kind, arg = cmd_conn.recv()
            if kind == "stop":
                return
            added += arg[0].params.n if kind == "add" else 0  # sequences, as the parent counts them
            err = run_command(engine, kind, arg)
            if err is not None:
                out_conn.send(("error", arg[0].request_id, str(err)))
        if not engine.has_unfinished_requests():
            if added or timeout == 0:  # commands changed the figures (aborts free blocks)
                out_conn.send(("outputs", [], figures(True), added))
            continue
        outs, failed, err = step_isolated(engine)
        # Without their prompts: the server process has them (it tokenized them; AsyncLLM._deliver_all
        # puts them back). Pickled with every streamed token, a 1,024-token prompt cost ~47 us to
        # unpickle there and ~22 us to pickle here per token.
        for out in outs:
            out.prompt, out.prompt_token_ids = None, None
        out_conn.send(("outputs", outs, figures(bool(failed) or any(o.finished for o in outs)), added))
        if failed:
            out_conn.send(("failed", failed, repr(err)))


class AsyncLLMProcess(AsyncLLM):
    def __init__(self, args: EngineArgs, max_waiting_requests: int | None = None, threads: int | None = None) -> None:
        super().__init__(EngineView(args), max_waiting_requests, start=False)
        ctx = mp.get_context("spawn")
        cmd_parent, cmd_child = ctx.Pipe(duplex=False)[::-1]  # (send end, receive end) -> parent sends
        out_parent, out_child = ctx.Pipe(duplex=False)
        self._cmd, self._out = cmd_parent, out_parent
        self._send_lock = threading.Lock()
        self.proc = ctx.Process(
            target=_core_main, args=(args, cmd_child, out_child, threads, logging.getLogger().level),
            name="arcserve-engine-core", daemon=True,
        )  # fmt: skip
        self.proc.start()
        try:
            while not self._out.poll(0.5):  # loading may take minutes; a child that died never answers
                if not self.proc.is_alive():
                    raise ValueError(f"the engine process exited while starting (exit code {self.proc.exitcode}); "
                                     "its log above says why")  # fmt: skip
            kind, payload = self._out.recv()
        except BaseException:  # Ctrl-C while loading, or the above: leave no engine process behind
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
            raise
        if kind == "fatal":
            self.proc.join(timeout=5)
            raise ValueError(payload)
        self.engine.snapshot = payload
        self._thread = threading.Thread(target=self._receive, name="arcserve-engine-io", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._pending + int(self.engine.snapshot.get("arcserve:num_requests_waiting", 0))

    def _num_running(self) -> int:
        return int(self.engine.snapshot.get("arcserve:num_requests_running", 0))

    def _submit(self, kind: str, arg) -> None:
        try:
            with self._send_lock:  # the event loop and the shutdown timer both send
                self._cmd.send((kind, arg))
        except (BrokenPipeError, OSError) as e:  # the engine process is gone: the reader fails the streams
            with self._lock:
                self.dead = self.dead or e

    def _receive(self) -> None:
        try:
            self._receive_loop()
        except BaseException as e:  # a fault of this thread: no stream may be left waiting on it
            logger.exception("the thread reading the engine's outputs failed")
            if not self._stop:
                # Nothing reads the engine's outputs any more: stop it (it would block writing
                # them, and stop reading commands) before failing every stream.
                self.proc.kill()
                self._die(e)

    def _receive_loop(self) -> None:
        while not self._stop:
            try:
                if not self._out.poll(0.5):
                    if not self.proc.is_alive():
                        raise EOFError("engine process exited")
                    continue
                msg = self._out.recv()
            except (EOFError, OSError) as e:
                if not self._stop:
                    self._die(e)
                return
            kind = msg[0]
            if kind == "outputs":
                _, outs, snapshot, added = msg
                self.engine.snapshot = {**self.engine.snapshot, **snapshot}  # first: then the added ones
                with self._lock:  # are counted there before they leave _pending (never in neither)
                    self._pending -= added
                self._deliver_all([(out.request_id, out) for out in outs])
            elif kind == "error":
                self._deliver(msg[1], ValueError(msg[2]))
            elif kind == "failed":
                for rid in msg[1]:
                    self._deliver(rid, RequestFailed(msg[2]))

    def shutdown(self) -> None:
        self._stop = True
        self._submit("stop", None)
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
        self._thread.join(timeout=5)
