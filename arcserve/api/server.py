"""The FastAPI app: routes, auth, errors; and run_server() for `arcserve serve`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket
import threading
import time

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import arcserve
from arcserve.api.errors import APIError, ClientDisconnected, bad_request, error_response
from arcserve.api.metrics import make_registry
from arcserve.api.middleware import (
    MAX_BODY_BYTES,
    OPEN_PATHS,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdHeaderMiddleware,
)
from arcserve.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from arcserve.api.serving import Serving, off_loop
from arcserve.engine.async_engine import (
    AsyncLLM,
    EngineDeadError,
    EngineOverloaded,
    RequestFailed,
    ServerShuttingDown,
)
from arcserve.engine.stat_logger import StatLogger, device_label
from arcserve.platform import cpu_threads_for_engine, resolve_device

logger = logging.getLogger("arcserve")


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _is_type_tag(part) -> bool:
    """A union member's name in a validation error's location ('str', 'list[ContentPart]'): not a
    field of the request, so not part of the parameter path a client is shown."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def build_app(engine: AsyncLLM, served_model_name: str | list[str], api_key: str | list[str] | None = None,
              chat_template: str | None = None, metrics_require_key: bool = False,
              max_body_bytes: int = MAX_BODY_BYTES, cors: dict | None = None,
              trust_request_chat_template: bool = False, chat_template_content_format: str = "auto",
              log_stats: str | None = None, log_requests: bool = False, max_log_len: int | None = None,
              response_role: str = "assistant", docs: bool = True, request_id_headers: bool = False,
              tokens_as_ids: bool = False, default_chat_template_kwargs: dict | None = None) -> FastAPI:  # fmt: skip
    """served_model_name: the name, or names, requests may give (responses and metrics carry the
    first, as vLLM's). cors: None (no CORS headers: browsers on other origins cannot call the API)
    or the keyword arguments of Starlette's CORSMiddleware (allow_origins, allow_methods,
    allow_headers, allow_credentials). log_stats: the KV cache's device label ("CPU", "GPU") for
    the periodic stats line (engine/stat_logger.py), None for none. log_requests, max_log_len,
    response_role: Serving's. docs=False: no /docs, /redoc, /openapi.json (--disable-fastapi-docs);
    request_id_headers: X-Request-Id on every response (--enable-request-id-headers); tokens_as_ids:
    --return-tokens-as-token-ids; default_chat_template_kwargs: --default-chat-template-kwargs."""
    llm = engine.engine
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    served_model_name = names[0]
    serving = Serving(engine, served_model_name, trust_request_chat_template, chat_template_content_format,
                      log_requests, max_log_len, response_role, tokens_as_ids, default_chat_template_kwargs)  # fmt: skip
    registry = make_registry(llm.get_metrics, served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        # Load anyio's event-loop backend now: Starlette's streamed responses need it, and loading it
        # within the first streamed request held that request's first chunk (and every request
        # behind it) for ~0.2 s.
        await anyio.sleep(0)
        task = None
        if log_stats is not None:
            stats = StatLogger(llm.get_metrics, log_stats)

            async def every_interval() -> None:
                while True:
                    await asyncio.sleep(stats.interval)
                    stats.log()

            task = asyncio.create_task(every_interval())
        try:
            yield
        finally:
            if task is not None:
                task.cancel()

    no_docs = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="arcserve", version=arcserve.__version__, lifespan=lifespan,
                  description="OpenAI-compatible API served by arcserve", **no_docs)  # fmt: skip
    created = int(time.time())

    # Middleware added last runs first: CORS (answers preflights, which carry no key), then the
    # key check, then the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_key:
        open_paths = frozenset(OPEN_PATHS - {"/metrics"} if metrics_require_key else OPEN_PATHS)
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    if cors is not None:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, **cors)
    if request_id_headers:  # (outermost: errors from the middleware above carry it too)
        app.add_middleware(RequestIdHeaderMiddleware)

    @app.exception_handler(APIError)
    async def api_error(_r: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_r: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _is_type_tag(x)]
        where = ".".join(loc)
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"Request body is not valid JSON: {msg}", code="invalid_json")
        return error_response(400, f"{where}: {msg}" if where else msg, param=where or None, code="invalid_value")

    @app.exception_handler(ClientDisconnected)
    async def gone(_r: Request, _e: ClientDisconnected):
        return Response(status_code=499)  # nobody reads it; logged as 499 (client closed request), no traceback

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(EngineOverloaded)
    async def overloaded(_r: Request, e: EngineOverloaded):
        return error_response(503, f"Server overloaded: {e}; retry later", code="overloaded",
                              headers={"Retry-After": "1"})  # fmt: skip

    @app.exception_handler(ServerShuttingDown)
    async def shutting_down(_r: Request, e: ServerShuttingDown):
        return error_response(503, str(e), code="server_shutting_down", headers={"Retry-After": "5"})

    @app.exception_handler(EngineDeadError)
    async def dead(_r: Request, e: EngineDeadError):
        return error_response(500, str(e), code="internal_error")

    @app.exception_handler(RequestFailed)
    async def failed(_r: Request, e: RequestFailed):
        return error_response(500, f"generation failed: {e}", code="internal_error")

    @app.exception_handler(ValueError)
    async def value_error(_r: Request, e: ValueError):
        err = bad_request(e)
        return error_response(400, err.message, err.param, err.code)

    @app.exception_handler(Exception)
    async def internal(_r: Request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"Internal error: {type(e).__name__}", code="internal_error")

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            served = ", ".join(repr(n) for n in names)
            raise APIError(404, f"The model {name!r} does not exist; this server serves {served}",
                           param="model", code="model_not_found")  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": n, "object": "model", "created": created, "owned_by": "arcserve",
            "root": llm.args.model, "max_model_len": llm.max_model_len} for n in names]}  # fmt: skip

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        check_model(body.model)
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        check_model(body.model)
        return await serving.chat(body, raw, chat_template)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:  # (the template, its kwargs and tools as a chat request has them)
            template = serving.request_template(body, chat_template)
            _, ids = await serving.render_chat(body, template)
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            encode = functools.partial(llm.tokenizer.encode, add_special_tokens=special)
            ids = await off_loop(len(body.prompt), encode, body.prompt)
        # Serialised off the event loop too when long: a megabyte prompt's ids take the encoder a while.
        return await off_loop(len(ids), _json_response, {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        known_len = len(llm.tokenizer)  # ids past the tokenizer (padded vocab) decode to nothing
        known = [t for t in body.tokens if t < known_len]
        return {"prompt": await off_loop(len(known), llm.tokenizer.decode, known)}

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return Response(status_code=200)

    @app.post("/ping")
    async def ping_post():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": arcserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


MAX_TEMPLATE_BYTES = 1 << 20


def _json_response(body: dict) -> Response:
    return Response(json.dumps(body), media_type="application/json")


def read_chat_template(path: str | None) -> str | None:
    """The --chat-template file: a Jinja template, or a tokenizer_config.json-style file holding one.
    Only this file is read: templates render in transformers' Jinja sandbox, which has no loader, so
    `{% include %}` / `{% import %}` cannot reach other files (such a template fails with a 400)."""
    if path is None:
        return None
    real = os.path.realpath(path)
    if not os.path.isfile(real):
        if any(c in path for c in "{}\n"):  # the template itself (vLLM takes it so too)
            return path
        raise FileNotFoundError(f"--chat-template {path}: no such file")
    if os.path.getsize(real) > MAX_TEMPLATE_BYTES:
        raise ValueError(f"--chat-template {path}: larger than {MAX_TEMPLATE_BYTES} bytes")
    with open(real, encoding="utf-8") as f:
        text = f.read()
    if real.endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--chat-template {path}: not valid JSON ({e})") from e
        if not isinstance(data, dict) or not isinstance(data.get("chat_template"), str):
            raise ValueError(f"--chat-template {path}: a .json file must hold a \"chat_template\" string")
        text = data["chat_template"]
    return text


def run_server(args, engine_args) -> None:
    import torch

    from arcserve.engine.core_process import AsyncLLMProcess

    template = read_chat_template(args.chat_template)
    ssl = bool(args.ssl_keyfile or args.ssl_certfile)
    if ssl and not (args.ssl_keyfile and args.ssl_certfile):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    env_key = os.environ.get("ARCSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")  # (vLLM reads the latter)
    api_key = args.api_key or ([env_key] if env_key else None)
    listener = listen_socket(args.host, args.port)  # before the model loads: a taken port fails at once
    device = resolve_device(engine_args.device)
    # The engine runs in its own process (no GIL shared with the event loop); this process only
    # parses, tokenizes and streams, so it keeps one thread and the engine gets every core.
    threads = cpu_threads_for_engine() if device.type == "cpu" else None
    if threads is not None:
        torch.set_num_threads(1)
        logger.info("CPU compute threads for the engine: %d (set OMP_NUM_THREADS to change)", threads)
    cors = cors_options(args)
    front = AsyncLLMProcess(engine_args, args.max_waiting_requests, threads)
    server = None
    try:
        try:  # (as vLLM: a template that cannot render a plain conversation is said at startup)
            front.engine.apply_chat_template([{"role": "user", "content": "hi"}], template)
        except ValueError as e:
            logger.warning("The chat template fails on a one-message conversation, so chat requests will get 400 "
                           "until it is fixed (--chat-template): %s", e)  # fmt: skip
        name = args.served_model_name or [os.path.basename(os.path.normpath(engine_args.model))]
        stats = None if engine_args.disable_log_stats else device_label(device)
        app = build_app(front, name, api_key, template, args.metrics_require_key, args.max_request_body_bytes, cors,
                        trust_request_chat_template=args.trust_request_chat_template,
                        chat_template_content_format=args.chat_template_content_format, log_stats=stats,
                        log_requests=args.enable_log_requests, max_log_len=args.max_log_len,
                        response_role=args.response_role, docs=not args.disable_fastapi_docs,
                        request_id_headers=args.enable_request_id_headers,
                        tokens_as_ids=args.return_tokens_as_token_ids,
                        default_chat_template_kwargs=args.default_chat_template_kwargs)  # fmt: skip
        routes = sorted(f"{','.join(sorted(r.methods or []))} {r.path}" for r in app.routes if hasattr(r, "methods"))
        logger.info("Routes: %s", "; ".join(routes))
        logger.info("Serving %s as %s on %s://%s:%d (API key %s; CORS %s)", engine_args.model,
                    ", ".join(repr(n) for n in name), "https" if ssl else "http", args.host,
                    listener.getsockname()[1], "required" if api_key else "off", "off" if cors is None else cors["allow_origins"])  # fmt: skip
        # uvicorn re-raises the signal that stopped it once it is done: a no-op handler makes
        # SIGTERM's graceful shutdown end in exit status 0.
        signal.signal(signal.SIGTERM, lambda *_: None)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level or args.log_level,
                                timeout_keep_alive=5, ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
                                ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
                                root_path=args.root_path or "", access_log=not args.disable_uvicorn_access_log,
                                timeout_graceful_shutdown=args.shutdown_timeout + 5)  # fmt: skip
        server = DrainingServer(config, front, args.shutdown_timeout)
        server.run(sockets=[listener])
    finally:
        listener.close()
        if server is not None and server.timer is not None:
            server.timer.cancel()  # everything finished before the shutdown timeout
        front.shutdown()


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now (vLLM binds before it starts the engine too): an
    address in use or not this machine's is a ValueError before minutes of model loading."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]  # fmt: skip
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain: on SIGTERM (or Ctrl-C) it stops accepting connections (uvicorn),
    refuses new requests on open ones (503), lets the requests in flight finish for up to
    `timeout` seconds, then stops the rest with a clear 503 error (streams end with an error event
    and [DONE]) so every connection closes and the process exits."""

    def __init__(self, config: uvicorn.Config, front: AsyncLLM, timeout: float) -> None:
        super().__init__(config)
        self.front, self.timeout = front, timeout
        self.timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self.front.draining = True
            logger.info("Shutting down: no new requests; those in flight get up to %.0f s to finish", self.timeout)
            self.timer = threading.Timer(self.timeout, _stop_rest, (self.front,))
            self.timer.daemon = True  # an early clean exit does not wait for it
            self.timer.start()


def _stop_rest(front: AsyncLLM) -> None:
    n = front.cancel_all(ServerShuttingDown("the server shut down before this request finished (--shutdown-timeout)"))
    if n:
        logger.warning("Shutdown timeout: stopped %d unfinished request(s)", n)


def cors_options(args) -> dict | None:
    """CORSMiddleware options from --allowed-origins etc.; None (CORS off) without origins."""
    origins = _list_flag(args.allowed_origins)
    if not origins:
        return None
    return {"allow_origins": origins, "allow_methods": _list_flag(args.allowed_methods) or ["GET", "POST"],
            "allow_headers": _list_flag(args.allowed_headers) or ["Authorization", "Content-Type"],
            "allow_credentials": args.allow_credentials}  # fmt: skip


def _list_flag(value: str | None) -> list[str]:
    """A JSON list (vLLM's form: '["https://a.example"]') or a comma-separated list."""
    if not value:
        return []
    value = value.strip()
    if value.startswith("["):
        items = json.loads(value)
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"expected a JSON list of strings, got {value!r}")
        return items
    return [x.strip() for x in value.split(",") if x.strip()]
