"""sage/forge/registry.py: the tool table on disk.  Names and session ids that could
leave their folder are refused; records round-trip; files are the supervisor's only;
a bad file is hidden and reported once; the scopes shadow in order.

(The project scope in a principal's home, where links may be planted, is in
tests/unit/test_forge_registry_homes.py.)"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sage.errors import ForgeError
from sage.forge.registry import NAME_RE, Registry, Scope, ToolRecord, fingerprint

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}
Events = list[tuple[str, dict[str, Any]]]


def _record(
    name: str = "fib",
    *,
    scope: Scope = "session",
    principal: str | None = "alice",
    session: str | None = "s1",
    impl: str = "print(1)\n",
) -> ToolRecord:
    return ToolRecord(
        name=name,
        description="the n-th Fibonacci number",
        input_schema=SCHEMA,
        impl=impl,
        runtime="python",
        scope=scope,
        principal_id=principal,
        session_id=session,
        created_at="2026-12-04T00:00:00Z",
        impl_sha256=hashlib.sha256(impl.encode()).hexdigest(),
        schema_fingerprint=fingerprint(SCHEMA),
    )


@pytest.fixture
def umask0() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def events() -> Events:
    return []


@pytest.fixture
def registry(tmp_path: Path, events: Events) -> Registry:
    homes = {"alice": tmp_path / "home-alice"}
    return Registry(tmp_path / "forge", homes.get, lambda k, p: events.append((k, p)))


@pytest.mark.parametrize("name", ["fib", "a", "A-b_9", "x" * 64])
def test_names_a_tool_may_have(name: str) -> None:
    assert NAME_RE.match(name)
    assert _record(name).name == name


@pytest.mark.parametrize(
    "name", ["", "x" * 65, "../fib", "a/b", "a.b", ".fib", "fib.json", "fib\n", "fib ", "é"]
)
def test_names_that_could_leave_the_folder_or_confuse_are_refused(
    registry: Registry, name: str
) -> None:
    with pytest.raises(ValueError, match="bad name"):
        _record(name)
    for scope in ("session", "project", "user"):
        assert registry.get(scope, name, "alice", "s1") is None
        assert registry.remove(scope, name, "alice", "s1") is False


def test_a_record_whose_impl_does_not_match_its_hash_is_refused() -> None:
    good = _record()
    with pytest.raises(ValueError, match="impl_sha256"):
        msgspec.structs.replace(good, impl="print(2)\n")
    raw = msgspec.json.encode(good).replace(b"print(1)", b"print(2)")
    with pytest.raises(msgspec.ValidationError, match="impl_sha256"):
        msgspec.json.decode(raw, type=ToolRecord)


@pytest.mark.parametrize("session", ["..", "../user", "a/b", ".hidden", "", "s" * 129])
def test_a_session_id_that_is_a_path_trick_has_no_scope(
    registry: Registry, tmp_path: Path, session: str
) -> None:
    assert registry.directory("session", "alice", session) is None
    with pytest.raises(ForgeError, match="no session scope"):
        registry.create(_record(session=session))
    assert registry.get("session", "fib", "alice", session) is None
    assert registry.scan("session", "alice", session) == []
    forge = tmp_path / "forge"
    assert not forge.exists() or not list(forge.rglob("*.json"))


def test_session_and_user_records_round_trip_private_whatever_the_umask(
    registry: Registry, tmp_path: Path, umask0: None
) -> None:
    record = _record()
    path = registry.create(record)
    assert path == tmp_path / "forge" / "sessions" / "s1" / "tools" / "fib.json"
    found = registry.get("session", "fib", "alice", "s1")
    assert found is not None
    assert (found.record, found.path) == (record, path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for folder in (path.parent, path.parent.parent, tmp_path / "forge" / "sessions"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert [p.name for p in path.parent.iterdir()] == ["fib.json"]  # no temp file left
    promoted = registry.promote(record, force=False)
    user = registry.get("user", "fib", "bob", None)
    assert user is not None
    assert user.record == promoted
    assert (promoted.scope, promoted.session_id, promoted.version) == ("user", None, 1)
    assert promoted.promoted_from == {"scope": "session", "principal_id": "alice", "session_id": "s1"}  # fmt: skip
    assert stat.S_IMODE(user.path.stat().st_mode) == 0o600


def test_a_name_is_created_once(registry: Registry) -> None:
    registry.create(_record())
    with pytest.raises(ForgeError, match="a tool named 'fib' already exists"):
        registry.create(_record(impl="print(2)\n"))
    found = registry.get("session", "fib", "alice", "s1")
    assert found is not None
    assert found.record.impl == "print(1)\n"  # the first one stays


def test_promote_versions_and_refuses_a_different_impl_unless_forced(registry: Registry) -> None:
    assert registry.promote(_record(), force=False).version == 1
    assert registry.promote(_record(), force=False).version == 2  # same impl: a new version
    other = _record(impl="print(2)\n")
    with pytest.raises(ForgeError, match="already promoted with a different impl"):
        registry.promote(other, force=False)
    assert registry.promote(other, force=True).version == 3
    found = registry.get("user", "fib", None, None)
    assert found is not None
    assert found.record.impl == "print(2)\n"


def test_a_session_tool_is_its_principals_only(registry: Registry) -> None:
    registry.create(_record())
    assert registry.get("session", "fib", "bob", "s1") is None
    assert registry.scan("session", "bob", "s1") == []
    assert registry.get("session", "fib", None, "s1") is not None  # an operator sees all
    assert [x.record.name for x in registry.all_records()] == ["fib"]


def test_a_bad_file_is_hidden_and_reported_once(registry: Registry, events: Events) -> None:
    path = registry.create(_record())
    path.write_bytes(b"{not json")
    assert registry.get("session", "fib", "alice", "s1") is None
    assert registry.scan("session", "alice", "s1") == []
    assert [k for k, _ in events] == ["registry_load_failed"]
    assert events[0][1]["path"] == str(path)


def test_a_file_holding_another_tool_under_this_name_is_hidden(
    registry: Registry, events: Events
) -> None:
    """fib.json that holds "evil": a rename must not smuggle a tool in under a name."""
    evil = registry.create(_record("evil"))
    os.rename(evil, evil.with_name("fib.json"))
    assert registry.get("session", "fib", "alice", "s1") is None
    assert "file holds 'evil'" in events[0][1]["error"]


def test_session_shadows_project_shadows_user(registry: Registry) -> None:
    registry.promote(_record(impl="print('user')\n"), force=False)
    found = registry.lookup("fib", "alice", "s1")
    assert found is not None
    assert found.record.scope == "user"
    registry.create(_record(scope="project", session=None, impl="print('project')\n"))
    found = registry.lookup("fib", "alice", "s1")
    assert found is not None
    assert found.record.scope == "project"
    registry.create(_record(impl="print('session')\n"))
    found = registry.lookup("fib", "alice", "s1")
    assert found is not None
    assert found.record.scope == "session"
    assert [x.record.scope for x in registry.visible("alice", "s1")] == ["session"]
    assert registry.remove("session", "fib", "alice", "s1")
    found = registry.lookup("fib", "alice", "s1")
    assert found is not None
    assert found.record.scope == "project"
    assert registry.remove("session", "fib", "alice", "s1") is False  # already gone


def test_a_principal_without_a_home_has_no_project_scope(registry: Registry) -> None:
    with pytest.raises(ForgeError, match="no project scope"):
        registry.create(_record(scope="project", principal="nobody-known", session=None))
    assert registry.get("project", "fib", "nobody-known", None) is None
