"""The fleet's lifecycles as tables (sage/fleet/states.py), without I/O: each table is
whole, its paths are the ones the shells take, and a change it refuses is the one
IllegalTransition; the registry keeper's resync and a relay walk their tables."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

from bus import Identity
from sage.config import FleetConfig
from sage.errors import IllegalTransition
from sage.fleet.lifecycle import LifecycleEvents
from sage.fleet.registry_keeper import RegistryKeeper
from sage.fleet.relays import Relay
from sage.fleet.routes import SessionEntry
from sage.fleet.states import (
    CLAIM_TRANSITIONS,
    MEMBERSHIP_TRANSITIONS,
    RELAY_TRANSITIONS,
    RESYNC_TRANSITIONS,
    ClaimState,
    Machine,
    MembershipState,
    RelayState,
    ResyncState,
)

TABLES: list[tuple[type[enum.Enum], Mapping[Any, frozenset[Any]]]] = [
    (ClaimState, CLAIM_TRANSITIONS),
    (MembershipState, MEMBERSHIP_TRANSITIONS),
    (RelayState, RELAY_TRANSITIONS),
    (ResyncState, RESYNC_TRANSITIONS),
]


@pytest.mark.parametrize(("states", "table"), TABLES)
def test_every_state_has_its_row_and_every_target_is_a_state(
    states: type[enum.Enum], table: Mapping[Any, frozenset[Any]]
) -> None:
    assert set(table) == set(states)
    for targets in table.values():
        assert targets <= set(states)
    assert all(state not in table[state] for state in states)  # staying is no move


def _walk(machine: Machine[Any], *path: enum.Enum) -> None:
    for state in path:
        machine.move(state)


def test_an_adoption_ends_in_one_of_its_outcomes() -> None:
    """The paths failover takes: adopted, released for the next node, given back failed,
    the race lost, taken before, the owner back; each outcome is final."""
    paths = [
        (ClaimState.WAITING, ClaimState.RACING, ClaimState.WON, ClaimState.RESTORING),
        (ClaimState.WAITING, ClaimState.RACING, ClaimState.WON),
        (ClaimState.WAITING, ClaimState.RACING),
        (ClaimState.WAITING,),
        (),
    ]
    outcomes = {
        ClaimState.RESTORING: {ClaimState.ADOPTED, ClaimState.RELEASED, ClaimState.FAILED},
        ClaimState.WON: {ClaimState.RELEASED, ClaimState.FAILED, ClaimState.RESTORING},
        ClaimState.RACING: {ClaimState.LOST, ClaimState.WON, ClaimState.FAILED},
        ClaimState.WAITING: {ClaimState.OWNER_BACK, ClaimState.RACING, ClaimState.FAILED},
        ClaimState.PLANNED: {ClaimState.TAKEN_BEFORE, ClaimState.WAITING, ClaimState.FAILED},
    }
    for path in paths:
        machine = Machine("claim s1", CLAIM_TRANSITIONS, ClaimState.PLANNED)
        _walk(machine, *path)
        assert set(CLAIM_TRANSITIONS[machine.state]) == outcomes[machine.state]
    done = Machine("claim s1", CLAIM_TRANSITIONS, ClaimState.PLANNED)
    _walk(done, ClaimState.WAITING, ClaimState.RACING, ClaimState.LOST)
    assert done.over
    with pytest.raises(IllegalTransition) as caught:
        done.move(ClaimState.WON)  # a race lost is never won after all
    assert (caught.value.code, str(caught.value)) == (
        "illegal_transition",
        "claim s1: lost -> won is not a legal transition",
    )


def test_no_adoption_runs_before_its_race_is_won() -> None:
    """Restoring (and adopting) only after winning; winning only after racing."""
    for early in (ClaimState.PLANNED, ClaimState.WAITING, ClaimState.RACING):
        machine = Machine("claim s1", CLAIM_TRANSITIONS, early)
        assert not machine.may(ClaimState.RESTORING)
        assert not machine.may(ClaimState.ADOPTED)
    assert not Machine("c", CLAIM_TRANSITIONS, ClaimState.WAITING).may(ClaimState.WON)


def test_membership_fails_and_resumes_until_it_leaves() -> None:
    node = Machine("node a", MEMBERSHIP_TRANSITIONS, MembershipState.JOINING)
    _walk(node, MembershipState.LIVE, MembershipState.FAILING, MembershipState.LIVE)
    node.move(MembershipState.LIVE)  # a beat on a live node: nothing changes
    _walk(node, MembershipState.LEAVING, MembershipState.LEFT)
    assert node.over
    with pytest.raises(IllegalTransition):
        node.move(MembershipState.LIVE)  # no heartbeat after the last record


def test_a_relay_that_ended_or_was_dropped_never_opens_again() -> None:
    relay = Relay("b", sub=None, ids={}, principal="alice")  # type: ignore[arg-type]
    seen = [relay.state]
    relay.approving()
    seen.append(relay.state)
    relay.ended()
    relay.approving()  # too late: it ended
    seen.append(relay.state)
    assert seen == [RelayState.OPEN, RelayState.APPROVING, RelayState.ENDED]
    relay.machine.move(RelayState.DROPPED)
    with pytest.raises(IllegalTransition):
        relay.machine.move(RelayState.OPEN)


class _Runner:
    def __init__(self, reply: dict[str, Any]) -> None:
        self.reply = reply

    async def ask(self, verb: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.reply


class _Member:
    node = "a"
    config = FleetConfig(url="nats://127.0.0.1:4222", node="a")
    claims = None
    registry = None
    connected = True

    def __init__(self, entries: list[tuple[str, SessionEntry, int]] | None) -> None:
        self.entries = entries

    async def session_entries(self) -> list[tuple[str, SessionEntry, int]]:
        if self.entries is None:
            from sage.errors import FleetUnavailable

            raise FleetUnavailable("nats: timeout")
        return self.entries


def _keeper(runner: dict[str, Any], entries: list[Any] | None) -> RegistryKeeper:
    keeper = RegistryKeeper(
        _Member(entries),  # type: ignore[arg-type]
        _Runner(runner),  # type: ignore[arg-type]
        None,
        lambda: False,
        LifecycleEvents(Identity("fleet")),
    )

    async def fence(sids: list[str]) -> list[str]:
        return sids

    keeper.fence = fence
    KEPT.append((keeper, keeper.writes()))
    return keeper


KEPT: list[tuple[RegistryKeeper, Any]] = []
"""The keepers made, with their write queues' receiving ends (closed after each test)."""


