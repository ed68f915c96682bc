"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from arcserve.engine.async_engine import ServerShuttingDown

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
          500: "internal_error"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


class FieldError(ValueError):
    """A ValueError about one request field (`param`): bad_request names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class ClientDisconnected(Exception):
    """The client went away before its non-streamed answer was ready (its requests are aborted)."""


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}  # fmt: skip


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def stream_error(e: Exception) -> dict:
    """The error event of a stream whose headers went out already: 503 when the server shut down
    before the request finished, 400 for a refused request, 500 for a failure while generating."""
    if isinstance(e, ServerShuttingDown):
        return error_body(503, str(e), code="server_shutting_down")
    if isinstance(e, ValueError):
        err = bad_request(e)
        return error_body(400, err.message, err.param, err.code)
    return error_body(500, f"generation failed: {e}", code="internal_error")


def bad_request(e: Exception) -> APIError:
    """A ValueError from validation -> 400, naming the parameter when the message starts with it."""
    msg = str(e)
    m = re.match(r"^([a-z_]+) must ", msg)
    param = e.param if isinstance(e, FieldError) else m.group(1) if m else None
    code = "context_length_exceeded" if "max_model_len" in msg else "invalid_value"
    return APIError(400, msg, param=param, code=code)
