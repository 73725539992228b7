"""The Unix-socket details under the bus server: peers, the lock, the socket's folder.

Who a peer is comes from the kernel (``SO_PEERCRED``), never from what it
says.  A server owns its socket path while it holds the lock file beside it,
so a stale socket is replaced only when no other server is alive.  The
socket lives in a private folder: one this code creates is 0700 (0750 with a
group), one that exists must be ours, a real directory and writable by
nobody else; the socket itself is bound under umask 0077.  A second group
that must reach the socket gets a POSIX ACL entry (:func:`grant_group`).
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
from typing import Final

from bus.errors import BusError

__all__ = (
    "PeerCred",
    "SocketLock",
    "bind_unix_socket",
    "ensure_private_dir",
    "grant_group",
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


_ACL: Final = "system.posix_acl_access"
_ACL_VERSION: Final = 2
_USER_OBJ, _GROUP, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x08, 0x04, 0x10, 0x20
_UNDEFINED: Final = 0xFFFFFFFF


def grant_group(path: Path, gid: int | None, perm: int) -> None:
    """Give group ``gid`` the permission bits ``perm`` (``rwx`` as 0-7) on ``path`` by a
    POSIX access ACL entry, besides the file's own group; ``gid`` None: drop any ACL.

    A file has one group; a second one that must pass through a folder or
    connect to a socket gets an entry of its own (the kernel checks it like
    the group bits), so neither group needs to be given the other's members.
    The entries follow the mode as it is now (owner, group, other); the mask
    is the group bits joined with ``perm``.  A file system without ACLs is
    refused with one line."""
    if gid is None:
        with contextlib.suppress(OSError):  # none set, or no ACLs here: nothing to drop
            os.removexattr(path, _ACL, follow_symlinks=False)
        return
    mode = stat.S_IMODE(os.lstat(path).st_mode)
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    entries = [
        (_USER_OBJ, owner, _UNDEFINED),
        (_GROUP_OBJ, group, _UNDEFINED),
        (_GROUP, perm, gid),
        (_MASK, group | perm, _UNDEFINED),
        (_OTHER, other, _UNDEFINED),
    ]
    entries.sort(key=lambda e: (e[0], e[2]))
    value = struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", *e) for e in entries)
    try:
        os.setxattr(path, _ACL, value, follow_symlinks=False)
    except OSError as exc:
        raise BusError(
            f"cannot give group {gid} access to {path} (a POSIX ACL entry):"
            f" {exc.strerror or exc}; the file system must support ACLs"
        ) from exc


def ensure_private_dir(
    directory: Path, *, group: int | None = None, extra_group: int | None = None
) -> None:
    """Make ``directory`` ours and private: created 0700 (0750 with a group).

    A folder this call creates gets exactly that mode.  One that already
    exists is tightened only if it is ours and nobody else can write to it;
    a folder others can write to (``/tmp``, say) is refused, never chmod'ed.
    ``extra_group`` may pass through it too (an ACL entry, :func:`grant_group`).
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
    grant_group(directory, extra_group if group is not None else None, 0o1)


def prepare_socket_dir(path: Path, group: int | None, extra_group: int | None = None) -> None:
    """The socket's directory: private, see :func:`ensure_private_dir`."""
    ensure_private_dir(path.parent, group=group, extra_group=extra_group)


def bind_unix_socket(
    path: Path, group: int | None, extra_group: int | None = None
) -> socket.socket:
    """Bind ``path`` under umask 0077; 0600, or 0660 with a group (and read-write for
    ``extra_group`` too, :func:`grant_group`)."""
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
    try:
        if group is not None:
            os.chown(path, -1, group)
            os.chmod(path, 0o660)
            grant_group(path, extra_group, 0o6)
        else:
            os.chmod(path, 0o600)
    except BaseException:
        sock.close()
        raise
    sock.listen(128)
    sock.setblocking(False)
    return sock
