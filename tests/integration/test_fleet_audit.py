"""The fleet audit over a real 3-server NATS cluster with JetStream and three supervisors.

Each node streams its audit log to the ``sage_audit`` stream; ``astrid audit verify
--fleet`` (asking the local supervisor) checks every node's chain and checkpoints from
the stream and has each live node compare its SQLite log with it.  The node users hold
exactly the permissions ``astrid fleet permissions`` prints.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sage.audit.chain import entry_hash
from sage.fleet.audit_check import StreamedEntry, subject_of
from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, wait_for

NODES = ["a", "b", "c"]


def node_config(cluster: NatsCluster, node: str) -> str:
    return (
        cluster.fleet_section(node, lost_after=3.0)
        # a checkpoint every 4 entries: the stream holds several
        + "[audit]\ncheckpoint_every = 4\n"
    )


@pytest.fixture
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with NatsCluster(NODES) as cluster:
        daemons = {node: Daemon(short_dir(), node_config(cluster, node)) for node in NODES}
        try:
            for daemon in daemons.values():
                daemon.launch()
            for daemon in daemons.values():
                daemon.wait_ready()
            yield cluster, daemons
        finally:
            for daemon in daemons.values():
                daemon.stop()


def audit_db(daemon: Daemon) -> Path:
    return daemon.root / "state" / "audit.db"


def local_head(daemon: Daemon) -> int:
    conn = sqlite3.connect(f"{audit_db(daemon).as_uri()}?mode=ro", uri=True)
    try:
        head: int = conn.execute("SELECT coalesce(max(seq), 0) FROM entries").fetchone()[0]
    finally:
        conn.close()
    return head


def _started(daemon: Daemon) -> dict[str, Any] | None:
    """The payload of the node's ``supervisor_started`` entry, once it is committed."""
    conn = sqlite3.connect(f"{audit_db(daemon).as_uri()}?mode=ro", uri=True)
    try:
        row = conn.execute(
            "SELECT payload FROM entries WHERE kind = 'sage.v1.audit.supervisor_started'"
        ).fetchone()
    finally:
        conn.close()
    return None if row is None else dict(json.loads(row[0])["payload"])


def emit(daemon: Daemon, count: int, what: str = "x") -> None:
    for i in range(count):
        result = daemon.astrid("bus", "pub", f"sage.v1.audit.test_{what}", json.dumps({"i": i}))
        assert result.returncode == 0, result.stderr


def verify(daemon: Daemon) -> tuple[int, dict[str, Any], subprocess.CompletedProcess[str]]:
    result = daemon.astrid("audit", "verify", "--fleet", "--json", timeout=60.0)
    data: dict[str, Any] = json.loads(result.stdout) if result.stdout.strip() else {}
    return result.returncode, data, result


def by_node(data: dict[str, Any]) -> dict[str, Any]:
    return {node["node"]: node for node in data["nodes"]}


def wait_streamed(daemons: dict[str, Daemon], timeout: float = 15.0) -> dict[str, Any]:
    """verify --fleet until every node's stream reaches its local head (all streamed)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        code, data, result = verify(daemons["a"])
        last = (code, result.stdout[-2000:], result.stderr[-500:])
        if code == 0:
            nodes = by_node(data)
            if all(
                nodes[n]["local"] is not None
                and nodes[n]["local"]["unstreamed"] == 0
                and nodes[n]["stream"]["head_seq"] >= local_head(d) - 1
                for n, d in daemons.items()
            ):
                return data
        time.sleep(0.3)
    raise AssertionError(f"the stream did not catch up within {timeout} s: {last}")


def writable(path: Path) -> sqlite3.Connection:
    """The audit db as an intruder opens it: the append-only triggers dropped."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=10.0)
    conn.execute("DROP TRIGGER entries_no_update")
    return conn


