"""Every failure leaves the server as an OpenAI-style error object that names the field.

`{"error": {"message", "type", "param", "code"}}`: 400 `invalid_request_error` for
anything the client can fix (FastAPI's 422, invalid JSON and values nested past the
recursion limit included), 404 for an unknown model or path, 500 only for a bug of ours.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from akv_core.server.protocol import ErrorDetail, ErrorResponse

log = logging.getLogger("akv.server")


class APIError(Exception):
    """An error the client caused (or, with status 500, one it did not)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code

    def response(self) -> JSONResponse:
        param = None if self.param is None else _encodable(self.param)
        detail = ErrorDetail(message=_encodable(self.message), type=self.type, param=param, code=self.code)
        return JSONResponse(ErrorResponse(error=detail).model_dump(), status_code=self.status)


def _encodable(text: str) -> str:
    """`text` with lone surrogates (from a client's key or value echoed back) written as escapes."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def field_path(loc: Sequence[Any]) -> str | None:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'.

    Pydantic adds union-member and tag names to locations (`str`, `list[...]`,
    `message_drop`); they mean nothing to a client and are left out.
    """
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_schema_label(str(part)):
            continue
        else:
            path += f".{part}" if path else str(part)
    return path or None


_SCHEMA_LABELS = {"str", "int", "float", "bool", "list", "dict", "message_drop", "thinking_drop", "text_drop",
                  "keep_text_drop"}


def _is_schema_label(part: str) -> bool:
    return part in _SCHEMA_LABELS or "[" in part or "|" in part


def _telling_error(errors: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The error to report: the first, unless it only says the value is not of one member of a
    union (`content` is not a string) and another member's error goes further into the value (a
    list of parts whose second is an image): that one says what is wrong."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if not (str(first.get("type", "")).endswith("_type") and loc and _is_schema_label(str(loc[-1]))):
        return first
    stem = loc[:-1]
    for error in errors[1:]:
        other = tuple(error.get("loc", ()))
        if other[:len(stem)] == stem and len(other) > len(loc):
            return error
    return first


def validation_error(exc: RequestValidationError) -> APIError:
    """The first validation error, with its field, in OpenAI's format."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body")
    first = _telling_error(errors)
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "could not decode")
        return APIError(f"invalid JSON in the request body: {reason}", code="invalid_json")
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
        return APIError("the request body is empty; send a JSON object", code="invalid_json")
    param = field_path(first.get("loc", ()))
    if first.get("type") == "union_tag_invalid":
        param = f"{param}.type"
    if first.get("type") == "extra_forbidden":
        return APIError(f"unrecognized request argument supplied: {param}", param=param)
    message = first.get("msg", "invalid value")
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return APIError(f"{param}: {message}" if param else message, param=param)


def install_error_handlers(app: FastAPI, on_error: Callable[[Request, int], None]) -> None:
    """Route every error path through the OpenAI error format; `on_error` counts them."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        on_error(request, exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_error(request, 400)
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, RecursionError):   # FastAPI's "error parsing the body"
            return APIError("invalid JSON in the request body: nested too deeply",
                            code="invalid_json").response()
        code = "not_found" if exc.status_code == 404 else None
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route for {request.method} {request.url.path}"
        response = APIError(message, status=exc.status_code, code=code).response()
        response.headers.update(exc.headers or {})   # a 405's `Allow`, as HTTP requires
        return response

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        # Only a client's value nests this deep: JSON inside a string (tool call arguments) or a
        # schema that parsed but is re-encoded deeper down the stack.
        on_error(request, 400)
        return APIError("a value in the request is nested too deeply to handle").response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error while serving a request")
        on_error(request, 500)
        return APIError(
            "internal server error", status=500, type="server_error", code="internal_error"
        ).response()
