"""Placement by load: three supervisors over a real 3-server NATS cluster, the CLI double.

Node a has ``max_live = 2``, b ``max_live = 4`` and one session per principal at
most, both serve alice and bob; c has ``max_live = 2``, serves bob only and places
spawns without ``--node`` by load (``[fleet] placement = "least_loaded"``).  Busy sessions (a turn that hangs, so
none is idle) set the loads; ``astrid sage spawn --node any`` is asked on c's
socket.  A NATS user ``d`` with no supervisor writes a record claiming an absurd
load.  The steps run in order on one fleet (the last kills b).
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from sage.fleet.permissions import BUCKET
from tests.support import FAKE_CLAUDE
from tests.support.daemon import Daemon, all_running, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, wait_for

HEARTBEAT = 0.4
LOST_AFTER = 1.5
SETUP = {
    "a": ("", 2, ["alice", "bob"], ""),
    "b": ("", 4, ["alice", "bob"], "max_logical_sessions_per_principal = 1\n"),
    "c": ('placement = "least_loaded"\n', 2, ["bob"], ""),
}


def node_config(cluster: NatsCluster, node: str) -> str:
    placement, max_live, principals, limits = SETUP[node]
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        f"[limits]\nstop_grace = 2.0\n{limits}"
        f"[sessions]\nmax_live = {max_live}\nwake_wait = 1.0\n"
        + cluster.fleet_section(node, heartbeat=HEARTBEAT, lost_after=LOST_AFTER)
        + placement
        # c's admins spawn here for alice, whom c does not serve (docs/fleet.md,
        # "Who may act for whom": another node's admins are not admins here by default)
        + ("" if node == "c" else "[fleet.peers.c]\nadmins = true\n")
        + "".join(f'[[principals]]\nname = "{name}"\noperator_key = true\n' for name in principals)
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with NatsCluster([*SETUP, "d"]) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-double"}
        with all_running(
            {n: Daemon(short_dir(), node_config(cluster, n), env=env) for n in SETUP}
        ) as daemons:
            yield cluster, daemons


def astrid(daemon: Daemon, *args: str, principal: str = "alice") -> Any:
    return daemon.astrid(*args, "--principal", principal, timeout=60.0)


def ok_json(daemon: Daemon, *args: str, principal: str = "alice") -> Any:
    result = astrid(daemon, *args, "--json", principal=principal)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return json.loads(result.stdout)


def as_admin(daemon: Daemon, *args: str) -> Any:
    """``astrid`` as an admin of ``daemon`` (alice is no principal of c: an admin on c
    spawns for her)."""
    result = daemon.astrid(*args, "--json", timeout=60.0)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return json.loads(result.stdout)


def request_as(daemon: Daemon, topic: str, principal: str) -> Any:
    """A request ``{}`` on ``daemon``'s socket, acting for ``principal``."""

    async def main() -> Any:
        from bus.client import BusClient

        async with BusClient.connect(
            daemon.socket, role="cli", name="test", principal=principal
        ) as client:
            reply = await client.request(topic, {}, deadline=10.0)
            return json.loads(reply.payload)

    return anyio.run(main)


def status(daemon: Daemon) -> dict[str, dict[str, Any]]:
    result = daemon.astrid("fleet", "status", "--json")
    assert result.returncode == 0, result.stderr
    return {n["node"]: n for n in json.loads(result.stdout)["nodes"]}


def wait_load(daemon: Daemon, node: str, live: int, idle: int = 0) -> None:
    def seen() -> bool:
        load = status(daemon).get(node, {}).get("load") or {}
        return (load.get("live"), load.get("idle")) == (live, idle)

    wait_for(seen, 10.0, f"node {node} at live {live}, idle {idle}")


def busy(daemon: Daemon, principal: str, node: str) -> str:
    """A session on ``node`` whose first turn never ends: live, and never idle."""
    spawned = ok_json(
        daemon, "sage", "spawn", principal, "--node", node, "--message", "/fault hang"
    )
    assert spawned["node"] == node
    return str(spawned["session_id"])


def claim_absurd_load(cluster: NatsCluster) -> None:
    """As NATS user d (no supervisor): a live record that serves alice with -5 live
    children of 4, its clock a minute ahead so it stays live for the test."""

    async def main() -> None:
        async with cluster.client("d") as nc:
            kv = await nc.jetstream(timeout=JS_TIMEOUT).key_value(BUCKET)
            record = {
                "node": "d",
                "host": "h",
                "pid": 7,
                "started_at": time.time(),
                "heartbeat_at": time.time() + 60,
                "heartbeat": 1.0,
                "load": {"live": -5, "max_live": 4},
                "principals": ["alice"],
            }
            await kv.put("d", json.dumps(record).encode())

    anyio.run(main)


