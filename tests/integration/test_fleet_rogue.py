"""A rogue node: as a node's own NATS user, exactly the permissions `astrid fleet
permissions` prints, try what a compromised node would, each refused or detected.

Rollups, purges and message deletes on every stream the fleet uses; writes to other
nodes' keys and subjects (claims, transcripts); a claim race no third node can
forge; streams made first with weak settings, which stop every node's start.
Three real supervisors (the CLI double) over a real 3-server NATS cluster.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anyio
import nats
import pytest
from nats.js.api import StorageType, StreamConfig

from sage.errors import FleetRaceLost
from sage.fleet.claims import Claims, cas_headers
from sage.fleet.permissions import AUDIT_STREAM, BUCKET, TOOLS_BUCKET
from sage.fleet.routes import CLAIMS, Claim, claim_filter
from sage.fleet.streams import STREAMS, Kind, StreamSpec
from sage.fleet.transcripts import TRANSCRIPTS
from tests.support.daemon import Daemon, short_dir
from tests.support.failover_fleet import fleet
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster

__all__ = ("fleet",)

pytestmark = pytest.mark.anyio

BUCKETS = [spec for spec in STREAMS if spec.kind is Kind.BUCKET]

Fleet = tuple[NatsCluster, dict[str, Daemon]]


def own_subject(spec: StreamSpec, node: str, key: str = "x") -> str:
    """A subject ``node``'s user may publish on in ``spec``'s stream."""
    if spec.name == AUDIT_STREAM:
        return f"sage.audit.{node}.entry"
    if spec.bucket in (BUCKET, TOOLS_BUCKET):
        return f"$KV.{spec.bucket}.{node}"
    if spec.bucket == TRANSCRIPTS:
        return f"$KV.{spec.bucket}.{node}.{key}.meta"
    if spec.bucket == CLAIMS:
        return f"$KV.{spec.bucket}.{node}.alice.{key}"
    return f"$KV.{spec.bucket}.{node}.{key}"


async def count(cluster: NatsCluster, spec: StreamSpec) -> int:
    """The messages in ``spec``'s stream now (as the admin)."""
    async with cluster.client() as admin:
        info = await admin.jetstream(timeout=JS_TIMEOUT).stream_info(spec.name)
        return int(info.state.messages)


@pytest.mark.parametrize("spec", STREAMS, ids=lambda spec: spec.name)
async def test_a_rollup_on_a_nodes_own_subject_is_refused_and_erases_nothing(
    fleet: Fleet, spec: StreamSpec
) -> None:
    """As node b: one message with ``Nats-Rollup: all`` on b's own subject (subject
    permissions cannot see a header) is refused by the stream, and a's message stays."""
    cluster, _ = fleet
    async with cluster.client("a") as a:
        await a.jetstream(timeout=JS_TIMEOUT).publish(own_subject(spec, "a"), b"{}")
    before = await count(cluster, spec)
    assert before >= 1
    async with cluster.client("b") as b:
        js = b.jetstream(timeout=JS_TIMEOUT)
        for rollup in ("all", "sub"):
            with pytest.raises(nats.js.errors.APIError, match="rollup not permitted"):
                await js.publish(own_subject(spec, "b"), b"{}", headers={"Nats-Rollup": rollup})
    assert await count(cluster, spec) == before


