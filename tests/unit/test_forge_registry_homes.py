"""The forge's project scope lives in a principal's home, which a root supervisor hands
to the principal's claude child: a link planted there must never redirect the forge."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import pytest

from sage.errors import ForgeError
from sage.forge.registry import Registry, ToolRecord


def _record(name: str = "fib") -> ToolRecord:
    impl = "print(1)\n"
    return ToolRecord(
        name=name,
        description="d",
        input_schema={"type": "object"},
        impl=impl,
        runtime="python",
        scope="project",
        principal_id="alice",
        created_at="2026-12-04T00:00:00Z",
        impl_sha256=hashlib.sha256(impl.encode()).hexdigest(),
        schema_fingerprint="x",
    )


def _registry(tmp_path: Path) -> tuple[Registry, Path, list[tuple[str, dict[str, Any]]]]:
    home = tmp_path / "home"
    home.mkdir()
    events: list[tuple[str, dict[str, Any]]] = []
    registry = Registry(tmp_path / "forge", lambda _: home, lambda k, p: events.append((k, p)))
    return registry, home, events


def test_project_tools_round_trip_in_the_home(tmp_path: Path) -> None:
    registry, home, _ = _registry(tmp_path)
    path = registry.create(_record())
    assert path == home / ".astrid" / "forge" / "tools" / "fib.json"
    found = registry.get("project", "fib", "alice", None)
    assert found is not None
    assert found.record.name == "fib"
    assert [x.record.name for x in registry.scan("project", "alice", None)] == ["fib"]
    with pytest.raises(ForgeError, match="already exists"):
        registry.create(_record())
    assert registry.remove("project", "fib", "alice", None)
    assert registry.get("project", "fib", "alice", None) is None


@pytest.mark.parametrize("link", [".astrid", ".astrid/forge", ".astrid/forge/tools"])
def test_a_linked_folder_in_the_home_is_never_followed(tmp_path: Path, link: str) -> None:
    """Whoever owns the home points a folder of the path elsewhere: the forge refuses
    to write there, reads nothing from there, and deletes nothing there."""
    registry, home, events = _registry(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "forge" / "tools").mkdir(parents=True)
    (elsewhere / "tools").mkdir()
    victim = elsewhere / "forge" / "tools" / "fib.json"
    victim.write_bytes(b"precious")
    (elsewhere / "tools" / "fib.json").write_bytes(b"precious")
    parent = home / Path(link).parent
    parent.mkdir(parents=True, exist_ok=True)
    target = {".astrid": elsewhere, ".astrid/forge": elsewhere / "forge", ".astrid/forge/tools": elsewhere / "tools"}[link]  # fmt: skip
    os.symlink(target, home / link)
    with pytest.raises(ForgeError, match="is a link or not a folder"):
        registry.create(_record("other"))
    assert not list(elsewhere.rglob("other*"))
    assert registry.get("project", "fib", "alice", None) is None
    assert registry.scan("project", "alice", None) == []
    with pytest.raises(ForgeError, match="is a link or not a folder"):
        registry.remove("project", "fib", "alice", None)
    assert victim.read_bytes() == b"precious"
    assert (elsewhere / "tools" / "fib.json").read_bytes() == b"precious"
    assert events  # the refusal is reported, not silent


def test_a_linked_tool_file_is_not_read(tmp_path: Path) -> None:
    registry, home, _ = _registry(tmp_path)
    registry.create(_record())
    secret = tmp_path / "secret.json"
    secret.write_bytes(b'{"not": "a tool"}')
    tool = home / ".astrid" / "forge" / "tools" / "fib.json"
    tool.unlink()
    os.symlink(secret, tool)
    assert registry.get("project", "fib", "alice", None) is None
