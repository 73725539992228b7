"""A runner session's state machine, and the runner's one reply path: no process at all.

The reply path is driven with a stand-in capsule context: a handler that raises
is answered ``internal_error`` while a live session (a real
:class:`ClaudeProcess` whose child never ran, its stdin a memory stream) goes on
and takes a turn afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import Envelope
from capsules.runner.claude_process import ClaudeProcess, EndReason
from capsules.runner.command import Launch
from capsules.runner.errors import SessionError
from capsules.runner.runner import Runner
from capsules.runner.sessions import (
    LIVE,
    SESSION_TRANSITIONS,
    AfterChild,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
)
from sage.config import Config, PrincipalConfig
from sage.errors import IllegalTransition, SageError
from sage.usage.admission import ADMIT_TOPIC
from tests.support.runner_context import admitted

pytestmark = pytest.mark.anyio

ALL_STATES = list(SessionState)


def session(state: SessionState = SessionState.STARTING) -> Session:
    record = SessionRecord(session_id="s1", principal_id="alice", claude_session="c")
    made = Session(record, PrincipalConfig(name="alice"))
    made.state = state
    return made


# -- the state table ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [(old, new) for old in ALL_STATES for new in sorted(SESSION_TRANSITIONS[old], key=str)],
)
def test_every_legal_transition_is_taken(old: SessionState, new: SessionState) -> None:
    s = session(old)
    assert s.may(new)
    s.move(new)
    assert s.state is new


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (old, new)
        for old in ALL_STATES
        for new in ALL_STATES
        if new is not old and new not in SESSION_TRANSITIONS[old]
    ],
)
def test_every_illegal_transition_is_refused(old: SessionState, new: SessionState) -> None:
    s = session(old)
    assert not s.may(new)
    with pytest.raises(IllegalTransition) as caught:
        s.move(new)
    assert s.state is old
    assert isinstance(caught.value, SageError)
    assert caught.value.code == "illegal_transition"


@pytest.mark.parametrize("state", ALL_STATES)
def test_staying_put_is_no_change(state: SessionState) -> None:
    s = session(state)
    s.move(state)
    assert s.state is state


def test_ended_and_interrupted_are_final() -> None:
    assert SESSION_TRANSITIONS[SessionState.ENDED] == frozenset()
    assert SESSION_TRANSITIONS[SessionState.INTERRUPTED] == frozenset()
    assert SESSION_TRANSITIONS[SessionState.STOPPING] == {
        SessionState.ENDED,
        SessionState.INTERRUPTED,
    }


# -- respawn, stop, ready -----------------------------------------------------------------


def test_a_respawn_waits_for_the_new_child_to_be_ready() -> None:
    s = session(SessionState.RUNNING)
    assert s.respawn("identity_refresh")
    assert (s.state, s.respawn_reason) == (SessionState.RESPAWNING, "identity_refresh")
    s.ready()  # the old child's init (no attempt yet): still respawning
    assert s.state is SessionState.RESPAWNING
    s.respawns = 1  # the runner counts the attempt before it launches
    s.ready()
    assert (s.state, s.respawn_reason, s.respawns) == (SessionState.RUNNING, None, 0)


def test_a_second_refresh_while_respawning_is_one_respawn() -> None:
    s = session(SessionState.RESPAWNING)
    s.respawn_reason = "identity_refresh"
    assert s.respawn("identity_refresh")
    assert s.state is SessionState.RESPAWNING


@pytest.mark.parametrize(
    "state", [SessionState.STOPPING, SessionState.ENDED, SessionState.INTERRUPTED]
)
def test_no_respawn_once_stopping_or_over(state: SessionState) -> None:
    s = session(state)
    assert not s.respawn("identity_refresh")
    assert (s.state, s.respawn_reason) == (state, None)


def test_a_stop_cancels_a_respawn() -> None:
    s = session(SessionState.RUNNING)
    s.respawn("identity_refresh")
    s.stop()
    assert (s.state, s.respawn_reason) == (SessionState.STOPPING, None)
    s.ready()
    assert s.state is SessionState.STOPPING


@pytest.mark.parametrize("state", [SessionState.ENDED, SessionState.INTERRUPTED])
def test_a_stop_that_comes_after_the_end_changes_nothing(state: SessionState) -> None:
    s = session(state)
    s.stop()
    assert s.state is state


def test_a_session_can_be_stopped_before_its_first_child() -> None:
    s = session()
    s.stop()
    assert s.state is SessionState.STOPPING


@pytest.mark.parametrize(
    ("state", "stored"),
    [
        (SessionState.STARTING, RecordState.RUNNING),
        (SessionState.RUNNING, RecordState.RUNNING),
        (SessionState.RESPAWNING, RecordState.RUNNING),
        (SessionState.STOPPING, RecordState.RUNNING),
        (SessionState.ENDED, RecordState.ENDED),
        (SessionState.INTERRUPTED, RecordState.INTERRUPTED),
    ],
)
def test_what_the_record_says(state: SessionState, stored: RecordState) -> None:
    assert session(state).record_state() is stored


def test_records_keep_their_strings() -> None:
    record = SessionRecord(
        session_id="s1",
        principal_id="alice",
        claude_session="c",
        state=RecordState.ENDED,
        reason=EndReason.STOPPED,
    )
    stored = msgspec.to_builtins(record)
    assert (stored["state"], stored["reason"]) == ("ended", "stopped")
    assert type(stored["state"]) is str
    back = msgspec.convert({**stored, "state": "interrupted"}, SessionRecord)
    assert back.state is RecordState.INTERRUPTED
    assert back.state in LIVE
    assert RecordState.ENDED not in LIVE
    assert [s.value for s in RecordState] == ["running", "interrupted", "hibernated", "ended"]


# -- the reply path -------------------------------------------------------------------------


class _Context:
    """What the runner's request path uses of a CapsuleContext."""

    def __init__(self, tmp: Path) -> None:
        self.replies: list[tuple[str, dict[str, Any]]] = []
        self.answered = anyio.Event()
        self.published: list[tuple[str, Any]] = []
        self.tmp = tmp
        self.config = Config()  # the defaults: a send's size is checked against them

    def reply(self, request: Envelope, payload: Any) -> bool:
        self.replies.append((request.topic, payload))
        self.answered.set()
        return True

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> Envelope:
        self.published.append((topic, payload))
        return Envelope(id=len(self.published), topic=topic, payload=b"{}", source="runner")

    async def request(self, topic: str, payload: Any, *, deadline: float | None = None) -> Any:
        assert topic == ADMIT_TOPIC
        return admitted()