@pytest.mark.parametrize("spec", STREAMS, ids=lambda spec: spec.name)
async def test_no_one_purges_or_deletes_a_message_of_a_fleet_stream(
    fleet: Fleet, spec: StreamSpec
) -> None:
    """A node's user has no purge, message delete, update or stream delete call (the
    server refuses the publish); even the admin's purge and delete are refused by the
    stream itself, which no update can make allow them again."""
    cluster, _ = fleet
    errors: list[str] = []
    async with cluster.client("b", errors=errors) as b:
        js = b.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.purge_stream(spec.name)
        with pytest.raises(nats.errors.TimeoutError):
            await js.delete_msg(spec.name, 1)
        with pytest.raises(nats.errors.TimeoutError):
            await js.delete_stream(spec.name)
        info = await b.jetstream(timeout=JS_TIMEOUT).stream_info(spec.name)
        weaker = info.config
        weaker.allow_rollup_hdrs = True
        with pytest.raises(nats.errors.TimeoutError):
            await js.update_stream(weaker)
    assert any("permissions violation" in error.lower() for error in errors), errors
    before = await count(cluster, spec)
    async with cluster.client() as admin:
        js = admin.jetstream(timeout=JS_TIMEOUT)
        with pytest.raises(nats.js.errors.APIError, match="purge not permitted"):
            await js.purge_stream(spec.name)
        with pytest.raises(nats.js.errors.APIError, match="delete not permitted"):
            await js.delete_msg(spec.name, (await js.stream_info(spec.name)).state.last_seq)
        weaker = (await js.stream_info(spec.name)).config
        weaker.deny_purge = False
        with pytest.raises(nats.js.errors.APIError, match="can not cancel deny purge"):
            await js.update_stream(weaker)
    assert await count(cluster, spec) == before


@pytest.mark.parametrize(
    ("bucket", "key"),
    [(CLAIMS, "a.alice.s9"), (TRANSCRIPTS, "a.s9.meta"), (TRANSCRIPTS, "a.s9.0")],
)
async def test_a_node_writes_no_claim_or_transcript_under_another_nodes_name(
    fleet: Fleet, bucket: str, key: str
) -> None:
    """As node b: a put or a delete of a key under a's name in ``sage_claims`` or
    ``sage_transcripts`` is a permissions violation, and a's value stays."""
    cluster, _ = fleet
    async with cluster.client("a") as a:
        await a.jetstream(timeout=JS_TIMEOUT).publish(f"$KV.{bucket}.{key}", b"a's")
    errors: list[str] = []
    async with cluster.client("b", errors=errors) as b:
        js = b.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(f"$KV.{bucket}.{key}", b"b's")
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(f"$KV.{bucket}.{key}", b"", headers={"KV-Operation": "DEL"})
    assert any("permissions violation" in error.lower() for error in errors), errors
    async with cluster.client() as admin:
        kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(bucket)
        assert (await kv.get(key)).value == b"a's"


async def test_a_claim_race_has_one_winner_and_no_third_node_writes_for_another(
    fleet: Fleet,
) -> None:
    """b and c race for one session, each naming the revision it read of every node's
    key: exactly one wins; the loser's stale write fails, and so does a later write that
    names a revision older than the winner's."""
    cluster, _ = fleet
    sid = f"race{int(time.time() * 1000) % 100000}"
    async with cluster.client("b") as b, cluster.client("c") as c:
        claims_b = Claims(b.jetstream(timeout=JS_TIMEOUT), "b")
        claims_c = Claims(c.jetstream(timeout=JS_TIMEOUT), "c")
        (_, seen_b), (_, seen_c) = (
            await claims_b.latest("alice", sid),
            await claims_c.latest("alice", sid),
        )
        assert seen_b == seen_c == 0
        results: dict[str, Any] = {}

        async def race(name: str, claims: Claims) -> None:
            try:
                results[name] = await claims.write(sid, Claim(node=name, principal_id="alice"), 0)
            except FleetRaceLost as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(race, "b", claims_b)
            tg.start_soon(race, "c", claims_c)
        won = [name for name, got in results.items() if isinstance(got, int)]
        assert len(won) == 1, results
        claim, revision = await claims_b.latest("alice", sid)
        assert claim is not None
        assert claim.holder == won[0]
        loser = claims_c if won == ["b"] else claims_b
        with pytest.raises(FleetRaceLost):
            await loser.write(sid, Claim(node=loser.node, principal_id="alice"), 0)
        with pytest.raises(ValueError, match="writes its own claims"):
            await loser.write(sid, Claim(node=won[0], principal_id="alice"), revision)
        # bob's session of the same id is another session: its claims race apart
        assert await claims_b.latest("bob", sid) == (None, 0)
        await loser.write(sid, Claim(node=loser.node, principal_id="bob"), 0)
        bobs, _ = await claims_b.latest("bob", sid)
        assert bobs is not None
        assert bobs.holder == loser.node
        assert (await claims_b.latest("alice", sid))[0] == claim
        # a value naming another node than its key's writer is not taken as that node's
        js = (b if loser.node == "b" else c).jetstream(timeout=JS_TIMEOUT)
        await js.publish(
            f"$KV.{CLAIMS}.{loser.node}.alice.{sid}",
            Claim(node=won[0], principal_id="alice", back="a").encode(),
            headers=cas_headers(revision, claim_filter("alice", sid)),
        )
        claim, revision = await claims_b.latest("alice", sid)
        assert claim is None
        # nor one naming another principal than its key's
        await js.publish(
            f"$KV.{CLAIMS}.{loser.node}.alice.{sid}",
            Claim(node=loser.node, principal_id="bob").encode(),
            headers=cas_headers(revision, claim_filter("alice", sid)),
        )
        claim, _ = await claims_b.latest("alice", sid)
        assert claim is None


