"""The Unix-socket details under the bus server: the socket's folder, the lock, the bind."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from bus import BusError
from bus.unix import SocketLock, bind_unix_socket, ensure_private_dir, peer_credentials


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_new_folder_is_created_0700(tmp_path: Path) -> None:
    """A folder (and its parents) this call creates is ours and 0700."""
    target = tmp_path / "a" / "run"
    ensure_private_dir(target)
    assert _mode(target) == 0o700
    assert target.stat().st_uid == os.getuid()


def test_a_new_folder_with_a_group_is_0750(tmp_path: Path) -> None:
    """With a group the folder is 0750 and belongs to that group."""
    target = tmp_path / "run"
    ensure_private_dir(target, group=os.getgid())
    assert (_mode(target), target.stat().st_gid) == (0o750, os.getgid())


def test_our_existing_folder_is_tightened(tmp_path: Path) -> None:
    """An existing folder of ours that others may read is made 0700."""
    target = tmp_path / "run"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    ensure_private_dir(target)
    assert _mode(target) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o720, 0o702])
def test_a_folder_others_can_write_is_refused_untouched(tmp_path: Path, mode: int) -> None:
    """A folder group or others can write to (/tmp, say) is refused and never chmod'ed."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(BusError, match="writable by others"):
        ensure_private_dir(shared)
    assert _mode(shared) == mode


def test_a_folder_of_another_uid_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A folder that is not ours is refused, whatever its mode, and left as it was."""
    target = tmp_path / "theirs"
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    owner = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    with pytest.raises(BusError, match=f"belongs to uid {owner}, not to us"):
        ensure_private_dir(target)
    assert _mode(target) == 0o755


def test_a_symlink_to_a_folder_is_refused(tmp_path: Path) -> None:
    """A symlink is not the folder itself: refused, and its target left alone."""
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    os.chmod(real, 0o755)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(BusError, match="is not a directory"):
        ensure_private_dir(link)
    assert _mode(real) == 0o755


def test_a_file_in_the_way_is_refused(tmp_path: Path) -> None:
    """A regular file where the folder should be is a BusError, not an OSError."""
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(BusError, match="cannot create"):
        ensure_private_dir(target)


def test_the_lock_is_held_by_one_server_at_a_time(tmp_path: Path) -> None:
    """A second lock on the same socket path is refused until the first is released."""
    path = tmp_path / "bus.sock"
    first, second = SocketLock(path), SocketLock(path)
    first.acquire()
    try:
        assert first.path == tmp_path / "bus.sock.lock"
        assert _mode(first.path) == 0o600
        with pytest.raises(BusError, match="another server holds"):
            second.acquire()
    finally:
        first.release()
    second.acquire()
    second.release()


def test_bind_replaces_a_stale_socket_but_not_a_file(tmp_path: Path) -> None:
    """A leftover socket is replaced; a regular file at the path is refused and kept."""
    path = tmp_path / "s"
    path.write_text("keep")
    with pytest.raises(BusError, match="is not a socket"):
        bind_unix_socket(path, None)
    assert path.read_text() == "keep"
    path.unlink()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(os.fspath(path))
    stale.close()
    sock = bind_unix_socket(path, None)
    try:
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert _mode(path) == 0o600
    finally:
        sock.close()


def test_bind_refuses_a_path_too_long_for_sun_path(tmp_path: Path) -> None:
    """A path over 107 bytes is refused with a clear message rather than truncated."""
    with pytest.raises(BusError, match="socket path too long"):
        bind_unix_socket(tmp_path / ("x" * 120), None)


def test_peer_credentials_come_from_the_kernel() -> None:
    """SO_PEERCRED names our own pid, uid and gid across a socketpair."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        cred = peer_credentials(a)
    assert (cred.pid, cred.uid, cred.gid) == (os.getpid(), os.getuid(), os.getgid())