async def forge_as_b(cluster: NatsCluster, secret: str) -> list[str]:
    """As node b's own user: read the stream (the secret is not in it), try to forge a's
    entry, purge and delete (each refused: no answer), publish garbage on its own key
    subject (allowed).  The server's error callbacks, as text."""
    from nats.errors import TimeoutError as NatsTimeout

    errors: list[str] = []

    async with cluster.client("b", errors=errors) as nc:
        js = nc.jetstream(timeout=JS_TIMEOUT)
        info = await js.stream_info("sage_audit")
        payloads = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg("sage_audit", seq)
            assert secret.encode() not in (msg.data or b"")
            if msg.subject == subject_of("a", "entry"):
                body = msgspec.json.decode(msg.data or b"", type=StreamedEntry)
                payloads.append(body.payload or b"")
        assert not any(secret.encode() in p for p in payloads)
        assert any(b'"api_token":"<redacted>"' in p for p in payloads), payloads
        forged = StreamedEntry(
            seq=1,
            ts=0,
            kind="forged",
            principal="root",
            session="",
            payload=b"{}",
            prev_hash=bytes(32),
            hash=bytes(32),
        )
        with pytest.raises(NatsTimeout):
            await js.publish(subject_of("a", "entry"), msgspec.json.encode(forged))
        with pytest.raises(NatsTimeout):
            await js.purge_stream("sage_audit")
        with pytest.raises(NatsTimeout):
            await js.delete_msg("sage_audit", 1)
        # its own subject is allowed (the server acknowledges it)
        ack = await js.publish(subject_of("b", "key"), b"{}")
        assert ack.stream == "sage_audit"
    return errors


