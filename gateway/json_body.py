"""Request bodies as JSON, for every JSON endpoint (the hot path in gateway/app.py and FastAPI's routes): parsed by
orjson, which nests at most 1024 arrays/objects deep (where `json.loads` recursed until RecursionError) and refuses
invalid UTF-8 and lone UTF-16 surrogates (`"\\ud800"`, which `json.loads` turns into a str no tokenizer can read).
Each refusal is an APIError 400 that says what was wrong with the body."""
from __future__ import annotations

from typing import Any, Callable, Coroutine

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute

from kvgate.gateway.errors import APIError, error_response

MAX_JSON_DEPTH = 1024  # orjson's fixed limit on nested arrays/objects


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an APIError 400 naming what is wrong: invalid UTF-8 (with the byte offset), a
    lone surrogate escape, nesting deeper than MAX_JSON_DEPTH, malformed JSON, or a value that is not an object."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise body_error(raw, e) from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {json_type(body)}")
    return body


def body_error(raw: bytes, e: orjson.JSONDecodeError) -> APIError:
    """The 400 for a body orjson refused: invalid UTF-8 (with the offset of the first bad byte), a byte order mark,
    a lone surrogate escape, too deep, empty, or malformed (orjson's own words). The error path only: the checks
    here cost a pass over the body."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as u:
        return APIError(400, f"the body is not valid UTF-8: byte {u.start} (0x{raw[u.start]:02x}) {u.reason}; "
                             "JSON must be UTF-8 text")
    msg = str(e)
    if raw.startswith(b"\xef\xbb\xbf"):
        return APIError(400, "the body starts with a UTF-8 byte order mark (BOM): send JSON without one")
    if "surrogate" in msg:
        return APIError(400, f"the body holds invalid Unicode: a lone UTF-16 surrogate escape (\\ud800-\\udfff not "
                             f"in a high-low pair) is not a character ({msg})")
    if "depth limit" in msg or "recursion" in msg:
        return APIError(400, f"the body nests JSON arrays/objects more than {MAX_JSON_DEPTH} levels deep ({msg})")
    if not raw.strip():
        return APIError(400, "the body is empty: send a JSON object")
    return APIError(400, f"malformed JSON body: {msg}")


def json_type(value: Any) -> str:
    """JSON's name for the type of a parsed value."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array"}.get(
        type(value), type(value).__name__)


class JSONBodyRequest(Request):
    """A starlette Request whose json() parses with parse_json_body (cached, as Request.json is)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json_body(await self.body())
        return self._json


class JSONBodyRoute(APIRoute):
    """FastAPI's route with the body parsed by parse_json_body before FastAPI reads it (FastAPI's documented
    custom-route pattern: `app.router.route_class = JSONBodyRoute`). FastAPI turns any exception of its own body
    parsing into "There was an error parsing the body"; parsing first lets the client see what was wrong."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        has_body = self.body_field is not None

        async def parse_then_handle(request: Request) -> Response:
            request = JSONBodyRequest(request.scope, request.receive)
            if has_body:
                try:
                    await request.json()
                except APIError as e:
                    return error_response(e)
            return await handler(request)

        return parse_then_handle
