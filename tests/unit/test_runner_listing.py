"""The listing rows (capsules/runner/listing.py), without processes: the state a row
shows, which the fleet's slots counts share, and the paging of live and ended rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import msgspec
import pytest

from capsules.runner.claude_process import ClaudeProcess
from capsules.runner.conversation import ProcessState as ProcState
from capsules.runner.listing import ended_row, ended_text, listed_state, live_row, page
from capsules.runner.sessions import RecordState, Session, SessionRecord, SessionState
from sage.config import PrincipalConfig


@dataclass
class _Turn:
    finished: int = 1
    cost_usd: float = 0.25


@dataclass
class _Proc:
    state: ProcState = ProcState.READY
    turn: _Turn = field(default_factory=_Turn)

    def describe(self) -> dict[str, Any]:
        return {"session_id": "s1", "principal_id": "alice", "pid": 42, "state": "x"}


def made(state: SessionState, proc: Any = None, sid: str = "s1") -> Session:
    record = SessionRecord(
        session_id=sid, principal_id="alice", claude_session="c", started_at=100.0
    )
    session = Session(record, PrincipalConfig(name="alice"), state=state, turns=2, cost_usd=0.5)
    session.proc = cast(ClaudeProcess, proc)
    return session


@pytest.mark.parametrize(
    "state",
    [
        SessionState.HIBERNATING,
        SessionState.HIBERNATED,
        SessionState.WAKING,
        SessionState.RESPAWNING,
    ],
)
def test_between_children_a_row_shows_the_sessions_own_state(state: SessionState) -> None:
    assert listed_state(made(state, _Proc(ProcState.BUSY))) == state.value


def test_with_a_child_a_row_shows_the_childs_state_and_before_one_starting() -> None:
    assert listed_state(made(SessionState.RUNNING, _Proc(ProcState.BUSY))) == "busy"
    assert listed_state(made(SessionState.RUNNING, _Proc(ProcState.READY))) == "ready"
    assert listed_state(made(SessionState.STARTING)) == "starting"


def test_a_live_row_has_the_sessions_totals_and_age() -> None:
    row = live_row(made(SessionState.RUNNING, _Proc(ProcState.BUSY)), now=130.04)
    assert row["state"] == "busy"
    assert row["pid"] == 42
    # the earlier children's turns and the one serving it now
    assert (row["turns"], row["cost_usd"]) == (3, 0.75)
    assert (row["started_at"], row["age_s"]) == (100.0, 30.0)
    asleep = live_row(made(SessionState.HIBERNATED), now=100.0)
    assert (asleep["state"], asleep["pid"]) == ("hibernated", None)


def test_an_ended_row_and_text_come_from_the_record() -> None:
    record = SessionRecord(
        session_id="s1",
        principal_id="alice",
        claude_session="c",
        state=RecordState.ENDED,
        reason="stopped",
        exit_code=0,
        ended_at=5.0,
    )
    row = ended_row(record)
    assert (row["state"], row["reason"], row["pid"], row["exit_code"]) == (
        "ended",
        "stopped",
        None,
        0,
    )
    assert ended_text(record).endswith("(stopped, exit code 0)")
    record.signal = 9
    assert ended_text(record).endswith("(stopped, signal 9)")


def test_a_page_runs_over_the_live_rows_into_the_ended_ones() -> None:
    live = [made(SessionState.HIBERNATED, sid=f"l{i}") for i in range(3)]
    ended = [
        msgspec.to_builtins(
            SessionRecord(
                session_id=f"e{i}",
                principal_id="alice",
                claude_session="c",
                state=RecordState.ENDED,
            )
        )
        for i in range(2)
    ]
    first = page(live, ended, offset=0, limit=2)
    assert [r["session_id"] for r in first["sessions"]] == ["l0", "l1"]
    assert (first["total"], first["next_offset"]) == (5, 2)
    second = page(live, ended, offset=2, limit=2)
    assert [r["session_id"] for r in second["sessions"]] == ["l2", "e0"]
    last = page(live, ended, offset=4, limit=2)
    assert [r["session_id"] for r in last["sessions"]] == ["e1"]
    assert last["next_offset"] is None
