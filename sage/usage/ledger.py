"""The usage ledger: what every model call spent, in one SQLite file that outlives the supervisor.

``<state_dir>/usage.db`` (0600, WAL) holds one row per UTC day, principal, session,
node, model and source (``session``: a model call of a session's ``claude``;
``llm``: a generation of the completion provider) with the sums of what was recorded
against it: calls, input, output, cache read and cache write tokens, sage's estimate
(``est_usd``, sage/usage/pricing.py), the CLI's own ``total_cost_usd`` of the turns
(``cli_usd``) and the USD a budget counts (``usd``, docs/operations.md, "Budgets and
metrics").  Rows are added to, never rewritten: a :class:`Entry` is merged into its
row by an upsert.

:meth:`Ledger.add` is synchronous and cheap (the entry is merged into a pending one
of the same key); a writer task commits what is pending in one transaction whenever
there is some, so a burst of model calls costs one commit, and a turn never waits
for the disk.  :meth:`Ledger.close` commits the rest.  A supervisor killed with
SIGKILL loses what it had not committed yet: the entries of the last moments
(milliseconds, under load a little more).

The ``budgets`` table keeps the budgets an admin set at runtime (``astrid sage
settings NAME --budget-...``), which win over the config's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiosqlite
import anyio
import msgspec
import structlog

from sage.contract.usage import GROUPINGS, Grouping, ReportRow
from sage.errors import StateError
from sage.usage.budget import Period, Spend

__all__ = ("GROUPINGS", "Entry", "Grouping", "Ledger", "ReportRow")

log = structlog.get_logger("sage.usage")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    day TEXT NOT NULL,
    principal TEXT NOT NULL,
    session TEXT NOT NULL,
    node TEXT NOT NULL,
    model TEXT NOT NULL,
    source TEXT NOT NULL,
    calls INTEGER NOT NULL,
    input INTEGER NOT NULL,
    output INTEGER NOT NULL,
    cache_read INTEGER NOT NULL,
    cache_write INTEGER NOT NULL,
    est_usd REAL NOT NULL,
    cli_usd REAL NOT NULL,
    usd REAL NOT NULL,
    PRIMARY KEY (day, principal, session, node, model, source)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_principal ON usage (principal, day);
CREATE TABLE IF NOT EXISTS budgets (
    principal TEXT PRIMARY KEY,
    limits TEXT NOT NULL,
    changed_at REAL NOT NULL,
    changed_by TEXT NOT NULL
) WITHOUT ROWID;
"""
_UPSERT = """
INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (day, principal, session, node, model, source) DO UPDATE SET
    calls = calls + excluded.calls,
    input = input + excluded.input,
    output = output + excluded.output,
    cache_read = cache_read + excluded.cache_read,
    cache_write = cache_write + excluded.cache_write,
    est_usd = est_usd + excluded.est_usd,
    cli_usd = cli_usd + excluded.cli_usd,
    usd = usd + excluded.usd
"""
_SUMS = (
    "SUM(calls), SUM(input), SUM(output), SUM(cache_read), SUM(cache_write),"
    " SUM(est_usd), SUM(cli_usd), SUM(usd)"
)

Key = tuple[str, str, str, str, str, str]


@dataclass
class Entry:
    """What one event adds to a ledger row (a model call, a turn's CLI cost, a generation)."""

    day: str
    principal: str
    session: str
    node: str
    model: str
    source: str
    calls: int = 0
    input: int = 0
    output: int = 0
    cache_read: int = 0
    cache_write: int = 0
    est_usd: float = 0.0
    cli_usd: float = 0.0
    usd: float = 0.0

    @property
    def key(self) -> Key:
        return (self.day, self.principal, self.session, self.node, self.model, self.source)

    @property
    def tokens(self) -> int:
        return self.input + self.output + self.cache_read + self.cache_write

    def merge(self, other: Entry) -> None:
        self.calls += other.calls
        self.input += other.input
        self.output += other.output
        self.cache_read += other.cache_read
        self.cache_write += other.cache_write
        self.est_usd += other.est_usd
        self.cli_usd += other.cli_usd
        self.usd += other.usd

    def row(self) -> tuple[Any, ...]:
        return (*self.key, *self.sums())

    def sums(self) -> tuple[int, int, int, int, int, float, float, float]:
        return (
            self.calls,
            self.input,
            self.output,
            self.cache_read,
            self.cache_write,
            self.est_usd,
            self.cli_usd,
            self.usd,
        )


