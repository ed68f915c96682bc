"""The FastAPI app: routes, auth, errors; and run_server() for `arcserve serve`."""

from __future__ import annotations

import hmac
import json
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import arcserve
from arcserve.api.errors import APIError, bad_request, error_response
from arcserve.api.metrics import make_registry
from arcserve.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from arcserve.api.serving import Serving
from arcserve.engine.async_engine import AsyncLLM, EngineDeadError, EngineOverloaded
from arcserve.platform import cpu_threads_for_engine, resolve_device

logger = logging.getLogger("arcserve")
OPEN_PATHS = {"/health", "/metrics", "/ping", "/version", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}


class APIKeyMiddleware:
    """Bearer-key check as plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client
    disconnects from the handlers, and a request whose client left must be aborted)."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                resp = error_response(401, "Missing or invalid API key (send Authorization: Bearer <key>)",
                                      code="invalid_api_key")  # fmt: skip
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(engine: AsyncLLM, served_model_name: str, api_key: str | None = None,
              chat_template: str | None = None) -> FastAPI:  # fmt: skip
    llm = engine.engine
    serving = Serving(engine, served_model_name)
    registry = make_registry(llm.get_metrics, served_model_name)
    app = FastAPI(title="arcserve", version=arcserve.__version__,
                  description="OpenAI-compatible API served by arcserve")  # fmt: skip
    created = int(time.time())

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(_r: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_r: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        msg = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return error_response(400, f"Request body is not valid JSON: {msg}", code="invalid_json")
        return error_response(400, f"{where}: {msg}" if where else msg, param=where or None, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(EngineOverloaded)
    async def overloaded(_r: Request, e: EngineOverloaded):
        return error_response(503, f"Server overloaded: {e}; retry later", code="overloaded",
                              headers={"Retry-After": "1"})  # fmt: skip

    @app.exception_handler(EngineDeadError)
    async def dead(_r: Request, e: EngineDeadError):
        return error_response(500, str(e), code="internal_error")

    @app.exception_handler(ValueError)
    async def value_error(_r: Request, e: ValueError):
        err = bad_request(e)
        return error_response(400, err.message, err.param, err.code)

    @app.exception_handler(Exception)
    async def internal(_r: Request, e: Exception):
        logger.exception("internal error")
        return error_response(500, f"Internal error: {type(e).__name__}", code="internal_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves {served_model_name!r}",
                           param="model", code="model_not_found")  # fmt: skip

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "arcserve",
            "root": llm.args.model, "max_model_len": llm.max_model_len}]}  # fmt: skip

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
        if body.messages is not None:
            try:
                _, ids = llm.apply_chat_template([m.as_template_dict() for m in body.messages], chat_template,
                                                 body.add_generation_prompt)  # fmt: skip
            except ValueError as e:
                raise bad_request(e) from e
        else:
            ids = llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        vocab = llm.model_config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:5]}", param="tokens")
        known_len = len(llm.tokenizer)  # ids past the tokenizer (padded vocab) decode to nothing
        known = [t for t in body.tokens if t < known_len]
        return {"prompt": llm.tokenizer.decode(known)}

    @app.get("/health")
    async def health():
        if engine.dead is not None:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": arcserve.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--chat-template {path}: no such file")
    with open(path) as f:
        text = f.read()
    if path.endswith(".json"):  # a tokenizer_config.json-style file
        text = json.loads(text).get("chat_template", text)
    return text


def run_server(args, engine_args) -> None:
    import torch
    import uvicorn

    from arcserve.engine.core_process import AsyncLLMProcess

    template = read_chat_template(args.chat_template)
    api_key = args.api_key or os.environ.get("ARCSERVE_API_KEY")
    device = resolve_device(engine_args.device)
    # The engine runs in its own process (no GIL shared with the event loop); this process only
    # parses, tokenizes and streams, so it keeps one thread and the engine gets every core.
    threads = cpu_threads_for_engine() if device.type == "cpu" else None
    if threads is not None:
        torch.set_num_threads(1)
        logger.info("CPU compute threads for the engine: %d (set OMP_NUM_THREADS to change)", threads)
    front = AsyncLLMProcess(engine_args, args.max_waiting_requests, threads)
    name = args.served_model_name or os.path.basename(os.path.normpath(engine_args.model))
    app = build_app(front, name, api_key, template)
    routes = sorted(f"{','.join(sorted(r.methods or []))} {r.path}" for r in app.routes if hasattr(r, "methods"))
    logger.info("Routes: %s", "; ".join(routes))
    logger.info("Serving %s as %r on http://%s:%d (API key %s)", engine_args.model, name, args.host, args.port,
                "required" if api_key else "off")  # fmt: skip
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=5)
    finally:
        front.shutdown()
