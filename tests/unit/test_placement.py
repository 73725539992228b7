"""Placement by load: the heartbeat's load and principals, and the choice of a node."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from bus import Bus, Identity
from sage.config import decode_config
from sage.errors import ConfigError
from sage.fleet.member import runner_load
from sage.fleet.nodes import NodeLoad, NodeState, NodeTable, NodeView, decode_record
from sage.fleet.placement import Passed, place, refusal_text

NOW = 100.0


def record(node: str, **fields: Any) -> bytes:
    base = {
        "node": node,
        "host": "h",
        "pid": 10,
        "started_at": 1.0,
        "heartbeat_at": NOW - 1.0,
        "heartbeat": 2.0,
    }
    return json.dumps({**base, **fields}).encode()


def view(
    node: str,
    live: int = 0,
    max_live: int | None = 10,
    *,
    idle: int = 0,
    principals: list[str] | None = None,
    state: NodeState = NodeState.LIVE,
    load: bool = True,
) -> NodeView:
    return NodeView(
        node=node,
        state=state,
        host="h",
        pid=1,
        started_at=1.0,
        heartbeat_at=NOW,
        age_s=0.0,
        load=NodeLoad(live=live, max_live=max_live, idle=idle) if load else None,
        principals=["alice", "bob"] if principals is None else principals,
    )


def table_of(*records: tuple[str, bytes]) -> list[NodeView]:
    table = NodeTable(lost_after=6.0)
    for key, data in records:
        table.observe(key, data)
    return table.verdicts(NOW)


# -- the record's load ------------------------------------------------------------


def test_an_older_record_without_load_still_decodes() -> None:
    """A record with neither load nor principals (an older node) is live, its load unknown."""
    got = decode_record("a", record("a"))
    assert (got.load, got.principals) == (None, None)
    table = NodeTable(lost_after=6.0)
    table.observe("a", record("a"))
    assert table.unknown_load == {}
    assert table.verdicts(NOW)[0].state is NodeState.LIVE


def test_a_record_carries_its_load_and_principals() -> None:
    """live, max_live, idle, hibernated and the principals' names come through as written."""
    got = decode_record(
        "a",
        record(
            "a", load={"live": 3, "max_live": 8, "idle": 1, "hibernated": 40}, principals=["al"]
        ),
    )
    assert got.load == NodeLoad(live=3, max_live=8, idle=1, hibernated=40)
    assert got.principals == ["al"]
    unbounded = decode_record("a", record("a", load={"live": 3}, principals=[]))
    assert unbounded.load is not None
    assert unbounded.load.max_live is None


@pytest.mark.parametrize(
    "load",
    [
        {"live": -1},
        {"live": 10**12},
        {"live": 2**70},
        {"live": 1.5},
        {"live": "3"},
        {"live": 1, "max_live": 0},
        {"live": 1, "max_live": -5},
        {"live": 1, "idle": 2},
        {"live": 1, "hibernated": -1},
        "lots",
    ],
)
def test_an_absurd_load_is_left_unknown_and_the_node_still_live(load: Any) -> None:
    """Negative, huge, fractional or inconsistent counts: the node stays live in the
    status, its load and principals unknown and the reason noted; nothing raises."""
    table = NodeTable(lost_after=6.0)
    got = table.observe("a", record("a", load=load, principals=["alice"]))
    assert got is not None
    assert (got.load, got.principals) == (None, None)
    assert "load" in table.unknown_load["a"]
    (shown,) = table.verdicts(NOW)
    assert shown.state is NodeState.LIVE
    placed = place([shown, view("b", 9)], "alice", "a")
    assert placed.candidates == ("b",)
    assert placed.passed[0].node == "a"


@pytest.mark.parametrize("principals", [["a.b"], ["*"], [""], "alice", [1]])
def test_principals_that_are_not_names_are_left_unknown(principals: Any) -> None:
    """A principal with a dot, a wildcard, empty, or not a list: unknown, never matched."""
    table = NodeTable(lost_after=6.0)
    got = table.observe("a", record("a", load={"live": 0}, principals=principals))
    assert got is not None
    assert got.principals is None
    assert "principals" in table.unknown_load["a"]


def test_a_good_record_clears_an_earlier_load_problem() -> None:
    table = NodeTable(lost_after=6.0)
    table.observe("a", record("a", load={"live": -1}))
    table.observe("a", record("a", load={"live": 1}, principals=["alice"]))
    assert table.unknown_load == {}


# -- the choice ---------------------------------------------------------------------


def test_the_least_loaded_share_of_slots_goes_first() -> None:
    """Ordered by live / max_live: 1/10 before 3/20 before 4/8."""
    placed = place([view("a", 4, 8), view("b", 3, 20), view("c", 1, 10)], "alice", "a")
    assert placed.candidates == ("c", "b", "a")
    assert placed.passed == ()


