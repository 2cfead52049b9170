"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_exceeded", 500: "internal_server_error",
          503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code if code is not None else status}}


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.status, e.message, e.param, e.code), status_code=e.status, headers=e.headers)


def validation_error(e: RequestValidationError | ValidationError) -> APIError:
    """A pydantic validation failure as a 400 that names the field and what was wrong with it."""
    first = e.errors()[0] if e.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}", None)
    if first.get("type") == "extra_forbidden":
        return APIError(400, f"unsupported field {param!r}: kvgate does not implement it", param)
    return APIError(400, f"invalid {param or 'request'}: {first.get('msg', 'invalid value')}", param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail)))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")  # the stack trace goes to the log, never to the client
        return error_response(APIError(500, "internal server error"))
