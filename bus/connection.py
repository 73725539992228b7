"""One bus connection's protocol state, apart from any socket (sans-IO, like h11).

A :class:`Connection` knows which state the connection is in and what each
client frame means in that state; it does no I/O.  The server feeds it the
frames it decodes (or the :class:`FrameError` a frame failed with) and
carries out the :data:`Step` it gets back: answer an error, end the
connection, ask the server's ``authorize`` callback, welcome an adopted
peer, or act on the bus.  States::

    HELLO ---> OPEN ---> CLOSING ---> CLOSED
      \\________________/^

``HELLO``: waiting for the peer's hello; nothing else is allowed and one
deadline covers the whole handshake.  ``OPEN``: the peer has an identity
and may publish, subscribe, request, reply and ping.  ``CLOSING``: ended or
cut off; nothing more is received or queued, the outbox is flushed.
``CLOSED``: the stream is closed.  An adopted connection (the caller fixed
its identity) starts ``OPEN``; its one optional hello is answered with a
welcome for that identity, and it has no idle timeout.  Any other move, or
a frame received after closing, raises :class:`ConnectionStateError`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final

from bus.acl import Identity
from bus.errors import ConnectionStateError, FrameError
from bus.wire import PROTOCOL_VERSION, ClientFrame, Err, Hello, Ping, Pub, Reply, Req, Sub, Unsub

__all__ = (
    "ACTS",
    "Act",
    "Answer",
    "Authorize",
    "Connection",
    "ConnectionState",
    "Refuse",
    "Step",
    "WelcomeAdopted",
)


class ConnectionState(enum.Enum):
    HELLO = "hello"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


_TRANSITIONS: Final = {
    ConnectionState.HELLO: frozenset({ConnectionState.OPEN, ConnectionState.CLOSING}),
    ConnectionState.OPEN: frozenset({ConnectionState.CLOSING}),
    ConnectionState.CLOSING: frozenset({ConnectionState.CLOSED}),
    ConnectionState.CLOSED: frozenset(),
}

_LIVE: Final = frozenset({ConnectionState.HELLO, ConnectionState.OPEN})


@dataclass(frozen=True, slots=True)
class Refuse:
    """Send ``error`` (fatal) and end the connection."""

    error: Err


@dataclass(frozen=True, slots=True)
class Answer:
    """Send ``error`` and go on reading."""

    error: Err


@dataclass(frozen=True, slots=True)
class Authorize:
    """Ask who this hello's peer is; then :meth:`Connection.open` or refuse it."""

    hello: Hello


@dataclass(frozen=True, slots=True)
class WelcomeAdopted:
    """Welcome an adopted peer under the identity its connection was given."""

    identity: Identity


@dataclass(frozen=True, slots=True)
class Act:
    """Carry ``frame`` out on the bus as the connection's identity."""

    frame: Pub | Sub | Unsub | Req | Reply | Ping
    identity: Identity


Step = Refuse | Answer | Authorize | WelcomeAdopted | Act

ACTS: Final = frozenset({Pub, Sub, Unsub, Req, Reply, Ping})
"""Frame types that, while ``OPEN``, always mean :class:`Act` (see :attr:`Connection.acts_as`)."""