def request(n: int, topic: str, payload: dict[str, Any]) -> Envelope:
    return Envelope(
        id=n,
        topic=topic,
        payload=msgspec.json.encode(payload),
        source="client",
        reply_to=f"_reply.{n}",
    )


def idle_process(tmp: Path, runner: Runner) -> ClaudeProcess:
    """A session's process whose child never ran: initialized, its stdin a memory stream."""
    launch = Launch(
        argv=["claude"],
        env={},
        cwd=tmp,
        identity_file=tmp / "identity.md",
        claude_session="c",
        flags_hash="",
        identity_fallback=False,
    )
    proc = ClaudeProcess(
        "s1",
        "alice",
        launch,
        runner,
        max_line_bytes=1 << 20,
        init_timeout=1.0,
        stop_grace=1.0,
        stdin_quota=1 << 20,
    )
    proc.conversation.initialized()
    return proc


async def broken(request: Envelope) -> dict[str, Any]:
    raise KeyError("a bug in a handler")


async def test_a_failing_handler_is_answered_and_the_live_session_goes_on(
    tmp_path: Path,
) -> None:
    ctx = _Context(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    live = session(SessionState.RUNNING)
    live.proc = proc = idle_process(tmp_path, runner)
    runner.sessions.add(live)
    send, requests = anyio.create_memory_object_stream[Envelope](8)
    session_task_cancelled = False

    async def session_task() -> None:  # what _run_session is to a live session
        nonlocal session_task_cancelled
        try:
            await live.done.wait()
        except anyio.get_cancelled_exc_class():
            session_task_cancelled = True
            raise

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            runner._tg = tg
            tg.start_soon(session_task)
            tg.start_soon(runner._serve, requests, broken)
            await send.send(request(1, "sage.v1.request.sessions", {}))
            await ctx.answered.wait()
            # the same task group still serves: the session takes a turn
            await runner._answer(
                request(2, "sage.v1.request.send.s1", {"text": "hi"}), runner._send
            )
            assert not session_task_cancelled
            live.done.set()
            send.close()
    requests.close()
    proc._send.close()  # what run() closes when the child is gone
    proc._outbox.close()
    assert ctx.replies[0][0] == "sage.v1.request.sessions"
    failure = ctx.replies[0][1]
    assert failure["ok"] is False
    assert failure["error"] == "internal_error"
    assert "sage.v1.request.sessions" in failure["message"]
    assert "KeyError" in failure["message"]
    assert ctx.replies[1] == (
        "sage.v1.request.send.s1",
        {"ok": True, "session_id": "s1", "turn": 1},
    )
    assert proc.turn.started == 1


@pytest.mark.parametrize(
    ("raised", "reply"),
    [
        (
            SessionError("unknown_session", "no session 'x'"),
            {"ok": False, "error": "unknown_session", "message": "no session 'x'"},
        ),
        (
            SageError("the store is gone", code="state_failed"),
            {"ok": False, "error": "state_failed", "message": "the store is gone"},
        ),
        (
            msgspec.ValidationError("Expected `str`"),
            {"ok": False, "error": "bad_request", "message": "Expected `str`"},
        ),
        (
            msgspec.DecodeError("truncated"),
            {"ok": False, "error": "bad_request", "message": "not JSON: truncated"},
        ),
    ],
)
async def test_known_failures_keep_their_reply(
    tmp_path: Path, raised: Exception, reply: dict[str, Any]
) -> None:
    ctx = _Context(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]

    async def handler(request: Envelope) -> dict[str, Any]:
        raise raised

    await runner._answer(request(1, "sage.v1.request.stop.x", {}), handler)
    assert ctx.replies == [("sage.v1.request.stop.x", reply)]


async def test_a_session_error_is_a_sage_error_with_its_code() -> None:
    exc = SessionError("stdin_quota", "too long")
    assert isinstance(exc, SageError)
    assert (exc.code, str(exc)) == ("stdin_quota", "too long")


async def test_a_request_without_reply_to_is_not_answered(tmp_path: Path) -> None:
    ctx = _Context(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    quiet = Envelope(id=1, topic="sage.v1.request.stop.x", payload=b"{}", source="client")
    await runner._answer(quiet, broken)
    assert ctx.replies == []


# -- after a child ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reason",
    [
        EndReason.EXITED,
        EndReason.CRASHED,
        EndReason.AUTH_FAILED,
        EndReason.LINE_TOO_LONG,
        EndReason.PERMISSION_MODE_MISMATCH,
    ],
)
def test_a_running_session_ends_with_its_child(reason: EndReason) -> None:
    s = session(SessionState.RUNNING)
    assert s.after_child(reason.value, 3) is AfterChild.END
    assert s.respawns == 0


def test_a_stop_ends_the_session_whatever_the_child_did() -> None:
    for reason in (EndReason.STOPPED.value, EndReason.RESPAWN.value, None):
        s = session(SessionState.STOPPING)
        assert s.after_child(reason, 3) is AfterChild.END
    s = session(SessionState.RESPAWNING)  # a stop overrode the respawn in the child
    assert s.after_child(EndReason.STOPPED.value, 3) is AfterChild.END


def test_a_child_stopped_for_a_respawn_is_followed_by_another() -> None:
    s = session(SessionState.RUNNING)
    s.respawn("identity_refresh")
    assert s.after_child(EndReason.RESPAWN.value, 3) is AfterChild.RESPAWN
    assert s.respawns == 1


@pytest.mark.parametrize("reason", [EndReason.CRASHED.value, EndReason.EXITED.value, None])
def test_a_respawn_that_fails_is_tried_again_then_abandoned(reason: str | None) -> None:
    s = session(SessionState.RUNNING)
    s.respawn("identity_refresh")
    assert s.after_child(EndReason.RESPAWN.value, 2) is AfterChild.RESPAWN
    # the new child died (or could not be launched) before it answered initialize
    assert s.after_child(reason, 2) is AfterChild.RESPAWN
    assert s.after_child(reason, 2) is AfterChild.ABANDON
    assert s.respawns == 3  # the audit reports respawns - 1 attempts


def test_a_respawned_child_that_came_up_ends_the_session_in_the_ordinary_way() -> None:
    s = session(SessionState.RUNNING)
    s.respawn("identity_refresh")
    assert s.after_child(EndReason.RESPAWN.value, 2) is AfterChild.RESPAWN
    s.ready()  # its init
    assert s.after_child(EndReason.CRASHED.value, 2) is AfterChild.END


# -- the table ----------------------------------------------------------------------------------


def made(sid: str, principal: str) -> Session:
    record = SessionRecord(session_id=sid, principal_id=principal, claude_session="c")
    return Session(record, PrincipalConfig(name=principal))


def test_the_table_takes_an_id_once() -> None:
    """(Its caps are admission's: tests/unit/test_runner_admission.py.)"""
    table = SessionTable()
    table.add(made("s1", "alice"))
    table.add(made("s2", "alice"))
    with pytest.raises(IllegalTransition):
        table.add(made("s1", "bob"))
    assert [s.id for s in table.of("alice")] == ["s1", "s2"]
    assert len(table) == 2


def test_another_principals_session_is_invisible() -> None:
    table = SessionTable()
    alice, bob = made("s1", "alice"), made("s2", "bob")
    table.add(alice)
    table.add(bob)
    assert table.visible("s1", "alice") is alice
    assert table.visible("s1", "bob") is None
    assert table.visible("s1", None) is alice  # an admin sees every session
    assert table.visible("nope", None) is None
    assert table.visible_to("bob") == [bob]
    assert table.visible_to(None) == [alice, bob]


def test_a_session_leaves_the_table_once_and_only_itself() -> None:
    table = SessionTable()
    old = made("s1", "alice")
    table.add(old)
    table.remove(old)
    assert "s1" not in table
    new = made("s1", "alice")  # a later spawn with the same id
    table.add(new)
    table.remove(old)  # the old one's late cleanup leaves the new one be
    assert table["s1"] is new
    assert list(table.values()) == [new]
