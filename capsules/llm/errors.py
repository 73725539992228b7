"""Failures translated at the boundary: an SDK or transport exception becomes one
``Error`` event with a readable ``message`` and a stable ``code``.

The SDK has already retried what is worth retrying (429, 5xx, 529,
connection errors, up to ``[llm] max_retries`` times) when an exception
reaches us, so the message says so for those.  Codes: ``authentication``,
``permission``, ``invalid_request``, ``not_found``, ``rate_limited``,
``overloaded``, ``server_error``, ``api_error``, ``timeout``, ``connection``,
``stream_incomplete``.  Nothing here sees the API key; the shell still
scrubs it from every message (:func:`scrub`).
"""

from __future__ import annotations

import anthropic
import httpx2

from capsules.llm.events import Error, IncompleteStream
from sage.redaction import REDACTED

__all__ = ("error_event", "scrub")

_BY_TYPE = {
    "authentication_error": "authentication",
    "permission_error": "permission",
    "invalid_request_error": "invalid_request",
    "not_found_error": "not_found",
    "rate_limit_error": "rate_limited",
    "overloaded_error": "overloaded",
    "api_error": "server_error",
}
_BY_STATUS = {
    400: "invalid_request",
    401: "authentication",
    403: "permission",
    404: "not_found",
    429: "rate_limited",
    529: "overloaded",
}
_WHAT = {
    "authentication": "the Messages API refused the API key",
    "permission": "the API key may not do this",
    "invalid_request": "the Messages API refused the request",
    "not_found": "the Messages API does not know this (a model name?)",
    "rate_limited": "rate limited by the Messages API",
    "overloaded": "the Messages API is overloaded",
    "server_error": "the Messages API failed",
    "api_error": "the Messages API answered with an error",
}
_RETRIED = frozenset({"rate_limited", "overloaded", "server_error"})


def error_event(
    exc: BaseException, *, max_retries: int, timeout: float, mid_stream: bool = False
) -> Error:
    """The one ``Error`` event for a failed generation.

    ``mid_stream``: the response had begun (the SDK returned the stream) when it
    failed.  A transport error then is a cut stream, however the SDK wraps it
    (anthropic 2.17 raises ``APIConnectionError`` where earlier releases let
    httpx's error through), and a timeout is a stalled stream, not a request
    nobody answered: neither is retried, since text was already sent on."""
    if isinstance(exc, IncompleteStream):
        return Error(str(exc), exc.code)
    if mid_stream:
        broken: BaseException = exc.__cause__ or exc.__context__ or exc
        if isinstance(exc, anthropic.APITimeoutError | httpx2.TimeoutException):
            return Error(f"the response stream stalled for more than {timeout:g} s", "timeout")
        if isinstance(exc, anthropic.APIConnectionError | httpx2.TransportError):
            return Error(
                f"the response stream broke off before the message was complete: {broken}",
                "stream_incomplete",
            )
    if isinstance(exc, anthropic.APIStatusError):
        return _status_error(exc, max_retries)
    if isinstance(exc, anthropic.APITimeoutError):
        return Error(
            f"no answer from the Messages API within {timeout:g} s"
            f" (tried {max_retries + 1} time{'s' if max_retries else ''})",
            "timeout",
        )
    if isinstance(exc, anthropic.APIConnectionError):
        cause = exc.__cause__ or exc.__context__
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        return Error(
            f"cannot reach the Messages API at {exc.request.url.host}"
            f" (tried {max_retries + 1} time{'s' if max_retries else ''}){detail}",
            "connection",
        )
    if isinstance(exc, httpx2.TimeoutException):
        return Error(f"the response stream stalled for more than {timeout:g} s", "timeout")
    if isinstance(exc, httpx2.TransportError | anthropic.APIResponseValidationError):
        return Error(
            f"the response stream broke off before the message was complete: {exc}",
            "stream_incomplete",
        )
    return Error(f"generation failed: {type(exc).__name__}: {exc}", "error")


def _status_error(exc: anthropic.APIStatusError, max_retries: int) -> Error:
    status = exc.status_code
    code = _BY_TYPE.get(exc.type or "") or _BY_STATUS.get(status)
    if code is None:
        code = "server_error" if status >= 500 else "api_error"
    if status == 200:  # an ``error`` event inside the stream
        where = f"mid-stream ({exc.type or 'error'})"
    else:
        where = f"HTTP {status}" + (f" {exc.type}" if exc.type else "")
    text = f"{_WHAT[code]} ({where})"
    if exc.api_message:
        text += f": {exc.api_message}"
    if code in _RETRIED and status != 200 and max_retries:
        text += f"; gave up after {max_retries} retr{'ies' if max_retries > 1 else 'y'}"
    if exc.request_id:
        text += f" [request-id {exc.request_id}]"
    return Error(text, code)


def scrub(text: str, secret: str | None) -> str:
    """``text`` without ``secret`` (a message must never carry the key)."""
    if secret and secret in text:
        return text.replace(secret, REDACTED)
    return text
