"""One supervisor per state folder: ``<state_dir>/supervisor.lock``, ``flock``ed and
holding the pid, so a second start says who runs instead of failing deeper down."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from sage.errors import SageError

__all__ = ("AlreadyRunning", "InstanceLock")


class AlreadyRunning(SageError):
    """Another supervisor holds this state folder."""

    code = "already_running"


class InstanceLock:
    """Held while a supervisor runs on a state folder; see the module docstring."""

    def __init__(self, state_dir: Path, socket: Path) -> None:
        self.path = state_dir / "supervisor.lock"
        self.socket = socket
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunning(
                    f"already running (pid {holder}, socket {self.socket});"
                    f" state folder {self.path.parent}"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)
            self._fd = None
