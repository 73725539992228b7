"""A peer's forwarded requests and tool calls in flight on a node are bounded: past the
bound the next is answered fleet_busy at once, and other peers are not held up."""

from __future__ import annotations

import json
from typing import Any

import anyio
import msgspec
import pytest

from bus import Bus, Identity
from sage.config import FleetConfig
from sage.errors import FleetBusy
from sage.fleet.inflight import MAX_IN_FLIGHT, InFlight
from sage.fleet.router import Router
from sage.fleet.routes import Forwarded
from sage.fleet.tools import FleetTools

pytestmark = pytest.mark.anyio


def test_each_origin_is_counted_apart_and_given_back() -> None:
    counts = InFlight("requests", limit=2)
    counts.take("b")
    counts.take("b")
    with pytest.raises(FleetBusy) as busy:
        counts.take("b")
    assert busy.value.code == "fleet_busy"
    assert "node 'b' has 2 requests in flight on this node (at most 2)" in str(busy.value)
    counts.take("c")  # another peer is not held up by b
    counts.give_back("b")
    counts.take("b")
    assert (counts.of("b"), counts.of("c")) == (2, 1)
    for origin in ("b", "b", "c"):
        counts.give_back(origin)
    assert (counts.of("b"), counts.of("c")) == (0, 0)


class Msg:
    """A NATS request as the router's and the tool server's callbacks get it."""

    def __init__(self, subject: str, data: bytes) -> None:
        self.subject = subject
        self.data = data
        self.reply = "_INBOX.b.1"
        self.answers: list[Any] = []

    async def respond(self, data: bytes) -> None:
        self.answers.append(json.loads(data))


class Member:
    """A node a whose bucket read (the vouching check) waits until ``release`` is set:
    every request taken stays in flight until then."""

    def __init__(self) -> None:
        self.node = "a"
        self.config = FleetConfig(url="nats://127.0.0.1:4222", node="a")
        self.release = anyio.Event()

    async def record_of(self, name: str) -> None:
        await self.release.wait()
        return None  # no record: refused principal_not_authenticated, once let through


def request(origin: str) -> Msg:
    forwarded = Forwarded(principal="alice", payload=msgspec.Raw(b"{}"))
    return Msg(f"sage.fleet.a.request.{origin}.session.s1", forwarded.encode())


async def test_a_flooding_peer_is_answered_fleet_busy_at_once() -> None:
    """b has MAX_IN_FLIGHT requests waiting: its next is refused fleet_busy without a
    task; c's still gets in; once b's are answered, b may ask again."""
    member = Member()
    router = Router(Bus(), member)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        router.forwarding.tg = tg
        held = [request("b") for _ in range(MAX_IN_FLIGHT)]
        for msg in held:
            await router.forwarding.take(msg)  # type: ignore[arg-type]
        flood = request("b")
        await router.forwarding.take(flood)  # type: ignore[arg-type]
        assert [a["error"] for a in flood.answers] == ["fleet_busy"]
        assert "node 'b' has 256 forwarded requests in flight" in flood.answers[0]["message"]
        other = request("c")
        await router.forwarding.take(other)  # type: ignore[arg-type]
        assert other.answers == []  # taken: waiting on the bucket like b's
        member.release.set()
        await anyio.wait_all_tasks_blocked()
        assert (router.forwarding.in_flight.of("b"), router.forwarding.in_flight.of("c")) == (0, 0)
        assert all(m.answers[0]["error"] == "principal_not_authenticated" for m in held)
        again = request("b")
        await router.forwarding.take(again)  # type: ignore[arg-type]
        await anyio.wait_all_tasks_blocked()
        assert again.answers[0]["error"] == "principal_not_authenticated"


def call(origin: str) -> Msg:
    body = {"call": {"tool_name": "greet", "principal_id": "alice", "arguments": {}}}
    return Msg(f"sage.fleet.a.tool.call.{origin}", json.dumps(body).encode())


async def test_a_peer_flooding_tool_calls_is_answered_fleet_busy_at_once() -> None:
    member = Member()
    tools = FleetTools(member, Bus(), Identity("fleet"), lambda: 1.0)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        held = [call("b") for _ in range(MAX_IN_FLIGHT)]
        for msg in held:
            await tools._take_call(tg, msg)  # type: ignore[arg-type]
        flood = call("b")
        await tools._take_call(tg, flood)  # type: ignore[arg-type]
        (answer,) = flood.answers
        assert answer["isError"] is True
        assert answer["content"][0]["text"].startswith("fleet_busy: node 'b' has 256 tool calls")
        other = call("c")
        await tools._take_call(tg, other)  # type: ignore[arg-type]
        assert other.answers == []
        member.release.set()
        await anyio.wait_all_tasks_blocked()
        assert (tools._in_flight.of("b"), tools._in_flight.of("c")) == (0, 0)
        assert all("principal_not_authenticated" in json.dumps(m.answers) for m in held)
