"""Process checks for the benchmarks and the harness tests: is a pid alive, who carries a marker."""

from __future__ import annotations

import os

__all__ = ("alive", "marked")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def marked(marker: bytes) -> list[int]:
    """Live processes, other than this one, whose environment contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]
