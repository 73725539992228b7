"""The audit log on a real SQLite file: durability, batching, append-only, tamper reports, CLI."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sage.audit import (
    AuditLog,
    ChainBuilder,
    FailureKind,
    LogState,
    checkpoint_message,
    entry_hash,
    load_public_key,
    load_signing_key,
    max_unsigned_for,
    parse_public_key,
    public_key_raw_b64,
    tail,
    verify_audit,
)
from sage.cli import audit as audit_cli
from sage.config import AuditConfig
from sage.errors import AuditError

ROOT = Path(__file__).resolve().parents[2]
CONFIG = AuditConfig(checkpoint_every=10, checkpoint_seconds=60.0, batch_max=64)


@pytest.fixture
def key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "audit.db"


async def fill(path: Path, key: Ed25519PrivateKey, n: int, config: AuditConfig = CONFIG) -> None:
    async with AuditLog.open(path, key, config) as log:
        for i in range(n):
            await log.append("sage.v1.audit.test", "alice", "s1", {"i": i})


def raw(path: Path) -> sqlite3.Connection:
    """A writable connection with the append-only triggers dropped (an attacker's view)."""
    conn = sqlite3.connect(path, isolation_level=None)
    for name in ("entries_no_update", "entries_no_delete", "checkpoints_no_update"):
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DROP TRIGGER checkpoints_no_delete")
    return conn


def rows(path: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        got = conn.execute("SELECT * FROM entries ORDER BY seq").fetchall()
    conn.close()
    return got


@pytest.mark.anyio
async def test_append_is_committed_when_acknowledged(db_path: Path, key: Ed25519PrivateKey) -> None:
    """An acknowledged seq is visible to a separate connection before the log closes."""
    async with AuditLog.open(db_path, key, CONFIG) as log:
        seq = await log.append("sage.v1.audit.x", "alice", "s1", {"n": 1, "token": "t0p"})
        assert seq == 1
        conn = sqlite3.connect(f"{db_path.as_uri()}?mode=ro", uri=True)
        row = conn.execute("SELECT seq, kind, principal, session, payload FROM entries").fetchone()
        conn.close()
    assert row == (1, "sage.v1.audit.x", "alice", "s1", b'{"n":1,"token":"<redacted>"}')
    assert stat.S_IMODE(os.stat(db_path).st_mode) == 0o600


@pytest.mark.anyio
async def test_concurrent_appenders_are_batched_in_order(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """Many concurrent appenders share group commits; seqs follow submission order."""
    acked: dict[tuple[int, int], int] = {}

    async def appender(log: AuditLog, worker: int) -> None:
        for j in range(20):
            acked[(worker, j)] = await log.append("k", f"w{worker}", "", {"w": worker, "j": j})

    async with AuditLog.open(db_path, key, CONFIG) as log:
        async with anyio.create_task_group() as tg:
            for w in range(32):
                tg.start_soon(appender, log, w)
        batches = log.stats()["batches"]
    assert sorted(acked.values()) == list(range(1, 641))
    assert isinstance(batches, int)
    assert batches < 640 / 4  # group commit, not one transaction per entry
    for w in range(32):
        seqs = [acked[(w, j)] for j in range(20)]
        assert seqs == sorted(seqs)
    stored = {r[0]: json.loads(r[5]) for r in rows(db_path)}  # type: ignore[arg-type]
    for (w, j), seq in acked.items():
        assert stored[seq] == {"w": w, "j": j}
    assert verify_audit(db_path, key.public_key()).ok


@pytest.mark.anyio
async def test_submit_preserves_order_and_can_be_awaited(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """submit() queues without waiting; its receipt yields the seq; order is kept."""
    async with AuditLog.open(db_path, key, CONFIG) as log:
        receipts = [log.submit("k", "p", "", {"i": i}) for i in range(100)]
        last = await receipts[-1].wait()
        assert all(r.done() for r in receipts)
    assert last == 100
    assert [await r.wait() for r in receipts] == list(range(1, 101))
    assert [json.loads(r[5])["i"] for r in rows(db_path)] == list(range(100))  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_submitted_entries_are_flushed_at_close(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """Entries submitted right before close are written, then a final checkpoint."""
    async with AuditLog.open(db_path, key, CONFIG) as log:
        for i in range(25):
            log.submit("k", "p", "", {"i": i})
    report = verify_audit(db_path, key.public_key())
    assert report.ok
    assert report.entries_checked == 25
    assert report.unsigned_tail == 0
    assert log.state is LogState.CLOSED


@pytest.mark.anyio
async def test_large_batches_commit_in_one_transaction(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """Batches beyond the multi-row INSERT size are written whole and in order."""
    config = AuditConfig(checkpoint_every=1000, checkpoint_seconds=60.0, batch_max=2000)
    async with AuditLog.open(db_path, key, config) as log:
        receipts = [log.submit("k", "p", "", {"i": i}) for i in range(1500)]
        assert await receipts[-1].wait() == 1500
        assert log.stats()["batches"] == 1
    assert [json.loads(r[5])["i"] for r in rows(db_path)] == list(range(1500))  # type: ignore[arg-type]
    assert verify_audit(db_path, key.public_key()).ok


@pytest.mark.anyio
async def test_checkpoints_every_n_and_on_time(db_path: Path, key: Ed25519PrivateKey) -> None:
    """Checkpoints follow checkpoint_every; an idle log signs after checkpoint_seconds."""
    config = AuditConfig(checkpoint_every=5, checkpoint_seconds=0.2, batch_max=64)
    async with AuditLog.open(db_path, key, config) as log:
        for i in range(10):
            await log.append("k", "p", "", {"i": i})
        assert log.checkpoints_written == 2
        await log.append("k", "p", "", {"i": 10})
        await anyio.sleep(0.6)  # three times checkpoint_seconds
        assert log.checkpoints_written == 3
        assert log.stats()["unsigned"] == 0
    with sqlite3.connect(db_path) as conn:
        sizes = [r[0] for r in conn.execute("SELECT size FROM checkpoints ORDER BY size")]
    conn.close()
    assert sizes == [5, 10, 11]


@pytest.mark.anyio
async def test_update_and_delete_are_refused(db_path: Path, key: Ed25519PrivateKey) -> None:
    """The triggers abort UPDATE and DELETE on entries and checkpoints."""
    await fill(db_path, key, 12)
    conn = sqlite3.connect(db_path)
    for sql in (
        "UPDATE entries SET payload = x'00' WHERE seq = 1",
        "DELETE FROM entries WHERE seq = 1",
        "UPDATE checkpoints SET signature = x'00'",
        "DELETE FROM checkpoints",
    ):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            conn.execute(sql)
    conn.close()


@pytest.mark.anyio
async def test_reopen_resumes_the_chain(db_path: Path, key: Ed25519PrivateKey) -> None:
    """A second open continues at the next seq, linked to the last hash."""
    await fill(db_path, key, 7)
    async with AuditLog.open(db_path, key, CONFIG) as log:
        assert log.head_seq == 7
        assert await log.append("k", "p", "", {}) == 8
    stored = rows(db_path)
    assert stored[7][6] == stored[6][7]
    assert verify_audit(db_path, key.public_key()).entries_checked == 8


@pytest.mark.anyio
async def test_open_refuses_a_tampered_head(db_path: Path, key: Ed25519PrivateKey) -> None:
    """Opening a log whose last row no longer matches its hash fails clearly."""
    await fill(db_path, key, 3)
    conn = raw(db_path)
    conn.execute("UPDATE entries SET payload = CAST('{}' AS BLOB) WHERE seq = 3")
    conn.close()
    with pytest.raises(AuditError, match=r"seq 3\) does not match"):
        async with AuditLog.open(db_path, key, CONFIG):
            pass


@pytest.mark.anyio
async def test_second_writer_is_refused(db_path: Path, key: Ed25519PrivateKey) -> None:
    """Only one process-wide writer may hold the log open."""
    async with AuditLog.open(db_path, key, CONFIG):
        with pytest.raises(AuditError, match="open in another process"):
            async with AuditLog.open(db_path, key, CONFIG):
                pass


@pytest.mark.anyio
async def test_append_after_close_and_bad_input_raise(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """Bad payloads and appends after close raise AuditError without harming the log."""
    async with AuditLog.open(db_path, key, CONFIG) as log:
        with pytest.raises(AuditError):
            await log.append("k", "p", "", object())
        with pytest.raises(AuditError):
            await log.append("k\udc80", "p", "", {})
        assert await log.append("k", "p", "", {}) == 1
    with pytest.raises(AuditError, match="closed"):
        await log.append("k", "p", "", {})


@pytest.mark.anyio
async def test_write_failure_fails_waiters_and_the_log(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """When a commit fails, its waiters get AuditError and the log refuses more work."""
    stack = contextlib.AsyncExitStack()
    log = await stack.enter_async_context(AuditLog.open(db_path, key, CONFIG))
    await log.append("k", "p", "", {})
    other = sqlite3.connect(db_path)  # occupy seq 2 behind the writer's back
    other.execute("INSERT INTO entries VALUES (2, 0, 'x', '', '', x'', zeroblob(32), zeroblob(32))")
    other.commit()
    other.close()
    with pytest.raises(AuditError, match="write failed"):
        await log.append("k", "p", "", {})
    assert log.state is LogState.FAILED
    with pytest.raises(AuditError, match="write failed"):
        log.submit("k", "p", "", {})
    with pytest.raises(AuditError, match="write failed"):
        await stack.aclose()


# --- tampering with the file -------------------------------------------------------------


@pytest.mark.anyio
async def test_edited_payload_is_reported_tampered(db_path: Path, key: Ed25519PrivateKey) -> None:
    """Editing a payload in the file is reported as tampered at that seq."""
    await fill(db_path, key, 30)
    conn = raw(db_path)
    conn.execute("UPDATE entries SET payload = CAST('{\"i\":-1}' AS BLOB) WHERE seq = 17")
    conn.close()
    report = verify_audit(db_path, key.public_key())
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.TAMPERED, 17)
    assert report.entries_checked == 16


@pytest.mark.anyio
async def test_deleted_row_is_reported_missing(db_path: Path, key: Ed25519PrivateKey) -> None:
    """Deleting a row is reported as missing at its seq."""
    await fill(db_path, key, 30)
    conn = raw(db_path)
    conn.execute("DELETE FROM entries WHERE seq = 12")
    conn.close()
    report = verify_audit(db_path, key.public_key())
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.MISSING, 12)


@pytest.mark.anyio
async def test_truncated_log_is_reported_missing(db_path: Path, key: Ed25519PrivateKey) -> None:
    """Cutting signed entries off the end is reported as missing."""
    await fill(db_path, key, 30)
    conn = raw(db_path)
    conn.execute("DELETE FROM entries WHERE seq > 25")
    conn.close()
    report = verify_audit(db_path, key.public_key())
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.MISSING, 26)


@pytest.mark.anyio
async def test_rewritten_chain_is_reported_bad_checkpoint(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """Rewriting every row with recomputed hashes is caught by the first checkpoint."""
    await fill(db_path, key, 30)
    original = rows(db_path)
    conn = raw(db_path)
    conn.execute("DELETE FROM entries")
    builder = ChainBuilder()
    for seq, ts, kind, principal, session, _payload, _prev, _hash in original:
        e = builder.link(ts, kind, principal, session, b'{"i":"rewritten"}')  # type: ignore[arg-type]
        assert e.seq == seq
        conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", e.as_row())
    conn.close()
    report = verify_audit(db_path, key.public_key())
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BAD_CHECKPOINT, 10)


@pytest.mark.anyio
async def test_rewrite_with_checkpoints_deleted_is_caught_by_policy(
    db_path: Path, key: Ed25519PrivateKey
) -> None:
    """Deleting every checkpoint and rewriting the chain leaves an unsigned tail the policy forbids."""
    config = AuditConfig(checkpoint_every=10, checkpoint_seconds=60.0, batch_max=5)
    await fill(db_path, key, 40, config)
    original = rows(db_path)
    conn = raw(db_path)
    conn.execute("DELETE FROM checkpoints")
    conn.execute("DELETE FROM entries")
    builder = ChainBuilder()
    for _seq, ts, kind, principal, session, _payload, _prev, _hash in original:
        e = builder.link(ts, kind, principal, session, b'{"i":"rewritten"}')  # type: ignore[arg-type]
        conn.execute("INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)", e.as_row())
    conn.close()
    assert verify_audit(db_path, key.public_key()).ok  # the bare chain alone cannot tell
    limit = max_unsigned_for(config)
    report = verify_audit(db_path, key.public_key(), max_unsigned=limit)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BAD_CHECKPOINT, limit + 1)
    assert "checkpoints are missing" in report.failure.reason


@pytest.mark.anyio
async def test_unsigned_tail_within_policy_verifies(db_path: Path, key: Ed25519PrivateKey) -> None:
    """The tail a crash can leave (up to checkpoint_every + batch_max) still verifies."""
    config = AuditConfig(checkpoint_every=10, checkpoint_seconds=60.0, batch_max=5)
    await fill(db_path, key, 12, config)
    conn = raw(db_path)
    conn.execute("DELETE FROM checkpoints WHERE size > 10")
    conn.close()
    report = verify_audit(db_path, key.public_key(), max_unsigned=max_unsigned_for(config))
    assert report.ok, report.failure


@pytest.mark.anyio
async def test_forged_checkpoints_are_reported(db_path: Path, key: Ed25519PrivateKey) -> None:
    """A rewrite with checkpoints re-signed by another key, or an altered signature, is bad."""
    await fill(db_path, key, 30)
    conn = raw(db_path)
    conn.execute("UPDATE checkpoints SET signature = zeroblob(64) WHERE size = 20")
    conn.close()
    report = verify_audit(db_path, key.public_key())
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BAD_CHECKPOINT, 20)

    forger = Ed25519PrivateKey.generate()
    conn = sqlite3.connect(db_path, isolation_level=None)
    conn.execute("DELETE FROM checkpoints")
    for (size,) in [(10,), (20,), (30,)]:
        (head,) = conn.execute("SELECT hash FROM entries WHERE seq = ?", (size,)).fetchone()
        sig = forger.sign(checkpoint_message(size, head))
        conn.execute("INSERT INTO checkpoints VALUES (?, ?, ?, 0)", (size, head, sig))
    conn.close()
    report = verify_audit(db_path, key.public_key())
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BAD_CHECKPOINT, 10)
    assert verify_audit(db_path, forger.public_key()).ok


def test_verify_of_a_missing_file_is_one_clear_error(tmp_path: Path) -> None:
    """verify_audit on a path without a log raises AuditError naming the path."""
    with pytest.raises(AuditError, match="no audit log there"):
        verify_audit(tmp_path / "nope.db", Ed25519PrivateKey.generate().public_key())


@pytest.mark.anyio
async def test_tail_reads_and_follows(db_path: Path, key: Ed25519PrivateKey) -> None:
    """tail yields stored entries after a seq and, when following, new ones as they land."""
    await fill(db_path, key, 5)
    seen = [e.seq async for e in tail(db_path, 2)]
    assert seen == [3, 4, 5]
    followed: list[int] = []
    async with AuditLog.open(db_path, key, CONFIG) as log:

        async def follower() -> None:
            async for entry in tail(db_path, 4, follow=True, poll_interval=0.02):
                followed.append(entry.seq)
                if entry.seq == 8:
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(follower)
            for i in range(3):
                await log.append("k", "p", "", {"i": i})
                await anyio.sleep(0.03)
    assert followed == [5, 6, 7, 8]


# --- keys --------------------------------------------------------------------------------


def test_key_is_created_private_and_reloaded(tmp_path: Path) -> None:
    """The first load creates a 0600 key in a 0700 folder; later loads return the same key."""
    keys = tmp_path / "keys"
    first = load_signing_key(keys)
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    assert stat.S_IMODE((keys / "audit_ed25519.pem").stat().st_mode) == 0o600
    again = load_signing_key(keys)
    assert public_key_raw_b64(again.public_key()) == public_key_raw_b64(first.public_key())
    assert public_key_raw_b64(load_public_key(keys)) == public_key_raw_b64(first.public_key())
    assert [p.name for p in keys.iterdir() if p.name.endswith(".tmp")] == []


def test_readable_key_is_refused(tmp_path: Path) -> None:
    """A key file group or other can read is refused with the chmod fix in the message."""
    keys = tmp_path / "keys"
    load_signing_key(keys)
    os.chmod(keys / "audit_ed25519.pem", 0o640)
    with pytest.raises(AuditError, match="chmod 600"):
        load_signing_key(keys)


def test_missing_key_without_create_is_an_error(tmp_path: Path) -> None:
    """Loading without create does not make a key."""
    with pytest.raises(AuditError, match="no audit key"):
        load_signing_key(tmp_path / "keys", create=False)
    assert not (tmp_path / "keys").exists()


def test_public_key_parses_from_pem_and_base64(tmp_path: Path) -> None:
    """The exported forms parse back to the same key; junk is one clear error."""
    from sage.audit import public_key_pem

    pub = load_signing_key(tmp_path / "k").public_key()
    raw64 = public_key_raw_b64(pub)
    assert public_key_raw_b64(parse_public_key(public_key_pem(pub))) == raw64
    assert public_key_raw_b64(parse_public_key(raw64 + "\n")) == raw64
    with pytest.raises(AuditError):
        parse_public_key("not a key")


# --- crash -------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import anyio
    import structlog
    from sage.audit import AuditLog, load_signing_key
    from sage.config import AuditConfig

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    async def main() -> None:
        key = load_signing_key(Path(sys.argv[2]))
        config = AuditConfig(checkpoint_every=50, checkpoint_seconds=0.5, batch_max=64)
        async with AuditLog.open(sys.argv[1], key, config) as log:

            async def worker(w: int) -> None:
                while True:
                    seq = await log.append("crash.test", "p", str(w), {"w": w, "pad": "x" * 200})
                    sys.stdout.write(f"{seq}\\n")
                    sys.stdout.flush()

            async with anyio.create_task_group() as tg:
                for w in range(8):
                    tg.start_soon(worker, w)

    anyio.run(main)
    """
)


def test_sigkill_loses_no_acknowledged_entry(tmp_path: Path) -> None:
    """After SIGKILL mid-stream, every seq the writer acknowledged is stored and verifies."""
    db = tmp_path / "audit.db"
    keys = tmp_path / "keys"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(db), str(keys)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
    )
    acked: list[int] = []
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            acked.append(int(line))
            if len(acked) >= 3000:
                break
        proc.send_signal(signal.SIGKILL)
        # lines already written to the pipe were acknowledged too
        acked.extend(int(line) for line in proc.stdout.read().split())
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) >= 3000
    with sqlite3.connect(f"{db.as_uri()}?mode=ro", uri=True) as conn:
        stored = {r[0] for r in conn.execute("SELECT seq FROM entries")}
    conn.close()
    assert set(acked) <= stored
    report = verify_audit(db, load_public_key(keys))
    assert report.ok, report.failure
    assert report.entries_checked == len(stored) >= 3000
    assert report.checkpoints_checked >= 1


# --- CLI ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="astrid")
    sub = parser.add_subparsers(dest="command", required=True)
    audit_cli.register(sub)
    return parser


def _config_file(tmp_path: Path) -> Path:
    cfg = tmp_path / "supervisor.toml"
    cfg.write_text('[supervisor]\nstate_dir = "st"\n')
    return cfg


def _run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if audit_cli.cmd_tail is args.handler:
        return int(anyio.run(args.handler, args))
    return int(args.handler(args))


async def _populate(tmp_path: Path, n: int) -> tuple[Path, Ed25519PrivateKey]:
    state = tmp_path / "st"
    key = load_signing_key(state / "keys")
    await fill(state / "audit.db", key, n)
    return state / "audit.db", key


def test_cli_verify_reports_intact_and_broken(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit verify` exits 0 with counts when intact and 2 with seq, kind and why when not."""
    cfg = _config_file(tmp_path)
    db, _key = anyio.run(_populate, tmp_path, 25)
    capsys.readouterr()
    assert _run(["audit", "verify", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "intact: 25 entries and 3 checkpoints checked" in out

    conn = raw(db)
    conn.execute("UPDATE entries SET principal = 'mallory' WHERE seq = 4")
    conn.close()
    assert _run(["audit", "verify", "--config", str(cfg)]) == 2
    out = capsys.readouterr().out
    assert "BROKEN at seq 4 (sage.v1.audit.test): tampered" in out
    assert _run(["audit", "verify", "--config", str(cfg), "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert doc["failure"]["kind"] == "tampered"
    assert doc["failure"]["seq"] == 4


def test_cli_verify_with_external_pubkey(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`audit verify --pubkey` checks against a saved key, catching a re-signed log."""
    cfg = _config_file(tmp_path)
    anyio.run(_populate, tmp_path, 12)
    capsys.readouterr()
    assert _run(["audit", "pubkey", "--config", str(cfg), "--raw"]) == 0
    saved = tmp_path / "saved.pub"
    saved.write_text(capsys.readouterr().out)
    assert _run(["audit", "verify", "--config", str(cfg), "--pubkey", str(saved)]) == 0
    other = tmp_path / "other.pub"
    other.write_text(public_key_raw_b64(Ed25519PrivateKey.generate().public_key()))
    assert _run(["audit", "verify", "--config", str(cfg), "--pubkey", str(other)]) == 2
    assert "bad_checkpoint" in capsys.readouterr().out


def test_cli_tail_prints_lines_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`audit tail -n N` prints the last N entries; --json prints one object per line."""
    cfg = _config_file(tmp_path)
    anyio.run(_populate, tmp_path, 8)
    capsys.readouterr()
    assert _run(["audit", "tail", "--config", str(cfg), "-n", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[0]) for line in lines] == [6, 7, 8]
    assert '{"i":7}' in lines[-1]
    assert _run(["audit", "tail", "--config", str(cfg), "-n", "2", "--json"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["seq"] for d in docs] == [7, 8]
    assert docs[-1]["payload"] == {"i": 7}
    assert docs[-1]["kind"] == "sage.v1.audit.test"
    assert len(docs[-1]["hash"]) == 64


def test_cli_pubkey_prints_pem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`audit pubkey` prints the PEM public key of the signing key."""
    cfg = _config_file(tmp_path)
    key = load_signing_key(tmp_path / "st" / "keys")
    assert _run(["audit", "pubkey", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("-----BEGIN PUBLIC KEY-----")
    assert public_key_raw_b64(parse_public_key(out)) == public_key_raw_b64(key.public_key())


def test_cli_missing_log_is_one_line(tmp_path: Path) -> None:
    """Through `astrid`, a missing audit log is one line on stderr and exit 1."""
    cfg = _config_file(tmp_path)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from sage.cli import main; raise SystemExit(main())",
            "audit",
            "verify",
            "--config",
            str(cfg),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=30,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("astrid: ")
    assert "no audit log there" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_hash_helpers_agree_with_stored_rows(tmp_path: Path) -> None:
    """Stored rows hash exactly as the chain module computes (no hidden re-encoding)."""
    db = tmp_path / "audit.db"
    anyio.run(fill, db, Ed25519PrivateKey.generate(), 3)
    for seq, ts, kind, principal, session, payload, prev, digest in rows(db):
        assert entry_hash(seq, ts, kind, principal, session, payload, prev) == digest  # type: ignore[arg-type]
