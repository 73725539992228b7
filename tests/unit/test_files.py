"""sage.files: private writes (0600, atomic, no partial file) and the private read checks."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sage import files
from sage.errors import SageError


class Refused(SageError):
    code = "refused"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _names(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_write_replace_is_0600_in_new_0700_folders_whatever_the_umask(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "f"
    old = os.umask(0)
    try:
        files.write_replace(target, b"one")
    finally:
        os.umask(old)
    assert target.read_bytes() == b"one"
    assert _mode(target) == 0o600
    assert _mode(tmp_path / "a") == _mode(tmp_path / "a" / "b") == 0o700


def test_write_replace_replaces_and_leaves_no_temp_file(tmp_path: Path) -> None:
    target = tmp_path / "f"
    files.write_replace(target, b"one")
    files.write_replace(target, b"two", durable=False)
    assert target.read_bytes() == b"two"
    assert _names(tmp_path) == ["f"]


def test_write_replace_replaces_a_symlink_never_writes_through_it(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(outside)
    files.write_replace(link, b"new")
    assert outside.read_bytes() == b"keep"
    assert not link.is_symlink()
    assert link.read_bytes() == b"new"


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_a_crash_mid_write_leaves_the_old_file_whole_and_no_partial_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    target = tmp_path / "f"
    files.write_replace(target, b"old")

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError(5, "crash")

    monkeypatch.setattr(os, step, crash)
    with pytest.raises(OSError, match="crash"):
        files.write_replace(target, b"new and longer")
    monkeypatch.undo()
    assert target.read_bytes() == b"old"
    assert _names(tmp_path) == ["f"]


def test_write_new_creates_once_and_the_second_writer_loses(tmp_path: Path) -> None:
    target = tmp_path / "k"
    assert files.write_new(target, b"first") is True
    assert files.write_new(target, b"second") is False
    assert target.read_bytes() == b"first"
    assert _mode(target) == 0o600
    assert _names(tmp_path) == ["k"]


def test_write_at_new_and_replace_inside_an_open_folder(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert files.write_at(fd, "n", b"1", replace=False) is True
        assert files.write_at(fd, "n", b"2", replace=False) is False
        assert (tmp_path / "n").read_bytes() == b"1"
        (tmp_path / "target").write_bytes(b"keep")
        (tmp_path / "l").symlink_to(tmp_path / "target")
        assert files.write_at(fd, "l", b"3", replace=True, mode=0o640) is True
    finally:
        os.close(fd)
    assert (tmp_path / "target").read_bytes() == b"keep"
    assert not (tmp_path / "l").is_symlink()
    assert (tmp_path / "l").read_bytes() == b"3"
    assert _mode(tmp_path / "l") == 0o640
    assert _mode(tmp_path / "n") == 0o600
    assert _names(tmp_path) == ["l", "n", "target"]


def test_read_private_reads_our_0600_file(tmp_path: Path) -> None:
    path = tmp_path / "key"
    files.write_new(path, b"secret")
    assert files.read_private(path, what="key", error=Refused) == b"secret"
    assert files.read_private(path, what="key", error=Refused, limit=3) == b"sec"


def test_read_private_refuses_a_too_open_mode(tmp_path: Path) -> None:
    path = tmp_path / "key"
    files.write_new(path, b"secret")
    path.chmod(0o640)
    with pytest.raises(Refused, match=r"accessible by group or other \(mode 0640\)"):
        files.read_private(path, what="key", error=Refused)
    assert files.read_private(path, what="key", error=Refused, check_owner=False) == b"secret"


def test_read_private_refuses_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    files.write_new(real, b"secret")
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(Refused, match="cannot open the key"):
        files.read_private(link, what="key", error=Refused)


def test_read_private_refuses_a_foreign_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "key"
    files.write_new(path, b"secret")
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
    with pytest.raises(Refused, match=f"owned by uid {os.getuid()}, not by us"):
        files.read_private(path, what="key", error=Refused)


def test_read_private_lets_a_missing_file_through(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        files.read_private(tmp_path / "none", what="key", error=Refused)


def test_ensure_private_dir_creates_tightens_and_refuses(tmp_path: Path) -> None:
    made = tmp_path / "made"
    files.ensure_private_dir(made, error=Refused)
    assert _mode(made) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    files.ensure_private_dir(loose, error=Refused)
    assert _mode(loose) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(Refused, match="writable by others"):
        files.ensure_private_dir(shared, error=Refused)
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(Refused, match="not a directory"):
        files.ensure_private_dir(link, error=Refused)
