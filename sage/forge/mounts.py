"""What a forged tool may mount: its ``x-bind`` paths, checked, then opened as checked.

The pure half, :func:`check_binds`, resolves each path and refuses what must never
be mounted (:data:`SYSTEM_FORBIDDEN`, the config's own paths: :func:`forbidden_for`,
the sandbox's own mount points), anything but a regular file or a folder, and
(with the sandbox uid) what that uid could not reach by the mode bits.
:func:`open_binds` then opens each checked path (``O_PATH|O_NOFOLLOW``, component by
component, the same inode as checked), and bwrap mounts the descriptors
(``--ro-bind-fd``/``--bind-fd``, sage/forge/sandbox.py), so what is mounted is what
was checked, whatever is swapped in later.  Every refusal is
``SandboxError("mount_refused")``.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from sage.errors import SandboxError

if TYPE_CHECKING:
    from sage.config import Config

__all__ = (
    "SYSTEM_FORBIDDEN",
    "Bind",
    "ResolvedBind",
    "check_binds",
    "forbidden_for",
    "open_binds",
)

SYSTEM_FORBIDDEN: tuple[Path, ...] = tuple(
    Path(p)
    for p in (
        "/etc",
        "/proc",
        "/sys",
        "/dev",
        "/run",
        "/var/run",
        "/boot",
        "/root",
        "/forge",
        "/tmp/.X11-unix",
        "/var/lib/sss",
    )
)
"""Never mountable, nor anything inside or containing them (so ``/`` neither)."""

_RESERVED_DESTS = frozenset({"/", "/usr", "/tmp", "/bin", "/sbin", "/lib", "/lib64"})


@dataclass(frozen=True)
class Bind:
    """One ``x-bind`` path as the schema gave it."""

    path: Path
    mode: Literal["ro", "rw"]


@dataclass(frozen=True)
class ResolvedBind:
    """A checked bind: the resolved path and the inode that was checked."""

    path: Path
    mode: Literal["ro", "rw"]
    dev: int
    ino: int
    is_dir: bool
    requested: Path


def forbidden_for(config: Config) -> tuple[Path, ...]:
    """The host paths of ``config`` no tool may mount (state, forge, audit, socket, vault, keys)."""
    paths = [
        config.state_dir,
        config.forge_dir,
        config.audit_path,
        config.socket_path,
        config.socket_path.parent,
        config.secrets_path,
        config.keys_dir,
    ]
    if config.secrets.key_file:
        paths.append(Path(config.secrets.key_file))
    credentials = os.environ.get("CREDENTIALS_DIRECTORY")
    if credentials:
        paths.append(Path(credentials))
    return tuple(paths)


def _refuse(path: Path | str, why: str) -> SandboxError:
    return SandboxError("mount_refused", f"x-bind {path}: {why}")


def _related(a: str, b: str) -> bool:
    """Is one of two normalized absolute paths the other or inside it?"""
    if a == b:
        return True
    a_dir = a if a.endswith("/") else a + "/"
    b_dir = b if b.endswith("/") else b + "/"
    return a.startswith(b_dir) or b.startswith(a_dir)


def _forbidden_set(forbidden: Iterable[Path]) -> list[str]:
    out: list[str] = []
    for path in (*SYSTEM_FORBIDDEN, *forbidden):
        text = os.path.normpath(os.path.abspath(path))
        out.append(text)
        real = os.path.realpath(text)
        if real != text:
            out.append(real)
    return out


def _may(info: os.stat_result, uid: int, gids: frozenset[int], want: int) -> bool:
    """Would ``uid``/``gids`` get ``want`` (rwx bits, 0-7) on this inode by its mode?"""
    mode = info.st_mode
    if uid == 0:
        return True
    if info.st_uid == uid:
        bits = (mode >> 6) & 7
    elif info.st_gid in gids:
        bits = (mode >> 3) & 7
    else:
        bits = mode & 7
    return bits & want == want


def check_binds(
    binds: Sequence[Bind],
    forbidden: Iterable[Path] = (),
    *,
    uid: int | None = None,
    gids: Iterable[int] = (),
) -> tuple[ResolvedBind, ...]:
    """Resolve and check ``binds``; ``SandboxError("mount_refused")`` for any bad one.

    Refused: a relative path, one that does not exist, anything but a regular
    file or a directory (no sockets, devices, fifos), a path that is (or,
    after resolving symlinks, lands) inside, equal to or above a forbidden
    path (:data:`SYSTEM_FORBIDDEN` plus ``forbidden``), a mount point the
    sandbox itself needs (``/usr``, ``/tmp`` ...).  With ``uid``: a path that
    uid could not reach through its parents, read, or (``rw``) write by the
    mode bits - the sandbox must not see more than its uid could.
    Returned sorted parents first; the same path twice is bound once, ``ro``
    winning over ``rw``.
    """
    forbid = _forbidden_set(forbidden)
    group_ids = frozenset(gids)
    chosen: dict[str, ResolvedBind] = {}
    for bind in binds:
        if bind.mode not in ("ro", "rw"):
            raise _refuse(bind.path, f"mode {bind.mode!r} is neither ro nor rw")
        raw = str(bind.path)
        if not raw or "\0" in raw or not os.path.isabs(raw):
            raise _refuse(bind.path, "not an absolute path")
        lexical = os.path.normpath(raw)
        try:
            real = os.path.realpath(raw, strict=True)
        except OSError as exc:
            raise _refuse(bind.path, f"cannot resolve it: {exc.strerror or exc}") from None
        for candidate in (lexical, real):
            for bad in forbid:
                if _related(candidate, bad):
                    via = "" if candidate == lexical else f" (it resolves to {real})"
                    raise _refuse(bind.path, f"overlaps {bad}, which is never mounted{via}")
            if candidate in _RESERVED_DESTS:
                raise _refuse(bind.path, "the sandbox's own mount point")
        try:
            info = os.stat(real)
        except OSError as exc:
            raise _refuse(bind.path, f"cannot stat it: {exc.strerror or exc}") from None
        is_dir = stat.S_ISDIR(info.st_mode)
        if not (is_dir or stat.S_ISREG(info.st_mode)):
            raise _refuse(bind.path, "neither a regular file nor a directory")
        if uid is not None:
            _check_access(Path(real), info, bind, uid, group_ids, is_dir)
        resolved = ResolvedBind(
            path=Path(real),
            mode=bind.mode,
            dev=info.st_dev,
            ino=info.st_ino,
            is_dir=is_dir,
            requested=bind.path,
        )
        previous = chosen.get(real)
        if previous is None or (previous.mode == "rw" and bind.mode == "ro"):
            chosen[real] = resolved
    return tuple(sorted(chosen.values(), key=lambda b: (str(b.path).count("/"), str(b.path))))


def _check_access(
    real: Path, info: os.stat_result, bind: Bind, uid: int, gids: frozenset[int], is_dir: bool
) -> None:
    for parent in reversed(real.parents):
        try:
            parent_info = os.stat(parent)
        except OSError as exc:
            raise _refuse(bind.path, f"cannot stat {parent}: {exc.strerror}") from None
        if not _may(parent_info, uid, gids, 1):
            raise _refuse(
                bind.path,
                f"uid {uid} cannot enter {parent} (the sandbox sees no more than its uid may)",
            )
    want = 4 | (1 if is_dir else 0) | (2 if bind.mode == "rw" else 0)
    if not _may(info, uid, gids, want):
        need = "read and write" if bind.mode == "rw" else "read"
        raise _refuse(
            bind.path,
            f"uid {uid} may not {need} it (chown, chmod or an ACL for the sandbox uid)",
        )


def open_binds(binds: Sequence[ResolvedBind]) -> list[int]:
    """An ``O_PATH`` descriptor per bind, opened without following any symlink.

    Each component is opened ``O_NOFOLLOW`` from ``/``; the inode reached must
    be the one :func:`check_binds` saw.  A path swapped (for a symlink or
    anything else) since the check is refused.  The caller closes the fds.
    """
    fds: list[int] = []
    try:
        for bind in binds:
            fds.append(_open_nofollow(bind))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def _open_nofollow(bind: ResolvedBind) -> int:
    flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
    parts = [p for p in str(bind.path).split("/") if p]
    fd = os.open("/", flags | os.O_DIRECTORY)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            try:
                nxt = os.open(part, flags | (0 if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as exc:
                why = (
                    "it was swapped for a symlink after it was checked"
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR)
                    else f"cannot open it: {exc.strerror}"
                )
                raise _refuse(bind.requested, why) from None
            os.close(fd)
            fd = nxt
        info = os.fstat(fd)
        if stat.S_ISLNK(info.st_mode):
            raise _refuse(bind.requested, "it was swapped for a symlink after it was checked")
        if (info.st_dev, info.st_ino) != (bind.dev, bind.ino):
            raise _refuse(bind.requested, "it was replaced after it was checked")
    except BaseException:
        os.close(fd)
        raise
    return fd