@pytest.fixture(autouse=True)
def _close_queues() -> Any:
    yield
    while KEPT:
        keeper, receive = KEPT.pop()
        keeper.close()
        receive.close()


@pytest.mark.anyio
async def test_the_resync_walks_its_table() -> None:
    """No runner yet, or the registry unreadable: needed still; else synced, with the
    runner's live sessions in ``here`` and their claims put."""
    listing = {
        "ok": True,
        "sessions": [
            {"session_id": "s1", "principal_id": "alice", "pid": 7, "state": "ready"},
            {"session_id": "s2", "principal_id": "alice", "pid": None, "state": "ended"},
        ],
    }
    no_runner = _keeper({"ok": False, "error": "no_runner", "message": "-"}, [])
    assert not await no_runner.resync()
    assert no_runner.resync_state.state is ResyncState.NEEDED
    unreadable = _keeper(listing, None)
    assert not await unreadable.resync()
    assert unreadable.resync_state.state is ResyncState.NEEDED
    keeper = _keeper(listing, [])
    assert await keeper.resync()
    assert keeper.resync_state.state is ResyncState.SYNCED
    assert keeper.here == {"s1": "alice"}
    with pytest.raises(IllegalTransition):
        await keeper.resync()  # synced: only an outage or a dropped event asks again
    keeper.resync_state.move(ResyncState.NEEDED)
    with anyio.fail_after(1):
        assert await keeper.resync()
