"""A synchronous bus subscriber: its handler runs inside the publish, with no queue.

The audit sink is one (sage/daemon/supervisor.py); the usage ledger and the metrics
use :class:`Tap` for the events they count, so a model call is counted (and a budget
decided) in the very publish that reports it, nothing is ever dropped, and no task
wakes for it.  A handler must be quick and must not block; one that raises is
logged and the publisher never sees it.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from bus import Envelope, Identity

__all__ = ("Tap",)

log = structlog.get_logger("sage.usage")


class Tap:
    """Hands each envelope on ``pattern`` to ``handler`` as it is published."""

    def __init__(self, pattern: str, owner: Identity, handler: Callable[[Envelope], None]) -> None:
        self.pattern = pattern
        self.owner = owner
        self.handler = handler
        self.delivered = 0
        self.dropped = 0

    def deliver(self, envelope: Envelope) -> bool:
        try:
            self.handler(envelope)
        except Exception:  # a counting bug must never fail the publisher
            log.exception("usage.tap_failed", pattern=self.pattern, topic=envelope.topic)
        self.delivered += 1
        return True
