"""The audit log on disk: an append-only SQLite file, one group-committing writer.

This module owns the SQLite shell around :mod:`sage.audit.chain`.  The file
is in WAL mode with ``synchronous=FULL``; tables ``entries`` and
``checkpoints`` are STRICT and append-only (triggers ``RAISE(ABORT)`` on
UPDATE and DELETE), and an exclusive ``flock`` on ``<file>.lock`` keeps a
second writer out.  :class:`AuditLog` runs one writer task in a task group
it owns: it drains up to ``batch_max`` pending entries in submission order,
links their hashes, writes them in one transaction (one multi-row INSERT
in autocommit mode, or BEGIN/executemany/COMMIT for batches over 512), and
only once it has committed resolves every waiter, so an acknowledged seq is
durable.  A signed checkpoint follows the batch that reaches
``checkpoint_every`` unsigned entries, is written alone after
``checkpoint_seconds`` with unsigned entries, and once more at a clean
close.  On open the head is resumed from the last row, whose hash is
recomputed.  Payloads are redacted before hashing (see
:func:`sage.audit.chain.encode_payload`).  Reading is separate and needs no
key: :func:`verify_audit` streams a read-only connection through
:func:`sage.audit.chain.verify_chain`, and :func:`tail` polls for new rows.
Every sqlite3 or OS error leaves this module as an :class:`AuditError`.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import functools
import math
import os
import sqlite3
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Final

import aiosqlite
import anyio
import structlog
from anyio.abc import TaskStatus
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from sage.audit.chain import (
    ChainBuilder,
    Checkpoint,
    CheckpointRow,
    Entry,
    EntryRow,
    VerifyReport,
    checkpoint_message,
    encode_payload,
    entry_hash,
    verify_chain,
)
from sage.config import AuditConfig
from sage.errors import AuditError, IllegalTransition

__all__ = (
    "AuditLog",
    "AuditReceipt",
    "LogState",
    "last_seq",
    "read_checkpoints",
    "read_entries",
    "tail",
    "verify_audit",
)

log = structlog.get_logger("sage.audit")

SCHEMA_VERSION: Final = 1
_CLOSE_DEADLINE: Final = 10.0
_TAIL_CHUNK: Final = 1000

_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY,
    ts INTEGER NOT NULL,
    kind TEXT NOT NULL,
    principal TEXT NOT NULL,
    session TEXT NOT NULL,
    payload BLOB NOT NULL,
    prev_hash BLOB NOT NULL,
    hash BLOB NOT NULL
) STRICT;
CREATE TRIGGER IF NOT EXISTS entries_no_update BEFORE UPDATE ON entries
BEGIN SELECT RAISE(ABORT, 'audit entries are append-only'); END;
CREATE TRIGGER IF NOT EXISTS entries_no_delete BEFORE DELETE ON entries
BEGIN SELECT RAISE(ABORT, 'audit entries are append-only'); END;
CREATE TABLE IF NOT EXISTS checkpoints (
    size INTEGER PRIMARY KEY,
    head_hash BLOB NOT NULL,
    signature BLOB NOT NULL,
    ts INTEGER NOT NULL
) STRICT;
CREATE TRIGGER IF NOT EXISTS checkpoints_no_update BEFORE UPDATE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END;
CREATE TRIGGER IF NOT EXISTS checkpoints_no_delete BEFORE DELETE ON checkpoints
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END;
"""
_ENTRY_COLUMNS: Final = "seq, ts, kind, principal, session, payload, prev_hash, hash"
_CHECKPOINT_COLUMNS: Final = "size, head_hash, signature, ts"
_INSERT_ENTRY: Final = f"INSERT INTO entries ({_ENTRY_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
_MULTI_ROW_MAX: Final = 512
"""Batches up to this size are one multi-row INSERT: one statement, one thread hop."""
_INSERT_CHECKPOINT: Final = (
    "INSERT INTO checkpoints (size, head_hash, signature, ts) VALUES (?, ?, ?, ?)"
)


@functools.cache
def _insert_rows_sql(count: int) -> str:
    values = ", ".join(["(?, ?, ?, ?, ?, ?, ?, ?)"] * count)
    return f"INSERT INTO entries ({_ENTRY_COLUMNS}) VALUES {values}"


class LogState(enum.Enum):
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"
    FAILED = "failed"


