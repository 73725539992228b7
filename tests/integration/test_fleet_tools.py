"""Tools anywhere: a tool served by a capsule on node b, called by a session on node a.

A real 3-server NATS cluster (the pinned nats-server, each node user with exactly
the permissions ``astrid fleet permissions`` prints) and three real supervisors:
a runs the session runner with the CLI double, b the greeter capsule, c only the
bridge.  The double's ``/fault tool NAME JSON`` turn calls the tool through the
sage MCP server, as Claude Code would.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import msgspec
import pytest

from bus.client import BusClient
from tests.support import FAKE_CLAUDE
from tests.support.daemon import Daemon, all_running, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, refused_kv, wait_for
from tests.support.sage_harness import Sage

NODES = ["a", "b", "c"]
HEARTBEAT = 0.4
LOST_AFTER = 1.5
DEADLINE = 5.0  # [limits] execute_deadline on every node
CAPSULES = {"a": '["runner", "tools"]', "b": '["tools", "greeter"]', "c": '["tools"]'}
ENV = {"ANTHROPIC_API_KEY": "sk-double"}


def node_config(cluster: NatsCluster, node: str) -> str:
    env = ", ".join(f"{k} = {json.dumps(v)}" for k, v in ENV.items())
    return (
        f"capsules = {CAPSULES[node]}\n"
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ {env} }}\n'
        f"[limits]\nexecute_deadline = {DEADLINE}\n"
        + cluster.fleet_section(node, heartbeat=HEARTBEAT, lost_after=LOST_AFTER)
        + f'[[principals]]\nname = "alice"\nuids = [{os.getuid()}]\noperator_key = true\n'
        'allowed_tools = ["mcp__sage__greet"]\n'
    )


@pytest.fixture
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with (
        NatsCluster(NODES) as cluster,
        all_running(
            {node: Daemon(short_dir(), node_config(cluster, node), env=ENV) for node in NODES}
        ) as daemons,
    ):
        yield cluster, daemons


def tools(daemon: Daemon) -> dict[str, dict[str, Any]]:
    result = daemon.astrid("tools", "list", "--json")
    assert result.returncode == 0, result.stderr
    return {tool["name"]: tool for tool in json.loads(result.stdout)}


def audit(daemon: Daemon, kind: str) -> list[dict[str, Any]]:
    result = daemon.astrid("audit", "tail", "-n", "500", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    return [row["payload"]["payload"] for row in rows if row["kind"] == f"sage.v1.audit.{kind}"]


GREET = "mcp__sage__greet"


def listed_on(daemon: Daemon) -> dict[str, Any]:
    """greet as ``daemon``'s catalogue lists it, once it does."""
    found: dict[str, Any] = wait_for(lambda: tools(daemon).get(GREET), 10.0, "greet listed")
    return found


async def call_greet(sage: Sage, sid: str, name: str) -> str:
    events = await sage.ready(sid)
    reply = await sage.send(sid, f'/fault tool greet {{"name":"{name}"}}')
    assert reply["ok"], reply
    text, _ = await events.text_until_done(within=DEADLINE + 10)
    return text


async def raw_call(cluster: NatsCluster, origin: str, node: str, principal: str | None) -> Any:
    """greet of ``node`` called by NATS user ``origin`` as a node would, for ``principal``."""

    async with cluster.client(origin) as nc:
        call = {"tool_name": "greet", "arguments": {"name": "Eve"}, "principal_id": principal}
        data = msgspec.json.encode({"call": call})
        msg = await nc.request(f"sage.fleet.{node}.tool.call.{origin}", data, timeout=5.0)
        return msgspec.json.decode(msg.data)


