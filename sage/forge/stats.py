"""What the forge counts, kept across restarts: ``<forge_dir>/stats.json``.

Call counts per (scope, tool) (``forge_list``'s ``call_count``), the failure
breakers that are not at rest and each session's forge count.  The file is
replaced atomically (never torn) but not fsynced, and written at most once
per :data:`SAVE_EVERY` seconds of calls, at once when a breaker changes
state, and when the forge closes: a crash can lose the counts of the last
second, never a breaker that opened.  An unreadable file is reported
(``stats_load_failed``) and the forge starts from zero; it never stops the
forge.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sage.files import write_replace

__all__ = ("SAVE_EVERY", "SCHEMA", "StatsFile")

SCHEMA = 1
SAVE_EVERY = 1.0
"""Seconds between two saves caused by calls alone."""

Emit = Callable[[str, dict[str, Any]], None]


class StatsFile:
    def __init__(self, path: Path, emit: Emit) -> None:
        self.path = path
        self.emit = emit

    def load(self) -> tuple[Counter[tuple[str, str]], dict[str, Any]]:
        """The call counts and the breaker board's saved state; empty when there is none."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return Counter(), {}
        except OSError as exc:
            return self._failed(f"cannot read it: {exc.strerror or exc}")
        try:
            data = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            return self._failed(f"not JSON: {exc}")
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            return self._failed(f"not a schema {SCHEMA} stats file")
        counts: Counter[tuple[str, str]] = Counter()
        calls = data.get("calls")
        for key, value in (calls if isinstance(calls, dict) else {}).items():
            scope, sep, name = key.partition(":")
            if sep and isinstance(value, int) and not isinstance(value, bool) and value > 0:
                counts[(scope, name)] = value
        breakers = data.get("breakers")
        return counts, breakers if isinstance(breakers, dict) else {}

    def _failed(self, why: str) -> tuple[Counter[tuple[str, str]], dict[str, Any]]:
        self.emit("stats_load_failed", {"path": str(self.path), "reason": why[:300]})
        return Counter(), {}

    def save(self, counts: Counter[tuple[str, str]], breakers: dict[str, Any]) -> None:
        data = {
            "schema": SCHEMA,
            "calls": {f"{scope}:{name}": n for (scope, name), n in sorted(counts.items())},
            "breakers": breakers,
        }
        write_replace(self.path, msgspec.json.encode(data), durable=False)
