"""The last events of each session, for ``astrid sage watch --replay N``.

A ring of :data:`RING` events per session, each with the id the bus gave its
envelope, so a watcher that subscribed before it asked can drop the live
copies of what the replay already showed (ids are one increasing sequence per
supervisor).  Rings of live sessions are kept; of ended ones only the
:data:`ENDED_KEPT` most recent, so memory is bounded by the number of live
sessions.  No I/O: the runner feeds it what it publishes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Final

__all__ = ("ENDED_KEPT", "RING", "EventHistory")

RING: Final = 256
"""Events kept per session: the most ``--replay`` can show."""
ENDED_KEPT: Final = 64
"""Ended sessions whose rings are kept (the oldest go first)."""

_Entry = tuple[int, str, float, dict[str, Any]]


class EventHistory:
    def __init__(self, ring: int = RING, ended_kept: int = ENDED_KEPT) -> None:
        self._ring = ring
        self._ended_kept = ended_kept
        self._rings: dict[str, deque[_Entry]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()

    def record(
        self, sid: str, envelope_id: int, name: str, ts: float, data: dict[str, Any]
    ) -> None:
        ring = self._rings.get(sid)
        if ring is None:
            ring = self._rings[sid] = deque(maxlen=self._ring)
        ring.append((envelope_id, name, ts, data))
        self._ended.pop(sid, None)  # a session spawned again under an ended id

    def ended(self, sid: str) -> None:
        """``sid`` ended: its ring is kept among the most recent ended ones."""
        if sid not in self._rings:
            return
        self._ended[sid] = None
        self._ended.move_to_end(sid)
        while len(self._ended) > self._ended_kept:
            gone, _ = self._ended.popitem(last=False)
            self._rings.pop(gone, None)

    def last(self, sid: str, count: int) -> list[dict[str, Any]]:
        """The last ``count`` events of ``sid``, oldest first, as watch prints them."""
        ring = self._rings.get(sid)
        if ring is None or count <= 0:
            return []
        entries = list(ring)[-count:]
        return [{"id": i, "event": name, "ts": ts, "data": data} for i, name, ts, data in entries]

    def __len__(self) -> int:
        return len(self._rings)
