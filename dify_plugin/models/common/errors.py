"""What went wrong talking to kvgate, as the Dify SDK's error types (Dify shows and retries by these types)."""
from __future__ import annotations

import json

import httpx
from dify_plugin.errors.model import (
    InvokeAuthorizationError,
    InvokeBadRequestError,
    InvokeConnectionError,
    InvokeError,
    InvokeRateLimitError,
    InvokeServerUnavailableError,
)


def gateway_message(response: httpx.Response) -> str:
    """The gateway's own words: OpenAI's {"error": {"message": ...}} body, else the raw text (shortened)."""
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("detail"):
            return str(body["detail"])
    return json.dumps(body)[:500]


def error_for_status(response: httpx.Response) -> InvokeError:
    """An HTTP error answer of the gateway: 401/403 auth, 429 rate limit, other 4xx bad request, 5xx unavailable."""
    status = response.status_code
    message = f"kvgate answered {status}: {gateway_message(response)}"
    if status in (401, 403):
        return InvokeAuthorizationError(message)
    if status == 429:
        retry = response.headers.get("retry-after")
        return InvokeRateLimitError(message + (f" (retry after {retry} s)" if retry else ""))
    if 400 <= status < 500:
        return InvokeBadRequestError(message)
    return InvokeServerUnavailableError(message)


def error_for_exception(error: Exception, url: str, timeout: float) -> InvokeError:
    """A failure below HTTP: the gateway could not be reached, or did not answer within `timeout` seconds."""
    if isinstance(error, InvokeError):
        return error
    if isinstance(error, httpx.ConnectTimeout):
        return InvokeConnectionError(f"cannot reach kvgate at {url}: connecting timed out")
    if isinstance(error, httpx.TimeoutException):
        return InvokeConnectionError(f"kvgate at {url} timed out: no answer within the timeout of {timeout:g} s "
                                     f"(raise the model's 'timeout' credential for longer generations)")
    if isinstance(error, httpx.ConnectError):
        return InvokeConnectionError(f"cannot reach kvgate at {url}: {error}")
    if isinstance(error, httpx.TransportError):
        return InvokeConnectionError(f"the connection to kvgate at {url} failed: {error!r}")
    if isinstance(error, (ValueError, KeyError, TypeError)):  # a body that is not what the OpenAI API promises
        return InvokeServerUnavailableError(f"kvgate at {url} sent a malformed answer: {error!r}")
    return InvokeError(f"calling kvgate at {url} failed: {error!r}")


# for every model type's _invoke_error_mapping: errors raised by this plugin are already of the right type;
# ValueError (bad credentials or parameters found before any request) is a bad request
INVOKE_ERROR_MAPPING: dict[type[InvokeError], list[type[Exception]]] = {
    InvokeConnectionError: [InvokeConnectionError, httpx.TransportError],
    InvokeServerUnavailableError: [InvokeServerUnavailableError],
    InvokeRateLimitError: [InvokeRateLimitError],
    InvokeAuthorizationError: [InvokeAuthorizationError],
    InvokeBadRequestError: [InvokeBadRequestError, ValueError],
}
