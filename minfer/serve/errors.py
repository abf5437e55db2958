"""OpenAI-style errors: every failed request is a JSON body

    {"error": {"message": "...", "type": "...", "param": null | "field", "code": null | "..."}}

with a 4xx status (503 when the server cannot take the request now), never a
traceback. `type` follows OpenAI's names: invalid_request_error (400, 404, 413,
422), authentication_error (401), server_busy (503, with Retry-After), server_error
(a bug: 500, its traceback on the server's stderr only).
"""
from __future__ import annotations

from starlette.responses import JSONResponse

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
         503: "server_busy", 500: "server_error"}


class APIError(Exception):
    """A request the server answers with an error: status, one-line message, the
    request field it concerns (param) and a machine-readable code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, " ".join(message.split("\n")), param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return APIError(status, message, param, code, headers).response()
