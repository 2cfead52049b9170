"""Requests to kvgate shared by every model type: one POST whose HTTP errors become the SDK's error types, and
token counts from the gateway's /tokenize."""
from __future__ import annotations

import logging
from typing import Any

import httpx

from models.common.errors import error_for_exception, error_for_status, gateway_message
from models.common.settings import GatewaySettings

logger = logging.getLogger(__name__)


def send(client: httpx.Client, settings: GatewaySettings, path: str, body: dict[str, Any],
         stream: bool = False) -> httpx.Response:
    """POST `body` as JSON to the gateway's `path`; the answer once its status is < 400 (read unless `stream`:
    then the caller reads and closes it). Anything else raises the SDK's InvokeError for it: the gateway's own
    message for an HTTP error, a connection error naming the URL and the timeout for a transport failure."""
    url = settings.url(path)
    try:
        response = client.send(client.build_request("POST", url, json=body), stream=stream)
    except httpx.HTTPError as e:
        raise error_for_exception(e, url, settings.timeout) from e
    if response.status_code >= 400:
        try:
            response.read()
        except httpx.HTTPError:
            pass
        finally:
            response.close()
        raise error_for_status(response)
    return response


def count_tokens(client: httpx.Client, settings: GatewaySettings, body: dict[str, Any]) -> int:
    """/tokenize's count for `body` ({"prompt": ...} or {"messages": [...]}); where the gateway cannot tokenize
    (an upstream without /tokenize, the "auto" router), an offline estimate of one token per 4 bytes of text,
    logged as such. Never raises for a gateway failure: a count is an estimate for Dify either way."""
    url = settings.url("/tokenize")
    try:
        response = client.post(url, json={"model": settings.model_name, **body})
        if response.status_code == 200:
            return int(response.json()["count"])
        reason = f"{response.status_code}: {gateway_message(response)}"
    except (httpx.HTTPError, ValueError, KeyError) as e:
        reason = repr(e)
    text = body.get("prompt") or "\n".join(m.get("content") or "" for m in body.get("messages", []))
    estimate = max(1, len(text.encode("utf-8")) // 4)
    logger.warning("kvgate /tokenize at %s failed (%s); estimating %d tokens", url, reason, estimate)
    return estimate
