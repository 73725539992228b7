"""Failover takes only what the lost node could vouch for: a real 3-server NATS cluster.

A rogue node ``r`` (a raw NATS client logged in as r; its heartbeat record declares
alice and bob, as a compromised node may) writes registry claims under its own name for a session of alice's and
one of bob's, with a transcript for bob's, and goes silent.  Node c pins r to alice
(``[fleet.peers.r] principals = ["alice"]``) and serves both principals: it adopts
alice's session (so the takeover runs), never bob's; bob's home gets no planted
conversation, and c's audit chain keeps one ``fleet_principal_rejected`` (verb
``adopt``) for it.  Without the check c adopts both (the review's repro).
"""

from __future__ import annotations

import time
from pathlib import Path

import anyio

from sage.fleet.nodes import NodeRecord
from sage.fleet.routes import SessionEntry, registry_key
from sage.fleet.transcript_store import TranscriptStore
from sage.fleet.transcripts import TRANSCRIPTS, TranscriptMeta
from tests.support.daemon import Daemon, short_dir
from tests.support.failover_fleet import (
    HEARTBEAT,
    LOST_AFTER,
    audit_rows,
    local_rows,
    node_config,
)
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, wait_for

PLANTED = "11111111-2222-4333-8444-555555555555"


async def _play_rogue(cluster: NatsCluster) -> None:
    """As node r: a record declaring alice and bob, claims to a1 (alice) and b1 (bob), and a
    transcript for b1; then silence (its record ages into lost)."""
    async with cluster.client("r") as nc:
        js = nc.jetstream(timeout=JS_TIMEOUT)
        now = time.time()
        record = NodeRecord(
            node="r",
            host="rogue",
            pid=1,
            started_at=now - 60,
            heartbeat_at=now,
            heartbeat=HEARTBEAT,
            principals=["alice", "bob"],
        )
        await (await js.key_value("sage_nodes")).put("r", record.encode())
        registry = await js.key_value("sage_sessions")
        for sid, principal in (("a1", "alice"), ("b1", "bob")):
            entry = SessionEntry(node="r", principal_id=principal, resume=True, at=now)
            await registry.put(registry_key("r", sid), entry.encode())
        data = b'{"type":"user","message":"planted by node r"}\n'
        meta = TranscriptMeta(
            session_id="b1",
            principal_id="bob",
            claude_session=PLANTED,
            cwd="",
            model="",
            node="r",
            turns=1,
            size=len(data),
        )
        store = TranscriptStore(await js.key_value(TRANSCRIPTS), "r")
        await store.put("b1", data, meta)


def test_a_lost_node_pinned_to_alice_cannot_plant_a_session_of_bob() -> None:
    with NatsCluster(["c", "r"]) as cluster:
        config = node_config(cluster, "c") + '[fleet.peers.r]\nprincipals = ["alice"]\n'
        c = Daemon(short_dir(), config, env={"ANTHROPIC_API_KEY": "sk-double"})
        c.launch()
        try:
            c.wait_ready(30.0)
            anyio.run(_play_rogue, cluster)
            # alice's is adopted: the takeover ran, and r could vouch for her here
            wait_for(lambda: "a1" in local_rows(c), LOST_AFTER + 20.0, "c adopts a1")

            def refused() -> list[dict[str, object]]:
                return [
                    r
                    for r in audit_rows(c, "sage.v1.audit.fleet_principal_rejected")
                    if r["verb"] == "adopt"
                ]

            (row,) = wait_for(refused, 10.0, "c audits the refusal of b1")
            assert (row["origin"], row["principal_id"], row["session_id"]) == ("r", "bob", "b1")
            assert "[fleet.peers.r] principals" in str(row["reason"])
            time.sleep(3 * 1.0)  # three more passes of the takeover: still not taken
            assert "b1" not in local_rows(c)
            assert len(refused()) == 1  # once per session, not every pass
            planted = [
                p for p in Path(c.root).rglob(f"{PLANTED}.jsonl") if p.is_file()
            ]  # nothing of r's written into bob's home
            assert planted == []
        finally:
            c.stop()
