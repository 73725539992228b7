"""Failover decisions without I/O: which sessions a node adopts, and the replicas it owes.

- :func:`adoptable`: the registry entries of ``lost`` nodes (never ``stopped``: a
  node that said it stopped resumes its own sessions when it starts again) whose
  node resumes sessions, for principals this node runs.  Every live node computes
  the same list; the registry update that names the entry's revision decides the
  one winner (sage/fleet/failover.py).
- :func:`adopters`: for each of those sessions, the live nodes that may adopt it in
  the order they try, by load as placement orders a spawn
  (:func:`sage.fleet.placement.why_not` and :func:`~sage.fleet.placement.share`):
  full nodes and nodes without the principal left out, the least loaded first, each
  session planned counting those planned before it, ties broken by rendezvous hashing
  so every node computes the same order.  :func:`rank` is a node's place in it: the
  first tries at once, the next a little later, and a node that cannot run one
  leaves it to the next.  A session that slept on the lost node (its entry says
  :data:`HIBERNATED`) is adopted asleep: it takes no slot, so a full node may take it.
- :class:`Pending`: the replicas a node owes the object store, one per session
  (a burst of turns is one upload of the latest transcript; an end replaces an
  upload still owed), bounded.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Callable, Iterable

from sage.config import NAME_PATTERN
from sage.contract.sessions import EntryState
from sage.fleet.nodes import NodeState, NodeView
from sage.fleet.placement import share, why_not
from sage.fleet.routes import SessionEntry

__all__ = (
    "ADOPTING",
    "HIBERNATED",
    "Owed",
    "Pending",
    "adoptable",
    "adopters",
    "adopting_entry",
    "rank",
)

_NAME = re.compile(NAME_PATTERN)

ADOPTING = EntryState.ADOPTING
"""The registry state of a session a node won and is restoring."""
HIBERNATED = EntryState.HIBERNATED
"""The registry state of a session asleep on its node (no child)."""


def adoptable(
    entries: dict[str, tuple[SessionEntry, int]],
    views: Iterable[NodeView],
    me: str,
    may_run: Callable[[str], bool],
) -> list[tuple[str, SessionEntry, int]]:
    """``(sid, entry, revision)`` of each session this node may take over now, by id."""
    states = {view.node: view.state for view in views}
    if states.get(me) is not NodeState.LIVE:
        return []  # a node the others may judge lost itself adopts nothing
    lost = {node for node, state in states.items() if state is NodeState.LOST and node != me}
    return [
        (sid, entry, revision)
        for sid, (entry, revision) in sorted(entries.items())
        if entry.node in lost
        and entry.resume
        and _NAME.match(sid) is not None  # a key no spawn could have made is left alone
        and may_run(entry.principal_id)
    ]


def adopters(
    sessions: Iterable[tuple[str, SessionEntry, int]], views: Iterable[NodeView]
) -> dict[str, list[str]]:
    """sid -> the nodes that may adopt it, in the order they try (see the module
    docstring); every node computes the same from the same heartbeats and entries."""
    nodes = list(views)
    more = {view.node: 0 for view in nodes}  # sessions planned on a node so far
    plan: dict[str, list[str]] = {}
    for sid, entry, _ in sorted(sessions, key=lambda found: found[0]):
        asleep = entry.state == HIBERNATED
        fit = [
            view
            for view in nodes
            if why_not(view, entry.principal_id, more=more[view.node], slot=not asleep) is None
        ]
        fit.sort(key=lambda view: (share(view, more[view.node]), _weight(view.node, sid)))
        plan[sid] = [view.node for view in fit]
        if fit and not asleep:
            more[fit[0].node] += 1
    return plan


def rank(sid: str, me: str, plan: dict[str, list[str]]) -> int | None:
    """``me``'s place (0: first) among the adopters of ``sid``; None: not one of them."""
    order = plan.get(sid, [])
    return order.index(me) if me in order else None


def _weight(node: str, sid: str) -> bytes:
    return hashlib.sha256(f"{node}\0{sid}".encode()).digest()


def adopting_entry(entry: SessionEntry, me: str, now: float) -> SessionEntry:
    """The entry a node writes (naming the revision it read) to be the one that adopts."""
    return SessionEntry(
        node=me, principal_id=entry.principal_id, state=ADOPTING, at=now, resume=entry.resume
    )


class Owed(enum.Enum):
    PUT = "put"
    """The latest transcript, after a finished turn."""
    DELETE = "delete"
    """The session ended for good: its object goes."""


class Pending:
    """What the object store is owed, per session, oldest first; at most ``limit`` sessions
    (past it the oldest upload is dropped, and counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._owed: dict[str, Owed] = {}
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._owed)

    def owe(self, sid: str, what: Owed) -> None:
        if what is Owed.PUT and self._owed.get(sid) is Owed.DELETE:
            return  # it ended: a late turn's replica is not wanted
        self._owed.pop(sid, None)  # its place in line is its latest mark
        self._owed[sid] = what
        while len(self._owed) > self.limit:
            puts = (sid for sid, owed in self._owed.items() if owed is Owed.PUT)
            oldest = next(puts, next(iter(self._owed)))
            del self._owed[oldest]
            self.dropped += 1

    def next(self) -> tuple[str, Owed] | None:
        """The oldest debt, taken off the list (None: nothing is owed)."""
        if not self._owed:
            return None
        sid = next(iter(self._owed))
        return sid, self._owed.pop(sid)
