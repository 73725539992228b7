"""Hibernation without processes: the session machine's sleep and wake, the table's
choice of whom to hibernate, and the live slots with their bounded queue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import anyio
import msgspec
import pytest

from capsules.runner.claude_process import ClaudeProcess
from capsules.runner.conversation import Conversation, EndReason
from capsules.runner.errors import SessionError
from capsules.runner.hibernation import Hibernation, Keeper
from capsules.runner.history import EventHistory
from capsules.runner.live_slots import LiveSlots
from capsules.runner.sessions import (
    AfterChild,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
)
from sage.config import Config, PrincipalConfig

pytestmark = pytest.mark.anyio


@dataclass
class _Proc:
    """What the table reads of a child to call its session idle."""

    initialized: bool = True
    idle: bool = True


def made(
    sid: str = "s1",
    principal: str = "alice",
    state: SessionState = SessionState.RUNNING,
    *,
    last_active: float = 0.0,
    proc: Any = None,
) -> Session:
    record = SessionRecord(session_id=sid, principal_id=principal, claude_session="c")
    session = Session(record, PrincipalConfig(name=principal), last_active=last_active)
    session.state = state
    session.proc = cast(ClaudeProcess, _Proc() if proc is None else proc)
    return session


# -- the session machine ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "stored"),
    [
        (SessionState.HIBERNATING, RecordState.HIBERNATED),
        (SessionState.HIBERNATED, RecordState.HIBERNATED),
        (SessionState.WAKING, RecordState.HIBERNATED),  # until the woken child is up
    ],
)
def test_what_the_record_says_of_a_sleeping_session(
    state: SessionState, stored: RecordState
) -> None:
    assert made(state=state).record_state() is stored


@pytest.mark.parametrize("reason", [EndReason.HIBERNATE, EndReason.CRASHED, None])
def test_a_hibernating_child_that_ends_puts_the_session_to_sleep(
    reason: EndReason | None,
) -> None:
    """Whatever the stopping child said last: the session is not over."""
    s = made()
    s.hibernate()
    assert s.settled is not None
    assert s.after_child(reason, max_respawns=5) is AfterChild.HIBERNATE
    settled = s.settled
    s.hibernated()
    assert s.state is SessionState.HIBERNATED
    assert s.proc is None
    assert settled.is_set()  # a send that waited for the hibernation goes on
    assert s.settled is None


def test_a_stop_wins_over_a_hibernation() -> None:
    s = made()
    s.hibernate()
    s.stop()
    assert s.state is SessionState.STOPPING
    assert s.after_child(EndReason.STOPPED, max_respawns=5) is AfterChild.END
    conversation = Conversation("alice", "s1", "default")
    conversation.end(EndReason.HIBERNATE)
    conversation.end(EndReason.STOPPED)
    assert conversation.reason is EndReason.STOPPED
    conversation = Conversation("alice", "s1", "default")
    conversation.end(EndReason.STOPPED)
    conversation.end(EndReason.HIBERNATE)
    assert conversation.reason is EndReason.STOPPED


def test_a_woken_child_that_ends_before_it_is_ready_ends_the_session() -> None:
    s = made(state=SessionState.HIBERNATED, proc=None)
    s.proc = None
    s.wake()
    assert s.after_child(EndReason.CRASHED, max_respawns=5) is AfterChild.END
    assert s.respawns == 0  # no retry: the runner says resume_failed


def test_a_wake_is_over_once_the_child_is_ready() -> None:
    s = made(state=SessionState.HIBERNATED)
    s.wake()
    settled = s.settled
    assert settled is not None
    assert s.live  # it takes a slot while it wakes
    s.woken()
    assert s.state is SessionState.RUNNING
    assert settled.is_set()


def test_a_wake_without_a_slot_sleeps_on() -> None:
    s = made(state=SessionState.HIBERNATED)
    s.wake()
    settled = s.settled
    s.sleep_on()
    assert s.state is SessionState.HIBERNATED
    assert settled is not None
    assert settled.is_set()


def test_only_a_hibernated_session_may_wake_and_it_may_end_at_once() -> None:
    for state in SessionState:
        s = made(state=state)
        assert s.may(SessionState.WAKING) is (
            state in (SessionState.HIBERNATED, SessionState.WAKING)
        )
    s = made(state=SessionState.HIBERNATED)
    s.move(SessionState.ENDED)  # a stop of a sleeping session: no child to wait for


def test_a_session_with_a_child_may_hibernate() -> None:
    """A running session when idle (the hibernator picks only idle ones), any session
    with a child when the node lost its fleet lease (fenced); never one asleep or over."""
    with_child = (
        SessionState.STARTING,
        SessionState.RUNNING,
        SessionState.RESPAWNING,
        SessionState.WAKING,
        SessionState.HIBERNATING,
    )
    for state in SessionState:
        s = made(state=state)
        assert s.may(SessionState.HIBERNATING) is (state in with_child), state


# -- the table: who is live, who is idle ------------------------------------------------


def test_live_and_idle() -> None:
    assert made().idle
    assert made().live
    assert not made(proc=_Proc(initialized=False)).idle  # still starting
    assert not made(proc=_Proc(idle=False)).idle  # a turn runs
    for state in (SessionState.HIBERNATING, SessionState.HIBERNATED):
        assert not made(state=state).live
        assert not made(state=state).idle
    for state in (SessionState.STARTING, SessionState.WAKING, SessionState.RESPAWNING):
        assert made(state=state).live
        assert not made(state=state).idle


def test_the_least_recently_used_idle_session_is_chosen() -> None:
    table = SessionTable()
    table.add(made("old", last_active=1.0, proc=_Proc(idle=False)))  # oldest, but busy
    table.add(made("older", last_active=2.0))
    table.add(made("newer", last_active=3.0))
    table.add(made("bobs", "bob", last_active=0.5))
    table.add(made("asleep", state=SessionState.HIBERNATED, last_active=0.1))
    assert table.least_recent_idle() is table["bobs"]
    assert table.least_recent_idle("alice") is table["older"]
    assert table.least_recent_idle("carol") is None
    assert [s.id for s in table.idle_since(2.5)] == ["older", "bobs"]
    assert sum(1 for s in table.values() if s.live) == 4
    assert [s.id for s in table.live_of("alice")] == ["old", "older", "newer"]


# -- live slots ----------------------------------------------------------------------------


async def test_slots_are_bounded_and_none_means_no_bound() -> None:
    slots = LiveSlots(2, queue=4)
    assert slots.try_take("a")
    assert slots.try_take("b")
    assert slots.try_take("a")  # held already
    assert not slots.try_take("c")
    assert len(slots) == 2
    assert "a" in slots
    unbounded = LiveSlots(0, queue=0)
    assert all(unbounded.try_take(f"s{i}") for i in range(1000))


async def test_a_slot_given_back_goes_to_the_first_waiter() -> None:
    slots = LiveSlots(1, queue=4)
    slots.try_take("a")
    got: list[str] = []

    async def wait(sid: str) -> None:
        await slots.take(sid, within=5)
        got.append(sid)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "b")
        await anyio.sleep(0.01)
        tg.start_soon(wait, "c")
        await anyio.sleep(0.01)
        assert slots.waiting == 2
        assert not slots.free
        assert not slots.try_take("d")  # no jumping the queue
        slots.give_back("a")
        await anyio.sleep(0.01)
        assert got == ["b"]
        slots.give_back("nobody")  # not held: nothing moves
        slots.give_back("b")
    assert got == ["b", "c"]
    assert "c" in slots
    assert len(slots) == 1


async def test_a_full_queue_and_a_wait_that_runs_out_are_host_full() -> None:
    slots = LiveSlots(1, queue=1)
    slots.try_take("a")
    async with anyio.create_task_group() as tg:
        tg.start_soon(slots.take, "b", 5.0)
        await anyio.sleep(0.01)
        with pytest.raises(SessionError) as full:
            await slots.take("c", 5.0)  # the queue holds one
        assert full.value.code == "host_full"
        assert "max_live" in str(full.value)
        slots.give_back("a")
    with pytest.raises(SessionError) as late:
        await slots.take("d", 0.05)
    assert late.value.code == "host_full"
    assert slots.waiting == 0  # the waiter that gave up left the queue
    slots.give_back("b")
    assert slots.try_take("d")


# -- making room ---------------------------------------------------------------------------


class _Keeper:
    """The runner, as far as making room goes: its table and config; tasks recorded."""

    def __init__(self, max_live: int) -> None:
        self.config = msgspec.convert({"sessions": {"max_live": max_live}}, Config)
        self.sessions = SessionTable()
        self.started: list[str] = []

    def soon(self, func: Any, *args: Any) -> None:
        self.started.append(args[0].id)


async def test_room_is_made_once_per_wait_not_once_per_look() -> None:
    """A wake that waits for the slot of a hibernating session is covered: the sweeper's
    next look must not put another session to sleep for it."""
    keeper = _Keeper(max_live=2)
    hibernation = Hibernation(cast(Keeper, keeper))
    hibernation.configure()
    for sid, used in (("old", 1.0), ("new", 2.0)):
        keeper.sessions.add(made(sid, last_active=used))
        assert hibernation.slots.try_take(keeper.sessions[sid])
    waker = made("waker", state=SessionState.HIBERNATED)
    keeper.sessions.add(waker)
    async with anyio.create_task_group() as tg:
        tg.start_soon(hibernation.slot_for, waker)
        await anyio.sleep(0.01)
        assert keeper.started == ["old"]  # the least recently used, once
        assert hibernation.slots.waiting == 1
        hibernation._make_room()  # the sweeper's look while the wake waits
        assert keeper.started == ["old"]  # "new" stays up
        keeper.sessions["old"].hibernated()
        hibernation.slots.give_back(keeper.sessions["old"])
    assert waker in hibernation.slots


# -- races with a stop, a full host, several senders ---------------------------------------


class _Runner:
    """A keeper that starts no process: ``start`` only takes the live slot, ``save`` may
    be held at a gate to open the window a stop can fall into."""

    def __init__(self, *, max_live: int = 1, wake_wait: float = 0.1, wake_queue: int = 256):
        sessions = {"max_live": max_live, "wake_wait": wake_wait, "wake_queue": wake_queue}
        self.config = msgspec.convert({"sessions": sessions}, Config)
        self.sessions = SessionTable()
        self.history = EventHistory()
        self.events: list[tuple[str, str]] = []
        self.ends: list[tuple[str, str]] = []
        self.begun: list[str] = []
        self.gate: anyio.Event | None = None
        self.hibernation = Hibernation(cast(Keeper, self))
        self.hibernation.configure()

    def principal(self, name: str) -> PrincipalConfig | None:
        return PrincipalConfig(name=name)

    def audit(self, kind: str, payload: dict[str, Any]) -> None:
        pass

    def session_event(self, sid: str, name: str, payload: dict[str, Any]) -> None:
        self.events.append((sid, name))
        self.history.record(sid, len(self.events), name, 0.0, payload)

    def soon(self, func: Any, *args: Any) -> None:
        self.begun.append(args[0].id)

    async def save(self, record: SessionRecord) -> None:
        if self.gate is not None:
            await self.gate.wait()

    async def scrub(self, session: Session) -> None:
        pass

    async def start(self, session: Session, *, resume: bool, initial: str | None) -> int:
        await self.hibernation.slot_for(session)
        return 1

    async def ended(self, session: Session, ending: Any, reason: str) -> None:
        session.move(SessionState.ENDED)
        self.ends.append((session.id, reason))
        session.over()


def _busy(runner: _Runner) -> None:
    """A live session holding the only slot, never idle (a turn runs)."""
    busy = made("busy", proc=_Proc(idle=False))
    runner.sessions.add(busy)
    assert runner.hibernation.slots.try_take(busy)


async def test_a_stop_while_the_hibernated_record_is_saved_ends_the_session() -> None:
    runner = _Runner()
    session = made("s")
    runner.sessions.add(session)
    session.hibernate()
    runner.gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.hibernation.hibernated, session)
        await anyio.sleep(0.01)
        session.stop()  # the operator's stop lands in the save
        runner.gate.set()
    assert session.state is SessionState.ENDED
    assert runner.ends == [("s", "stopped")]
    assert ("s", "hibernated") not in runner.events


async def test_a_stop_while_a_wake_waits_for_a_slot_ends_the_session() -> None:
    runner = _Runner(wake_wait=0.1)
    _busy(runner)
    session = made("s", state=SessionState.HIBERNATED)
    session.proc = None
    runner.sessions.add(session)
    caught: list[SessionError] = []

    async def send() -> None:
        try:
            await runner.hibernation.awake(session)
        except SessionError as exc:
            caught.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.sleep(0.01)
        assert session.state is SessionState.WAKING
        session.stop()
    assert [exc.code for exc in caught] == ["session_ended"]
    assert session.state is SessionState.ENDED
    assert session.done.is_set()
    assert session not in runner.hibernation.slots


async def test_a_wake_without_a_slot_says_host_full_once_for_every_sender() -> None:
    """Senders waiting on the same wake share its failure (not one wake_wait each);
    nothing was announced, the ring stays bounded, and a later wake tries again."""
    runner = _Runner(wake_wait=0.2)
    _busy(runner)
    session = made("s", state=SessionState.HIBERNATED)
    session.proc = None
    runner.sessions.add(session)
    codes: list[str] = []

    async def send() -> None:
        try:
            await runner.hibernation.awake(session)
        except SessionError as exc:
            codes.append(exc.code)

    started = anyio.current_time()
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(send)
    assert codes == ["host_full"] * 3
    assert anyio.current_time() - started < 0.4
    assert session.state is SessionState.HIBERNATED
    assert ("s", "waking") not in runner.events  # no "resuming" for a wake that never began
    assert len(runner.history) == 0
    runner.hibernation.slots.give_back(runner.sessions["busy"])
    with anyio.fail_after(5):  # room now: the next send wakes it (no child here: no init)
        await runner.hibernation._wake(session)
    assert session.state.value == "waking"
    assert ("s", "waking") in runner.events


async def test_a_request_refused_at_once_puts_nobody_to_sleep() -> None:
    runner = _Runner(max_live=3, wake_wait=5, wake_queue=1)
    _busy(runner)
    for used, sid in enumerate(("i1", "i2")):
        idle = made(sid, last_active=float(used))
        runner.sessions.add(idle)
        runner.hibernation.slots.try_take(idle)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.hibernation.slot_for, made("w1", state=SessionState.STARTING))
        await anyio.sleep(0.01)
        with pytest.raises(SessionError) as full:
            await runner.hibernation.slot_for(made("w2", state=SessionState.STARTING))
        tg.cancel_scope.cancel()
    assert full.value.code == "host_full"
    assert runner.begun == ["i1"]  # for the one that waits; none for the one refused


async def test_a_send_on_its_way_keeps_the_session_awake() -> None:
    session = made("s")
    assert session.idle
    session.sending += 1  # between its wake and its turn written
    assert not session.idle


async def test_a_send_during_a_respawn_waits_for_the_next_child() -> None:
    """While an identity refresh replaces the child, a turn is not for the old one (it
    ends): awake returns once the new child is attached, and at once when the session
    is over instead."""
    keeper = _Keeper(max_live=0)
    hibernation = Hibernation(cast(Keeper, keeper))
    session = made()
    old = session.proc
    assert session.respawn("identity_refresh")
    assert session.between_children
    returned: list[Any] = []

    async def send() -> None:
        await hibernation.awake(session)
        returned.append(session.proc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(send)
        await anyio.sleep(0.05)
        assert returned == []  # the old child may not take it
        new = cast(ClaudeProcess, _Proc())
        session.attach(new)
    assert returned == [new]
    assert old is not new
    assert not session.between_children

    ending = made("s2")
    assert ending.respawn("identity_refresh")
    async with anyio.create_task_group() as tg:
        tg.start_soon(hibernation.awake, ending)
        await anyio.sleep(0.05)
        ending.move(SessionState.ENDED)
        ending.over()  # the respawn failed: the send learns it from the session's state
