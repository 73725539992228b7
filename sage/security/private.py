"""Reading a file only the supervisor's uid may read: the audit key, the secrets key.

:func:`read_private` opens without following a symlink, then checks the
open file itself (``fstat``, so a swap after the check cannot matter): no
group or other bits, owned by the effective uid.  ``check_owner=False`` is
for files whose owner and mode another party sets, such as systemd's
``$CREDENTIALS_DIRECTORY``.  A missing file raises ``FileNotFoundError``
(callers create it); anything else raises ``error(message)``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from sage.errors import SageError

__all__ = ("read_private",)


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