class Connection:
    """The state of one connection and the meaning of each frame in it.

    ``now`` and the timeouts are in seconds of the caller's clock; the
    hello deadline runs from ``now``.  ``identity`` makes the connection
    adopted: it starts ``OPEN`` with that identity.
    """

    __slots__ = (
        "acts_as",
        "adopted",
        "hello",
        "hello_by",
        "hello_timeout",
        "identity",
        "idle_timeout",
        "live",
        "state",
        "welcomed",
    )

    def __init__(
        self,
        *,
        now: float,
        hello_timeout: float,
        idle_timeout: float,
        identity: Identity | None = None,
    ) -> None:
        self.identity = identity
        self.adopted = identity is not None
        self.state = ConnectionState.HELLO if identity is None else ConnectionState.OPEN
        self.live = True
        """Frames may still be received and queued (HELLO or OPEN); a plain attribute,
        as the server asks it for every frame it queues."""
        self.acts_as: Identity | None = identity
        """The identity frames act as, set only while ``OPEN``: then a frame whose type is
        in :data:`ACTS` means ``Act(frame, acts_as)``, exactly what :meth:`receive` would
        return, so the server's hot path need not build the step (one per message)."""
        self.hello: Hello | None = None
        """The hello an identity was authorized from; None while in HELLO and when adopted."""
        self.welcomed = False
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self.hello_by = now + hello_timeout

    def _move(self, to: ConnectionState) -> None:
        if to not in _TRANSITIONS[self.state]:
            raise ConnectionStateError(f"connection: {self.state.value} -> {to.value}")
        self.state = to
        self.live = to in _LIVE
        self.acts_as = self.identity if to is ConnectionState.OPEN else None

    # -- transitions ------------------------------------------------------

    def open(self, hello: Hello, identity: Identity) -> None:
        """HELLO -> OPEN: ``hello`` was authorized as ``identity``."""
        self._move(ConnectionState.OPEN)
        self.hello = hello
        self.identity = self.acts_as = identity

    def close(self) -> None:
        """HELLO or OPEN -> CLOSING: ended, refused or cut off."""
        self._move(ConnectionState.CLOSING)

    def finish(self) -> None:
        """CLOSING -> CLOSED: the stream is closed."""
        self._move(ConnectionState.CLOSED)

    # -- what a frame means -----------------------------------------------

    def receive(self, frame: ClientFrame | FrameError) -> Step:
        """What to do with one frame (or the error it failed to decode with)."""
        if self.state is ConnectionState.HELLO:
            return self._handshake(frame)
        if self.state is not ConnectionState.OPEN:
            raise ConnectionStateError(f"connection: a frame received while {self.state.value}")
        identity = self.identity
        assert identity is not None  # OPEN always has one
        if isinstance(frame, FrameError):
            return Answer(Err(frame.code, str(frame)))
        if not isinstance(frame, Hello):
            return Act(frame, identity)
        if self.adopted and not self.welcomed:
            refused = _version_refused(frame)
            if refused is not None:
                return refused
            self.welcomed = True
            return WelcomeAdopted(identity)
        return Answer(Err("bad_frame", "hello may be sent only once"))

    def _handshake(self, frame: ClientFrame | FrameError) -> Step:
        if isinstance(frame, FrameError):
            return Refuse(Err("bad_hello", f"expected a hello frame first: {frame}", fatal=True))
        if not isinstance(frame, Hello):
            return Refuse(Err("bad_hello", "the first frame must be a hello", fatal=True))
        return _version_refused(frame) or Authorize(frame)

    # -- how long to wait for the peer ------------------------------------

    def read_timeout(self, now: float, *, busy: bool) -> float | None:
        """Seconds to wait for the peer's next bytes; None for no limit.

        In HELLO: what is left of the one handshake deadline, however the
        bytes trickle in.  In OPEN: none while the peer has subscriptions
        or requests in flight (``busy``) or is adopted, else the idle timeout.
        """
        if self.state is ConnectionState.HELLO:
            return max(0.0, self.hello_by - now)
        if self.state is not ConnectionState.OPEN:
            raise ConnectionStateError(f"connection: no reading while {self.state.value}")
        if busy or self.adopted:
            return None
        return self.idle_timeout

    def timed_out(self) -> Refuse:
        """The fatal error for a peer that stayed silent past :meth:`read_timeout`."""
        if self.state is ConnectionState.HELLO:
            message = f"no hello within {self.hello_timeout:g} s"
        else:
            message = f"no activity within {self.idle_timeout:g} s"
        return Refuse(Err("timeout", message, fatal=True))


def _version_refused(hello: Hello) -> Refuse | None:
    if hello.version == PROTOCOL_VERSION:
        return None
    return Refuse(
        Err(
            "bad_hello",
            f"protocol version {hello.version} is not supported (server speaks {PROTOCOL_VERSION})",
            fatal=True,
        )
    )