def test_every_node_streams_verify_passes_then_names_an_altered_row(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Entries of all three nodes reach the stream and verify --fleet passes from any
    node.  A secret in an audited payload reaches the stream redacted.  Node b's own user
    cannot publish a forged entry on a's subject (the server refuses it, the stream does
    not hold it), nor purge the stream or delete a message; garbage on its own subject is
    reported as malformed, not a crash.  Then a row altered in b's SQLite (a plain
    UPDATE) and c's chain rewritten from seq 3 with recomputed hashes are each named with
    their first bad seq, while a stays ok."""
    cluster, daemons = fleet
    for name, daemon in daemons.items():  # joining the fleet is in each node's own chain
        deadline = time.monotonic() + 10.0
        while (started := _started(daemon)) is None and time.monotonic() < deadline:
            time.sleep(0.1)  # the entry is committed moments after the node is ready
        assert started is not None, f"{name}: no supervisor_started entry"
        assert started["fleet"]["node"] == name, started
    secret = "sk-" + "9f3b" * 8
    for daemon in daemons.values():
        emit(daemon, 3)
    result = daemons["a"].astrid(
        "bus", "pub", "sage.v1.audit.test_secret", json.dumps({"api_token": secret})
    )
    assert result.returncode == 0, result.stderr
    # larger than one NATS message once streamed (base64): streamed without its payload
    big = json.dumps({"blob": "x" * 900_000}).encode()
    result = daemons["c"].astrid("bus", "pub", "sage.v1.audit.test_big", "-", input=big)
    assert result.returncode == 0, result.stderr
    data = wait_streamed(daemons)
    assert (data["intact"], data["complete"], data["strays"]) == (True, True, [])
    assert [by_node(data)[n]["stream"]["opaque"] for n in NODES] == [0, 0, 1]
    nodes = by_node(data)
    assert sorted(nodes) == NODES
    for name, node in nodes.items():
        assert (node["ok"], node["live"], node["failure"]) == (True, True, None), node
        assert node["stream"]["entries"] >= 4  # supervisor_started and three more
        assert node["stream"]["checkpoints"] >= 1
        assert node["local"]["compared"] == node["stream"]["entries"], name
    text = daemons["c"].astrid("audit", "verify", "--fleet", timeout=60.0)
    assert text.returncode == 0, text.stdout + text.stderr
    assert text.stdout.startswith("fleet audit intact: 3 nodes")
    assert text.stdout.count(" ok ") == 3

    errors = anyio.run(forge_as_b, cluster, secret)
    assert any(
        "permissions violation for publish" in e.lower() and "sage.audit.a.entry" in e
        for e in errors
    ), errors
    code, data, result = verify(daemons["c"])
    assert code == 2, result.stdout + result.stderr
    nodes = by_node(data)
    assert (nodes["a"]["ok"], nodes["c"]["ok"]) == (True, True), result.stdout
    assert nodes["a"]["stream"]["entries"] == nodes["a"]["stream"]["head_seq"]
    failure = nodes["b"]["failure"]
    assert (failure["kind"], failure["where"]) == ("malformed", "stream"), failure

    conn = writable(audit_db(daemons["b"]))
    conn.execute("UPDATE entries SET payload = CAST('{\"i\":42}' AS BLOB) WHERE seq = 2")
    conn.close()
    conn = writable(audit_db(daemons["c"]))
    rows = conn.execute("SELECT * FROM entries WHERE seq >= 3 ORDER BY seq").fetchall()
    prev = conn.execute("SELECT hash FROM entries WHERE seq = 2").fetchone()[0]
    for seq, ts, kind, principal, session, payload, _prev, _hash in rows:
        if seq == 3:
            payload = b'{"rewritten":true}'
        digest = entry_hash(seq, ts, kind, principal, session, payload, prev)
        conn.execute(
            "UPDATE entries SET payload = ?, prev_hash = ?, hash = ? WHERE seq = ?",
            (payload, prev, digest, seq),
        )
        prev = digest
    conn.close()

    code, data, result = verify(daemons["a"])
    assert code == 2, result.stdout + result.stderr
    nodes = by_node(data)
    assert not data["intact"]
    assert (nodes["a"]["ok"], nodes["a"]["failure"]) == (True, None)
    b = nodes["b"]["failure"]
    assert (b["seq"], b["kind"], b["where"]) == (2, "tampered", "local"), b
    c = nodes["c"]["failure"]
    assert (c["seq"], c["kind"], c["where"]) == (3, "diverged", "local"), c
    assert nodes["b"]["stream"]["entries"] >= 4  # the stream's entries are intact
    text = daemons["b"].astrid("audit", "verify", "--fleet", timeout=60.0)
    assert text.returncode == 2
    lines = text.stdout.splitlines()
    assert lines[0].startswith("fleet audit BROKEN: 3 nodes")
    assert any(line.split()[:2] == ["a", "ok"] for line in lines)
    assert any(line.split()[:5] == ["b", "BROKEN", "at", "seq", "2"] for line in lines), lines
    assert any(line.split()[:5] == ["c", "BROKEN", "at", "seq", "3"] for line in lines), lines


def test_a_nats_outage_then_catch_up_loses_no_entry(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Every NATS server down: a's audit goes on locally (entries written meanwhile),
    then the servers come back and a catches up from its SQLite from the last seq the
    stream holds: the stream ends where the local log ends, one copy of each."""
    cluster, daemons = fleet
    a = daemons["a"]
    wait_streamed(daemons)
    cluster.kill_all()
    emit(a, 8, "outage")
    assert local_head(a) >= 9
    for index in range(cluster.size):
        cluster.launch(index)
    cluster.wait_meta_leader()
    data = wait_streamed(daemons, timeout=30.0)
    node = by_node(data)["a"]
    assert node["ok"], node
    head = local_head(a)
    assert node["stream"]["head_seq"] >= head - 1  # at most the newest entry in flight
    assert node["stream"]["entries"] == node["stream"]["head_seq"]  # no gap, no duplicate
    assert '"fleet.audit_stream_failed"' in a.log()
    assert '"fleet.audit_caught_up"' in a.log()
    stream = a.status()["audit"]["stream"]
    assert stream["catch_ups"] >= 2
    assert stream["sent_seq"] >= head - 1
    assert stream["behind"] is False


