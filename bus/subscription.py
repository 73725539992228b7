"""Bounded delivery to one subscriber.

A :class:`Subscription` owns a bounded queue.  Delivery never blocks the
publisher: when the queue is full the envelope is dropped and counted.  The
consumer iterates with ``async for``; closing the subscription ends the
iteration once the queue is drained.  States: OPEN -> CLOSED, once.

A :class:`FairSubscription` bounds the queue per source instead and serves
the sources in turn, so one flooding publisher fills only its own lane.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import anyio

from bus.envelope import Envelope

if TYPE_CHECKING:
    from bus.acl import Identity

__all__ = ("FairSubscription", "Subscription", "SubscriptionState")


class SubscriptionState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


_CLOSED = SubscriptionState.CLOSED


class Subscription:
    """One pattern's bounded queue of envelopes."""

    __slots__ = (
        "_on_close",
        "_queue",
        "_waiter",
        "delivered",
        "dropped",
        "limit",
        "owner",
        "pattern",
        "state",
    )

    def __init__(
        self,
        pattern: str,
        owner: Identity,
        limit: int,
        on_close: Callable[[Subscription], None] | None = None,
    ) -> None:
        self.pattern = pattern
        self.owner = owner
        self.limit = limit
        self.delivered = 0
        self.dropped = 0
        self.state = SubscriptionState.OPEN
        self._queue: deque[Envelope] = deque()
        self._waiter: anyio.Event | None = None
        self._on_close = on_close

    def deliver(self, envelope: Envelope) -> bool:
        """Queue ``envelope``; False (and counted) when full or closed."""
        queue = self._queue
        # a module constant: SubscriptionState.CLOSED costs an enum lookup per delivery
        if len(queue) >= self.limit or self.state is _CLOSED:
            self.dropped += 1
            return False
        queue.append(envelope)
        self.delivered += 1
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()
        return True

    def __len__(self) -> int:
        return len(self._queue)

    def get_nowait(self) -> Envelope | None:
        return self._queue.popleft() if self._queue else None

    def drain(self) -> list[Envelope]:
        """Everything queued now, oldest first."""
        items = list(self._queue)
        self._queue.clear()
        return items

    async def get(self) -> Envelope:
        """The next envelope; raises EndOfStream once closed and drained."""
        await self._until_queued()
        return self._queue.popleft()

    async def _until_queued(self) -> None:
        """Wait until something is queued; EndOfStream once closed with nothing left."""
        while not len(self):
            if self.state is SubscriptionState.CLOSED:
                raise anyio.EndOfStream
            waiter = self._waiter
            if waiter is None:
                waiter = self._waiter = anyio.Event()
            await waiter.wait()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Envelope:
        queue = self._queue
        if queue:  # fast path: no second coroutine per envelope when one is queued
            return queue.popleft()
        try:
            return await self.get()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Stop delivery; a waiting consumer finishes what is queued, then stops."""
        if self.state is SubscriptionState.CLOSED:
            return
        self.state = SubscriptionState.CLOSED
        if self._on_close is not None:
            self._on_close(self)
        if self._waiter is not None:
            self._waiter.set()
            self._waiter = None

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FairSubscription(Subscription):
    """A subscription with one bounded lane per source, served in turn.

    ``key`` names an envelope's source (e.g. its publisher's uid).  Each
    source may have at most ``limit`` envelopes queued; past that its own
    envelopes are dropped, counted in :attr:`dropped` and per source (see
    :meth:`take_drops`), never another source's.  The consumer takes one
    envelope from each source with some queued in turn (round robin), so a
    flooding source delays another's envelope by at most one of its own per
    turn.  Memory is bounded by ``limit`` per source; sources are as many as
    the publishers the bus lets in (uids allowed on the socket, capsules).
    """

    __slots__ = ("_drops", "_key", "_lanes", "_ring", "_size")

    def __init__(
        self,
        pattern: str,
        owner: Identity,
        limit: int,
        key: Callable[[Envelope], str],
        on_close: Callable[[Subscription], None] | None = None,
    ) -> None:
        super().__init__(pattern, owner, limit, on_close)
        self._key = key
        self._lanes: dict[str, deque[Envelope]] = {}
        self._ring: deque[str] = deque()
        """Sources with envelopes queued, in the order they are served next."""
        self._drops: dict[str, int] = {}
        self._size = 0

    def deliver(self, envelope: Envelope) -> bool:
        """Queue ``envelope`` in its source's lane; False (and counted) when that
        lane is full or the subscription closed."""
        if self.state is _CLOSED:
            self.dropped += 1
            return False
        source = self._key(envelope)
        lane = self._lanes.get(source)
        if lane is None:
            lane = self._lanes[source] = deque()
            self._ring.append(source)
        elif len(lane) >= self.limit:
            self.dropped += 1
            self._drops[source] = self._drops.get(source, 0) + 1
            return False
        lane.append(envelope)
        self._size += 1
        self.delivered += 1
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            waiter.set()
        return True

    def take_drops(self) -> dict[str, int]:
        """Envelopes dropped per source since the last call."""
        drops, self._drops = self._drops, {}
        return drops

    def _pop(self) -> Envelope:
        source = self._ring.popleft()
        lane = self._lanes[source]
        envelope = lane.popleft()
        if lane:
            self._ring.append(source)
        else:
            del self._lanes[source]
        self._size -= 1
        return envelope

    def __len__(self) -> int:
        return self._size

    def get_nowait(self) -> Envelope | None:
        return self._pop() if self._size else None

    def drain(self) -> list[Envelope]:
        """Everything queued now, in the order it would be served."""
        return [self._pop() for _ in range(self._size)]

    async def get(self) -> Envelope:
        await self._until_queued()
        return self._pop()

    async def __anext__(self) -> Envelope:
        if self._size:
            return self._pop()
        try:
            return await self.get()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None
