"""HTTP errors of the server and their two body styles.

OpenAI style (every /v1 path but /v1/messages):
    {"error": {"message": ..., "type": "invalid_request_error", "param": ..., "code": ...}}
Anthropic style (/v1/messages):
    {"type": "error", "error": {"type": "invalid_request_error", "message": ...}}
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    404: ("invalid_request_error", "not_found_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class APIError(Exception):
    """A request the server refuses: status (4xx/5xx), a one-line message naming the request
    parameter (`param`) at fault, an optional machine-readable `code` and extra headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def error_body(err: APIError, anthropic: bool) -> dict[str, Any]:
    """The JSON body of `err` in OpenAI or Anthropic style."""
    openai_type, anthropic_type = _TYPES.get(err.status, _TYPES[400 if err.status < 500 else 500])
    if anthropic:
        return {"type": "error", "error": {"type": anthropic_type, "message": err.message}}
    return {
        "error": {
            "message": err.message,
            "type": openai_type,
            "param": err.param,
            "code": err.code,
        }
    }


def error_response(err: APIError, path: str) -> JSONResponse:
    """A JSONResponse for `err`, styled for the endpoint at `path`."""
    return JSONResponse(
        error_body(err, path.startswith("/v1/messages")),
        status_code=err.status,
        headers=err.headers,
    )