def test_a_node_whose_streamed_history_is_gone_is_listed_missing(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """c stops (its record says so), then the stream is deleted (as a user with the
    rights: the node users have none, and no one may purge it).  a and b make it again
    and stream their logs anew; verify --fleet still lists c, broken ``missing``, and
    says the fleet's audit is not intact; a and b are ok."""
    cluster, daemons = fleet
    wait_streamed(daemons)
    assert daemons["c"].stop() == 0

    async def delete() -> None:
        async with cluster.client() as admin:
            js = admin.jetstream(timeout=JS_TIMEOUT)
            await js.delete_stream("sage_audit")

    anyio.run(delete)
    emit(daemons["a"], 1, "after")  # a notices the stream is gone and makes it again
    emit(daemons["b"], 1, "after")

    def streamed_again() -> tuple[int, dict[str, Any], Any] | None:
        code, data, result = verify(daemons["a"])
        nodes = by_node(data) if data.get("ok") else {}
        again = all(
            nodes.get(n, {}).get("local") is not None
            and nodes[n]["local"]["unstreamed"] == 0
            and nodes[n]["stream"]["head_seq"] == local_head(daemons[n])
            for n in ("a", "b")
        )
        return (code, data, result) if again else None

    found = wait_for(streamed_again, 30.0, "a and b streaming their whole logs again")
    code, data, result = found
    assert code == 2, result.stdout + result.stderr
    assert data["intact"] is False
    nodes = by_node(data)
    assert set(nodes) == {"a", "b", "c"}, sorted(nodes)
    assert nodes["a"]["ok"], nodes["a"]
    assert nodes["b"]["ok"], nodes["b"]
    gone = nodes["c"]
    assert (gone["live"], gone["ok"], gone["stream"]["entries"]) == (False, False, 0)
    assert gone["failure"]["kind"] == "missing"
    assert (
        "node 'c' is stopped and the stream holds none of its history"
        in (gone["failure"]["reason"])
    )
    text = daemons["a"].astrid("audit", "verify", "--fleet", timeout=60.0)
    assert text.returncode == 2
    assert "BROKEN  missing in the stream log: node 'c' is stopped" in text.stdout, text.stdout


def test_verify_fleet_without_a_fleet_says_so() -> None:
    """A single host: `astrid audit verify --fleet` exits 1 with not_in_fleet, and
    --pubkey with --fleet is refused."""
    daemon = Daemon(short_dir()).start()
    try:
        result = daemon.astrid("audit", "verify", "--fleet")
        assert result.returncode == 1
        assert result.stderr.startswith("astrid: not_in_fleet: "), result.stderr
        result = daemon.astrid("audit", "verify", "--fleet", "--pubkey", "/nonexistent")
        assert result.returncode == 1
        assert "--pubkey and --fleet" in result.stderr
    finally:
        daemon.stop()


@pytest.mark.anyio
async def test_a_full_queue_is_caught_up_from_sqlite_not_dropped(tmp_path: Path) -> None:
    """A batch larger than the publisher's queue overflows it: the overflow is counted
    and the publisher catches up from the SQLite log, so the stream ends up holding every
    entry once, with the checkpoints, and verifies."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from sage.audit import AuditLog
    from sage.config import AuditConfig, FleetConfig
    from sage.fleet import join
    from sage.fleet.audit_stream import AuditStreamer, read_book

    with NatsCluster(NODES) as cluster:
        config = FleetConfig(
            url=cluster.urls,
            node="a",
            password_file=str(cluster.password_file("a")),
            replicas=3,
        )
        key = Ed25519PrivateKey.generate()
        audit_config = AuditConfig(checkpoint_every=16, batch_max=8)
        path = tmp_path / "audit.db"
        async with (
            join(config, Path, started_at=time.time()) as member,
            AuditLog.open(path, key, audit_config) as audit,
            anyio.create_task_group() as tg,
        ):
            streamer = AuditStreamer(member, path, key.public_key(), queue_max=5)
            audit.on_commit = streamer.offer_rows
            audit.on_checkpoint = streamer.offer_checkpoint
            tg.start_soon(streamer.run)
            with anyio.fail_after(10):
                # the first catch-up over (not merely not begun: the task may not run yet)
                while streamer.catch_ups < 1 or streamer.behind:  # noqa: ASYNC110 - polled
                    await anyio.sleep(0.05)
            receipts = [audit.submit("sage.v1.audit.burst", "", "", {"i": i}) for i in range(150)]
            last = await receipts[-1].wait()
            assert last == 150
            with anyio.fail_after(20):
                while streamer.sent_seq < last or streamer.behind:  # noqa: ASYNC110 - polled
                    await anyio.sleep(0.05)
            assert streamer.overflows >= 1
            assert streamer.catch_ups >= 2
            book = await read_book(member.jetstream)
            tg.cancel_scope.cancel()
        verdict = book.verdict("a")
        assert verdict.failure is None
        assert (verdict.entries, verdict.head_seq) == (150, 150)
        assert verdict.checkpoints >= 9  # one per 16 entries
