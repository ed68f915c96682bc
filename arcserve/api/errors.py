"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 503: "service_unavailable",
          500: "internal_error"}  # fmt: skip


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}  # fmt: skip


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def bad_request(e: Exception) -> APIError:
    """A ValueError from validation -> 400, naming the parameter when the message starts with it."""
    msg = str(e)
    m = re.match(r"^([a-z_]+) must ", msg)
    param = m.group(1) if m else None
    code = "context_length_exceeded" if "max_model_len" in msg else "invalid_value"
    return APIError(400, msg, param=param, code=code)