@dataclass
class Ledger:
    """The ledger file; make one with ``async with Ledger.open(path)``."""

    db: aiosqlite.Connection
    path: Path
    _pending: dict[Key, Entry] = field(default_factory=dict)
    _wake: anyio.Event = field(default_factory=anyio.Event)
    _idle: anyio.Event = field(default_factory=anyio.Event)
    written: int = 0
    """Entries committed since the file was opened."""
    failures: int = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, path: str | os.PathLike[str]) -> AsyncIterator[Ledger]:
        file = Path(path)
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            os.close(fd)
            db = await aiosqlite.connect(file, isolation_level=None)
        except (OSError, aiosqlite.Error) as exc:
            raise StateError(f"usage ledger {file}: cannot open: {exc}") from exc
        try:
            await db.execute("PRAGMA journal_mode=WAL")
            await db.execute("PRAGMA synchronous=NORMAL")
            await db.executescript(_SCHEMA)
            ledger = cls(db, file)
            ledger._idle.set()
            async with anyio.create_task_group() as tg:
                tg.start_soon(ledger._writer)
                try:
                    yield ledger
                finally:
                    with anyio.CancelScope(shield=True), anyio.move_on_after(5.0):
                        await ledger.flush()
                    tg.cancel_scope.cancel()
        except aiosqlite.Error as exc:
            raise StateError(f"usage ledger {file}: {exc}") from exc
        finally:
            with anyio.CancelScope(shield=True):
                await db.close()

    # -- writing ---------------------------------------------------------------------

    def add(self, entry: Entry) -> None:
        """Record ``entry`` (merged into what is pending for its row; committed soon)."""
        pending = self._pending.get(entry.key)
        if pending is None:
            self._pending[entry.key] = dataclasses.replace(entry)
        else:
            pending.merge(entry)
        if self._idle.is_set():
            self._idle = anyio.Event()
        self._wake.set()

    async def flush(self) -> None:
        """Wait until everything added so far is committed (or failed, logged)."""
        while self._pending or not self._idle.is_set():
            await self._idle.wait()

    async def _writer(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            batch, self._pending = list(self._pending.values()), {}
            if batch:
                await self._commit(batch)
            if not self._pending:
                self._idle.set()

    async def _commit(self, batch: list[Entry]) -> None:
        try:
            await self.db.execute("BEGIN IMMEDIATE")
            await self.db.executemany(_UPSERT, [entry.row() for entry in batch])
            await self.db.execute("COMMIT")
        except aiosqlite.Error as exc:
            self.failures += 1
            log.error("usage.ledger_write_failed", error=str(exc), entries=len(batch))
            with contextlib.suppress(aiosqlite.Error):
                await self.db.execute("ROLLBACK")
            return
        self.written += len(batch)

    # -- reading ---------------------------------------------------------------------

    async def spend(self, period: Period) -> dict[str, Spend]:
        """Each principal's spend in ``period``'s UTC day and month (committed entries)."""
        await self.flush()
        out: dict[str, Spend] = {}
        query = (
            "SELECT principal,"
            " SUM(CASE WHEN day = ? THEN input + output + cache_read + cache_write ELSE 0 END),"
            " SUM(CASE WHEN day = ? THEN usd ELSE 0 END), SUM(usd)"
            " FROM usage WHERE day >= ? AND day < ? GROUP BY principal"
        )
        month_first = f"{period.month}-01"
        month_next = f"{period.month}-99"  # every day of the month sorts below it
        async with self.db.execute(
            query, (period.day, period.day, month_first, month_next)
        ) as cursor:
            async for principal, tokens, usd_day, usd_month in cursor:
                out[str(principal)] = Spend(int(tokens or 0), float(usd_day), float(usd_month))
        return out

    async def report(
        self,
        *,
        principal: str | None = None,
        since: str = "",
        by: Grouping = "day",
    ) -> list[ReportRow]:
        """The sums grouped ``by`` day, session, model or principal (each with its
        principal), for one principal (None: all) from the UTC day ``since`` on."""
        await self.flush()
        column = {"day": "day", "session": "session", "model": "model", "principal": "''"}[by]
        where, args = ["day >= ?"], [since]
        if principal is not None:
            where.append("principal = ?")
            args.append(principal)
        query = (
            f"SELECT {column}, principal, {_SUMS} FROM usage WHERE {' AND '.join(where)}"
            f" GROUP BY {column}, principal ORDER BY {column}, principal"
        )
        rows: list[ReportRow] = []
        async with self.db.execute(query, args) as cursor:
            async for key, who, *sums in cursor:
                calls, inp, out, read, write, est, cli, usd = sums
                rows.append(
                    ReportRow(
                        key=str(key) if by != "principal" else str(who),
                        principal=str(who),
                        calls=int(calls),
                        input_tokens=int(inp),
                        output_tokens=int(out),
                        cache_read_tokens=int(read),
                        cache_write_tokens=int(write),
                        tokens=int(inp + out + read + write),
                        est_usd=round(float(est), 6),
                        cli_usd=round(float(cli), 6),
                        usd=round(float(usd), 6),
                    )
                )
        return rows

    # -- budgets set at runtime ------------------------------------------------------------

    async def budgets(self) -> dict[str, dict[str, float | None]]:
        """The budgets an admin set at runtime, by principal: kind -> value (None: that
        budget was taken away); a kind not named keeps the config's."""
        out: dict[str, dict[str, float | None]] = {}
        async with self.db.execute("SELECT principal, limits FROM budgets") as cursor:
            async for principal, limits in cursor:
                try:
                    out[str(principal)] = msgspec.json.decode(limits, type=dict[str, float | None])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.error("usage.budget_unreadable", principal=principal)
        return out

    async def set_budget(
        self, principal: str, changes: dict[str, float | None], *, at: float, by: str
    ) -> None:
        """Keep ``principal``'s runtime budgets (empty: forget them, the config's apply)."""
        if not changes:
            await self.db.execute("DELETE FROM budgets WHERE principal = ?", (principal,))
            return
        await self.db.execute(
            "INSERT INTO budgets VALUES (?, ?, ?, ?) ON CONFLICT (principal) DO UPDATE SET"
            " limits = excluded.limits, changed_at = excluded.changed_at,"
            " changed_by = excluded.changed_by",
            (principal, msgspec.json.encode(changes).decode(), at, by),
        )


def merged(rows: Iterable[ReportRow]) -> list[ReportRow]:
    """Rows of several nodes' reports added up by key and principal (``--fleet``)."""
    sums: dict[tuple[str, str], list[float]] = {}
    for row in rows:
        acc = sums.setdefault((row.key, row.principal), [0.0] * 9)
        for i, value in enumerate(
            (
                row.calls,
                row.input_tokens,
                row.output_tokens,
                row.cache_read_tokens,
                row.cache_write_tokens,
                row.tokens,
                row.est_usd,
                row.cli_usd,
                row.usd,
            )
        ):
            acc[i] += value
    return [
        ReportRow(
            key=key,
            principal=principal,
            calls=int(a[0]),
            input_tokens=int(a[1]),
            output_tokens=int(a[2]),
            cache_read_tokens=int(a[3]),
            cache_write_tokens=int(a[4]),
            tokens=int(a[5]),
            est_usd=round(a[6], 6),
            cli_usd=round(a[7], 6),
            usd=round(a[8], 6),
        )
        for (key, principal), a in sorted(sums.items())
    ]
