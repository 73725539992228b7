"""The fence: a small process that kills a node's ``claude`` children when its fleet
lease runs out, even while the supervisor itself is frozen (sage/lease.py).

``python -m sage.fence ROOT_PID``, started by the supervisor of a fleet node
(:class:`~sage.fleet.fence_keeper.FenceKeeper`), reads one grant per line on stdin:
the monotonic time (the host's ``CLOCK_MONOTONIC``, which it shares with the
supervisor) until which the node holds its lease.  Once that time passes with no
later grant, it sends SIGKILL to the process group of every descendant of
``ROOT_PID`` that is a session's child (its environment names ``ASTRID_SESSION_ID``
and it leads its group: the runner starts each child in a group of its own, so the
child's tools go with it), and again every :data:`POLL` seconds while the lease
stays lost.  A later grant stops it.  End of input (the supervisor is gone): it
exits.  It writes one line to stderr per kill, and nothing else.

Why a process of its own: the session runner fences its sessions too
(capsules/runner/fleet_lease.py), but it runs in the supervisor's process, which a
SIGSTOP (or a long stall) freezes with it; this process is not frozen with it.  It
imports nothing beyond the standard library, so it starts in milliseconds.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

POLL = 0.05
"""Seconds between two looks for children while the lease is lost."""
MARK = b"ASTRID_SESSION_ID="


def _children_of(root: int) -> dict[int, list[int]]:
    """ppid -> pids, from /proc (a process that goes meanwhile is left out)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        # the command may hold spaces and parentheses: the fields follow the last ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            tree.setdefault(int(fields[1]), []).append(int(entry))
    return tree


def session_groups(root: int) -> list[int]:
    """The process groups of ``root``'s descendants that are sessions' children."""
    tree = _children_of(root)
    found: list[int] = []
    todo = list(tree.get(root, []))
    while todo:
        pid = todo.pop()
        todo.extend(tree.get(pid, []))
        try:
            if os.getpgid(pid) != pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as file:
                environ = file.read()
        except OSError:
            continue
        if any(item.startswith(MARK) for item in environ.split(b"\0")):
            found.append(pid)
    return found


def fence(root: int) -> int:
    """Kill every session child's group below ``root``; how many."""
    killed = 0
    for group in session_groups(root):
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            continue
        killed += 1
        print(f"sage.fence: lease lost, killed group {group}", file=sys.stderr, flush=True)
    return killed


def run(root: int, grants: int = 0) -> int:
    """Serve grants from the descriptor ``grants`` until it ends."""
    until: float | None = None
    buffered = b""
    while True:
        now = time.monotonic()
        if until is None:
            timeout = None
        elif now < until:
            timeout = until - now
        else:  # lost: fence, and look again soon for what a start in flight adds
            fence(root)
            timeout = POLL
        ready, _, _ = select.select([grants], [], [], timeout)
        if not ready:
            continue
        chunk = os.read(grants, 4096)
        if not chunk:
            return 0
        buffered += chunk
        *lines, buffered = buffered.split(b"\n")
        for line in lines:
            try:
                granted = float(line)
            except ValueError:
                continue
            until = granted if until is None else max(until, granted)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not argv[0].isdigit():
        print("usage: python -m sage.fence ROOT_PID  (grants on stdin)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor ends it (end of input)
    return run(int(argv[0]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