@pytest.mark.anyio
async def test_a_session_on_a_calls_a_tool_of_b_then_b_is_killed(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """a's (and c's) catalogue lists b's greet with node b; a session on a calls it and
    gets b's answer; b audits the execution for alice from a, a the forwarding to b; c
    calling it for a principal c does not authenticate, or as an admin, is refused and
    audited on b; b SIGKILLed: the next call is an error result at once, and greet leaves a's catalogue
    once b is lost."""
    _, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    for daemon in (a, c):
        listed = await anyio.to_thread.run_sync(listed_on, daemon)
        assert (listed["node"], listed["capsule"]) == ("b", "greeter")
    assert tools(b)[GREET]["node"] == "b"
    shown = a.astrid("tools", "list")
    assert any(line.split()[:3] == [GREET, "b", "greeter"] for line in shown.stdout.splitlines())

    async with BusClient.connect(a.socket, role="cli", name="test") as client:
        sage = Sage(a, client)
        assert await call_greet(sage, "s1", "Ada") == "tool: Hello, Ada!"

        (executed,) = [r for r in audit(b, "tool_call") if r.get("from_node") == "a"]
        assert executed["principal_id"] == "alice"
        assert executed["session_id"] == "s1"
        assert (executed["tool_name"], executed["allowed"]) == ("greet", True)
        (decided,) = [r for r in audit(a, "tool_call") if r["tool_name"] == "greet"]
        assert (decided["node"], decided["allowed"]) == ("b", True)
        (forwarded,) = audit(a, "tool_forwarded")
        assert forwarded["node"] == "b"
        assert forwarded["principal_id"] == "alice"
        assert forwarded["is_error"] is False

        # NATS user c (its own name as the origin) calls b's greet for a principal c
        # does not authenticate, then as an admin: refused, audited on b, never run
        cluster, _ = fleet
        for principal in ("mallory", None):
            refused = await raw_call(cluster, "c", "b", principal)
            assert refused["isError"] is True
            assert refused["content"][0]["text"].startswith("principal_not_authenticated: ")
        rejected = audit(b, "fleet_principal_rejected")
        assert [(r["origin"], r["principal_id"], r["tool_name"]) for r in rejected] == [
            ("c", "mallory", "greet"),
            ("c", None, "greet"),
        ]
        assert rejected[0]["subject"] == "sage.fleet.b.tool.call.c"
        assert "arguments" not in rejected[0]
        assert not [r for r in audit(b, "tool_call") if r.get("from_node") == "c"]

        b.signal(signal.SIGKILL)
        t0 = time.monotonic()
        text = await call_greet(sage, "s2", "Bob")
        assert text.startswith("tool error: "), text
        assert "node b" in text
        assert time.monotonic() - t0 < DEADLINE + 3

    await anyio.to_thread.run_sync(
        lambda: wait_for(
            lambda: GREET not in tools(a), LOST_AFTER + 4 * HEARTBEAT + 2, "greet gone"
        )
    )


def test_a_node_cannot_forge_another_nodes_catalogue_or_take_its_calls() -> None:
    """NATS refuses node a a put of b's key in sage_tools, a subscription to b's
    call subjects, a call to its own, and a call to b naming c as the origin; a's own
    key is put."""
    from nats.errors import Error as NatsError

    with NatsCluster(NODES) as cluster:
        cluster.wait_meta_leader()

        async def main() -> None:
            errors: list[str] = []
            async with cluster.client("a", errors=errors) as nc:
                js = nc.jetstream(timeout=JS_TIMEOUT)
                kv = await js.create_key_value(bucket="sage_tools", history=1, replicas=3)
                forged = msgspec.json.encode({"node": "b", "tools": []})
                with pytest.raises((NatsError, TimeoutError)):
                    await (await refused_kv(nc, "sage_tools")).put("b", forged)
                await kv.put("a", msgspec.json.encode({"node": "a", "tools": []}))
                await nc.subscribe("sage.fleet.b.tool.call.*")
                with pytest.raises(TimeoutError):  # refused: no "no responders" either
                    await nc.request("sage.fleet.a.tool.call.a", b"{}", timeout=1.0)
                with pytest.raises(TimeoutError):  # another node's name as the origin
                    await nc.request("sage.fleet.b.tool.call.c", b"{}", timeout=1.0)
                await nc.flush()
                await anyio.sleep(0.3)
                assert any("subscription" in e and "sage.fleet.b.tool.call.*" in e for e in errors)
                assert any("publish" in e and "sage.fleet.a.tool.call.a" in e for e in errors)
                assert any("publish" in e and "sage.fleet.b.tool.call.c" in e for e in errors)

        anyio.run(main)
