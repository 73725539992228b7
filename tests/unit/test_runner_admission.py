"""Admission of a spawn, an adoption and a wake (capsules/runner/admission.py), without
processes: the decision from what the table says, and the shell that reads the table
and begins the hibernation a decision asks for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from capsules.runner.admission import Admission, Join, Limits, Seen, decide, judge
from capsules.runner.claude_process import ClaudeProcess
from capsules.runner.errors import SessionError
from capsules.runner.live_slots import LiveSlots
from capsules.runner.sessions import Session, SessionRecord, SessionState, SessionTable
from sage.config import Config, LimitsConfig, PrincipalConfig
from sage.contract.codes import ErrorCode

LIMITS = Limits(cap=2, logical_cap=4, hibernation=True, may_hibernate=True, wake_wait=30)


def test_a_free_principal_is_admitted_every_way() -> None:
    for join in Join:
        assert decide(join, "s", "alice", Seen(live=1, logical=1), LIMITS) == Admission()


def test_a_taken_id_is_a_duplicate_before_any_cap_but_not_for_a_wake() -> None:
    seen = Seen(taken=True, live=9, logical=9)
    for join in (Join.SPAWN, Join.ADOPT, Join.ADOPT_ASLEEP):
        decision = decide(join, "s", "alice", seen, LIMITS)
        assert decision.code is ErrorCode.DUPLICATE_SESSION
        assert decision.message == "session 's' exists"
    assert decide(Join.WAKE, "s", "alice", Seen(taken=True, live=1), LIMITS).admitted


def test_the_logical_cap_counts_the_asleep_and_binds_an_asleep_adoption() -> None:
    seen = Seen(live=0, logical=4)
    for join in (Join.SPAWN, Join.ADOPT, Join.ADOPT_ASLEEP):
        decision = decide(join, "s", "alice", seen, LIMITS)
        assert decision.code is ErrorCode.PRINCIPAL_LIMIT
        assert "max_logical_sessions_per_principal" in decision.message
    # a wake's session is one of the four already
    assert decide(Join.WAKE, "s", "alice", seen, LIMITS).admitted


def test_at_the_live_cap_an_idle_session_makes_room_else_a_refusal() -> None:
    full = Seen(live=2, logical=2)
    for join in (Join.SPAWN, Join.ADOPT, Join.WAKE):
        assert decide(join, "s", "alice", Seen(live=2, logical=2, idle=True), LIMITS) == (
            Admission(make_room=True)
        )
        assert decide(join, "s", "alice", full, LIMITS).code is ErrorCode.PRINCIPAL_LIMIT
    # asleep, it takes no live place
    assert decide(Join.ADOPT_ASLEEP, "s", "alice", full, LIMITS).admitted
    # hibernation off: an idle session does not make room
    off = Limits(cap=2, logical_cap=4, hibernation=False, may_hibernate=False)
    refused = decide(Join.SPAWN, "s", "alice", Seen(live=2, logical=2, idle=True), off)
    assert refused.message == "principal 'alice' has 2 live sessions already"


def test_the_refusals_say_why() -> None:
    shared = Limits(
        cap=1, note=" (its share)", logical_cap=4, hibernation=True, may_hibernate=True, wake_wait=2
    )
    full = Seen(live=1, logical=1)
    spawn = decide(Join.SPAWN, "s", "alice", full, shared)
    assert (
        spawn.message
        == "principal 'alice' has 1 live sessions already (its share), none of them idle"
    )
    wake = decide(Join.WAKE, "s", "alice", full, shared)
    assert wake.message == (
        "principal 'alice' has 1 live sessions (its share), none idle within 2 s"
        " ([sessions] wake_wait)"
    )
    error = wake.error()
    assert isinstance(error, SessionError)
    assert (error.code, str(error)) == ("principal_limit", wake.message)


def test_an_adoption_needs_a_slot_free_or_soon_a_spawn_waits_for_one() -> None:
    no_room = Seen(live=0, logical=0, host_room=False, host_live=3)
    limits = Limits(cap=2, logical_cap=4, hibernation=True, may_hibernate=True, max_live=3)
    adopt = decide(Join.ADOPT, "s", "alice", no_room, limits)
    assert adopt.code is ErrorCode.HOST_FULL
    assert adopt.message == "the host runs 3 sessions of max_live 3, none idle"
    assert decide(Join.SPAWN, "s", "alice", no_room, limits).admitted
    assert decide(Join.ADOPT_ASLEEP, "s", "alice", no_room, limits).admitted
    # the principal's own idle session hibernating gives the slot back
    making_room = Seen(live=2, logical=2, idle=True, host_room=False)
    assert decide(Join.ADOPT, "s", "alice", making_room, limits).make_room


# -- the shell ------------------------------------------------------------------------------


@dataclass
class _Proc:
    initialized: bool = True
    idle: bool = True


@dataclass
class _Room:
    """Hibernation as admission sees it."""

    cap: int = 2
    enabled: bool = True
    slots: LiveSlots = field(default_factory=lambda: LiveSlots(0, 0))
    soon: bool = True
    begun: list[tuple[str, str]] = field(default_factory=list)

    def live_cap(self, principal: str) -> tuple[int, str]:
        return self.cap, ""

    def room_soon(self) -> bool:
        return self.soon

    def begin(self, session: Session, why: str) -> None:
        self.begun.append((session.id, why))
        session.state = SessionState.HIBERNATING


def _session(sid: str, principal: str = "alice", *, last: float = 0.0, **state: Any) -> Session:
    record = SessionRecord(session_id=sid, principal_id=principal, claude_session="c")
    session = Session(record, PrincipalConfig(name=principal), last_active=last)
    session.state = state.get("state", SessionState.RUNNING)
    session.proc = cast(ClaudeProcess, _Proc(idle=state.get("idle", True)))
    return session


def _config(logical: int = 5) -> Config:
    return Config(limits=LimitsConfig(max_logical_sessions_per_principal=logical))


def test_judge_reads_the_table_and_hibernates_the_least_recent_idle_for_room() -> None:
    table = SessionTable()
    table.add(_session("busy", last=0.0, idle=False))
    table.add(_session("old", last=1.0))
    table.add(_session("new", last=2.0))
    table.add(_session("bobs", "bob", last=0.5))
    room = _Room(cap=3)
    decision = judge(Join.SPAWN, "s", "alice", sessions=table, room=room, config=_config())
    assert decision.make_room
    assert room.begun == [("old", "principal_limit")]
    # with the room made (one hibernating), the next spawn fits under the cap
    assert judge(Join.SPAWN, "t", "alice", sessions=table, room=room, config=_config()).admitted
    assert room.begun == [("old", "principal_limit")]


def test_judge_refuses_without_beginning_anything() -> None:
    table = SessionTable()
    table.add(_session("a", idle=False))
    table.add(_session("b", state=SessionState.HIBERNATED))
    room = _Room(cap=1)
    refused = judge(Join.SPAWN, "c", "alice", sessions=table, room=room, config=_config())
    assert refused.code is ErrorCode.PRINCIPAL_LIMIT
    assert room.begun == []
    # the hibernated one counts against the logical cap
    logical = judge(Join.ADOPT_ASLEEP, "c", "alice", sessions=table, room=room, config=_config(2))
    assert logical.code is ErrorCode.PRINCIPAL_LIMIT
    assert judge(Join.SPAWN, "a", "bob", sessions=table, room=room, config=_config()).code is (
        ErrorCode.DUPLICATE_SESSION
    )
    full = _Room(cap=5, soon=False)
    assert judge(Join.ADOPT, "c", "alice", sessions=table, room=full, config=_config()).code is (
        ErrorCode.HOST_FULL
    )


@pytest.mark.parametrize("join", list(Join))
def test_every_join_is_decided(join: Join) -> None:
    """No way of joining falls through the decision undecided."""
    decision = decide(join, "s", "alice", Seen(live=5, logical=5), LIMITS)
    assert isinstance(decision, Admission)
    assert decision.admitted or decision.code in {
        ErrorCode.PRINCIPAL_LIMIT,
        ErrorCode.DUPLICATE_SESSION,
        ErrorCode.HOST_FULL,
    }


def test_judge_refuses_a_duplicate_and_a_principal_past_its_cap() -> None:
    table = SessionTable()
    room = _Room(cap=2, enabled=False)

    def code(sid: str, principal: str, join: Join = Join.SPAWN, logical: int = 5) -> Any:
        return judge(join, sid, principal, sessions=table, room=room, config=_config(logical)).code

    assert code("s1", "alice") is None
    table.add(_session("s1", state=SessionState.STARTING))
    assert code("s1", "bob") is ErrorCode.DUPLICATE_SESSION
    assert code("s2", "alice") is None
    table.add(_session("s2", state=SessionState.STARTING))
    assert code("s3", "alice") is ErrorCode.PRINCIPAL_LIMIT
    assert code("s3", "bob") is None
    # a session that joins asleep (an adopted hibernated one) counts in all, not live
    assert code("s3", "alice", Join.ADOPT_ASLEEP) is None
    assert code("s3", "alice", Join.ADOPT_ASLEEP, logical=2) is ErrorCode.PRINCIPAL_LIMIT


def test_the_caps_count_live_sessions_and_all_sessions() -> None:
    table = SessionTable()
    table.add(_session("a", idle=False))
    table.add(_session("b", state=SessionState.HIBERNATED))
    table.add(_session("c", state=SessionState.HIBERNATING))
    room = _Room(cap=2, enabled=False)
    assert judge(Join.SPAWN, "d", "alice", sessions=table, room=room, config=_config()).admitted
    room.cap = 1
    assert not judge(Join.SPAWN, "d", "alice", sessions=table, room=room, config=_config()).admitted
    room.cap = 2
    for logical, admitted in ((3, False), (4, True)):
        decision = judge(
            Join.SPAWN, "d", "alice", sessions=table, room=room, config=_config(logical)
        )
        assert decision.admitted is admitted
