"""Principals' settings files: strict reading, migration, refusal of the future."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import msgspec
import pytest

from capsules.runner import principals
from capsules.runner.principals import (
    PrincipalSettings,
    SettingsCorrupt,
    SettingsUnsupported,
)
from sage.config import PrincipalConfig
from sage.errors import SageError


def test_round_trip_through_a_file(tmp_path: Path) -> None:
    settings = PrincipalSettings(principal_id="alice", interaction_mode="repl", max_turns=3)
    principals.save(tmp_path, settings)
    path = principals.settings_path(tmp_path, "alice")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = principals.load(tmp_path, "alice")
    assert loaded is not None
    assert (loaded.interaction_mode, loaded.max_turns, loaded.schema_version) == ("repl", 3, 1)
    assert loaded.updated_at > 0
    assert principals.load(tmp_path, "bob") is None
    assert [p.name for p in path.parent.iterdir()] == ["alice.json"]  # no temp left


def test_a_newer_schema_is_refused_with_a_way_out() -> None:
    data = b'{"schema_version": 2, "principal_id": "alice", "colour": "red"}'
    with pytest.raises(SettingsUnsupported, match="newer than this sage") as info:
        principals.decode(data, "alice")
    assert info.value.code == "schema_version_unsupported"
    assert isinstance(info.value, SageError)
    assert "--force" in str(info.value)


@pytest.mark.parametrize(
    "data",
    [
        b"{not json",
        b"[]",
        b'{"schema_version": 1, "principal_id": "alice", "auth_mode": "magic"}',
        b'{"schema_version": 1, "principal_id": "alice", "colour": "red"}',
        b'{"schema_version": 1, "principal_id": "bob"}',
        b'{"schema_version": -1, "principal_id": "alice"}',
        b'{"schema_version": "1", "principal_id": "alice"}',
        b'{"schema_version": 1, "principal_id": "alice", "max_turns": -4}',
        b" " * (principals.MAX_FILE + 1),
    ],
)
def test_corrupt_files_are_refused(data: bytes) -> None:
    with pytest.raises(SettingsCorrupt) as info:
        principals.decode(data, "alice")
    assert info.value.code == "settings_corrupt"


def test_version_0_patches_are_migrated() -> None:
    old = msgspec.json.encode({"model": "claude-x", "max_turns": 2})
    settings = principals.decode(old, "alice")
    assert (settings.schema_version, settings.principal_id) == (1, "alice")
    assert (settings.model, settings.max_turns, settings.auth_mode) == ("claude-x", 2, "api_key")


def test_apply_and_patch_keep_absent_fields() -> None:
    base = PrincipalConfig(name="alice", model="m1", identity="secret identity text")
    current = principals.of(base)
    new = principals.patched(current, {"interaction_mode": "repl"})
    applied = principals.apply(base, new)
    assert (applied.interaction_mode, applied.model, applied.identity) == (
        "repl",
        "m1",
        "secret identity text",
    )
    assert "identity" not in principals.view(applied)
    with pytest.raises(SettingsCorrupt):
        principals.patched(current, {"auth_mode": "magic"})
    with pytest.raises(SettingsCorrupt, match="unknown settings: colour"):
        principals.patched(current, {"colour": "red"})


def test_a_symlinked_settings_file_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b'{"schema_version": 1, "principal_id": "alice"}')
    path = principals.settings_path(tmp_path, "alice")
    path.parent.mkdir()
    os.symlink(target, path)
    with pytest.raises(SettingsCorrupt, match="cannot read"):
        principals.load(tmp_path, "alice")
