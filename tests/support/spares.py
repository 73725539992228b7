"""Finding a supervisor's warm spares from a test: its ``claude`` children that no
listing names, once each has logged ``spare.ready``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from tests.support.daemon import descendants
from tests.support.sage_harness import Sage

__all__ = ("claude_children", "environ", "listed", "ready_spares")


def environ(pid: int) -> dict[str, str]:
    """The environment of process ``pid`` (empty when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return dict(pairs)


def claude_children(sage: Sage) -> dict[str, int]:
    """The supervisor's ``claude`` children by their session id."""
    assert sage.daemon.proc is not None
    out: dict[str, int] = {}
    for pid in descendants(sage.daemon.proc.pid):
        env = environ(pid)
        if "ASTRID_SESSION_ID" in env:
            out[env["ASTRID_SESSION_ID"]] = pid
    return out


async def listed(sage: Sage) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = (await sage.request("sage.v1.request.sessions", {}))["sessions"]
    return rows


async def ready_spares(sage: Sage, count: int = 1, within: float = 30.0) -> dict[str, int]:
    """Wait until at least ``count`` spares are ready; their pids by session id."""
    with anyio.fail_after(within):
        while True:
            names = {row["session_id"] for row in await listed(sage)}
            spares = {s: p for s, p in claude_children(sage).items() if s not in names}
            ready = "\n".join(
                line for line in sage.daemon.log().splitlines() if "spare.ready" in line
            )
            spares = {s: p for s, p in spares.items() if f'"session_id": "{s}"' in ready}
            if len(spares) >= count:
                return spares
            await anyio.sleep(0.05)
