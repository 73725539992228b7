"""The node's fleet lease: its arithmetic and clock (sage/lease.py), the config that
refuses a lease shorter than a heartbeat, and the runner's half (capsules/runner/
fleet_lease.py): grants taken only from the supervisor, the gates, and the fence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import msgspec
import pytest

from bus import Envelope
from capsules.runner.claude_process import ClaudeProcess
from capsules.runner.errors import SessionError
from capsules.runner.fleet_lease import LEASE_LOST, FleetLease
from capsules.runner.sessions import Session, SessionRecord, SessionState, SessionTable
from sage.config import Config, PrincipalConfig, decode_config
from sage.contract.sessions import LEASE_TOPIC, LeaseGrant
from sage.errors import ConfigError
from sage.lease import FENCE_TIME, Lease, beat_interval, lease_term

pytestmark = pytest.mark.anyio

FLEET = '[fleet]\nurl = "nats://127.0.0.1:4222"\nnode = "a"\ninsecure_no_auth = true\n'


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the arithmetic ---------------------------------------------------------------------


def test_the_lease_ends_before_another_node_may_judge_this_one_lost() -> None:
    """Another node adopts once the record is lost_after old by its clock, which may be
    max_clock_skew ahead; the runner needs FENCE_TIME to kill: the lease leaves both."""
    term = lease_term(6.0, 1.0)
    assert term == 4.75
    assert term + 1.0 + FENCE_TIME == 6.0
    assert decode_config(FLEET).fleet is not None
    assert decode_config(FLEET).fleet.lease == 4.75  # type: ignore[union-attr]
    assert beat_interval(2.0, term) == 2.0
    assert beat_interval(2.0, 3.0) == 1.5  # two beats a lease at least


def test_a_lease_shorter_than_a_heartbeat_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"leaves a lease of 0\.25 s"):
        decode_config(FLEET + "heartbeat = 0.4\nlost_after = 1.5\n")
    config = decode_config(FLEET + "heartbeat = 0.4\nlost_after = 1.5\nmax_clock_skew = 0.05\n")
    assert config.fleet is not None
    assert config.fleet.lease == 1.2


def test_a_lease_is_held_until_its_end_lost_once_and_regained_by_a_grant() -> None:
    clock = Clock()
    lease = Lease(clock)
    assert lease.pending
    assert not lease.held()
    assert not lease.expire()  # never held: nothing to fence
    assert lease.grant(clock.now + 2.0) is False
    assert lease.grant(clock.now + 1.0) is False  # an older grant shortens nothing
    assert lease.held()
    assert lease.remaining() == 2.0
    clock.now += 1.9
    assert lease.held()
    assert not lease.expire()
    clock.now += 0.1
    assert not lease.held()
    assert lease.expire() is True  # the moment to fence
    assert lease.expire() is False  # once
    assert (lease.lost, lease.losses) == (True, 1)
    assert lease.grant(clock.now - 0.5) is False  # a late grant of the past: still lost
    assert lease.grant(clock.now + 2.0) is True
    assert not lease.lost


# -- the runner's half ------------------------------------------------------------------


@dataclass
class Proc:
    """What the fence reads of a session's process."""

    child: Any = None
    fenced: int = 0

    def fence(self) -> None:
        self.fenced += 1


@dataclass
class Running:
    running: bool = True


@dataclass
class Rig:
    config: Config
    sessions: SessionTable = field(default_factory=SessionTable)
    fenced: list[str] = field(default_factory=list)
    audits: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    clock: Clock = field(default_factory=Clock)

    def __post_init__(self) -> None:
        self.lease = FleetLease(
            lambda: self.config,
            self.sessions,
            lambda s: self.fenced.append(s.id),
            lambda kind, payload: self.audits.append((kind, payload)),
            Lease(self.clock),
        )

    def add(self, sid: str, state: SessionState, proc: Proc | None) -> Session:
        record = SessionRecord(session_id=sid, principal_id="alice", claude_session="c")
        session = Session(record, PrincipalConfig(name="alice"))
        session.state = state
        session.proc = cast(ClaudeProcess, proc)
        self.sessions.add(session)
        return session


def grant(until: float, source: str = "supervisor", principal: str | None = None) -> Envelope:
    payload = msgspec.json.encode(LeaseGrant(until=until, term=1.0))
    return Envelope(1, LEASE_TOPIC, payload, source, principal)


async def feed(rig: Rig, *envelopes: Envelope) -> None:
    async def grants() -> Any:
        for envelope in envelopes:
            yield envelope

    await rig.lease.follow(grants())


