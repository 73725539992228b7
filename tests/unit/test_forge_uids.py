"""Sandbox uids (sage.security.uids): one per principal, persisted, never a host user's."""

from __future__ import annotations

import pwd
from pathlib import Path

import pytest

from sage.config import decode_config
from sage.errors import ConfigError, SandboxError
from sage.security.uids import NO_PRINCIPAL, SandboxUids, known_uid


def test_principals_get_distinct_uids_in_order_and_keep_them(tmp_path: Path) -> None:
    uids = SandboxUids(tmp_path, 90000, 10)
    table = uids.allocate([NO_PRINCIPAL, "alice", "bob"])
    assert table == {"": 90000, "alice": 90001, "bob": 90002}
    assert uids.uid_for(None) == 90000
    assert uids.uid_for("carol") == 90003  # a principal added later: the next free one
    assert (tmp_path / "sandbox_uids.json").stat().st_mode & 0o777 == 0o600
    # another process, principals in another order, one removed: nothing moves
    other = SandboxUids(tmp_path, 90000, 10)
    assert other.allocate(["bob", "alice"]) == {
        "": 90000,
        "alice": 90001,
        "bob": 90002,
        "carol": 90003,
    }
    assert other.uid_for("dave") == 90004  # carol's uid is never reused


def test_a_uid_the_host_knows_is_skipped_and_refused(tmp_path: Path) -> None:
    nobody = pwd.getpwnam("nobody").pw_uid
    assert known_uid(nobody)
    uids = SandboxUids(tmp_path, nobody - 1, 3)
    assert uids.allocate(["a", "b"]) == {"a": nobody - 1, "b": nobody + 1}
    # a table that hands out a host user's uid (edited, or the user was created later)
    (tmp_path / "sandbox_uids.json").write_text(f'{{"uids": {{"x": {nobody}}}}}')
    with pytest.raises(SandboxError) as caught:
        SandboxUids(tmp_path, nobody - 1, 3).uid_for("x")
    assert caught.value.code == "sandbox_uid_taken"


def test_a_bad_table_fails_closed_and_a_full_range_says_so(tmp_path: Path) -> None:
    (tmp_path / "sandbox_uids.json").write_text("not json")
    with pytest.raises(SandboxError) as caught:
        SandboxUids(tmp_path, 90000, 10).uid_for("alice")
    assert caught.value.code == "sandbox_uid_unavailable"
    assert (tmp_path / "sandbox_uids.json").read_text() == "not json"  # nothing lost
    full = SandboxUids(tmp_path / "f", 90000, 2)
    full.allocate(["a", "b"])
    with pytest.raises(SandboxError) as caught:
        full.uid_for("c")
    assert caught.value.code == "sandbox_uid_exhausted"


def test_config_refuses_the_old_key_and_a_range_holding_nobody() -> None:
    with pytest.raises(ConfigError, match=r"sandbox_uid is gone.*sandbox_uid_base"):
        decode_config("[forge]\nsandbox_uid = 65534\n")
    with pytest.raises(ConfigError, match="65534"):
        decode_config("[forge]\nsandbox_uid_base = 65000\n")
    forge = decode_config("").forge
    assert (forge.sandbox_uid_base, forge.sandbox_uid_count) == (90000, 1000)
    assert not any(known_uid(u) for u in range(90000, 91000))