def weak_config(name: str, subjects: list[str]) -> StreamConfig:
    """A stream as nats-py (or a careless admin, or a rogue node) would make it."""
    return StreamConfig(
        name=name,
        subjects=subjects,
        storage=StorageType.MEMORY,
        allow_rollup_hdrs=True,
        max_msgs_per_subject=-1,
        max_msgs=100,
    )


@pytest.fixture
def bare_cluster() -> Iterator[NatsCluster]:
    with NatsCluster(["a", "b"]) as cluster:
        yield cluster


@pytest.mark.parametrize(
    ("stream", "subjects"),
    [("KV_sage_claims", ["$KV.sage_claims.>"]), (AUDIT_STREAM, ["sage.audit.*.entry"])],
)
async def test_a_stream_made_first_with_weak_settings_stops_a_node_naming_the_fix(
    bare_cluster: NatsCluster, stream: str, subjects: list[str]
) -> None:
    """Node b's user makes a fleet stream before any node (it may create it, with any
    settings): node a then refuses to start, ``fleet_stream_unsafe`` naming each weak
    setting and how to fix it."""
    async with bare_cluster.client("b") as b:
        await b.jetstream(timeout=JS_TIMEOUT).add_stream(weak_config(stream, subjects))
    daemon = Daemon(short_dir(), 'capsules = ["echo"]\n' + bare_cluster.fleet_section("a"))
    result = daemon.run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"astrid: fleet: stream {stream} is weaker than the fleet needs:"), last
    for setting in ("allow_rollup_hdrs is True", "deny_purge is False", "storage is 'memory'"):
        assert setting in last, last
    assert "max_msgs is 100" in last
    assert f"nats stream edit {stream} --no-allow-rollup" in last
    assert f"nats stream rm {stream}" in last  # memory storage cannot be edited
    if stream == AUDIT_STREAM:
        assert "subjects is" in last  # one subject of three


async def test_every_stream_a_node_makes_is_safe(bare_cluster: NatsCluster) -> None:
    """The first node makes every stream itself: no rollups, no purges or deletes, file
    storage, no limits but one value a key."""
    daemon = Daemon(short_dir(), 'capsules = ["echo"]\n' + bare_cluster.fleet_section("a")).start()
    try:
        async with bare_cluster.client() as admin:
            js = admin.jetstream(timeout=JS_TIMEOUT)
            for spec in STREAMS:
                config = (await js.stream_info(spec.name)).config
                assert (config.allow_rollup_hdrs, config.deny_purge, config.deny_delete) == (
                    False,
                    True,
                    True,
                ), spec.name
                assert config.storage == StorageType.FILE
                assert config.num_replicas == 3
                assert config.max_msgs_per_subject == spec.per_subject
                assert sorted(config.subjects or []) == sorted(spec.subjects)
    finally:
        assert daemon.stop() == 0
