"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}} with the right status."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_exceeded",
          500: "internal_server_error", 503: "service_unavailable"}


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


# OpenAI (and vLLM) endpoints that kvgate does not serve: a 404 that says so, and what to use where there is something
UNSERVED = {
    "/v1/responses": "the Responses API is not served by kvgate; use POST /v1/chat/completions",
    "/v1/images": "kvgate serves text models: there is no image generation",
    "/v1/audio": "kvgate serves text models: there is no speech synthesis or transcription",
    "/v1/realtime": "kvgate serves text models: there is no realtime audio API",
    "/v1/moderations": "kvgate serves no moderation models",
    "/v1/rerank": "kvgate serves no reranker (cross-encoder) models yet",
    "/rerank": "kvgate serves no reranker (cross-encoder) models yet",
    "/v1/score": "kvgate serves no score (cross-encoder) models yet",
    "/score": "kvgate serves no score (cross-encoder) models yet",
    "/pooling": "use POST /v1/embeddings",
    "/classify": "kvgate serves no classification models",
    **{f"/v1/{k}": "kvgate has no stored objects (files, batches, assistants, fine-tuning, ...): it serves stateless "
                   "completions" for k in ("files", "uploads", "batches", "fine_tuning", "assistants", "threads",
                                           "vector_stores", "evals", "containers", "conversations", "videos")},
}
SERVED = "POST /v1/chat/completions, POST /v1/completions, POST /v1/embeddings, GET /v1/models"


def unserved(method: str, path: str, post_paths: tuple[str, ...] = ()) -> APIError:
    """The error for a request no route takes: 405 (with Allow) for the wrong method on a served POST endpoint,
    else a 404 in OpenAI's shape that names what kvgate does not serve and what it serves."""
    if path in post_paths:
        return APIError(405, f"{path} takes POST, not {method}", None, "method_not_allowed",
                        headers={"Allow": "POST"})
    prefix = next((p for p in UNSERVED if path == p or path.startswith(p + "/")), None)
    if prefix is not None:
        return APIError(404, f"{method} {path}: {UNSERVED[prefix]}. kvgate serves {SERVED}.", None,
                        "unsupported_endpoint")
    return APIError(404, f"Invalid URL ({method} {path}): kvgate serves {SERVED} (and /health, /metrics, "
                         "/tokenize, /detokenize, /version).", None, "not_found")


def validation_error(e: RequestValidationError | ValidationError) -> APIError:
    """A pydantic validation failure as a 400 that names the field, what was wrong with it and the value sent.
    Of a union's failures the one that got deepest is reported (the branch that matched best), and the union's
    branch tags (`str`, `list[ContentPart]`) are left out of the field's name."""
    errors = e.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = max(errors, key=lambda err: len(_field_path(err.get("loc", ()))))
    path = _field_path(first.get("loc", ()))
    param = _format_path(path) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error') or first.get('msg', '')}")
    if kind == "extra_forbidden":  # the client's own field name, whatever it looks like
        param = _format_path([p for p in first.get("loc", ()) if p != "body"])
        return APIError(400, f"unsupported field {param!r}: kvgate does not implement it", param)
    top = str(path[0]) if path else None
    if kind in ("prompt_shape", "stop_shape", "tool_choice_shape"):  # our validators: complete messages
        return APIError(400, first.get("msg", "invalid value"), top)
    got = "" if kind == "missing" else f", got {_show(first.get('input'))}"
    return APIError(400, f"invalid {param or 'request'}: {first.get('msg', 'invalid value')}{got}", param)


def _field_path(loc: tuple | list) -> list[str | int]:
    """The location without "body" and without pydantic's union-branch tags (`str`, `list[int]`, `ContentPart`)."""
    return [p for p in loc if p != "body" and not (isinstance(p, str) and (
        "[" in p or p in ("str", "int", "float", "bool", "list", "dict", "none") or p[:1].isupper()))]


def _format_path(path: list[str | int]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _show(value: object) -> str:
    """A short rendering of a rejected value: JSON scalars as JSON, containers by their JSON type."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "an array"
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, (str, int, float, bool)) or value is None \
        else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI, post_paths: tuple[str, ...] = ()) -> None:
    """OpenAI-shaped errors for everything the app raises; `post_paths` are the POST endpoints served outside
    FastAPI's routing (a GET on one of them is a 405, not a 404)."""
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404 and e.detail == "Not Found":  # no route: say what is served instead
            return error_response(unserved(request.method, request.url.path, post_paths))
        if e.status_code == 405:  # a route with other methods: say which, in the message and in Allow
            allow = (e.headers or {}).get("Allow") or (e.headers or {}).get("allow") or ""
            return error_response(APIError(405, f"{request.url.path} takes {allow or 'another method'}, not "
                                                f"{request.method}", None, "method_not_allowed",
                                           headers={**(e.headers or {}), "Allow": allow}))
        return error_response(APIError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")  # the stack trace goes to the log, never to the client
        return error_response(APIError(500, "internal server error"))
