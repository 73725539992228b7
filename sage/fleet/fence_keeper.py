"""The supervisor's side of the fence process (sage/fence.py): start it, hand it each
lease grant, end it.

:meth:`FenceKeeper.run` starts ``python -m sage.fence <supervisor pid>`` (its stderr
the supervisor's) and keeps it for the supervisor's life; :meth:`FenceKeeper.grant`
writes the monotonic time the lease holds until, one line, from the heartbeat's
callback (sage/fleet/member.py, ``renewed``).  A fence that died is started again at
the next grant (logged ``fleet.fence_restarted``); until then the runner's own fence
(capsules/runner/fleet_lease.py) still holds while the supervisor runs.  Leaving
closes its input, which ends it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from typing import Final

import anyio
import anyio.abc
import anyio.to_thread
import structlog

__all__ = ("FenceKeeper",)

log = structlog.get_logger("sage.fleet")

STOP_WAIT: Final = 2.0


class FenceKeeper:
    """See the module docstring."""

    def __init__(self, root: int | None = None) -> None:
        self.root = os.getpid() if root is None else root
        self._proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    def _start(self) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sage.fence", str(self.root)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            close_fds=True,
        )
        log.info("fleet.fence_started", pid=proc.pid)
        return proc

    def grant(self, until: float) -> None:
        """Tell the fence the lease holds until ``until`` (monotonic seconds)."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is not None:  # it died: a new one takes this grant
            self.restarts += 1
            log.warning("fleet.fence_restarted", exit_code=proc.returncode)
            proc = self._proc = self._start()
        assert proc.stdin is not None
        try:
            proc.stdin.write(f"{until!r}\n".encode())
            proc.stdin.flush()
        except OSError as exc:
            log.warning("fleet.fence_grant_failed", error=str(exc))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Keep the fence until cancelled."""
        self._proc = self._start()
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            proc, self._proc = self._proc, None
            if proc is not None:
                with contextlib.suppress(OSError):
                    assert proc.stdin is not None
                    proc.stdin.close()
                with anyio.CancelScope(shield=True):
                    try:
                        await anyio.to_thread.run_sync(proc.wait, STOP_WAIT)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