_TRANSITIONS: Final = {
    LogState.OPEN: frozenset({LogState.CLOSING, LogState.FAILED}),
    LogState.CLOSING: frozenset({LogState.CLOSED, LogState.FAILED}),
    LogState.FAILED: frozenset({LogState.CLOSED}),
    LogState.CLOSED: frozenset(),
}


class AuditReceipt:
    """The promise of one submitted entry: ``await receipt.wait()`` gives its durable seq."""

    __slots__ = ("_error", "_log", "_seq")

    def __init__(self, log: AuditLog) -> None:
        self._seq = 0
        self._error: AuditError | None = None
        self._log = log

    def done(self) -> bool:
        return self._seq > 0 or self._error is not None

    async def wait(self) -> int:
        """The entry's seq once its transaction committed; AuditError when it never will."""
        while not self.done():
            await self._log._committed.wait()
        if self._error is not None:
            raise self._error
        return self._seq


_Pending = tuple[int, str, str, str, bytes, AuditReceipt]


class AuditLog:
    """The append side of the audit log; make one with ``async with AuditLog.open(...)``."""

    def __init__(
        self,
        path: Path,
        db: aiosqlite.Connection,
        lock_fd: int,
        signing_key: Ed25519PrivateKey,
        config: AuditConfig,
        builder: ChainBuilder,
        unsigned: int,
    ) -> None:
        self._path = path
        self._db = db
        self._lock_fd = lock_fd
        self._key = signing_key
        self._config = config
        self._builder = builder
        self._unsigned = unsigned
        self._first_unsigned_at: float | None = anyio.current_time() if unsigned else None
        self._pending: deque[_Pending] = deque()
        self._wake = anyio.Event()
        self._committed = anyio.Event()
        """Set (and replaced) after every batch: one wake-up per batch, not per waiter."""
        self._writer_done = anyio.Event()
        self._state = LogState.OPEN
        self._failure: AuditError | None = None
        self._checkpoints_written = 0
        self._batches = 0
        self.on_commit: Callable[[list[EntryRow]], None] | None = None
        """Told each committed batch's rows, in order (the fleet's audit stream); it must
        not block, and what it raises is logged, never the writer's failure."""
        self.on_checkpoint: Callable[[Checkpoint], None] | None = None
        """Told each checkpoint once it is written (after the rows it covers)."""

    # --- lifecycle -----------------------------------------------------------------------

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls,
        path: str | os.PathLike[str],
        signing_key: Ed25519PrivateKey,
        config: AuditConfig,
    ) -> AsyncIterator[AuditLog]:
        """Open (creating if needed) the log at ``path`` and run its writer until exit."""
        audit = await cls._connect(Path(path), signing_key, config)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(audit._run_writer)
                try:
                    yield audit
                finally:
                    with anyio.move_on_after(_CLOSE_DEADLINE, shield=True):
                        await audit._close()
                    tg.cancel_scope.cancel()
        finally:
            with anyio.move_on_after(_CLOSE_DEADLINE, shield=True):
                await audit._release()
        if audit._failure is not None:
            raise audit._failure

    @classmethod
    async def _connect(
        cls, path: Path, signing_key: Ed25519PrivateKey, config: AuditConfig
    ) -> AuditLog:
        lock_fd = _lock(path)
        db: aiosqlite.Connection | None = None
        try:
            db = await aiosqlite.connect(path, isolation_level=None)  # explicit transactions
            mode = await db.execute_fetchall("PRAGMA journal_mode=WAL")
            if [tuple(r) for r in mode] != [("wal",)]:
                raise AuditError(f"{path}: cannot switch the audit log to WAL mode")
            await db.execute("PRAGMA synchronous=FULL")
            await db.execute("PRAGMA busy_timeout=5000")
            version = next(iter(await db.execute_fetchall("PRAGMA user_version")))[0]
            if version > SCHEMA_VERSION:
                raise AuditError(f"{path}: audit schema version {version} is newer than ours")
            await db.executescript(_SCHEMA)
            await db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            builder, unsigned = await _resume(path, db)
        except BaseException as exc:
            if db is not None:
                with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await db.close()
            _unlock(lock_fd)
            if isinstance(exc, (sqlite3.Error, OSError, ValueError)):
                raise AuditError(f"{path}: cannot open the audit log: {exc}") from exc
            raise
        log.info("audit.opened", path=str(path), head=builder.head_seq, unsigned=unsigned)
        return cls(path, db, lock_fd, signing_key, config, builder, unsigned)

    def _transition(self, new: LogState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise IllegalTransition("audit log", self._state.value, new.value)
        self._state = new

    @property
    def state(self) -> LogState:
        return self._state

    @property
    def head_seq(self) -> int:
        """The seq of the last entry linked (committed, or in the batch being committed)."""
        return self._builder.head_seq

    @property
    def checkpoints_written(self) -> int:
        return self._checkpoints_written

    def stats(self) -> dict[str, int | str]:
        """Counters for ``astrid status``."""
        return {
            "state": self._state.value,
            "head_seq": self._builder.head_seq,
            "pending": len(self._pending),
            "unsigned": self._unsigned,
            "batches": self._batches,
            "checkpoints": self._checkpoints_written,
        }

    async def _close(self) -> None:
        if self._state is LogState.OPEN:
            self._transition(LogState.CLOSING)
        self._wake.set()
        await self._writer_done.wait()
        # The writer leaves once the queue is empty, or early when it was cancelled.
        while self._pending and self._state is LogState.CLOSING:
            await self._flush()
        if self._state is LogState.CLOSING and self._unsigned:
            await self._write_checkpoint()
        if self._state is LogState.CLOSING:
            self._transition(LogState.CLOSED)

    async def _release(self) -> None:
        error = self._failure or AuditError("audit log closed before the entry was written")
        while self._pending:
            self._pending.popleft()[5]._error = error
        self._notify()
        if self._state is LogState.OPEN:
            self._transition(LogState.CLOSING)
        if self._state is not LogState.CLOSED:
            self._transition(LogState.CLOSED)
        try:
            await self._db.close()
        except (sqlite3.Error, ValueError) as exc:
            log.warning("audit.close_failed", path=str(self._path), error=str(exc))
        finally:
            _unlock(self._lock_fd)
        log.info("audit.closed", path=str(self._path), head=self._builder.head_seq)

    # --- appending -----------------------------------------------------------------------

    def submit(self, kind: str, principal: str, session: str, payload: object) -> AuditReceipt:
        """Queue an entry without waiting; entries are written in submission order."""
        if self._state is not LogState.OPEN:
            raise self._failure or AuditError(f"audit log is {self._state.value}")
        if not (isinstance(kind, str) and isinstance(principal, str) and isinstance(session, str)):
            raise AuditError("audit kind, principal and session must be strings")
        if not (kind.isascii() and principal.isascii() and session.isascii()):
            try:  # a lone surrogate would fail the whole batch in the writer
                kind.encode()
                principal.encode()
                session.encode()
            except UnicodeEncodeError as exc:
                raise AuditError(f"audit kind, principal or session is not text: {exc}") from exc
        data = encode_payload(payload)
        receipt = AuditReceipt(self)
        self._pending.append((time.time_ns(), kind, principal, session, data, receipt))
        self._wake.set()
        return receipt

    async def append(self, kind: str, principal: str, session: str, payload: object) -> int:
        """Write an entry and return its seq once its transaction has committed."""
        return await self.submit(kind, principal, session, payload).wait()

    # --- the writer ----------------------------------------------------------------------

    async def _run_writer(
        self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        try:
            while self._state in (LogState.OPEN, LogState.CLOSING):
                if self._pending:
                    with anyio.CancelScope(shield=True):
                        await self._flush()
                elif self._state is LogState.CLOSING:
                    return
                elif await self._wait_for_work():
                    with anyio.CancelScope(shield=True):
                        await self._write_checkpoint()
        finally:
            self._writer_done.set()

    async def _wait_for_work(self) -> bool:
        """Sleep until woken; True when a time-based checkpoint is due instead."""
        timeout = math.inf
        if self._unsigned and self._first_unsigned_at is not None:
            due = self._first_unsigned_at + self._config.checkpoint_seconds
            timeout = max(0.0, due - anyio.current_time())
        self._wake = anyio.Event()
        with anyio.move_on_after(timeout) as scope:
            await self._wake.wait()
        return scope.cancelled_caught and not self._pending and self._unsigned > 0

    def _checkpoint_due(self, unsigned: int) -> bool:
        if unsigned >= self._config.checkpoint_every:
            return True
        started = self._first_unsigned_at
        return started is not None and (
            anyio.current_time() - started >= self._config.checkpoint_seconds
        )

    def _sign(self) -> Checkpoint:
        size, head = self._builder.head_seq, self._builder.head_hash
        signature = self._key.sign(checkpoint_message(size, head))
        return Checkpoint(size=size, head_hash=head, signature=signature, ts=time.time_ns())

    async def _flush(self) -> None:
        """Write one batch: link, insert, commit, then acknowledge."""
        count = min(len(self._pending), self._config.batch_max)
        items = [self._pending.popleft() for _ in range(count)]
        start_seq, start_hash = self._builder.head_seq, self._builder.head_hash
        link = self._builder.link
        rows = [link(ts, kind, pr, se, data).as_row() for ts, kind, pr, se, data, _ in items]
        try:
            if count <= _MULTI_ROW_MAX:
                # autocommit: the statement is its own transaction, durable on return
                await self._db.execute(_insert_rows_sql(count), [v for r in rows for v in r])
            else:
                await self._db.execute("BEGIN IMMEDIATE")
                await self._db.executemany(_INSERT_ENTRY, rows)
                await self._db.execute("COMMIT")
        except (sqlite3.Error, ValueError, OSError) as exc:
            self._builder.reset(start_seq, start_hash)
            error = AuditError(f"{self._path}: audit write failed: {exc}")
            for item in items:
                item[5]._error = error
            await self._fail(error)
            return
        self._batches += 1
        if self._unsigned == 0:
            self._first_unsigned_at = anyio.current_time()
        self._unsigned += count
        for row, item in zip(rows, items, strict=True):
            item[5]._seq = row[0]  # committed: durable even if the checkpoint below fails
        self._tell(self.on_commit, rows)
        if self._checkpoint_due(self._unsigned):
            await self._write_checkpoint()
        self._notify()

    async def _write_checkpoint(self) -> None:
        checkpoint = self._sign()
        try:
            await self._db.execute(_INSERT_CHECKPOINT, checkpoint.as_row())
        except (sqlite3.Error, ValueError, OSError) as exc:
            await self._fail(AuditError(f"{self._path}: audit checkpoint failed: {exc}"))
            return
        self._checkpoint_written()
        self._tell(self.on_checkpoint, checkpoint)

    def _tell(self, listener: Callable[[Any], None] | None, what: object) -> None:
        if listener is None:
            return
        try:
            listener(what)
        except Exception as exc:  # a listener never fails the log
            log.error("audit.listener_failed", path=str(self._path), error=str(exc))

    def _checkpoint_written(self) -> None:
        self._unsigned = 0
        self._first_unsigned_at = None
        self._checkpoints_written += 1

    def _notify(self) -> None:
        committed, self._committed = self._committed, anyio.Event()
        committed.set()

    async def _fail(self, error: AuditError) -> None:
        log.error("audit.failed", path=str(self._path), error=str(error))
        self._failure = error
        if self._state is not LogState.FAILED:
            self._transition(LogState.FAILED)
        while self._pending:
            self._pending.popleft()[5]._error = error
        self._notify()
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error, ValueError):
                await self._db.execute("ROLLBACK")


# --- opening helpers ---------------------------------------------------------------------


def _lock(path: Path) -> int:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(
            path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
    except OSError as exc:
        raise AuditError(f"{path}: cannot create the audit log: {exc.strerror}") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError as exc:
        os.close(fd)
        raise AuditError(f"{path}: the audit log is open in another process") from exc
    try:  # SQLite gives the -wal and -shm files the mode of the main file
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    except OSError as exc:
        os.close(fd)
        raise AuditError(f"{path}: cannot create the audit log: {exc.strerror}") from exc
    return fd


def _unlock(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # closing the descriptor releases the flock


async def _resume(path: Path, db: aiosqlite.Connection) -> tuple[ChainBuilder, int]:
    """The chain head from the last row (its hash rechecked) and the unsigned count."""
    rows = await db.execute_fetchall(
        f"SELECT {_ENTRY_COLUMNS} FROM entries ORDER BY seq DESC LIMIT 1"
    )
    last = list(rows)
    if not last:
        return ChainBuilder(), 0
    seq, ts, kind, principal, session, payload, prev_hash, digest = last[0]
    if entry_hash(seq, ts, kind, principal, session, payload, prev_hash) != digest:
        raise AuditError(
            f"{path}: the last audit entry (seq {seq}) does not match its hash;"
            " run `astrid audit verify`"
        )
    signed_rows = await db.execute_fetchall("SELECT coalesce(max(size), 0) FROM checkpoints")
    signed = next(iter(signed_rows))[0]
    if signed > seq:
        raise AuditError(
            f"{path}: a checkpoint covers {signed} entries but the log ends at {seq};"
            " run `astrid audit verify`"
        )
    return ChainBuilder(seq, bytes(digest)), seq - signed


# --- reading -----------------------------------------------------------------------------


def _connect_ro(path: str | os.PathLike[str]) -> sqlite3.Connection:
    file = Path(path)
    if not file.exists():
        raise AuditError(f"{file}: no audit log there (the supervisor creates it on first start)")
    try:
        conn = sqlite3.connect(f"{file.resolve().as_uri()}?mode=ro", uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise AuditError(f"{file}: cannot open the audit log: {exc}") from exc
    return conn


def verify_audit(
    path: str | os.PathLike[str],
    public_key: Ed25519PublicKey,
    *,
    max_unsigned: int | None = None,
) -> VerifyReport:
    """Verify the whole log at ``path`` read-only, in one consistent snapshot.

    ``max_unsigned``: see :func:`sage.audit.chain.verify_chain`; use
    :func:`max_unsigned_for` to derive it from the audit config.
    """
    conn = _connect_ro(path)
    try:
        conn.execute("BEGIN")
        checkpoints: list[CheckpointRow] = conn.execute(
            f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints ORDER BY size"
        ).fetchall()
        rows: Any = conn.execute(f"SELECT {_ENTRY_COLUMNS} FROM entries ORDER BY seq")
        report = verify_chain(rows, checkpoints, public_key, max_unsigned=max_unsigned)
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise AuditError(f"{path}: cannot read the audit log: {exc}") from exc
    finally:
        conn.close()
    return report


def max_unsigned_for(config: AuditConfig) -> int:
    """The longest unsigned tail the writer can leave: a checkpoint is due after
    ``checkpoint_every`` entries, and one group commit of ``batch_max`` may land
    before it (a crash right then leaves both unsigned)."""
    return config.checkpoint_every + config.batch_max


def _select(path: str | os.PathLike[str], sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
    """The rows of one read-only query of the log at ``path``."""
    conn = _connect_ro(path)
    try:
        return conn.execute(sql, params).fetchall()
    except sqlite3.Error as exc:
        raise AuditError(f"{path}: cannot read the audit log: {exc}") from exc
    finally:
        conn.close()


def last_seq(path: str | os.PathLike[str]) -> int:
    """The seq of the last entry in the log at ``path`` (0 when empty)."""
    value: int = _select(path, "SELECT coalesce(max(seq), 0) FROM entries")[0][0]
    return value


def read_entries(
    path: str | os.PathLike[str], after_seq: int, limit: int = _TAIL_CHUNK
) -> list[EntryRow]:
    """Up to ``limit`` entries after ``after_seq``, in seq order (read-only)."""
    return _select(
        path,
        f"SELECT {_ENTRY_COLUMNS} FROM entries WHERE seq > ? ORDER BY seq LIMIT ?",
        (after_seq, limit),
    )


def read_checkpoints(path: str | os.PathLike[str], after_size: int = 0) -> list[CheckpointRow]:
    """The checkpoints covering more than ``after_size`` entries, by size (read-only)."""
    return _select(
        path,
        f"SELECT {_CHECKPOINT_COLUMNS} FROM checkpoints WHERE size > ? ORDER BY size",
        (after_size,),
    )


async def tail(
    path: str | os.PathLike[str],
    after_seq: int = 0,
    follow: bool = False,
    *,
    poll_interval: float = 0.2,
) -> AsyncIterator[Entry]:
    """Yield the entries after ``after_seq``; with ``follow``, keep polling for new ones."""
    last = after_seq
    while True:
        rows = await anyio.to_thread.run_sync(read_entries, path, last)
        for row in rows:
            last = row[0]
            yield Entry.from_row(row)
        if len(rows) == _TAIL_CHUNK:
            continue
        if not follow:
            return
        await anyio.sleep(poll_interval)