def test_status_shows_each_nodes_load(fleet: tuple[NatsCluster, dict[str, Daemon]]) -> None:
    """Every node's heartbeat carries its load and principals: --json has them, the
    table says `live 0/2`."""
    _, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    wait_for(lambda: all(n.get("load") for n in status(c).values()), 10.0, "every load")
    nodes = status(c)
    assert nodes["a"]["load"] == {"live": 0, "max_live": 2, "idle": 0, "hibernated": 0}
    assert nodes["b"]["load"]["max_live"] == 4
    assert (nodes["a"]["principals"], nodes["c"]["principals"]) == (["alice", "bob"], ["bob"])
    # a principal sees its own name among a node's principals, never the others'
    as_bob = request_as(c, "sage.v1.request.fleet.status", "bob")["nodes"]
    assert [(n["node"], n["principals"]) for n in as_bob if n["node"] in ("a", "c")] == [
        ("a", ["bob"]),
        ("c", ["bob"]),
    ]
    # the runner's slots are for the supervisor (an admin), not for a principal
    refused = request_as(a, "sage.v1.request.slots", "alice")
    assert (refused["ok"], refused["error"]) == (False, "not_authorized"), refused
    busy(a, "alice", "a")
    wait_load(c, "a", live=1)
    table = c.astrid("fleet", "status")
    assert table.returncode == 0, table.stderr
    line = next(row for row in table.stdout.splitlines() if row.split()[:1] == ["a"])
    assert "live 1/2 idle 0 hibernated 0" in line, table.stdout


def test_any_goes_to_the_least_loaded_node_that_serves_the_principal(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """From c's socket (c serves no alice; an admin asks): alice's session goes to b
    (0/4) before a (1/2), and d's absurd record is never asked; her next one is
    refused by b (principal_limit), so a takes it; bob's goes to c (local, 0/2),
    placed by [fleet] placement without --node."""
    cluster, daemons = fleet
    c = daemons["c"]
    wait_load(c, "a", live=1)
    claim_absurd_load(cluster)
    placed = as_admin(c, "sage", "spawn", "alice", "--node", "any")
    assert (placed["node"], placed["placed"], placed["refused"]) == ("b", True, [])
    assert status(c)["d"]["load"] is None  # shown live, its load unknown
    wait_load(c, "b", live=1, idle=1)
    second = as_admin(c, "sage", "spawn", "alice", "--node", "any", "--message", "/fault hang")
    assert second["node"] == "a"
    (refusal,) = second["refused"]
    assert refusal["node"] == "b"
    assert refusal["why"].startswith("principal_limit: principal 'alice' has 1 sessions"), refusal
    wait_load(c, "a", live=2)
    human = astrid(c, "sage", "spawn", "bob", principal="bob")
    assert human.returncode == 0, human.stderr
    assert "astrid: placed on node c" in human.stderr
    sid = human.stdout.strip()
    rows = {r["session_id"]: r for r in ok_json(c, "sage", "sessions", principal="bob")}
    assert rows[sid]["node"] == "c"


def test_a_lost_node_is_never_chosen_and_none_left_is_one_clear_error(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """b (the least loaded, 1/4) killed: bob's next session goes to c (1/2), b never
    asked; alice's (a full, b lost, c not hers, d unknown) is one error naming each."""
    _, daemons = fleet
    b, c = daemons["b"], daemons["c"]
    wait_load(c, "c", live=1, idle=1)
    b.signal(signal.SIGKILL)
    assert b.proc is not None
    b.proc.wait()
    wait_for(lambda: status(c)["b"]["state"] == "lost", LOST_AFTER + 5, "b lost")
    placed = ok_json(c, "sage", "spawn", "bob", "--node", "any", principal="bob")
    assert (placed["node"], placed["refused"]) == ("c", [])
    refused = c.astrid("sage", "spawn", "alice", "--node", "any")
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == (
        "astrid: placement_failed: no node of the fleet may take a session of 'alice'"
        " (a: full: live 2/2, none idle; b: lost; c: it does not serve principal 'alice';"
        " d: its load is unknown (an older node, or its runner did not answer))"
    ), refused.stderr
    assert "Traceback" not in refused.stderr
