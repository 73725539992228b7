"""The session registry's trust model: a node writes only its own claims, and the server
enforces it (docs/security.md, "Fleet trust model").

Three real supervisors (the CLI double) over a real 3-server NATS cluster whose node
users hold exactly `astrid fleet permissions`' subjects: test_fleet_registry_copy's
fleet (its node b hibernates idle sessions; no session here is b's).  A second connection with
node b's own user stands in for a compromised node b: the server refuses its put and
delete of node a's key ``a.<sid>``; what b may write (its own ``b.<sid>``, any
``sage_claims`` key) never takes a live node's session: two live claimants are refused
``session_conflict`` and logged, forwarded to neither; a claim under a lost node's name
beside the live owner's is not followed.
"""

from __future__ import annotations

import json
import time

import anyio
import nats
import pytest

from sage.fleet.claims import Claims
from sage.fleet.nodes import NodeRecord
from sage.fleet.permissions import BUCKET
from sage.fleet.routes import REGISTRY, Claim, SessionEntry, registry_key
from tests.support.daemon import Daemon
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, refused_kv, wait_for
from tests.support.registry_fleet import fleet, forwarded, send

__all__ = ("fleet",)  # the module's fixture: its own cluster and nodes


def spawn(daemon: Daemon, sid: str) -> None:
    spawned = daemon.astrid("sage", "spawn", "alice", "--session", sid, timeout=30.0)
    assert spawned.returncode == 0, spawned.stderr


def registry_value(cluster: NatsCluster, key: str) -> bytes | None:
    return cluster.admin_get(REGISTRY, key)


def test_a_node_cannot_put_or_delete_another_nodes_claim(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    spawn(a, "t1")
    wait_for(lambda: registry_value(cluster, "a.t1") is not None, 10.0, "a's claim to t1")
    before = registry_value(cluster, "a.t1")
    violations: list[str] = []

    async def main() -> None:
        async with cluster.client("b", errors=violations) as nc:  # a rogue node b
            denied = await refused_kv(nc, REGISTRY)
            lie = SessionEntry(node="b", principal_id="alice", at=time.time()).encode()
            with pytest.raises(nats.errors.TimeoutError):
                await denied.put("a.t1", lie)
            with pytest.raises(nats.errors.TimeoutError):
                await denied.delete("a.t1")
            with pytest.raises(nats.errors.TimeoutError):
                await denied.purge("a.t1")
            # its own key it may write (and delete)
            kv = await nc.jetstream(timeout=JS_TIMEOUT).key_value(REGISTRY)
            assert await kv.put("b.elsewhere", lie) > 0
            await kv.delete("b.elsewhere")

    anyio.run(main)
    assert registry_value(cluster, "a.t1") == before
    refused = [v for v in violations if "permissions violation" in v.lower()]
    assert all("$kv.sage_sessions.a.t1" in v.lower() for v in refused), violations
    assert len(refused) >= 3, violations
    code, out = send(c, "t1", "still a's")
    assert code == 0, out
    assert forwarded(a, "t1")[-1]["ok"] is True


def test_a_claim_under_a_lost_nodes_name_is_not_followed(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """A lost node's claim (as one left behind by a node that died) beside the live
    owner's: the live one is followed, however new the other; and a ``sage_claims``
    key naming b, which node b may write, routes nothing.  (The key says b's try
    failed: one that did not would make a's sweep end t2 ``failed_over`` within a few
    heartbeats, by design (docs/security.md, fleet trust model), racing the send.)"""
    cluster, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    spawn(a, "t2")
    wait_for(lambda: registry_value(cluster, "a.t2") is not None, 10.0, "a's claim to t2")

    dead = NodeRecord(node="d", host="h", pid=1, started_at=1.0, heartbeat_at=2.0, heartbeat=0.5)
    cluster.admin_put(BUCKET, "d", dead.encode())
    newer = SessionEntry(node="d", principal_id="alice", at=time.time() + 3600)
    cluster.admin_put(REGISTRY, registry_key("d", "t2"), newer.encode())

    async def main() -> None:
        async with cluster.client("b") as rogue:
            claims = Claims(rogue.jetstream(timeout=JS_TIMEOUT), "b")
            _, last = await claims.latest("alice", "t2")
            lie = Claim(node="b", at=time.time(), principal_id="alice", failed=True)
            await claims.write("t2", lie, last)

    anyio.run(main)
    status = json.loads(c.astrid("fleet", "status", "--json", timeout=30.0).stdout)
    assert {n["node"]: n["state"] for n in status["nodes"]}["d"] == "lost"
    asked_b = len(forwarded(daemons["b"], "t2"))
    code, out = send(c, "t2", "to the live one")
    assert code == 0, out
    assert "echo: to the live one" in out
    assert forwarded(a, "t2")[-1]["ok"] is True
    assert len(forwarded(daemons["b"], "t2")) == asked_b
    assert not c.log_events("fleet.session_conflict")


def test_two_live_claimants_are_refused_and_logged(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Node b claims a's session under its own name (all the server lets it write):
    a request for it from c goes to neither, says why, and c's log names both; once
    b's claim is gone, c reaches a again."""
    cluster, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    spawn(a, "t3")
    wait_for(lambda: send(c, "t3", "hello")[0] == 0, 10.0, "a send from c reaching a")
    violations: list[str] = []

    async def claim(write: bool) -> None:
        async with cluster.client("b", errors=violations) as rogue:
            kv = await rogue.jetstream(timeout=JS_TIMEOUT).key_value(REGISTRY)
            if write:
                lie = SessionEntry(node="b", principal_id="alice", at=time.time())
                await kv.put(registry_key("b", "t3"), lie.encode())
            else:
                await kv.delete(registry_key("b", "t3"))

    asked = len(forwarded(a, "t3")), len(forwarded(b, "t3"))
    anyio.run(claim, True)
    _, out = wait_for(lambda: (r := send(c, "t3", "to whom?"))[0] != 0 and r, 10.0, "c refusing t3")
    assert "session_conflict" in out, out
    assert "a, b" in out, out
    conflicts = c.log_events("fleet.session_conflict")
    assert conflicts
    assert (conflicts[-1]["session_id"], conflicts[-1]["nodes"]) == ("t3", ["a", "b"])
    assert conflicts[-1]["level"] == "warning"
    assert (len(forwarded(a, "t3")), len(forwarded(b, "t3"))) == asked
    assert not violations

    anyio.run(claim, False)
    wait_for(lambda: send(c, "t3", "a again")[0] == 0, 10.0, "a send from c reaching a again")
