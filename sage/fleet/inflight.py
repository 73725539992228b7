"""How many forwarded requests or tool calls of each peer this node answers at once.

Each request or tool call another node sends over NATS becomes a task here, and
one may wait up to two minutes (a ``send``'s turn, a tool's run).  Without a
bound, a peer that floods (a bug, or a compromised node) would grow tasks and
memory without end.  :class:`InFlight` counts them per origin node (the origin
the NATS server proved, from the subject): past :data:`MAX_IN_FLIGHT` the next
one is refused at once with :class:`FleetBusy` (``fleet_busy``), and the peer
may ask again when some have been answered.  The count is per origin, so one
busy or hostile peer never stops another's requests.  Sans-IO: the router and
the tool server take and give back around each task.
"""

from __future__ import annotations

from sage.errors import FleetBusy

__all__ = ("MAX_IN_FLIGHT", "InFlight")

MAX_IN_FLIGHT = 256
"""Requests (and, apart, tool calls) of one peer being answered at once, at most."""


class InFlight:
    """The requests (or tool calls) of each origin node being answered now."""

    def __init__(self, what: str, limit: int = MAX_IN_FLIGHT) -> None:
        self._what = what
        self._limit = limit
        self._counts: dict[str, int] = {}

    def take(self, origin: str) -> None:
        """Count one more of ``origin``'s, or raise FleetBusy (nothing counted)."""
        held = self._counts.get(origin, 0)
        if held >= self._limit:
            raise FleetBusy(
                f"node {origin!r} has {held} {self._what} in flight on this node (at most"
                f" {self._limit}): try again when some have been answered"
            )
        self._counts[origin] = held + 1

    def give_back(self, origin: str) -> None:
        """One of ``origin``'s was answered (or failed)."""
        held = self._counts.get(origin, 0) - 1
        if held > 0:
            self._counts[origin] = held
        else:
            self._counts.pop(origin, None)

    def of(self, origin: str) -> int:
        return self._counts.get(origin, 0)
