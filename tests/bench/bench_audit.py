"""Audit log throughput: AuditLog appends and verify_audit, each against a raw sqlite3 loop.

(a) Appends/s through :class:`sage.audit.AuditLog` (aiosqlite, WAL,
synchronous=FULL, group commit) with 64 concurrent appenders, against a
plain ``sqlite3`` loop that does the same work: the same payload encoding
and redaction, the same chain hashing, the same batch size (our measured
mean batch), the same checkpoints, one commit per batch; best of five
alternating rounds each.  (b) Entries/s of
:func:`sage.audit.verify_audit` against a plain loop that reads the same
rows and recomputes the same hashes and signatures.  Set ``SAGE_BENCH_DIR``
to put the files on another disk (fsync cost is what (a) measures).
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import tempfile
import time
from pathlib import Path

import anyio
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from sage.audit import (
    GENESIS_HASH,
    AuditLog,
    ChainBuilder,
    checkpoint_message,
    encode_entry,
    encode_payload,
    verify_audit,
)
from sage.audit.store import _SCHEMA
from sage.config import AuditConfig
from tests.bench.report import Report

APPENDERS = 64
TOTAL = 20_000
VERIFY_ENTRIES = 200_000
ROUNDS = 5
CONFIG = AuditConfig()  # checkpoint_every=1000, batch_max=1024


def _payload(worker: int, j: int) -> dict[str, object]:
    return {"tool": "Bash", "worker": worker, "n": j, "input": {"command": "ls -la /tmp"}}


async def _ours(path: Path, key: Ed25519PrivateKey) -> tuple[float, float]:
    """Appends/s and the mean batch size."""
    per = TOTAL // APPENDERS

    async def appender(log: AuditLog, worker: int) -> None:
        for j in range(per):
            await log.append("sage.v1.audit.tool_call", "alice", f"s{worker}", _payload(worker, j))

    async with AuditLog.open(path, key, CONFIG) as log:
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for w in range(APPENDERS):
                tg.start_soon(appender, log, w)
        elapsed = time.perf_counter() - start
        batches = int(log.stats()["batches"])
    return per * APPENDERS / elapsed, per * APPENDERS / max(batches, 1)


def _connect_raw(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.executescript(_SCHEMA)
    return conn


def _raw_appends(path: Path, key: Ed25519PrivateKey, total: int, batch: int) -> float:
    """The same chained, batched, checkpointed inserts in a plain loop; entries/s."""
    conn = _connect_raw(path)
    builder = ChainBuilder()
    every = CONFIG.checkpoint_every
    unsigned = 0
    start = time.perf_counter()
    done = 0
    while done < total:
        n = min(batch, total - done)
        rows = []
        for i in range(done, done + n):
            w, j = i % APPENDERS, i // APPENDERS
            data = encode_payload(_payload(w, j))
            rows.append(
                builder.link(
                    time.time_ns(), "sage.v1.audit.tool_call", "alice", f"s{w}", data
                ).as_row()
            )
        conn.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        unsigned += n
        if unsigned >= every:
            size, head = builder.head_seq, builder.head_hash
            sig = key.sign(checkpoint_message(size, head))
            conn.execute(
                "INSERT INTO checkpoints VALUES (?, ?, ?, ?)", (size, head, sig, time.time_ns())
            )
            unsigned = 0
        conn.commit()
        done += n
    elapsed = time.perf_counter() - start
    conn.close()
    return total / elapsed


def _raw_verify(path: Path, public_key: Ed25519PublicKey) -> int:
    """A plain verification loop: recompute, compare, link, check signatures."""
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    conn.execute("BEGIN")
    checkpoints = {
        size: (head, sig)
        for size, head, sig in conn.execute("SELECT size, head_hash, signature FROM checkpoints")
    }
    prev = GENESIS_HASH
    expected = 1
    for seq, ts, kind, principal, session, payload, prev_hash, digest in conn.execute(
        "SELECT seq, ts, kind, principal, session, payload, prev_hash, hash"
        " FROM entries ORDER BY seq"
    ):
        if seq != expected:
            raise AssertionError("gap")
        recomputed = hashlib.sha256(
            encode_entry(seq, ts, kind, principal, session, payload, prev_hash)
        ).digest()
        if recomputed != digest or prev_hash != prev:
            raise AssertionError("broken")
        cp = checkpoints.get(seq)
        if cp is not None:
            if cp[0] != digest:
                raise AssertionError("bad checkpoint")
            public_key.verify(cp[1], checkpoint_message(seq, cp[0]))
        prev = digest
        expected += 1
    conn.execute("COMMIT")
    conn.close()
    return expected - 1


def _best_of(times: int, fn: object) -> float:
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def run(report: Report) -> None:
    key = Ed25519PrivateKey.generate()
    base = os.environ.get("SAGE_BENCH_DIR") or None
    with tempfile.TemporaryDirectory(prefix="sage-bench-audit-", dir=base) as tmp:
        root = Path(tmp)
        ours = raw = 0.0
        for i in range(ROUNDS):  # alternate, keep the best: fsync latency is noisy
            rate, batch = anyio.run(_ours, root / f"ours{i}.db", key)
            ours = max(ours, rate)
            raw = max(raw, _raw_appends(root / f"raw{i}.db", key, TOTAL, max(1, round(batch))))
        report.add(
            "audit",
            f"appends/s, {APPENDERS} appenders, FULL (batch ~{batch:.0f})",
            ours,
            "entries/s",
            reference=raw,
            reference_name="raw sqlite3 loop, same hashing and batch",
            goal=">= 0.5x",
        )

        big = root / "verify.db"
        _raw_appends(big, key, VERIFY_ENTRIES, CONFIG.batch_max)
        pub = key.public_key()
        report_ = verify_audit(big, pub)
        assert report_.ok, report_
        assert report_.entries_checked == VERIFY_ENTRIES
        assert _raw_verify(big, pub) == VERIFY_ENTRIES
        ours_t = _best_of(3, lambda: verify_audit(big, pub))
        raw_t = _best_of(3, lambda: _raw_verify(big, pub))
        report.add(
            "audit",
            f"verify_audit entries/s ({VERIFY_ENTRIES:,} entries)",
            VERIFY_ENTRIES / ours_t,
            "entries/s",
            reference=VERIFY_ENTRIES / raw_t,
            reference_name="raw sqlite3 verify loop",
            goal=">= 0.5x",
        )


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
