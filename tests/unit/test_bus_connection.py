"""A bus connection's state machine, with no socket at all (as h11 tests its own)."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from bus import ConnectionState, ConnectionStateError, FrameError
from bus.acl import Acl, Identity
from bus.connection import (
    _TRANSITIONS,
    ACTS,
    Act,
    Answer,
    Authorize,
    Connection,
    Refuse,
    WelcomeAdopted,
)
from bus.wire import PROTOCOL_VERSION, ClientFrame, Err, Hello, Ping, Pub, Reply, Req, Sub, Unsub

HELLO, OPEN, CLOSING, CLOSED = (
    ConnectionState.HELLO,
    ConnectionState.OPEN,
    ConnectionState.CLOSING,
    ConnectionState.CLOSED,
)
ALICE = Identity("cli:1001", principal="alice", acl=Acl(publish=("a.>",)), uid=1001)
WORKER = Identity("capsule:echo")
PAYLOAD = msgspec.Raw(b"{}")
OPS: list[Pub | Sub | Unsub | Req | Reply | Ping] = [
    Pub("a.b", PAYLOAD),
    Sub(1, "a.>"),
    Unsub(1),
    Req(2, "a.b", PAYLOAD),
    Reply("_INBOX.x", PAYLOAD),
    Ping(3),
]


def _new(identity: Identity | None = None) -> Connection:
    return Connection(now=100.0, hello_timeout=5.0, idle_timeout=600.0, identity=identity)


def _in(state: ConnectionState) -> Connection:
    """A connection of a peer that said hello, brought to ``state`` by legal moves."""
    conn = _new()
    if state is HELLO:
        return conn
    if state is OPEN:
        conn.open(Hello(role="cli"), ALICE)
        return conn
    conn.close()
    if state is CLOSED:
        conn.finish()
    return conn


# -- the transition table ---------------------------------------------------


def test_the_table_is_hello_open_closing_closed() -> None:
    """The one place transitions live says HELLO -> OPEN -> CLOSING -> CLOSED, HELLO -> CLOSING."""
    assert {
        HELLO: {OPEN, CLOSING},
        OPEN: {CLOSING},
        CLOSING: {CLOSED},
        CLOSED: set(),
    } == _TRANSITIONS


def test_a_peer_starts_in_hello_and_an_adopted_one_open() -> None:
    """Only a connection whose identity the caller fixed skips the handshake."""
    peer, adopted = _new(), _new(WORKER)
    assert (peer.state, peer.identity, peer.adopted) == (HELLO, None, False)
    assert (adopted.state, adopted.identity, adopted.adopted) == (OPEN, WORKER, True)


def test_open_records_the_hello_and_identity() -> None:
    """HELLO -> OPEN keeps the hello, so a reload can authorize it again."""
    conn = _new()
    hello = Hello(role="cli", principal="alice")
    conn.open(hello, ALICE)
    assert (conn.state, conn.hello, conn.identity) == (OPEN, hello, ALICE)


@pytest.mark.parametrize("start", [HELLO, OPEN])
def test_a_live_connection_closes_then_finishes(start: ConnectionState) -> None:
    """HELLO and OPEN both close to CLOSING, which finishes to CLOSED."""
    conn = _in(start)
    assert conn.live
    conn.close()
    assert (conn.state, conn.live) == (CLOSING, False)
    conn.finish()
    assert (conn.state, conn.live) == (CLOSED, False)


@pytest.mark.parametrize(
    ("start", "move"),
    [
        (start, move)
        for start, move in itertools.product(ConnectionState, ("open", "close", "finish"))
        if {"open": OPEN, "close": CLOSING, "finish": CLOSED}[move] not in _TRANSITIONS[start]
    ],
)
def test_every_other_move_is_refused(start: ConnectionState, move: str) -> None:
    """A move the table does not allow raises ConnectionStateError and changes nothing."""
    conn = _in(start)
    moves = {
        "open": lambda: conn.open(Hello(role="cli"), ALICE),
        "close": conn.close,
        "finish": conn.finish,
    }
    with pytest.raises(ConnectionStateError, match=f"{start.value} ->") as info:
        moves[move]()
    assert info.value.code == "bad_connection_state"
    assert conn.state is start


# -- what each state allows -------------------------------------------------


@pytest.mark.parametrize("frame", OPS)
def test_nothing_but_a_hello_before_the_handshake(frame: ClientFrame) -> None:
    """No publish, subscribe, request, reply or ping before an identity: refused, fatal."""
    conn = _new()
    step = conn.receive(frame)
    assert step == Refuse(Err("bad_hello", "the first frame must be a hello", fatal=True))
    assert (conn.state, conn.identity) == (HELLO, None)


def test_a_broken_first_frame_is_a_bad_hello() -> None:
    """A first frame that does not decode ends the connection as a bad hello."""
    step = _new().receive(FrameError("frame is not valid JSON: x"))
    assert step == Refuse(
        Err("bad_hello", "expected a hello frame first: frame is not valid JSON: x", fatal=True)
    )


def test_a_hello_asks_who_the_peer_is() -> None:
    """A hello of our protocol version is for the server to authorize; the state waits."""
    conn = _new()
    hello = Hello(role="cli", principal="alice")
    assert conn.receive(hello) == Authorize(hello)
    assert conn.state is HELLO


@pytest.mark.parametrize("adopted", [False, True])
def test_a_hello_of_another_version_is_refused(adopted: bool) -> None:
    """A peer speaking another protocol version is told which one the server speaks."""
    conn = _new(WORKER if adopted else None)
    step = conn.receive(Hello(role="cli", version=PROTOCOL_VERSION + 1))
    assert isinstance(step, Refuse)
    assert step.error.fatal
    assert step.error.message == (
        f"protocol version {PROTOCOL_VERSION + 1} is not supported"
        f" (server speaks {PROTOCOL_VERSION})"
    )
    assert not conn.welcomed


@pytest.mark.parametrize("frame", OPS)
def test_open_acts_on_every_operation_as_its_identity(frame: ClientFrame) -> None:
    """Once OPEN, each operation frame is carried out as the authorized identity."""
    assert _in(OPEN).receive(frame) == Act(frame, ALICE)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "adopted"),
    [
        (HELLO, False),
        (OPEN, False),
        (CLOSING, False),
        (CLOSED, False),
        (OPEN, True),  # an adopted connection starts OPEN
        (CLOSING, True),
        (CLOSED, True),
    ],
)
def test_the_hot_path_means_what_receive_says(state: ConnectionState, adopted: bool) -> None:
    """``acts_as`` and ``ACTS`` (the server's per-message shortcut) claim an Act exactly
    when :meth:`receive` would return that Act, in every state, for every frame."""
    if adopted:
        conn = _new(WORKER)
        if state in (CLOSING, CLOSED):
            conn.close()
        if state is CLOSED:
            conn.finish()
    else:
        conn = _in(state)
    assert (conn.acts_as is not None) == (state is OPEN)
    frames: list[ClientFrame | FrameError] = [*OPS, Hello(role="cli"), FrameError("x")]
    for frame in frames:
        shortcut = conn.acts_as is not None and type(frame) in ACTS
        if conn.live:
            step = conn.receive(frame)
            assert (step == Act(frame, conn.acts_as)) == shortcut, (frame, step)  # type: ignore[arg-type]
        else:
            assert not shortcut


def test_open_answers_a_bad_frame_and_goes_on() -> None:
    """A frame that does not decode after the handshake is answered with its own code."""
    conn = _in(OPEN)
    step = conn.receive(FrameError("unknown frame type: x", code="unknown_type"))
    assert step == Answer(Err("unknown_type", "unknown frame type: x"))
    assert conn.state is OPEN


def test_a_second_hello_is_answered_not_fatal() -> None:
    """Hello may be sent only once; a second one is an error, not the end."""
    assert _in(OPEN).receive(Hello(role="cli")) == Answer(
        Err("bad_frame", "hello may be sent only once")
    )


def test_an_adopted_peer_is_welcomed_once_whatever_it_claims() -> None:
    """An adopted peer's first hello gets a welcome for its fixed identity; a second is refused."""
    conn = _new(WORKER)
    assert conn.receive(Hello(role="admin", principal="root")) == WelcomeAdopted(WORKER)
    assert (conn.welcomed, conn.identity) == (True, WORKER)
    assert conn.receive(Hello(role="cli")) == Answer(
        Err("bad_frame", "hello may be sent only once")
    )


def test_an_adopted_peer_may_act_without_a_hello() -> None:
    """The hello is optional for an adopted connection."""
    assert _new(WORKER).receive(OPS[0]) == Act(OPS[0], WORKER)


@pytest.mark.parametrize("state", [CLOSING, CLOSED])
@pytest.mark.parametrize("frame", [Hello(role="cli"), *OPS, FrameError("x")])
def test_nothing_is_received_after_closing(
    state: ConnectionState, frame: ClientFrame | FrameError
) -> None:
    """A frame after closing is a bug in the server: refused, never acted on."""
    with pytest.raises(ConnectionStateError, match=f"while {state.value}"):
        _in(state).receive(frame)


# -- how long to wait --------------------------------------------------------


def test_the_handshake_has_one_deadline() -> None:
    """In HELLO the wait is what is left of one deadline, however the bytes trickle in."""
    conn = _new()
    assert conn.read_timeout(100.0, busy=False) == 5.0
    assert conn.read_timeout(103.5, busy=True) == 1.5
    assert conn.read_timeout(200.0, busy=False) == 0.0
    assert conn.timed_out() == Refuse(Err("timeout", "no hello within 5 s", fatal=True))


def test_an_idle_open_peer_times_out_unless_busy() -> None:
    """OPEN waits the idle timeout, or forever while subscriptions or requests are live."""
    conn = _in(OPEN)
    assert conn.read_timeout(1e6, busy=False) == 600.0
    assert conn.read_timeout(1e6, busy=True) is None
    assert conn.timed_out() == Refuse(Err("timeout", "no activity within 600 s", fatal=True))


def test_an_adopted_peer_never_times_out() -> None:
    """Neither the hello deadline nor the idle timeout applies to an adopted connection."""
    assert _new(WORKER).read_timeout(1e9, busy=False) is None


@pytest.mark.parametrize("state", [CLOSING, CLOSED])
def test_no_reading_after_closing(state: ConnectionState) -> None:
    """Asking how long to read after closing is refused."""
    with pytest.raises(ConnectionStateError):
        _in(state).read_timeout(0.0, busy=False)
