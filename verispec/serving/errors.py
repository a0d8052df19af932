"""OpenAI's error shape: the body, the exception the app answers with, and request validation errors turned
into one HTTP 400 naming the field."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class ApiError(Exception):
    """A request the server refuses, answered in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.code, self.kind), status_code=self.status,
                            headers=self.headers)


def error_body(message: str, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code)).model_dump()


# Error types raised by the request models' validators (protocol.py): their messages already name the field.
_OWN_ERRORS = {"invalid_type", "invalid_value", "unsupported_parameter", "unsupported_content"}


def validation_error(errors: Sequence[dict]) -> ApiError:
    """The first of FastAPI's request validation errors as an ``ApiError`` naming the field (``param``)."""
    error = errors[0] if errors else {"type": "invalid_value", "loc": (), "msg": "invalid request"}
    kind = error.get("type", "")
    loc = tuple(error.get("loc", ()))
    loc = loc[1:] if loc[:1] == ("body",) else loc
    if kind == "json_invalid":
        detail = (error.get("ctx") or {}).get("error", "")
        return ApiError(f"the request body is not valid JSON: {detail}", code="invalid_json")
    if not loc:
        return ApiError("the request body must be a JSON object, sent as Content-Type: application/json",
                        code="invalid_json")
    param = loc[0] if isinstance(loc[0], str) else None
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    if kind in _OWN_ERRORS:  # the message names the field already, unless the field is inside a list
        return ApiError(error["msg"] if len(loc) == 1 else f"'{path}': {error['msg']}", param, kind)
    message = f"'{path}': {error.get('msg', 'invalid value')}"
    value = error.get("input")
    if kind != "missing" and isinstance(value, (int, float, str, type(None))):
        message += f", got {short(value)}"
    code = "missing_required_parameter" if kind == "missing" else (
        "invalid_type" if kind.endswith(("_type", "_parsing")) else "invalid_value")
    return ApiError(message, param, code)


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
