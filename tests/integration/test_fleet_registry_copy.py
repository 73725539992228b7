"""The router's copy of the session registry (sage/fleet/registry_copy.py): a stale copy
never sends a request to the wrong node silently.

Three real supervisors (the CLI double) over a real 3-server NATS cluster.  Node c's
copy is made stale on purpose: the registry says b owns a session that runs on a (an
admin's put of ``b.<sid>`` and delete of ``a.<sid>``, seen by c's watch), then c's
watch consumer is deleted (an admin's JetStream request) and the registry is put
right (a), which c's copy does not see.
A send from c goes to b, the copy's owner; b's runner does not know the session; c's
router asks the bucket afresh, logs the stale copy, and forwards to a.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import nats

from sage.fleet.nodes import NodeRecord
from sage.fleet.permissions import BUCKET
from sage.fleet.registry_keeper import RESYNC_CHECK
from sage.fleet.routes import REGISTRY, REGISTRY_STREAM, SessionEntry, registry_key
from tests.support.daemon import Daemon
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, wait_for
from tests.support.registry_fleet import NODES, fleet, forwarded, send

__all__ = ("fleet",)  # the module's fixture: its own cluster and nodes


def owner_in_bucket(cluster: NatsCluster, sid: str) -> str:
    """The node whose key claims ``sid`` ("": none; "a,b": several)."""

    async def main() -> str:
        async with cluster.client() as admin:
            kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(REGISTRY)
            found = []
            for node in NODES:
                try:
                    value = (await kv.get(registry_key(node, sid))).value or b"{}"
                except nats.js.errors.KeyNotFoundError:
                    continue
                found.append(str(json.loads(value).get("node", "")))
        return ",".join(found)

    return anyio.run(main)


def put_owner(cluster: NatsCluster, sid: str, node: str) -> None:
    async def main() -> None:
        async with cluster.client() as admin:
            kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(REGISTRY)
            # written now: a resync that listed its runner before leaves it alone
            entry = SessionEntry(node=node, principal_id="alice", at=time.time())
            await kv.put(registry_key(node, sid), entry.encode())
            for other in NODES:  # the session moved: no other node claims it
                if other != node:
                    await kv.delete(registry_key(other, sid))

    anyio.run(main)


def delete_watch_of(cluster: NatsCluster, node: str) -> int:
    """Delete ``node``'s consumers of the registry stream (its router's watch: delivered
    to the node's own inboxes); how many."""

    async def main() -> int:
        async with cluster.client() as admin:
            js = admin.jetstream(timeout=JS_TIMEOUT)
            deleted = 0
            for info in await js.consumers_info(REGISTRY_STREAM):
                deliver = info.config.deliver_subject or ""
                if deliver.startswith(f"_INBOX.{node}.") and info.name:
                    await js.delete_consumer(REGISTRY_STREAM, info.name)
                    deleted += 1
            return deleted

    return anyio.run(main)


def ask_router(daemon: Daemon, sid: str) -> Any:
    """The router's own answer to a send (what the CLI asks beside the runner)."""

    async def main() -> Any:
        from bus.client import BusClient

        async with BusClient.connect(
            daemon.socket, role="cli", name="test", principal="alice"
        ) as client:
            topic = f"sage.v1.request.fleet.send.{sid}"
            reply = await client.request(topic, {"text": "hi"}, deadline=10.0)
            return json.loads(reply.payload)

    return anyio.run(main)


def router_leaves_to_runner(daemon: Daemon, sid: str, what: str) -> None:
    """Wait until ``daemon``'s router answers a send for ``sid`` as its runner's session:
    ``unknown_session``, "... is on this node" (it forwards nothing)."""
    reply = wait_for(
        lambda: (r := ask_router(daemon, sid)).get("message", "").endswith("is on this node") and r,
        10.0,
        what,
    )
    assert reply["error"] == "unknown_session"


