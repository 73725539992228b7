"""The host's side of the control protocol as a sans-IO state machine.

:class:`ControlChannel` owns request ids and the life of every control
request in either direction, and does no I/O.  Requests the host sends
(``initialize``, ``interrupt``, ``mcp_message`` notifications) go
``PENDING -> COMPLETED | FAILED``: an incoming ``control_response`` is
matched by ``request_id``, and :meth:`ControlChannel.fail_all` fails every
pending one at once when the child exits.  Requests the CLI sends go
``RECEIVED -> answered``, or ``RECEIVED -> CANCELLED -> dropped`` when a
``control_cancel_request`` arrives first, in which case
:meth:`ControlChannel.answer` tells the caller to write nothing.  Finished
requests are forgotten, so a long session holds only open ones.  A response or cancel for an id nobody is waiting on is counted
and ignored (the peer's business); a transition the caller gets wrong
raises :class:`~sage.errors.ProtocolError`.
"""

from __future__ import annotations

import enum
import itertools

import msgspec

from sage.claude.protocol.messages import ControlCancelRequest, ControlRequest, ControlResponse
from sage.errors import ProtocolError

__all__ = (
    "ChannelState",
    "ControlChannel",
    "ControlOutcome",
    "IncomingState",
    "OutgoingState",
)


class ChannelState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"  # the child is gone; fail_all() ran


class OutgoingState(enum.Enum):
    PENDING = "pending"
    COMPLETED = "completed"
    FAILED = "failed"


class IncomingState(enum.Enum):
    RECEIVED = "received"
    CANCELLED = "cancelled"


class ControlOutcome(msgspec.Struct, frozen=True):
    """How a request the host sent ended.

    ``state`` is COMPLETED (``response`` holds the raw answer, empty when the
    CLI sent none) or FAILED (``error`` holds the CLI's error text).
    """

    request_id: str
    subtype: str
    state: OutgoingState
    response: msgspec.Raw = msgspec.Raw()
    error: str | None = None


class ControlChannel:
    """Request ids and request states for one CLI process."""

    def __init__(self, id_prefix: str = "sage") -> None:
        self.state = ChannelState.OPEN
        self._prefix = id_prefix
        self._ids = itertools.count(1)
        self._outgoing: dict[str, str] = {}  # request_id -> subtype, PENDING only
        self._incoming: dict[str, IncomingState] = {}  # RECEIVED or CANCELLED only
        self.unmatched_responses = 0
        self.unmatched_cancels = 0
        self.close_reason: str | None = None

    # -- requests the host sends -------------------------------------------

    def open_request(self, subtype: str, request_id: str | None = None) -> str:
        """Track a request about to be written; returns its (fresh) id."""
        self._require_open("open a request")
        if request_id is None:
            request_id = f"{self._prefix}_{next(self._ids)}"
            while request_id in self._outgoing:
                request_id = f"{self._prefix}_{next(self._ids)}"
        elif request_id in self._outgoing:
            raise ProtocolError(f"control request id {request_id!r} is already pending")
        self._outgoing[request_id] = subtype
        return request_id

    def outgoing_state(self, request_id: str) -> OutgoingState | None:
        """PENDING while the request awaits its answer, else None (finished or unknown)."""
        return OutgoingState.PENDING if request_id in self._outgoing else None

    @property
    def pending(self) -> tuple[str, ...]:
        """Ids of requests sent and not yet answered, oldest first."""
        return tuple(self._outgoing)

    def receive_response(self, msg: ControlResponse) -> ControlOutcome | None:
        """Match an answer to its request; None (and counted) if nobody waits for it."""
        self._require_open("receive a control response")
        body = msg.response
        subtype = self._outgoing.pop(body.request_id, None)
        if subtype is None:
            self.unmatched_responses += 1
            return None
        if body.subtype == "success":
            return ControlOutcome(
                body.request_id, subtype, OutgoingState.COMPLETED, response=body.response
            )
        error = body.error if body.error is not None else f"control response {body.subtype!r}"
        return ControlOutcome(body.request_id, subtype, OutgoingState.FAILED, error=error)

    def fail_all(self, reason: str) -> list[str]:
        """The child exited: fail every pending request at once, close, return their ids.

        ``reason`` is kept in :attr:`close_reason` for the caller's error messages.
        """
        self._require_open("fail all requests")
        failed = list(self._outgoing)
        self._outgoing.clear()
        self._incoming.clear()
        self.state = ChannelState.CLOSED
        self.close_reason = reason
        return failed

    # -- requests the CLI sends --------------------------------------------

    def receive_request(self, msg: ControlRequest) -> None:
        """Record a request from the CLI that the caller must answer."""
        self._require_open("receive a control request")
        if msg.request_id in self._incoming:
            raise ProtocolError(f"CLI reused control request id {msg.request_id!r}")
        self._incoming[msg.request_id] = IncomingState.RECEIVED

    def receive_cancel(self, msg: ControlCancelRequest) -> bool:
        """Mark a request from the CLI cancelled; False (and counted) if it is not open."""
        self._require_open("receive a control cancel")
        if self._incoming.get(msg.request_id) is not IncomingState.RECEIVED:
            self.unmatched_cancels += 1
            return False
        self._incoming[msg.request_id] = IncomingState.CANCELLED
        return True

    def incoming_state(self, request_id: str) -> IncomingState | None:
        """RECEIVED or CANCELLED while unanswered, else None."""
        return self._incoming.get(request_id)

    def answer(self, request_id: str) -> bool:
        """The caller has an answer: True means write it, False means it was cancelled."""
        self._require_open("answer a control request")
        state = self._incoming.pop(request_id, None)
        if state is None:
            raise ProtocolError(f"no open control request {request_id!r} to answer")
        return state is IncomingState.RECEIVED

    # -- internals ----------------------------------------------------------

    def _require_open(self, action: str) -> None:
        if self.state is not ChannelState.OPEN:
            raise ProtocolError(f"cannot {action}: control channel is {self.state.value}")
