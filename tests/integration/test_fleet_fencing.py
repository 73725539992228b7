"""Fencing: a node judged lost while it still ran (frozen by SIGSTOP past ``lost_after``)
kills its own children first, when its lease ends (sage/lease.py), and gives up, once
back, each session another node adopted meanwhile: its copy ends ``failed_over``
(audited ``session_fenced``), so at most one ``claude`` child runs the conversation
fleet-wide at any moment, and a send from any node reaches the adopter.

Three real supervisors (the CLI double, ``[sessions] resume = true``) over a real
3-server NATS cluster, with test_fleet_failover's configuration.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import pytest

from sage.fleet.fencing import SWEEP_BEATS
from sage.fleet.routes import REGISTRY, Claim
from tests.support.daemon import Daemon, all_running, descendant_argvs, short_dir
from tests.support.failover_fleet import (
    HEARTBEAT,
    LOST_AFTER,
    NODES,
    audit_rows,
    claim,
    conversation_of,
    fleet,
    local_rows,
    node_config,
    put_claim,
    request,
    rows,
    running,
    stored,
    value,
)
from tests.support.nats_cluster import NatsCluster, wait_for

__all__ = ("fleet",)  # the module's fixture: its own cluster and nodes


def children_on(daemon: Daemon, claude_session: str) -> list[int]:
    """The descendants of ``daemon`` that run ``claude_session``."""
    assert daemon.proc is not None
    return [
        pid
        for pid, argv in descendant_argvs(daemon.proc.pid).items()
        if any(claude_session in arg for arg in argv)
    ]


class Sampler:
    """Every 20 ms, in a thread: how many ``claude`` children of ``claude_session`` run
    on each node; the most at once, fleet-wide, and which nodes had them then."""

    def __init__(self, daemons: dict[str, Daemon], claude_session: str) -> None:
        self.daemons = daemons
        self.claude_session = claude_session
        self.most = 0
        self.worst: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            counts = {
                name: len(children_on(daemon, self.claude_session))
                for name, daemon in self.daemons.items()
                if daemon.proc is not None
            }
            self.samples += 1
            if sum(counts.values()) > self.most:
                self.most, self.worst = sum(counts.values()), counts
            time.sleep(0.02)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_a_frozen_node_fences_its_own_children_before_another_node_adopts(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """a's supervisor is frozen (SIGSTOP): no heartbeat renews its lease, and z1's child
    is killed once the lease ends, before b or c may judge a lost; one of
    them adopts z1.  Never two children on the conversation at any 20 ms sample.  Back
    (SIGCONT), a ends its copy (asleep: no child to stop) ``failed_over``.  The child is
    killed by the fence process (sage/fence.py): the runner is frozen with its
    supervisor."""
    cluster, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    ok = a.astrid("sage", "spawn", "alice", "--session", "z1", "--json")
    assert ok.returncode == 0, ok.stderr
    claude_session = conversation_of(rows(a)["z1"]["pid"])
    sent = a.astrid("sage", "send", "z1", "t1", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: stored(cluster, "z1"), 10.0, "z1 replicated after its turn")

    with Sampler(daemons, claude_session) as sampler:
        a.signal(signal.SIGSTOP)  # alive, but silent: the others judge it lost
        try:
            frozen = time.monotonic()
            wait_for(lambda: not children_on(a, claude_session), LOST_AFTER, "a's fence")
            fenced_after = time.monotonic() - frozen
            adopter_name = wait_for(
                lambda: next((n for n in ("b", "c") if running(daemons[n], "z1")), None),
                LOST_AFTER + 15.0,
                "z1 adopted by b or c",
            )
            adopter = daemons[adopter_name]
            wait_for(lambda: children_on(adopter, claude_session), 10.0, "the adopter's child")
        finally:
            a.signal(signal.SIGCONT)
    assert sampler.samples > 20
    assert sampler.most == 1, (sampler.most, sampler.worst)
    assert fenced_after < LOST_AFTER, fenced_after
    assert "sage.fence: lease lost, killed group" in a.log()  # the fence, not frozen
    # thawed, the runner sees the child gone without its lease: fenced, not crashed
    wait_for(lambda: a.log_events("fleet.lease_lost"), 8.0, "the runner's lease lost")
    wait_for(lambda: a.log_events("session.fenced"), 8.0, "z1 fenced by the runner")

    # back, a notices it may have been lost and ends its (sleeping) copy
    wait_for(
        lambda: local_rows(a)["z1"]["state"] == "ended", 8.0, "a's copy of z1 ended failed_over"
    )
    local = local_rows(a)["z1"]
    assert (local["state"], local["reason"]) == ("ended", "failed_over"), local
    (fenced,) = [
        r for r in audit_rows(a, "sage.v1.audit.session_fenced") if r["session_id"] == "z1"
    ]
    assert (fenced["principal_id"], fenced["node"]) == ("alice", adopter_name)
    assert fenced["pid"] is None  # the lease had killed its child: it slept
    assert "fleet.may_have_been_lost" in a.log()  # looked at once, not at the next sweep
    wait_for(lambda: a.log_events("fleet.lease_regained"), 8.0, "a's lease regained")

    # exactly one child on the conversation, fleet-wide; the adopter's claims stay
    assert len(children_on(adopter, claude_session)) == 1
    others = [n for n in daemons if n != adopter_name]
    assert not any(children_on(daemons[n], claude_session) for n in others)
    wait_for(lambda: value(cluster, REGISTRY, "a.z1") is None, 10.0, "a's own claim gone")
    assert value(cluster, REGISTRY, f"{adopter_name}.z1") is not None
    taken = claim(cluster, "z1")
    assert taken is not None
    assert (taken["holder"], taken["failed"]) == (adopter_name, False)
    assert stored(cluster, "z1") is not None  # the transcript stays: it runs on

    # a send from any node reaches the adopter
    pid = local_rows(adopter)["z1"]["pid"]
    for via in (a, c):
        sent = via.astrid(
            "sage", "send", "z1", f"via {via.root.name}", "--timeout", "20", "--principal", "alice"
        )
        assert sent.returncode == 0, sent.stderr
        assert f"echo: via {via.root.name}" in sent.stdout
    assert local_rows(adopter)["z1"]["pid"] == pid
    assert local_rows(adopter)["z1"]["turns"] >= 2

    # a's resync, later, claims nothing back
    time.sleep(3.0)
    assert value(cluster, REGISTRY, "a.z1") is None
    assert claim(cluster, "z1") == taken
    assert not children_on(a, claude_session)
    stop = c.astrid("sage", "stop", "z1", "--principal", "alice", "--json")
    assert stop.returncode == 0, stop.stderr


def test_yielding_a_session_is_the_supervisors_alone(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    _, daemons = fleet
    b = daemons["b"]
    ok = b.astrid("sage", "spawn", "alice", "--session", "y1", "--json")
    assert ok.returncode == 0, ok.stderr

    async_reply = _as_alice(b, "sage.v1.request.yield.y1", {"node": "c"})
    assert async_reply["error"] == "not_authorized", async_reply
    assert running(b, "y1")
    # the supervisor's side (here an admin) may: it ends failed_over, audited
    reply = request(b, "sage.v1.request.yield.y1", {"node": "c"})
    assert reply["ok"] is True, reply
    local = local_rows(b)["y1"]
    assert (local["state"], local["reason"]) == ("ended", "failed_over")
    assert [r for r in audit_rows(b, "sage.v1.audit.session_fenced") if r["session_id"] == "y1"]


def test_the_slow_sweep_ends_a_session_sage_claims_gives_another_node(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """No return noticed (the node never paused): the sweep every few beats finds it."""
    cluster, daemons = fleet
    b = daemons["b"]
    ok = b.astrid("sage", "spawn", "alice", "--session", "w1", "--json")
    assert ok.returncode == 0, ok.stderr
    wait_for(lambda: value(cluster, REGISTRY, "b.w1"), 10.0, "b's claim to w1")
    # (a start under load may stall b's loop past lost_after / 2 once: that return, before
    # the claim below, fences nothing; only one after it would make this no sweep's work)
    returns_before = len(b.log_events("fleet.may_have_been_lost"))
    put_claim(cluster, "w1", Claim(node="c", at=time.time(), principal_id="alice"))
    wait_for(lambda: not running(b, "w1"), 4 * SWEEP_BEATS * HEARTBEAT, "w1 fenced by a sweep")
    local = local_rows(b)["w1"]
    assert (local["state"], local["reason"]) == ("ended", "failed_over")
    assert value(cluster, REGISTRY, "b.w1") is None
    assert len(b.log_events("fleet.may_have_been_lost")) == returns_before


def _as_alice(daemon: Daemon, topic: str, payload: object) -> dict[str, object]:
    import json

    import anyio

    async def main() -> dict[str, object]:
        from bus.client import BusClient

        async with BusClient.connect(
            daemon.socket, role="cli", name="test", principal="alice"
        ) as client:
            reply = await client.request(topic, payload, deadline=10.0)
            data: dict[str, object] = json.loads(reply.payload)
            return data

    return anyio.run(main)


@pytest.fixture(scope="module")
def sleepy_fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    """The same fleet, but a's idle sessions hibernate after 1 s."""
    with NatsCluster(NODES) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-double"}
        daemons = {}
        for node in NODES:
            config = node_config(cluster, node)
            if node == "a":
                config = config.replace(
                    "[sessions]\nresume = true\n",
                    "[sessions]\nresume = true\nhibernate_after = 1.0\n",
                )
            daemons[node] = Daemon(short_dir(), config, env=env)
        with all_running(daemons) as running_daemons:
            yield cluster, running_daemons


