"""The session events the router keeps its books by, on a queue of their own.

The router publishes every local session event on NATS from one subscription to
``sage.v1.event.>``, which every streamed text delta shares.  Under a flood of
deltas that queue fills and the bus drops what comes next: a dropped
``spawned`` left a session out of the registry (never reachable from other
nodes, never failed over), a dropped ``exited`` left its entry and its stored
transcript behind.  :class:`LifecycleEvents` takes only the events the books
need (:data:`LIFECYCLE`: ``spawned`` puts the registry entry, ``hibernated`` marks it
asleep, ``exited`` deletes
it and the transcript, ``done`` replicates the transcript) into a bounded queue
of their own, so deltas never crowd them out.  It is a bus subscriber of the
same pattern that queues nothing else, in the order the bus published them.  A
full queue (the router stalled) is logged for each event dropped, and
:attr:`lost` tells the router to resync the registry with its runner.
"""

from __future__ import annotations

import structlog

from bus import Envelope, Identity, Subscription
from sage.contract.sessions import EVENTS, SessionEvent

__all__ = ("LIFECYCLE", "LIFECYCLE_QUEUE", "LifecycleEvents")

log = structlog.get_logger("sage.fleet.lifecycle")

LIFECYCLE = frozenset(
    {SessionEvent.SPAWNED, SessionEvent.HIBERNATED, SessionEvent.EXITED, SessionEvent.DONE}
)
"""The session events the registry (sage/fleet/router.py) and failover
(sage/fleet/failover.py) follow; a woken session's ``spawned`` is among them, and
``hibernated`` marks its entry asleep (a node that adopts it keeps it so)."""
LIFECYCLE_QUEUE = 4096
"""Lifecycle events queued at most (a handful per session; deltas never count)."""


class LifecycleEvents:
    """A bus subscriber to every session event that keeps only :data:`LIFECYCLE`."""

    pattern = EVENTS

    def __init__(self, owner: Identity, limit: int = LIFECYCLE_QUEUE) -> None:
        self.owner = owner
        self.queue = Subscription(self.pattern, owner, limit)
        """What the router reads (``async for``), oldest first."""
        self.lost = False
        """An event was dropped since the router last looked: its books need a resync."""
        self.delivered = 0
        self.dropped = 0

    def deliver(self, envelope: Envelope) -> bool:
        name = envelope.topic.rsplit(".", 1)[-1]
        if name not in LIFECYCLE:
            return True  # not one of ours: nothing to keep, nothing lost
        if self.queue.deliver(envelope):
            self.delivered += 1
            return True
        self.dropped += 1
        self.lost = True
        log.warning(
            "fleet.lifecycle_event_dropped",
            topic=envelope.topic,
            queued=len(self.queue),
            dropped=self.dropped,
        )
        return False

    def close(self) -> None:
        self.queue.close()