async def test_without_a_fleet_every_gate_passes() -> None:
    rig = Rig(decode_config(""))
    await rig.lease.require("start a claude child")
    assert rig.lease.held()
    assert rig.lease.refusal() is None


async def test_grants_are_taken_from_the_supervisor_only() -> None:
    rig = Rig(decode_config(FLEET))
    now = rig.clock.now
    await feed(
        rig,
        grant(now + 60, source="cli:1000"),  # a user's
        grant(now + 60, source="capsule:echo"),  # a capsule's
        grant(now + 60, principal="alice"),  # on behalf of a principal
        Envelope(1, LEASE_TOPIC, b"{not json", "supervisor", None),
    )
    assert rig.lease.lease.pending
    await feed(rig, grant(now + 3))
    assert rig.lease.held()
    assert rig.lease.lease.remaining() == 3.0


async def test_without_its_lease_a_node_starts_no_child_runs_no_tool_writes_no_turn() -> None:
    rig = Rig(decode_config(FLEET))
    await feed(rig, grant(rig.clock.now + 1))
    await rig.lease.require("write a turn")
    rig.clock.now += 1
    with pytest.raises(SessionError) as refused:
        await rig.lease.require("write a turn")
    assert refused.value.code == LEASE_LOST
    assert "cannot write a turn now: it lost its fleet lease" in str(refused.value)
    refusal = rig.lease.refusal()
    assert refusal is not None
    assert refusal.startswith("fleet_lease_lost: ")


async def test_a_start_before_the_first_grant_waits_for_it() -> None:
    rig = Rig(decode_config(FLEET))
    waited: list[float] = []

    async def start() -> None:
        began = anyio.current_time()
        await rig.lease.require("start a claude child")
        waited.append(anyio.current_time() - began)

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
        await anyio.sleep(0.2)
        assert not waited
        await feed(rig, grant(rig.clock.now + 5))
    assert len(waited) == 1
    assert waited[0] >= 0.2


async def test_a_lost_lease_fences_every_session_with_a_child_once() -> None:
    """Running, starting, waking and stopping sessions with a live child are fenced;
    one asleep, one whose child is gone, and one fenced already are not."""
    rig = Rig(decode_config(FLEET))
    rig.add("run", SessionState.RUNNING, Proc(Running()))
    rig.add("start", SessionState.STARTING, Proc(None))  # its child not spawned yet
    rig.add("wake", SessionState.WAKING, Proc(Running()))
    rig.add("stop", SessionState.STOPPING, Proc(Running()))
    rig.add("asleep", SessionState.HIBERNATED, None)
    rig.add("gone", SessionState.RUNNING, Proc(Running(running=False)))
    rig.add("done", SessionState.RUNNING, Proc(Running())).fenced = True
    await feed(rig, grant(rig.clock.now + 0.5))

    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.lease.watch)
        await anyio.sleep(0.1)
        assert rig.fenced == []  # held: nothing happens
        rig.clock.now += 0.5
        with anyio.fail_after(5):
            while not rig.audits:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert sorted(rig.fenced) == ["run", "start", "stop", "wake"]
    ((kind, payload),) = rig.audits
    assert kind == "fleet_lease_lost"
    assert payload["children_killed"] == 4
    assert rig.lease.lease.lost
    await feed(rig, grant(rig.clock.now + 5))
    assert rig.audits[-1] == ("fleet_lease_regained", {"losses": 1})


def test_a_grant_after_the_lease_ran_out_unnoticed_is_a_lapse() -> None:
    """A frozen supervisor thawed: the next grant may come before the watch noted the
    loss, while the fence had killed the children; a child's end then is the fence's."""
    clock = Clock()
    lease = Lease(clock)
    assert not lease.lapsed_within(5.0)  # never held
    lease.grant(clock.now + 1.0)
    assert not lease.lapsed_within(5.0)
    clock.now += 3.0  # frozen past the lease
    assert lease.lapsed_within(5.0)  # not held: a child ending now was fenced
    assert lease.grant(clock.now + 1.0) is True  # the thaw's grant: a lapse, ended
    assert lease.losses == 1
    assert lease.held()
    assert lease.lapsed_within(5.0)  # held again, but it ran out just now
    for _ in range(6):  # held on, beat after beat: the lapse ages out
        clock.now += 0.9
        lease.grant(clock.now + 1.0)
    assert lease.held()
    assert not lease.lapsed_within(5.0)
