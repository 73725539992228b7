"""The state store: what must outlive the supervisor, in one SQLite file.

A small namespaced key-value table (``namespace``, ``key`` -> JSON value),
WAL mode, ``synchronous=FULL``, written through aiosqlite.  The supervisor
opens it at start (``<state_dir>/state.db``, 0600) and hands it to the parts
that keep records: session records, principal settings, hook-token hashes
and install markers live here as the later issues add them.  Names are
checked (``[A-Za-z0-9_.:-]{1,128}``) so a key is never a path or a query.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import msgspec

from sage.errors import StateError

__all__ = ("StateStore",)

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    namespace TEXT NOT NULL,
    key TEXT NOT NULL,
    value BLOB NOT NULL,
    updated_ns INTEGER NOT NULL,
    PRIMARY KEY (namespace, key)
) WITHOUT ROWID;
"""


def _check(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise StateError(f"state {what} {name!r} must match [A-Za-z0-9_.:-]{{1,128}}")


class StateStore:
    """Namespaced JSON values in SQLite.  Make one with ``async with StateStore.open(path)``."""

    def __init__(self, db: aiosqlite.Connection, path: Path) -> None:
        self._db = db
        self.path = path

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, path: str | os.PathLike[str]) -> AsyncIterator[StateStore]:
        file = Path(path)
        try:
            fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.close(fd)
            db = await aiosqlite.connect(file, isolation_level=None)
        except (OSError, aiosqlite.Error) as exc:
            raise StateError(f"{file}: cannot open the state store: {exc}") from exc
        try:
            try:
                await db.execute("PRAGMA journal_mode=WAL")
                await db.execute("PRAGMA synchronous=FULL")
                await db.executescript(_SCHEMA)
            except aiosqlite.Error as exc:
                raise StateError(f"{file}: not a usable state store: {exc}") from exc
            yield cls(db, file)
        finally:
            await db.close()

    async def get(self, namespace: str, key: str, default: Any = None) -> Any:
        _check("namespace", namespace)
        _check("key", key)
        try:
            async with self._db.execute(
                "SELECT value FROM kv WHERE namespace = ? AND key = ?", (namespace, key)
            ) as cursor:
                row = await cursor.fetchone()
        except aiosqlite.Error as exc:
            raise StateError(f"cannot read {namespace}/{key}: {exc}") from exc
        return default if row is None else msgspec.json.decode(row[0])

    async def put(self, namespace: str, key: str, value: Any) -> None:
        """Store ``value`` (anything msgspec can encode); durable when this returns."""
        _check("namespace", namespace)
        _check("key", key)
        data = msgspec.json.encode(value)
        try:
            await self._db.execute(
                "INSERT INTO kv VALUES (?, ?, ?, ?) ON CONFLICT (namespace, key)"
                " DO UPDATE SET value = excluded.value, updated_ns = excluded.updated_ns",
                (namespace, key, data, time.time_ns()),
            )
        except aiosqlite.Error as exc:
            raise StateError(f"cannot write {namespace}/{key}: {exc}") from exc

    async def delete(self, namespace: str, key: str) -> bool:
        _check("namespace", namespace)
        _check("key", key)
        try:
            cursor = await self._db.execute(
                "DELETE FROM kv WHERE namespace = ? AND key = ?", (namespace, key)
            )
        except aiosqlite.Error as exc:
            raise StateError(f"cannot delete {namespace}/{key}: {exc}") from exc
        return cursor.rowcount > 0

    async def items(self, namespace: str) -> list[tuple[str, Any]]:
        """Every (key, value) of ``namespace``, ordered by key."""
        _check("namespace", namespace)
        try:
            async with self._db.execute(
                "SELECT key, value FROM kv WHERE namespace = ? ORDER BY key", (namespace,)
            ) as cursor:
                rows = await cursor.fetchall()
        except aiosqlite.Error as exc:
            raise StateError(f"cannot list {namespace}: {exc}") from exc
        return [(key, msgspec.json.decode(value)) for key, value in rows]

    async def count(self) -> int:
        async with self._db.execute("SELECT count(*) FROM kv") as cursor:
            row = await cursor.fetchone()
        return int(row[0]) if row else 0