def test_ties_go_to_the_local_node_then_by_name() -> None:
    placed = place([view("a", 2), view("c", 2), view("b", 2), view("d", 5)], "alice", "c")
    assert placed.candidates == ("c", "a", "b", "d")


def test_a_node_without_max_live_counts_against_a_hundred_slots() -> None:
    """No bound: 30 live is a share of 0.3, after 2/10 and before 4/10."""
    placed = place([view("u", 30, None), view("a", 2), view("b", 4)], "alice", "z")
    assert placed.candidates == ("a", "u", "b")


def test_lost_and_stopped_nodes_are_never_chosen() -> None:
    placed = place(
        [
            view("a", 0, state=NodeState.LOST),
            view("b", 9),
            view("c", 0, state=NodeState.STOPPED),
        ],
        "alice",
        "a",
    )
    assert placed.candidates == ("b",)
    assert placed.passed == (Passed("a", "lost"), Passed("c", "stopped"))


def test_a_node_without_the_principal_is_skipped() -> None:
    placed = place([view("a", 0, principals=["bob"]), view("b", 5)], "alice", "a")
    assert placed.candidates == ("b",)
    assert placed.passed == (Passed("a", "it does not serve principal 'alice'"),)


def test_a_node_with_unknown_load_is_skipped() -> None:
    placed = place([view("a", load=False), view("b", 5)], "alice", "a")
    assert placed.candidates == ("b",)
    assert "load is unknown" in placed.passed[0].why


def test_a_full_node_is_skipped_unless_something_idle_makes_room() -> None:
    """At max_live with none idle: passed over; with one idle: a candidate, but last."""
    placed = place([view("a", 10, 10), view("b", 10, 10, idle=1), view("c", 9)], "alice", "a")
    assert placed.candidates == ("c", "b")
    assert placed.passed == (Passed("a", "full: live 10/10, none idle"),)


def test_none_may_take_it_names_each_node_and_why() -> None:
    placed = place(
        [view("a", 3, 3), view("b", 0, principals=[]), view("c", state=NodeState.LOST)],
        "alice",
        "a",
    )
    assert placed.candidates == ()
    assert refusal_text("alice", list(placed.passed)) == (
        "no node of the fleet may take a session of 'alice' (a: full: live 3/3, none idle;"
        " b: it does not serve principal 'alice'; c: lost)"
    )
    assert "no node is known" in refusal_text("alice", [])


# -- the knob, and the heartbeat's reading of the runner -------------------------------


def test_placement_is_local_unless_the_config_says_least_loaded() -> None:
    """[fleet] placement: "local" by default, "least_loaded" taken, anything else and a
    node named "any" (reserved for spawn --node any) refused."""
    base = '[fleet]\nurl = "nats://127.0.0.1:4222"\nnode = "a"\n'
    fleet = decode_config(base).fleet
    assert fleet is not None
    assert fleet.placement == "local"
    placed = decode_config(base + 'placement = "least_loaded"\n').fleet
    assert placed is not None
    assert placed.placement == "least_loaded"
    with pytest.raises(ConfigError, match="placement"):
        decode_config(base + 'placement = "random"\n')
    with pytest.raises(ConfigError, match="reserved"):
        decode_config(base.replace('"a"', '"any"'))


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            {"ok": True, "live": 3, "max_live": 8, "idle": 1, "hibernated": 2, "waiting": 0},
            NodeLoad(live=3, max_live=8, idle=1, hibernated=2),
        ),
        ({"ok": True, "live": 3, "max_live": None, "idle": 0, "hibernated": 0}, NodeLoad(live=3)),
        ({"ok": True, "live": -3, "max_live": 8, "idle": 0, "hibernated": 0}, None),
        ({"ok": False, "error": "not_authorized", "message": "no"}, None),
        (["not", "an", "object"], None),
        (None, None),  # nobody answers: no responders
    ],
)
async def test_the_heartbeat_reads_the_runners_slots_or_says_nothing(
    answer: Any, expected: NodeLoad | None
) -> None:
    """runner_load over a real bus: the runner's answer as a NodeLoad; an error, an
    absurd count, a non-object or no runner at all is None (the load left out)."""
    bus = Bus()
    runner, supervisor = Identity("runner"), Identity("supervisor")

    requests = bus.subscribe("sage.v1.request.slots", runner) if answer is not None else None

    async def answer_once() -> None:
        assert requests is not None
        async for request in requests:
            assert request.principal is None  # asked as an admin
            bus.reply(runner, request.reply_to or "", answer)
            return

    async with anyio.create_task_group() as tg:
        if requests is not None:
            tg.start_soon(answer_once)
        assert await runner_load(bus, supervisor, deadline=1.0) == expected
        tg.cancel_scope.cancel()
