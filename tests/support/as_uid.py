"""A bus client forked from the test as another uid, for the tests that need root.

Forked, not executed: the interpreter and the test's modules are already
loaded, so the child starts in milliseconds and runs a closure of the test.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Awaitable, Callable

import anyio

__all__ = ("NOGROUP", "Say", "fork_as")

#: The group every forked client takes (the tests' ``[socket] group = "nogroup"``).
NOGROUP = 65534

#: Writes one line (a newline is added) to the pipe the test reads.
Say = Callable[[str], None]


def fork_as(uid: int | None, main: Callable[[Say], Awaitable[None]]) -> tuple[int, int]:
    """Fork a child that takes ``uid`` (group nogroup, no supplementary groups) unless
    None (it stays root), runs ``main(say)`` under anyio and exits 0; it never returns
    into pytest.  A failure exits 1, reported on stderr and as a line ``error ...`` on
    the pipe.  Returns (pid, read end of the pipe); the caller reaps the pid and closes
    the read end.  Fork from a worker thread when an event loop runs in this one."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    code = 0
    try:
        os.close(read)
        if uid is not None:
            os.setgroups([])
            os.setgid(NOGROUP)
            os.setuid(uid)

        def say(line: str) -> None:
            os.write(write, line.encode() + b"\n")

        anyio.run(main, say)
    except BaseException as exc:  # report, never return into pytest
        print(f"forked as uid {uid}: {type(exc).__name__}: {exc}", file=sys.stderr)
        with contextlib.suppress(OSError):  # the test may have stopped reading
            os.write(write, f"error {exc!r}\n".encode())
        code = 1
    os._exit(code)
