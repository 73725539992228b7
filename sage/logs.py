"""Structured logging: JSON lines on stderr for journald, via structlog.

Context (capsule, principal, session) is bound, not formatted into
messages.  A processor strips values of keys that name secrets, so a token
or key never reaches a log line even when a caller passes one by mistake.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from sage.redaction import REDACTED, is_secret_key, redact

__all__ = ("configure_logging", "log_loop_errors", "redact_secrets")


_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def redact_secrets(
    _logger: Any, _method: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Hide the value of every key that names a secret, at any depth (sage.redaction)."""
    for key, value in event.items():
        if is_secret_key(key):
            event[key] = REDACTED
        elif isinstance(value, dict | list):
            event[key] = redact(value)
    return event


def configure_logging(level: str = "info") -> None:
    """JSON lines on stderr at ``level`` and above."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_secrets,
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def log_loop_errors() -> None:
    """Report what the running asyncio loop cannot hand to a task (an exception in a
    callback, a task never awaited) as one JSON log line, ``asyncio.error``, instead of
    the logging module's raw multi-line traceback on stderr."""
    asyncio.get_running_loop().set_exception_handler(_loop_error)


def _loop_error(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    details = {
        key: repr(value)[:500]
        for key, value in context.items()
        if key not in ("message", "exception")
    }
    structlog.get_logger("asyncio").error(
        "asyncio.error",
        message=str(context.get("message", "")),
        error=repr(exc) if exc is not None else None,
        exc_info=exc if isinstance(exc, BaseException) else None,
        **details,
    )