def test_a_frozen_nodes_hibernated_session_adopted_asleep_ends_there_without_a_child(
    sleepy_fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = sleepy_fleet
    a = daemons["a"]
    ok = a.astrid("sage", "spawn", "alice", "--session", "h1", "--json")
    assert ok.returncode == 0, ok.stderr
    claude_session = conversation_of(rows(a)["h1"]["pid"])
    sent = a.astrid("sage", "send", "h1", "t1", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: stored(cluster, "h1"), 10.0, "h1 replicated after its turn")
    wait_for(
        lambda: (value(cluster, REGISTRY, "a.h1") or {}).get("state") == "hibernated",
        10.0,
        "h1 hibernated on a",
    )

    a.signal(signal.SIGSTOP)
    try:
        adopter_name = wait_for(
            lambda: next(
                (
                    n
                    for n in ("b", "c")
                    if local_rows(daemons[n]).get("h1", {}).get("state") == "hibernated"
                ),
                None,
            ),
            LOST_AFTER + 15.0,
            "h1 adopted asleep by b or c",
        )
    finally:
        a.signal(signal.SIGCONT)
    adopter = daemons[adopter_name]

    def ended_here() -> bool:
        return bool(local_rows(a)["h1"]["state"] == "ended")

    wait_for(ended_here, 8.0, "a's copy of h1 ended")
    assert local_rows(a)["h1"]["reason"] == "failed_over"
    (fenced,) = [
        r for r in audit_rows(a, "sage.v1.audit.session_fenced") if r["session_id"] == "h1"
    ]
    assert (fenced["node"], fenced["pid"], fenced["state"]) == (adopter_name, None, "hibernated")
    wait_for(lambda: value(cluster, REGISTRY, "a.h1") is None, 10.0, "a's own claim gone")

    # a send through a wakes it on the adopter, never on a
    sent = a.astrid("sage", "send", "h1", "wake up", "--timeout", "20", "--principal", "alice")
    assert sent.returncode == 0, sent.stderr
    assert "echo: wake up" in sent.stdout
    assert not children_on(a, claude_session)
    assert len(children_on(adopter, claude_session)) == 1
