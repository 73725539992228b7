"""The bus's own error hierarchy, rooted at :class:`BusError`.

The bus is a library that knows nothing of sage, so it has its own root.
Every error has a short machine ``code`` (a class default, overridable per
instance with ``code=``) that travels in error frames, so a remote client
re-raises the same class the server raised.
"""

from __future__ import annotations

import os

__all__ = (
    "AclDenied",
    "BusClosed",
    "BusError",
    "ConnectionLost",
    "ConnectionStateError",
    "FrameError",
    "NoResponders",
    "NotAuthorized",
    "PayloadTooLarge",
    "RequestTimeout",
    "SlowConsumer",
    "TopicError",
    "check_payload",
    "connect_error",
    "error_for_code",
    "sole_error",
)


class BusError(Exception):
    """Root of every error the bus raises."""

    code: str = "bus_error"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class TopicError(BusError):
    """A topic or pattern breaks the grammar, or a wildcard was published to."""

    code = "bad_topic"


class PayloadTooLarge(BusError):
    """A payload is larger than the configured limit."""

    code = "payload_too_large"


def check_payload(size: int, limit: int | None, what: str) -> None:
    """Refuse at once a payload the server would not take (``limit``: the welcome's
    ``max_payload``; None before the welcome).  Sent anyway, it would make the server
    drop the frame with an error no request waits for, and the request time out."""
    if limit is not None and size > limit:
        raise PayloadTooLarge(
            f"{what}: the payload is {size} bytes, over the supervisor's limit of"
            f" {limit} ([bus] max_payload)"
        )


class AclDenied(BusError):
    """The publisher or subscriber may not use this topic."""

    code = "acl_denied"


class NoResponders(BusError):
    """A request was sent to a topic nobody subscribes to."""

    code = "no_responders"


class RequestTimeout(BusError):
    """A request got no reply before its deadline."""

    code = "timeout"


class NotAuthorized(BusError):
    """The peer may not connect, or may not act for the principal it named."""

    code = "not_authorized"


class FrameError(BusError):
    """A wire frame was malformed, oversized or of an unknown type."""

    code = "bad_frame"


class SlowConsumer(BusError):
    """A remote subscriber fell behind past its deadline and was disconnected."""

    code = "slow_consumer"


class BusClosed(BusError):
    """The bus or connection was closed by us."""

    code = "closed"


class ConnectionLost(BusError):
    """The connection broke underneath us."""

    code = "connection_lost"


class ConnectionStateError(BusError):
    """A connection was asked to do what its state does not allow (a bug in the server)."""

    code = "bad_connection_state"


_BY_CODE: dict[str, type[BusError]] = {
    cls.code: cls
    for cls in (
        AclDenied,
        BusClosed,
        ConnectionLost,
        ConnectionStateError,
        FrameError,
        NoResponders,
        NotAuthorized,
        PayloadTooLarge,
        RequestTimeout,
        SlowConsumer,
        TopicError,
    )
}
for _code in ("frame_too_large", "unknown_type", "bad_hello", "bad_payload"):
    _BY_CODE[_code] = FrameError


def connect_error(path: str | os.PathLike[str], exc: OSError) -> ConnectionLost | None:
    """What a failed connect to the supervisor's socket says (None: not one of these)."""
    where = os.fspath(path)
    if isinstance(exc, FileNotFoundError):
        return ConnectionLost(f"no supervisor socket at {where} (is it running?)")
    if isinstance(exc, ConnectionRefusedError):
        return ConnectionLost(f"supervisor at {where} refused the connection (not running?)")
    if isinstance(exc, PermissionError):
        return ConnectionLost(f"permission denied on {where}")
    return None


def error_for_code(code: str, message: str) -> BusError:
    """The exception a remote error frame stands for."""
    return _BY_CODE.get(code, BusError)(message)


def sole_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error inside a task group's exception group, else the group.

    Cancellations are not counted: they are how the group stopped its other
    tasks, not what went wrong.
    """
    import anyio

    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        elif not isinstance(exc, anyio.get_cancelled_exc_class()):
            leaves.append(exc)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group
