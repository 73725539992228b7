"""The Unix-socket details under the bus server: peers, the lock, the socket's folder.

Who a peer is comes from the kernel (``SO_PEERCRED``), never from what it
says.  A server owns its socket path while it holds the lock file beside it,
so a stale socket is replaced only when no other server is alive.  The
socket lives in a private folder: one this code creates is 0700 (0750 with a
group), one that exists must be ours, a real directory and writable by
nobody else; the socket itself is bound under umask 0077.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from bus.errors import BusError

__all__ = (
    "PeerCred",
    "SocketLock",
    "bind_unix_socket",
    "ensure_private_dir",
    "peer_credentials",
    "prepare_socket_dir",
)


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    """The peer's pid, uid and gid as the kernel reports them."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


class SocketLock:
    """The lock file beside a socket: held while a server owns the path."""

    def __init__(self, socket_path: Path) -> None:
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BusError(
                    f"another server holds {self.path} (is the supervisor already running?)"
                ) from exc
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def ensure_private_dir(directory: Path, *, group: int | None = None) -> None:
    """Make ``directory`` ours and private: created 0700 (0750 with a group).

    A folder this call creates gets exactly that mode.  One that already
    exists is tightened only if it is ours and nobody else can write to it;
    a folder others can write to (``/tmp``, say) is refused, never chmod'ed.
    """
    existed = directory.exists()
    old = os.umask(0o077)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise BusError(f"cannot create {directory}: {exc.strerror}") from exc
    finally:
        os.umask(old)
    try:
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode):
            raise BusError(f"{directory} is not a directory")
        if info.st_uid != os.getuid():
            raise BusError(f"{directory} belongs to uid {info.st_uid}, not to us")
        mode = stat.S_IMODE(info.st_mode)
        if existed and mode & 0o022:
            raise BusError(
                f"{directory} is writable by others (mode {mode:04o}); use a private folder"
            )
        want = 0o750 if group is not None else 0o700
        if mode != want:
            os.chmod(directory, want)
        if group is not None:
            os.chown(directory, -1, group)
    except OSError as exc:  # e.g. EPERM giving the folder a group: one clear error
        raise BusError(f"cannot make {directory} private: {exc.strerror or exc}") from exc


def prepare_socket_dir(path: Path, group: int | None) -> None:
    """The socket's directory: private, see :func:`ensure_private_dir`."""
    ensure_private_dir(path.parent, group=group)


def bind_unix_socket(path: Path, group: int | None) -> socket.socket:
    """Bind ``path`` under umask 0077; 0600, or 0660 with a group."""
    if len(os.fsencode(path)) > 107:
        raise BusError(f"socket path too long (over 107 bytes): {path}")
    with contextlib.suppress(FileNotFoundError):
        info = path.lstat()
        if not stat.S_ISSOCK(info.st_mode):
            raise BusError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(os.fspath(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
        os.chmod(path, 0o660)
    else:
        os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock
