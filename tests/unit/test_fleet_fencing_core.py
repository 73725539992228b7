"""Fencing's sans-IO core (sage/fleet/fencing.py): when a node looks, what it ends, and
which of its sessions each slow sweep reads; and an adopter leaves a node back before
its race its sessions."""

from __future__ import annotations

from typing import Any, cast

import pytest

from bus import Bus
from sage.config import Config
from sage.fleet.failover import Failover
from sage.fleet.fencing import Sweep, may_have_been_lost, runs_elsewhere
from sage.fleet.member import FleetMember
from sage.fleet.nodes import NodeState, NodeView
from sage.fleet.routes import Claim, SessionEntry
from sage.fleet.states import ClaimState, Machine


def test_a_gap_past_half_of_lost_after_or_failed_beats_mean_a_look() -> None:
    assert not may_have_been_lost(100.0, 102.5, 6.0)  # a beat of 2 s, a slow one
    assert may_have_been_lost(100.0, 103.5, 6.0)  # the others' clocks may be ahead
    assert may_have_been_lost(100.0, 160.0, 6.0)  # SIGSTOP for a minute
    assert may_have_been_lost(100.0, 100.5, 6.0, failing=True)  # NATS was away


def test_only_another_nodes_claim_that_did_not_fail_takes_a_session() -> None:
    assert runs_elsewhere("a", None) is None
    assert runs_elsewhere("a", Claim(node="a", at=1.0)) is None
    assert runs_elsewhere("a", Claim(node="b", at=1.0)) == "b"
    # b won but could not run it: given back to a, which keeps it
    assert runs_elsewhere("a", Claim(node="b", at=1.0, failed=True)) is None
    assert runs_elsewhere("a", Claim(node="b", at=1.0, back="a", failed=True)) is None
    # b gives it back to a (no room there): a keeps it; given back to c: c's
    assert runs_elsewhere("a", Claim(node="b", at=1.0, back="a")) is None
    assert runs_elsewhere("a", Claim(node="b", at=1.0, back="c")) == "c"


def test_sweeps_read_every_session_a_batch_at_a_time_and_go_round() -> None:
    sweep = Sweep(batch=2)
    here = {"s5", "s1", "s3", "s2", "s4"}
    assert sweep.next(here) == ["s1", "s2"]
    assert sweep.next(here) == ["s3", "s4"]
    assert sweep.next(here) == ["s5", "s1"]  # past the end: round again
    assert sweep.next(here) == ["s2", "s3"]
    here -= {"s4"}  # ended meanwhile
    assert sweep.next(here) == ["s5", "s1"]


def test_a_sweep_of_few_sessions_reads_them_all_each_time() -> None:
    sweep = Sweep(batch=8)
    assert sweep.next({"b", "a"}) == ["a", "b"]
    assert sweep.next({"b", "a", "c"}) == ["a", "b", "c"]
    assert sweep.next(set()) == []


# -- the adopter's side: a lost node back before the race is left its sessions --------------


class _Member:
    """What an adoption reads of the fleet: the claim, and the nodes as judged now."""

    node = "b"

    def __init__(self, a_state: NodeState) -> None:
        self.a_state = a_state

    async def claim_of(self, principal: str, sid: str) -> tuple[Claim | None, int]:
        return None, 0

    async def nodes(self) -> list[NodeView]:
        return [
            NodeView(
                node=name,
                state=state,
                host="h",
                pid=1,
                started_at=0.0,
                heartbeat_at=0.0,
                age_s=0.0,
            )
            for name, state in (("a", self.a_state), ("b", NodeState.LIVE))
        ]


@pytest.mark.anyio
@pytest.mark.parametrize(("a_state", "raced"), [(NodeState.LOST, True), (NodeState.LIVE, False)])
async def test_an_adoption_runs_its_race_only_while_the_node_is_still_lost(
    a_state: NodeState, raced: bool
) -> None:
    member = _Member(a_state)
    failover = Failover(cast(Bus, None), cast(FleetMember, member), Config, _never)
    taken: list[str] = []

    async def take(
        sid: str, entry: SessionEntry, revision: int, claim_state: Machine[ClaimState]
    ) -> None:
        assert claim_state.state is ClaimState.WAITING  # read, its turn come: the race is next
        taken.append(sid)

    failover._take = take  # type: ignore[method-assign]
    entry = SessionEntry(node="a", principal_id="alice", resume=True)
    await failover._adopt("s1", entry, 0, 0.0)
    assert taken == (["s1"] if raced else [])


async def _never(verb: str, sid: str | None, body: Any) -> dict[str, Any]:
    raise AssertionError("the runner is not asked")
