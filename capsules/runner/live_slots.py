"""Live slots: how many sessions may have a ``claude`` child at once on this host.

``[sessions] max_live`` bounds them (0: no bound).  A session holds its slot
from before its child is launched until the child is reaped (the session
hibernated, ended or was interrupted), so the live children never outnumber
the slots, even while a hibernating child is still on its way out.

A spawn or a wake that finds no slot free waits in a bounded first-come queue
(``[sessions] wake_queue``) for at most ``[sessions] wake_wait`` seconds; a
slot given back goes straight to the first waiter.  A full queue, or a wait
that runs out, is ``host_full``: never a silent drop.  Making room (which
session hibernates) is the runner's decision, not this module's.

**A principal's share** (:func:`share`): one principal may hold at most
``max(1, max_live - others)`` live slots, ``others`` being the other
principals with a session on the host (live or hibernated): one slot is
kept for each of them, so bob's busy sessions cannot hold every slot while
alice's hibernated session waits to wake.  It bounds a principal's live
sessions below ``[limits] max_sessions_per_principal`` when it is smaller,
and is enforced the same way: past it a spawn or a wake hibernates one of the
principal's own idle sessions, or is refused ``principal_limit``.  A principal
alone on the host has no share: its spawns and wakes wait for slots as usual.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass, field

import anyio

from capsules.runner.errors import SessionError

__all__ = ("LiveSlots", "share")


def share(limit: int, others: int) -> int:
    """The live slots one principal may hold on a host of ``limit`` slots (``[sessions]
    max_live``, not 0) while ``others`` other principals have sessions there: one slot is
    kept for each of them, and each principal may hold one at least."""
    return max(1, limit - others)


@dataclass
class _Waiter:
    holder: Hashable
    granted: bool = False
    event: anyio.Event = field(default_factory=anyio.Event)


class LiveSlots:
    """See the module docstring; ``limit`` 0 means no bound."""

    def __init__(self, limit: int, queue: int) -> None:
        self.limit = limit
        self.queue = queue
        self._held: set[Hashable] = set()
        self._waiters: deque[_Waiter] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, holder: object) -> bool:
        return holder in self._held

    @property
    def waiting(self) -> int:
        """Spawns and wakes waiting for a slot now."""
        return len(self._waiters)

    @property
    def free(self) -> bool:
        return not self.limit or (len(self._held) < self.limit and not self._waiters)

    def try_take(self, holder: Hashable) -> bool:
        """Take a slot for ``holder`` (a session: by identity, so a later session under
        the same id holds its own) if one is free now and nobody waits before it."""
        if holder in self._held:
            return True
        if not self.free:
            return False
        self._held.add(holder)
        return True

    def may_wait(self, within: float) -> None:
        """:class:`SessionError` ``host_full`` when a wait could not even start: the queue
        is full, or no wait is allowed (``within`` 0)."""
        if len(self._waiters) >= self.queue or within <= 0:
            raise SessionError(
                "host_full",
                f"the host runs {len(self._held)} live sessions ([sessions] max_live ="
                f" {self.limit}) and {len(self._waiters)} more wait for a slot; try again later",
            )

    async def take(self, holder: Hashable, within: float) -> None:
        """A slot for ``holder``: at once, or the first given back within ``within``
        seconds; else :class:`SessionError` ``host_full``."""
        if self.try_take(holder):
            return
        self.may_wait(within)
        waiter = _Waiter(holder)
        self._waiters.append(waiter)
        try:
            with anyio.move_on_after(within):
                await waiter.event.wait()
        except BaseException:  # cancelled: a slot granted meanwhile is nobody's
            if waiter.granted:
                self.give_back(holder)
            else:
                self._waiters.remove(waiter)
            raise
        if waiter.granted:
            return
        self._waiters.remove(waiter)
        raise SessionError(
            "host_full",
            f"no live slot came free within {within:g} s: the host runs {len(self._held)}"
            f" live sessions ([sessions] max_live = {self.limit}) and none was idle",
        )

    def give_back(self, holder: Hashable) -> None:
        """``holder``'s child is gone: its slot goes to the first waiter, if any."""
        if holder not in self._held:
            return
        self._held.discard(holder)
        while self._waiters and (not self.limit or len(self._held) < self.limit):
            waiter = self._waiters.popleft()
            waiter.granted = True
            self._held.add(waiter.holder)
            waiter.event.set()
