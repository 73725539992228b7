"""The state store on a real SQLite file: values survive a reopen, names are checked."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from sage.errors import StateError
from sage.state import StateStore

pytestmark = pytest.mark.anyio


async def test_values_survive_reopen(tmp_path: Path) -> None:
    """What is put is there after the store is closed and opened again."""
    path = tmp_path / "state.db"
    async with StateStore.open(path) as store:
        await store.put("sessions", "s1", {"principal": "alice", "pid": 42})
        await store.put("sessions", "s2", [1, 2])
        await store.put("sessions", "s1", {"principal": "alice", "pid": 43})
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    async with StateStore.open(path) as store:
        assert await store.get("sessions", "s1") == {"principal": "alice", "pid": 43}
        assert await store.items("sessions") == [
            ("s1", {"principal": "alice", "pid": 43}),
            ("s2", [1, 2]),
        ]
        assert await store.get("sessions", "nope", "dflt") == "dflt"
        assert await store.delete("sessions", "s2")
        assert not await store.delete("sessions", "s2")
        assert await store.count() == 1


@pytest.mark.parametrize("name", ["../etc", "a/b", "", "x" * 129, "a b", "k\n"])
async def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    """Keys and namespaces with path tricks or odd characters are a StateError."""
    async with StateStore.open(tmp_path / "state.db") as store:
        with pytest.raises(StateError, match="must match"):
            await store.put("ns", name, 1)
        with pytest.raises(StateError, match="must match"):
            await store.get(name, "k")


async def test_a_file_that_is_not_sqlite_is_one_clear_error(tmp_path: Path) -> None:
    """A corrupt state file gives a StateError naming it, not a traceback."""
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StateError, match="state store"):
        async with StateStore.open(path):
            pass
