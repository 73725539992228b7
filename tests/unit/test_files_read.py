"""sage/files.py, reading: a private file is read only when nobody else could
have read or planted it (mode, owner, no symlink), checked on the open file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sage.errors import SageError
from sage.files import read_private


class Refused(SageError):
    code = "test.refused"


def _read(path: Path, *, check_owner: bool = True, limit: int = 1 << 20) -> bytes:
    return read_private(path, what="test key", error=Refused, check_owner=check_owner, limit=limit)


def _file(tmp_path: Path, mode: int, data: bytes = b"secret") -> Path:
    path = tmp_path / "key"
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_a_file_only_we_can_read_is_read(tmp_path: Path) -> None:
    assert _read(_file(tmp_path, 0o600)) == b"secret"
    assert _read(_file(tmp_path, 0o400)) == b"secret"


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o610, 0o601, 0o644])
def test_any_group_or_other_bit_is_refused(tmp_path: Path, mode: int) -> None:
    path = _file(tmp_path, mode)
    with pytest.raises(
        Refused, match=rf"test key is accessible by group or other \(mode {mode:04o}\)"
    ):
        _read(path)
    # the message names the fix
    with pytest.raises(Refused, match=f"chmod 600 {path}"):
        _read(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_file_another_uid_owns_is_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, 0o600)
    os.chown(path, 65534, -1)
    with pytest.raises(Refused, match="owned by uid 65534, not by us"):
        _read(path)


def test_a_symlink_is_refused_even_to_a_private_file(tmp_path: Path) -> None:
    target = _file(tmp_path, 0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(Refused, match="cannot open the test key"):
        _read(link)


def test_a_missing_file_is_file_not_found_for_the_caller_to_create(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        _read(tmp_path / "absent")


def test_without_the_owner_check_mode_and_owner_are_the_other_partys(tmp_path: Path) -> None:
    """systemd's credentials: another party sets mode and owner; a symlink is still refused."""
    path = _file(tmp_path, 0o644, b"credential")
    assert _read(path, check_owner=False) == b"credential"
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(Refused):
        _read(link, check_owner=False)


def test_at_most_limit_bytes_are_read(tmp_path: Path) -> None:
    data = os.urandom(200_000)
    path = _file(tmp_path, 0o600, data)
    assert _read(path) == data  # more than one read's chunk
    assert _read(path, limit=70_000) == data[:70_000]
    assert _read(path, limit=0) == b""
