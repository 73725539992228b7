"""The node's lease: never two live children for one conversation across a partition.

Sans-IO.  Without it a node cut off from NATS (a partition, a paused supervisor)
keeps its sessions' ``claude`` children running while the other nodes judge it lost
and adopt those sessions: two children run one conversation until the node returns
and fences (sage/fleet/fencing.py).  With it the node stops its own children first:

- **Granted by the heartbeat.** Each heartbeat write that NATS acknowledged grants the
  node a lease until :func:`lease_term` seconds after the write *began*, by the host's
  monotonic clock: the supervisor hands the time to its session runner
  (:class:`~sage.contract.sessions.LeaseGrant` on ``sage.v1.fleet.lease``) and to the
  fence process (sage/fence.py).  The other nodes judge the node by the record that
  write carried, so the lease ends before any of them may judge it lost.
- **Held by the runner and the fence.** Without a lease the runner starts no child,
  writes no turn and runs no tool call (capsules/runner/fleet_lease.py); once a lease
  it held expires, the fence kills every session's child's process group at once
  (SIGKILL), and the runner hibernates those sessions.  The fence is a process of its
  own because the runner runs in the supervisor's process, which a SIGSTOP or a stall
  freezes with it.  A new grant lets the sessions wake again; those another node took
  meanwhile are then yielded, as before (``failed_over``).
- **Why it holds.** Another node adopts a session once the node's last record is
  older than ``lost_after`` by *its* clock, and the failover waits that long.  The
  lease ends ``lost_after - max_clock_skew - FENCE_TIME`` after the write began
  (:func:`lease_term`), and the runner has killed every child within
  :data:`FENCE_TIME` after that, so the children are gone before any adoption as long
  as no two nodes' clocks are more than ``[fleet] max_clock_skew`` apart (1 s by
  default; ``astrid doctor`` measures each host against the servers) and the runner
  is not itself stalled past :data:`FENCE_TIME`.  docs/fleet.md, "Leases", states it
  with its assumptions.
- **What it costs.** A node whose heartbeat writes stall longer than the lease (4.75 s
  with the defaults) loses it though the others may not have judged it lost yet:
  its sessions hibernate, and a send wakes them (``--resume``) once the lease is
  back.  The node beats at least twice a lease (:func:`beat_interval`); the config
  refuses a lease shorter than one heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

__all__ = ("FENCE_TIME", "Lease", "beat_interval", "lease_term")

FENCE_TIME: Final = 0.25
"""Seconds the runner takes at most, once its lease expired, to have killed every
session's child (it looks every :data:`FENCE_POLL`, and SIGKILL is at once)."""
FENCE_POLL: Final = 0.05
"""Seconds between two looks of the runner's watch while its lease is lost."""


def lease_term(lost_after: float, max_clock_skew: float) -> float:
    """How long one acknowledged heartbeat write lets the node run its children."""
    return round(lost_after - max_clock_skew - FENCE_TIME, 6)


def beat_interval(heartbeat: float, term: float) -> float:
    """Seconds between two heartbeats: ``heartbeat``, or less when the lease is short
    (two beats a lease at least, so one slow write does not lose it)."""
    return min(heartbeat, term / 2)


class Lease:
    """The runner's lease: granted until a monotonic time, held while that is ahead.

    ``pending``: never granted since the runner started (the first heartbeat after it
    is on its way); ``lost``: a lease it held has expired and no new one came."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.until: float | None = None
        self.grants = 0
        self.losses = 0
        self.lapsed_at: float | None = None
        """When the lease last ran out (monotonic), once noted."""
        self._lost = False

    def grant(self, until: float) -> bool:
        """Take a grant; True when it ends a loss (the lease is held again).  A grant
        that comes after the lease ran out, before anyone noted it (a frozen process
        thawed: the grant and the fence's kill arrive together), is a lapse too."""
        if self.until is not None and not self._lost and self.clock() >= self.until:
            self._lost = True
            self.losses += 1
            self.lapsed_at = self.clock()
        self.until = until if self.until is None else max(self.until, until)
        self.grants += 1
        if self._lost and self.held():
            self._lost = False
            return True
        return False

    @property
    def pending(self) -> bool:
        return self.until is None

    def held(self) -> bool:
        return self.until is not None and self.clock() < self.until

    def remaining(self) -> float:
        """Seconds the lease holds yet (0: not held)."""
        return 0.0 if self.until is None else max(0.0, self.until - self.clock())

    def expire(self) -> bool:
        """Note that the lease is not held now; True the first time after it was (the
        moment to fence)."""
        if self._lost or self.pending or self.held():
            return False
        self._lost = True
        self.losses += 1
        self.lapsed_at = self.clock()
        return True

    def lapsed_within(self, seconds: float) -> bool:
        """Whether the lease is not held now (once held), or ran out in the last
        ``seconds``: a child that died then was the fence's."""
        if self.pending:
            return False
        if self._lost or not self.held():
            return True
        return self.lapsed_at is not None and self.clock() - self.lapsed_at <= seconds

    @property
    def lost(self) -> bool:
        return self._lost
