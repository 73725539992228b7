"""Start-up's plan (capsules/runner/startup.py), without processes: what becomes of each
session the last supervisor left live."""

from __future__ import annotations

from typing import Any

import pytest

from capsules.runner.sessions import RecordState, SessionRecord
from capsules.runner.startup import Fate, Step, fate, left_live
from sage.config import PrincipalConfig

ALICE = PrincipalConfig(name="alice")
BARE = PrincipalConfig(name="alice", model="bare")  # the configured one, no stored settings


def record(state: RecordState = RecordState.RUNNING, sid: str = "s1") -> SessionRecord:
    return SessionRecord(session_id=sid, principal_id="alice", claude_session="c", state=state)


def decided(r: SessionRecord, **given: Any) -> Fate:
    inputs: dict[str, Any] = {
        "elsewhere": {},
        "resume": True,
        "principal": ALICE,
        "configured": BARE,
        "binary": True,
        "room": True,
    }
    inputs.update(given)
    return fate(r, **inputs)


def test_left_live_is_the_running_interrupted_and_hibernated_not_in_the_table() -> None:
    records = [
        record(RecordState.RUNNING, "run"),
        record(RecordState.INTERRUPTED, "int"),
        record(RecordState.HIBERNATED, "hib"),
        record(RecordState.ENDED, "end"),
        record(RecordState.RUNNING, "here"),
    ]
    kept = left_live(records, lambda sid: sid == "here")
    assert [r.session_id for r in kept] == ["run", "int", "hib"]


@pytest.mark.parametrize("state", [RecordState.RUNNING, RecordState.HIBERNATED])
def test_taken_elsewhere_ends_failed_over_whatever_it_was(state: RecordState) -> None:
    assert decided(record(state), elsewhere={"s1": "b"}) == Fate(Step.FAILED_OVER, node="b")


def test_a_live_one_resumes_with_its_principal() -> None:
    assert decided(record()) == Fate(Step.RESUME, keeper=ALICE)
    assert decided(record(RecordState.INTERRUPTED)) == Fate(Step.RESUME, keeper=ALICE)


def test_an_asleep_one_sleeps_on_even_with_its_settings_unreadable() -> None:
    assert decided(record(RecordState.HIBERNATED)) == Fate(Step.SLEEP, keeper=ALICE)
    # its wake will say why the settings cannot be read; it keeps existing meanwhile
    unreadable = decided(record(RecordState.HIBERNATED), principal=None)
    assert unreadable == Fate(Step.SLEEP, keeper=BARE)
    # a principal no longer configured: it ends
    gone = decided(record(RecordState.HIBERNATED), principal=None, configured=None)
    assert gone == Fate(Step.END)


def test_when_the_fleet_cannot_say_it_sleeps_unsure_and_starts_no_child() -> None:
    unsure = decided(record(), elsewhere=None)
    assert unsure == Fate(Step.SLEEP, unsure=True, keeper=ALICE)
    assert decided(record(), elsewhere=None, principal=None).keeper == BARE
    # without resume, nothing would start a child anyway: it ends as ever
    assert decided(record(), elsewhere=None, resume=False).step is Step.END


def test_past_max_live_a_resumable_one_sleeps_instead() -> None:
    assert decided(record(), room=False) == Fate(Step.SLEEP, keeper=ALICE)


@pytest.mark.parametrize(
    "given",
    [{"resume": False}, {"binary": False}, {"principal": None}],
    ids=["resume off", "no claude", "principal unusable"],
)
def test_otherwise_it_ends_supervisor_restart(given: dict[str, Any]) -> None:
    chosen = decided(record(), **given)
    assert chosen.step is Step.END
    assert chosen.keeper == given.get("principal", ALICE)
