"""What every check of ``astrid doctor`` shares: a report row, and what is wrong with a
file's owner and mode.  Apart from sage/cli/doctor.py so that its fleet checks
(sage/cli/doctor_fleet.py) use them without an import cycle."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = ("Check", "Status", "owner_and_mode")

Status = Literal["ok", "warn", "fail"]


class Check(msgspec.Struct, frozen=True, kw_only=True):
    """One row of the report."""

    name: str
    status: Status
    detail: str
    """One line for a human."""
    facts: dict[str, Any] = {}
    """Machine-readable extras, merged into the row in ``--json`` output."""


def owner_and_mode(path: Path, info: os.stat_result, allowed: int, *, need: int) -> list[str]:
    """What is wrong with who owns ``path`` and who may use it (empty: nothing)."""
    problems = []
    me = os.getuid()
    if info.st_uid != me:
        problems.append(
            f"{path} belongs to uid {info.st_uid}, not to uid {me} (you); chown it to the"
            " supervisor's user, and run astrid doctor as that user"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & ~allowed:
        can = "write to" if mode & 0o022 & ~allowed else "read"
        who = f"group or others can {can} it"
        problems.append(
            f"{path} has mode {mode:04o}, {who} (want {allowed:04o}); run `chmod {allowed:o} {path}`"
        )
    elif mode & need != need:
        problems.append(f"{path} has mode {mode:04o}, the owner lacks {need:04o}")
    return problems
