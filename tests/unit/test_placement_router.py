"""The router's placement shell: a real bus and runner stand-in, a node table and
NATS answers given (no cluster): who is asked, in what order, and what the caller hears."""

from __future__ import annotations

import json
from typing import Any

import anyio
import msgspec
import pytest

from bus import Bus, Envelope, Identity
from sage.config import FleetConfig
from sage.fleet.nodes import NodeLoad, NodeState, NodeView
from sage.fleet.router import Router

pytestmark = pytest.mark.anyio


HUNG: dict[str, Any] = {}
"""A peer that does not answer within the deadline."""


def view(node: str, live: int, max_live: int = 4) -> NodeView:
    return NodeView(
        node=node,
        state=NodeState.LIVE,
        host="h",
        pid=1,
        started_at=1.0,
        heartbeat_at=1.0,
        age_s=0.0,
        load=NodeLoad(live=live, max_live=max_live),
        principals=["alice"],
    )


class Msg:
    def __init__(self, data: bytes) -> None:
        self.data = data


class Nats:
    """Each peer's answer to a forwarded spawn, and the subjects asked, in order."""

    def __init__(self, answers: dict[str, dict[str, Any]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def request(self, subject: str, data: bytes, **_: float) -> Msg:
        node = subject.split(".")[2]
        self.asked.append(node)
        answer = self.answers[node]
        if answer is HUNG:
            from nats.errors import TimeoutError as NatsTimeout

            await anyio.sleep(0.05)  # past the spawn deadline the test sets
            raise NatsTimeout
        return Msg(json.dumps(answer).encode())


class Member:
    """What the router reads of this node's membership: its name, config, connection
    and the node table."""

    def __init__(self, nodes: list[NodeView], nc: Nats, *, connected: bool = True) -> None:
        self.node = "a"
        self.config = FleetConfig(url="nats://127.0.0.1:4222", node="a")
        self.nc = nc
        self.connected = connected
        self._nodes = nodes

    async def nodes(self) -> list[NodeView]:
        return self._nodes

    async def record_of(self, name: str) -> None:
        return None  # what the router vouches with: no request reaches this node here


async def spawn(member: Member, local_answer: dict[str, Any], body: dict[str, Any]) -> Any:
    """``sage.v1.request.fleet.spawn`` with ``body`` through a Router on a real bus,
    the local runner answering ``local_answer``; the reply, and whether it was asked."""
    bus = Bus()
    runner = Identity("runner")
    requests = bus.subscribe("sage.v1.request.spawn", runner)
    asked: list[bool] = []

    async def local_runner() -> None:
        async for request in requests:
            asked.append(True)
            bus.reply(runner, request.reply_to or "", local_answer)

    router = Router(bus, member)  # type: ignore[arg-type]
    envelope = Envelope(1, "sage.v1.request.fleet.spawn", msgspec.json.encode(body), "cli")
    async with anyio.create_task_group() as tg:
        tg.start_soon(local_runner)
        reply = await router._spawn(envelope)
        tg.cancel_scope.cancel()
    return reply, bool(asked)


OK = {"ok": True, "session_id": "s1", "pid": 42}
FULL = {"ok": False, "error": "host_full", "message": "the host runs 4 live sessions"}


async def test_a_refusal_of_its_own_moves_on_to_the_next_node() -> None:
    """b (least loaded) answers host_full, c takes it: the reply names c and b's refusal;
    the local node a (most loaded) is never asked."""
    nc = Nats({"b": FULL, "c": OK})
    member = Member([view("a", 3), view("b", 0), view("c", 1)], nc)
    reply, local = await spawn(member, OK, {"principal_id": "alice", "node": "any"})
    assert nc.asked == ["b", "c"]
    assert not local
    assert (reply["node"], reply["placed"]) == ("c", True)
    assert reply["refused"] == [{"node": "b", "why": "host_full: the host runs 4 live sessions"}]


async def test_a_refusal_any_node_would_give_is_the_answer_at_once() -> None:
    """duplicate_session from b: no other node is asked, the caller hears it as it is."""
    taken = {"ok": False, "error": "duplicate_session", "message": "session 's1' exists"}
    nc = Nats({"b": taken, "c": OK})
    member = Member([view("a", 3), view("b", 0), view("c", 1)], nc)
    reply, _ = await spawn(member, OK, {"principal_id": "alice", "node": "any"})
    assert nc.asked == ["b"]
    assert reply == taken


async def test_every_node_refusing_is_one_error_naming_each() -> None:
    nc = Nats({"b": FULL})
    member = Member([view("a", 1), view("b", 0)], nc)
    reply, local = await spawn(member, FULL, {"principal_id": "alice", "node": "any"})
    assert local
    assert reply["error"] == "placement_failed"
    assert reply["message"] == (
        "no node of the fleet may take a session of 'alice' (b: host_full: the host runs 4"
        " live sessions; a: host_full: the host runs 4 live sessions)"
    )


async def test_without_nats_it_is_this_node_only_with_a_warning() -> None:
    nc = Nats({})
    member = Member([view("b", 0)], nc, connected=False)
    reply, local = await spawn(member, OK, {"principal_id": "alice", "node": "any"})
    assert local
    assert nc.asked == []
    assert (reply["node"], reply["placed"]) == ("a", True)
    assert "NATS is not connected" in reply["warning"]


async def test_no_node_given_follows_the_placement_knob() -> None:
    """Without node: "local" asks this node alone (no `placed`); "least_loaded" places."""
    nc = Nats({"b": OK})
    member = Member([view("a", 3), view("b", 0)], nc)
    reply, local = await spawn(member, OK, {"principal_id": "alice"})
    assert (local, nc.asked, reply["node"], "placed" in reply) == (True, [], "a", False)
    member.config = FleetConfig(url="nats://127.0.0.1:4222", node="a", placement="least_loaded")
    reply, local = await spawn(member, OK, {"principal_id": "alice"})
    assert (local, nc.asked, reply["node"], reply["placed"]) == (False, ["b"], "b", True)


async def test_a_spawn_without_a_principal_is_a_bad_request() -> None:
    reply, local = await spawn(Member([], Nats({})), OK, {"node": "any"})
    assert (reply["error"], local) == ("bad_request", False)


async def test_a_node_that_does_not_answer_in_time_ends_the_placement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b times out: the spawn may yet start there, so c is not asked for a second one;
    the caller hears fleet_unavailable saying so."""
    from sage.fleet import runner_link

    monkeypatch.setitem(runner_link.DEADLINES, "spawn", 0.01)
    nc = Nats({"b": HUNG, "c": OK})
    member = Member([view("a", 3), view("b", 0), view("c", 1)], nc)
    reply, local = await spawn(member, OK, {"principal_id": "alice", "node": "any"})
    assert (nc.asked, local) == (["b"], False)
    assert reply["error"] == "fleet_unavailable"
    assert reply["message"].endswith("(it may yet start on 'b')"), reply
