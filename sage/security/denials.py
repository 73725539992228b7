"""How many refusals get an audit entry each: a flood of denials must not fill the audit log.

The supervisor limits the refusals it audits per peer, the hooks capsule
per principal; both use :class:`DenialLimiter`, a pure policy on the caller's clock.
"""

from __future__ import annotations

__all__ = ("DenialLimiter",)


class DenialLimiter:
    """At most ``burst`` audited refusals per source per ``window`` seconds (pure: caller's clock).

    A peer that hammers a topic it may not use would otherwise fill the audit
    log; the refusals past the limit are counted, and the next audited one
    says how many were not written one by one.
    """

    def __init__(self, burst: int = 20, window: float = 60.0) -> None:
        self.burst = burst
        self.window = window
        self._seen: dict[str, tuple[float, int, int]] = {}

    def admit(self, source: str, now: float) -> int | None:
        """None: do not audit this one. Else audit it, noting this many suppressed before it."""
        start, count, suppressed = self._seen.get(source, (now, 0, 0))
        if now - start >= self.window:
            start, count = now, 0
        if count >= self.burst:
            self._seen[source] = (start, count, suppressed + 1)
            return None
        if len(self._seen) > 10_000:
            self._seen.clear()
        self._seen[source] = (start, count + 1, 0)
        return suppressed
