"""The last events of each session, for ``astrid sage watch --replay N``.

A ring of :data:`RING` events per session, each with the id the bus gave its
envelope, so a watcher that subscribed before it asked can drop the live
copies of what the replay already showed (ids are one increasing sequence per
supervisor).  Rings of live sessions are kept; of ended ones only the
:data:`ENDED_KEPT` most recent, so memory is bounded by the number of live
sessions.  What is there for programs following live (``sage.client``) and can be
large is not kept (:data:`NOT_KEPT`, :data:`FIELDS_NOT_KEPT`): a ring stays small,
and a replay of 256 events fits in one reply.  No I/O: the runner feeds it what it
publishes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Final

__all__ = ("ENDED_KEPT", "FIELDS_NOT_KEPT", "NOT_KEPT", "RING", "EventHistory")

RING: Final = 256
"""Events kept per session: the most ``--replay`` can show."""
ENDED_KEPT: Final = 64
"""Ended sessions whose rings are kept (the oldest go first)."""

NOT_KEPT: Final = frozenset({"assistant"})
"""Events not kept: a whole message (up to 512 KiB), whose text the ``text`` events have."""
FIELDS_NOT_KEPT: Final = ("content", "content_preview", "content_bytes", "result")
"""Fields dropped from a kept event: a tool's result (``tool_result``), a turn's final
text (``done``), up to 64 KiB each."""

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
        if name in NOT_KEPT:
            return
        if any(key in data for key in FIELDS_NOT_KEPT):
            data = {k: v for k, v in data.items() if k not in FIELDS_NOT_KEPT}
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