def watching_nodes(cluster: NatsCluster) -> set[str]:
    """The nodes with a consumer of the registry stream delivered to their inboxes."""

    async def main() -> set[str]:
        async with cluster.client() as admin:
            infos = await admin.jetstream(timeout=JS_TIMEOUT).consumers_info(REGISTRY_STREAM)
        subjects = [info.config.deliver_subject or "" for info in infos]
        return {node for node in NODES if any(s.startswith(f"_INBOX.{node}.") for s in subjects)}

    return anyio.run(main)


def test_every_node_watches_the_registry_with_its_own_permissions(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """The users hold exactly `astrid fleet permissions`' subjects: each node's watch
    consumer is there, and no node logged a failed watch."""
    cluster, daemons = fleet
    wait_for(lambda: watching_nodes(cluster) == set(NODES), 15.0, "every node's registry watch")
    for daemon in daemons.values():
        assert not daemon.log_events("fleet.registry_watch_failed")


def test_a_stale_copy_is_corrected_by_the_bucket_and_said(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    spawned = a.astrid("sage", "spawn", "alice", "--session", "moving", timeout=30.0)
    assert spawned.returncode == 0, spawned.stderr
    wait_for(lambda: send(c, "moving", "hello")[0] == 0, 10.0, "a send from c reaching a")

    # the registry (and c's copy) say b: b does not know the session, so a send fails.
    # a's first resync after its start may put the truth back (a has the session), so
    # the lie is told until it holds across a resync period
    def lie_holds() -> bool:
        put_owner(cluster, "moving", "b")
        try:
            wait_for(lambda: "unknown_session" in send(c, "moving", "to b?")[1], 3.0, "c naming b")
        except AssertionError:  # a resync put the truth back meanwhile: tell it again
            return False
        time.sleep(2 * RESYNC_CHECK)
        return (
            owner_in_bucket(cluster, "moving") == "b"
            and "unknown_session" in send(c, "moving", "still b?")[1]
        )

    wait_for(lie_holds, 30.0, "the registry naming b for good")
    before = len(c.log_events("fleet.registry_copy_stale"))

    # c's watch is cut, and the registry put right: c's copy still says b
    assert delete_watch_of(cluster, "c") >= 1
    put_owner(cluster, "moving", "a")
    code, out = send(c, "moving", "after the move")
    assert code == 0, out
    stale = c.log_events("fleet.registry_copy_stale")
    assert len(stale) > before, "c's router did not find its copy stale"
    assert (stale[-1]["copy"], stale[-1]["node"], stale[-1]["session_id"]) == ("b", "a", "moving")
    # b was asked and said no; a answered
    asked_b = forwarded(b, "moving")
    assert asked_b
    assert asked_b[-1]["ok"] is False
    answered = forwarded(a, "moving")
    assert answered[-1]["ok"] is True

    # the stale copy's watch is started anew at once (nats-py alone would take 10 s or
    # more to miss two heartbeats), and the next send needs no correction
    wait_for(lambda: "c" in watching_nodes(cluster), 8.0, "c's new registry watch")
    code, out = send(c, "moving", "once more")
    assert code == 0, out
    assert len(c.log_events("fleet.registry_copy_stale")) == len(stale)


def test_the_router_leaves_a_session_of_its_own_node_to_its_runner(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """The CLI asks the runner and the router at once: for a session its runner has, the
    router answers unknown_session at once (its runner answers), forwarding nothing; the
    CLI's send gets the runner's answer, one turn."""
    _, daemons = fleet
    a = daemons["a"]
    spawned = a.astrid("sage", "spawn", "alice", "--session", "homebody", timeout=30.0)
    assert spawned.returncode == 0, spawned.stderr

    router_leaves_to_runner(a, "homebody", "a's router knowing its runner has the session")
    code, out = send(a, "homebody", "hello")
    assert code == 0, out
    for daemon in daemons.values():
        assert not forwarded(daemon, "homebody")


def test_a_session_restored_at_a_restart_is_left_to_the_runner_too(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """A hibernated session survives a restart without a new ``spawned``: the router
    learns it from its runner's listing at the resync, and forwards nothing for it."""
    _, daemons = fleet
    b = daemons["b"]
    spawned = b.astrid("sage", "spawn", "alice", "--session", "sleeper", timeout=30.0)
    assert spawned.returncode == 0, spawned.stderr

    def state() -> str:
        result = b.astrid("sage", "sessions", "--json", "--principal", "alice", timeout=30.0)
        assert result.returncode == 0, result.stderr
        found = [r for r in json.loads(result.stdout) if r["session_id"] == "sleeper"]
        return str(found[0]["state"]) if found else ""

    wait_for(lambda: state() == "hibernated", 15.0, "the session hibernated on b")
    assert b.stop() == 0
    b.start(30.0)
    router_leaves_to_runner(b, "sleeper", "b's router knowing its runner has the restored session")
    code, out = send(b, "sleeper", "good morning")
    assert code == 0, out


def test_the_listing_takes_a_silent_nodes_sessions_from_the_copy(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Node z stopped (its record says so) and left claims in the registry: a listing
    shows them, stopped, from the copy (no key read one at a time), and only the
    caller's; an admin sees them all."""
    cluster, daemons = fleet
    c = daemons["c"]
    now = time.time()
    record = NodeRecord(
        node="z", host="gone", pid=1, started_at=now, heartbeat_at=now, heartbeat=2.0, stopped=True
    )
    cluster.admin_put(BUCKET, "z", record.encode())
    for sid, principal in (("z1", "alice"), ("z2", "bob"), ("z3", "alice")):
        entry = SessionEntry(node="z", principal_id=principal, at=now)
        cluster.admin_put(REGISTRY, registry_key("z", sid), entry.encode())

    def listing(*principal: str) -> dict[str, Any]:
        result = c.astrid("sage", "sessions", "--json", *principal, timeout=30.0)
        assert result.returncode == 0, result.stderr
        return {r["session_id"]: r for r in json.loads(result.stdout) if r["node"] == "z"}

    alice = wait_for(
        lambda: (found := listing("--principal", "alice")).keys() == {"z1", "z3"} and found,
        10.0,
        "z's sessions in c's listing",
    )
    assert {r["state"] for r in alice.values()} == {"stopped"}
    assert alice["z1"]["principal_id"] == "alice"
    assert alice["z1"]["pid"] is None
    assert listing().keys() == {"z1", "z2", "z3"}
    sources = [r["registry"] for r in c.log_events("fleet.listing")]
    assert sources[-2:] == ["copy", "copy"], sources  # alice's listing and the admin's


def test_a_copy_behind_the_bucket_leaves_the_listing_to_the_bucket(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """c's watch is cut (its consumer deleted), then z's claims change: c's copy misses
    it, so the listing (which asks the bucket's last revision first) reads the bucket,
    and shows the change."""
    cluster, daemons = fleet
    c = daemons["c"]
    wait_for(lambda: "c" in watching_nodes(cluster), 8.0, "c's registry watch")
    assert delete_watch_of(cluster, "c") >= 1
    cluster.admin_put(
        REGISTRY,
        registry_key("z", "z4"),
        SessionEntry(node="z", principal_id="alice", at=time.time()).encode(),
    )

    async def forget_z1() -> None:
        async with cluster.client() as admin:
            kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(REGISTRY)
            await kv.delete(registry_key("z", "z1"))

    anyio.run(forget_z1)
    result = c.astrid("sage", "sessions", "--json", "--principal", "alice", timeout=30.0)
    assert result.returncode == 0, result.stderr
    listed = {r["session_id"] for r in json.loads(result.stdout) if r["node"] == "z"}
    assert listed == {"z3", "z4"}
    assert c.log_events("fleet.listing")[-1]["registry"] == "bucket"
