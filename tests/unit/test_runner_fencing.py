"""The runner's side of fencing, without processes: ``sage.v1.request.yield.<sid>`` is the
supervisor's alone and ends a session ``failed_over`` (audited ``session_fenced``), and a
session kept asleep at start because the fleet could not say whether another node took it
is asked about again before it wakes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from bus import Envelope
from capsules.runner.errors import SessionError
from capsules.runner.runner import Runner
from capsules.runner.sessions import RecordState, Session, SessionRecord, SessionState
from sage.config import PrincipalConfig
from tests.support.runner_context import RunnerContext

pytestmark = pytest.mark.anyio


def asleep(runner: Runner, sid: str = "s1") -> Session:
    record = SessionRecord(
        session_id=sid, principal_id="alice", claude_session="c", state=RecordState.HIBERNATED
    )
    session = Session(record, PrincipalConfig(name="alice"), state=SessionState.HIBERNATED)
    runner.sessions.add(session)
    return session


def state_of(session: Session) -> SessionState:
    return session.state  # (read afresh: a request changed it)


def envelope(topic: str, payload: Any, principal: str | None = None) -> Envelope:
    return Envelope(
        id=1,
        topic=topic,
        payload=msgspec.json.encode(payload),
        source="client",
        principal=principal,
    )


def audits(ctx: RunnerContext, kind: str) -> list[Any]:
    return [p for t, p in ctx.published if t == f"sage.v1.audit.{kind}"]


def exited(ctx: RunnerContext) -> list[Any]:
    return [p for t, p in ctx.published if t.endswith(".exited")]


async def test_yield_is_refused_to_a_principal_and_ends_a_session_failed_over(
    tmp_path: Path,
) -> None:
    ctx = RunnerContext(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    session = asleep(runner)
    with pytest.raises(SessionError) as refused:
        await runner.fleet.yield_request(
            envelope("sage.v1.request.yield.s1", {"node": "b"}, "alice")
        )
    assert refused.value.code == "not_authorized"
    assert session.state is SessionState.HIBERNATED

    reply = await runner.fleet.yield_request(envelope("sage.v1.request.yield.s1", {"node": "b"}))
    assert reply == {"ok": True, "session_id": "s1", "node": "b"}
    assert state_of(session) is SessionState.ENDED
    assert "s1" not in runner.sessions
    assert ctx.state.data["sessions", "s1"]["reason"] == "failed_over"
    assert [e["reason"] for e in exited(ctx)] == ["failed_over"]
    assert audits(ctx, "session_fenced") == [
        {
            "principal_id": "alice",
            "session_id": "s1",
            "node": "b",
            "pid": None,
            "state": "hibernated",
        }
    ]
    with pytest.raises(SessionError) as gone:
        await runner.fleet.yield_request(envelope("sage.v1.request.yield.s1", {"node": "b"}))
    assert gone.value.code == "unknown_session"


async def test_a_session_the_fleet_could_not_vouch_for_is_asked_about_before_it_wakes(
    tmp_path: Path,
) -> None:
    ctx = RunnerContext(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    session = asleep(runner)
    runner.fleet.unsure.add("s1")
    # the fleet still cannot say: no wake (never a second child), it sleeps on
    with pytest.raises(SessionError) as unknown:
        await runner.fleet.still_here(session)
    assert unknown.value.code == "fleet_unavailable"
    assert session.state is SessionState.HIBERNATED
    # another node took it meanwhile: it ends here, and the send goes to that node
    ctx.claims = {"ok": True, "elsewhere": {"s1": "b"}}
    with pytest.raises(SessionError) as moved:
        await runner.fleet.still_here(session)
    assert moved.value.code == "unknown_session"
    assert state_of(session) is SessionState.ENDED
    assert [e["reason"] for e in exited(ctx)] == ["failed_over"]
    assert ctx.asked == [
        {"session_ids": ["s1"], "principals": {"s1": "alice"}},
        {"session_ids": ["s1"], "principals": {"s1": "alice"}},
    ]


async def test_a_session_still_this_nodes_wakes_and_is_asked_about_once(tmp_path: Path) -> None:
    ctx = RunnerContext(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    session = asleep(runner)
    runner.fleet.unsure.add("s1")
    ctx.claims = {"ok": True, "elsewhere": {}}
    await runner.fleet.still_here(session)
    await runner.fleet.still_here(session)
    assert ctx.asked == [{"session_ids": ["s1"], "principals": {"s1": "alice"}}]
    assert session.state is SessionState.HIBERNATED  # the wake goes on from here
    other = asleep(runner, "s2")  # never in doubt: nothing asked
    await runner.fleet.still_here(other)
    assert len(ctx.asked) == 1


async def test_a_session_fenced_twice_at_once_is_audited_once(tmp_path: Path) -> None:
    """The return and the sweep may both yield a live session: one fence, one audit row,
    and both wait for its end."""
    import anyio

    ctx = RunnerContext(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    record = SessionRecord(session_id="s2", principal_id="alice", claude_session="c2")
    session = Session(record, PrincipalConfig(name="alice"), state=SessionState.RUNNING)
    runner.sessions.add(session)
    returned: list[str] = []

    async def yield_it(who: str) -> None:
        await runner.fleet.fence(session, "b")
        returned.append(who)

    async with anyio.create_task_group() as tg:
        tg.start_soon(yield_it, "return")
        tg.start_soon(yield_it, "sweep")
        await anyio.sleep(0.05)
        assert returned == []  # both wait for the child's end
        session.done.set()
    assert sorted(returned) == ["return", "sweep"]
    assert [a["session_id"] for a in audits(ctx, "session_fenced")] == ["s2"]
