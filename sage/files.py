"""Private files: the one place sage reads and writes a file only its uid may see.

Writers (every one atomic: a temp file in the same folder, opened
``O_CREAT | O_EXCL | O_NOFOLLOW`` with mode 0600, written, fsynced, then put
in place, then the folder fsynced, so a crash leaves the old file or the new
one, never a part of one, and nobody else can read it for an instant):

- :func:`write_new` creates a file that must not exist yet (``os.link``: of
  two racing writers exactly one wins; the other gets False);
- :func:`write_replace` replaces a file (``os.replace``); ``durable=False``
  skips the fsyncs for files that may be lost but never torn;
- :func:`write_at` does either inside a folder opened by descriptor, for
  folders another uid owns (a principal's home), where no link is followed.

Folders: :func:`private_dir` makes missing ones 0700 whatever the umask;
:func:`ensure_private_dir` also checks (and tightens) one that exists.

Reader: :func:`read_private` opens without following a symlink, then checks
the open file itself (``fstat``, so a swap after the check cannot matter): no
group or other bits, owned by the effective uid.  ``check_owner=False`` is for
files whose owner and mode another party sets, such as systemd's
``$CREDENTIALS_DIRECTORY``.  A missing file raises ``FileNotFoundError``
(callers create it); anything else raises ``error(message)``.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from bus import BusError, unix
from sage.errors import SageError

__all__ = (
    "ensure_private_dir",
    "fsync_dir",
    "private_dir",
    "private_temp",
    "read_private",
    "write_at",
    "write_new",
    "write_replace",
)

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def fsync_dir(path: Path) -> None:
    """Make the names in folder ``path`` durable (a created or renamed file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(directory: Path) -> Path:
    """Make ``directory`` and its missing parents, each 0700 whatever the umask.

    Folders that exist are left as they are.
    """
    missing: list[Path] = []
    here = directory
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700, follow_symlinks=False)
    return directory


def ensure_private_dir(
    directory: Path, *, error: Callable[[str], SageError], group: int | None = None
) -> None:
    """Make ``directory`` ours and private (created 0700, 0750 with a group; an existing
    one others can write to is refused): :func:`bus.unix.ensure_private_dir`, the one
    implementation, with its refusal raised as ``error``."""
    try:
        unix.ensure_private_dir(directory, group=group)
    except BusError as exc:
        raise error(str(exc)) from exc.__cause__


def _temp_name(name: str) -> str:
    return f".{name}.{os.getpid()}.{threading.get_ident()}.{os.urandom(4).hex()}.tmp"


def private_temp(
    directory: Path, name: str, data: bytes, *, durable: bool = True, mode: int = 0o600
) -> Path:
    """A new temp file (``mode``, 0600 by default) in ``directory`` (made 0700 if missing)."""
    private_dir(directory)
    tmp = directory / _temp_name(name)
    fd = os.open(tmp, _NEW, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_new(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` (0600); False, and nothing written, when it exists."""
    tmp = private_temp(path.parent, path.name, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    return True


def write_replace(path: Path, data: bytes, *, durable: bool = True, mode: int = 0o600) -> None:
    """Replace ``path`` atomically: readers see the old bytes or the new, never a mix.

    ``durable`` (the default) also fsyncs the file and its folder, so the new
    bytes survive a power cut; without it they may not (a crash can lose
    the file, never tear it for a reader that runs meanwhile).  ``mode`` is
    subject to the umask, as with ``open``.
    """
    tmp = private_temp(path.parent, path.name, data, durable=durable, mode=mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_at(
    folder: int,
    name: str,
    data: bytes,
    *,
    replace: bool,
    owner: tuple[int, int] | None = None,
    mode: int | None = None,
) -> bool:
    """Write ``name`` in the folder open as ``folder``; never follows a link there.

    ``replace`` renames over an existing name (a link there is replaced, never
    written through); otherwise the name must be new and False means it
    existed.  ``owner`` (uid, gid) is given to the file before any byte is
    written; ``mode`` is set exactly (no umask), else the file stays 0600.
    """
    tmp = _temp_name(name)
    out = os.open(tmp, _NEW, 0o600, dir_fd=folder)
    try:
        with os.fdopen(out, "wb") as fh:
            if owner is not None:
                os.fchown(fh.fileno(), *owner)
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        else:
            try:
                os.link(tmp, name, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
            except FileExistsError:
                return False
        os.fsync(folder)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)


def read_private(
    path: Path,
    *,
    what: str,
    error: Callable[[str], SageError],
    check_owner: bool = True,
    limit: int = 1 << 20,
) -> bytes:
    """At most ``limit`` bytes of ``path``, after the checks above."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"{path}: cannot open the {what}: {exc.strerror}") from exc
    try:
        if check_owner:
            info = os.fstat(fd)
            mode = stat.S_IMODE(info.st_mode)
            if mode & 0o077:
                raise error(
                    f"{path}: {what} is accessible by group or other (mode {mode:04o});"
                    f" run `chmod 600 {path}`"
                )
            if info.st_uid != os.geteuid():
                raise error(f"{path}: {what} is owned by uid {info.st_uid}, not by us")
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 65536))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
