"""The server's plain ASGI middleware: the API key check, the request-body limit and the
X-Request-Id header. Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would hide client
disconnects from the handlers (a request whose client left must be aborted)."""

from __future__ import annotations

import hmac
import uuid

from arcserve.api.errors import error_response

OPEN_PATHS = {"/health", "/metrics", "/ping", "/version", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}
MAX_BODY_BYTES = 16 << 20  # default --max-request-body-bytes: a 128k-token prompt as JSON ids is ~1 MB


class APIKeyMiddleware:
    """Bearer-key check as plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client
    disconnects from the handlers, and a request whose client left must be aborted). api_key: one
    key or several (any of them is accepted, as vLLM's --api-key k1 k2), each compared in constant
    time. open_paths need no key."""

    def __init__(self, app, api_key: str | list[str], open_paths: frozenset = frozenset(OPEN_PATHS)) -> None:
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self.app, self.keys, self.open = app, [k.encode() for k in keys], open_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _route_path(scope) not in self.open:
            given = dict(scope["headers"]).get(b"authorization", b"")
            token = given[7:] if given[:7].lower() == b"bearer " else b""
            if sum(hmac.compare_digest(token, k) for k in self.keys) == 0:
                resp = error_response(401, "Missing or invalid API key (send Authorization: Bearer <key>)",
                                      code="invalid_api_key")  # fmt: skip
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def _route_path(scope) -> str:
    """The request's path without the --root-path prefix a proxy may leave on it (as Starlette routes)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


class RequestIdHeaderMiddleware:
    """--enable-request-id-headers (vLLM's): every response carries X-Request-Id, the request's own
    header when it sent one, else a fresh id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope["headers"]).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(msg):
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid)]}
            await send(msg)

        return await self.app(scope, receive, send_with_id)


class BodyLimitMiddleware:
    """Refuse request bodies over max_bytes with 413: by Content-Length before reading anything, and
    for bodies without one (chunked uploads) by counting while reading them in, so a huge body is
    never held in memory past the limit."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:  # the server holds the body to its declared length
            if not declared.isdigit() or int(declared) > self.max:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, seen = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left
                return
            seen += len(msg.get("body", b""))
            if seen > self.max:
                return await self._refuse(scope, receive, send)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send):
        resp = error_response(413, f"Request body too large: the limit is {self.max} bytes "
                              "(--max-request-body-bytes)", code="request_too_large")  # fmt: skip
        await resp(scope, receive, send)
