"""The fleet's lifecycles as tables (sans-IO): an adoption's claim, the node's own
membership, a relay, the registry's resync.

Each is an enum and a transition table; :class:`Machine` is one instance of one of
them, and :meth:`Machine.move` is the one place its state changes.  A change the
table does not allow is a bug: :class:`~sage.errors.IllegalTransition`, as for every
table of sage (sessions, processes, spares, capsules, the audit log).  Moving to the
state it is in already changes nothing.

- :class:`ClaimState`, :data:`CLAIM_TRANSITIONS`: one lost node's session as this node
  tries to adopt it (sage/fleet/failover.py): planned, waiting its turn, racing in
  ``sage_claims``, then won (restoring, adopted; or given back: released for the
  next node, failed for good) or not (lost the race, taken before, its node back).
- :class:`MembershipState`, :data:`MEMBERSHIP_TRANSITIONS`: this node in the fleet
  (sage/fleet/member.py): joining, live while its heartbeats are stored, failing while
  they are not, leaving, left.
- :class:`RelayState`, :data:`RELAY_TRANSITIONS`: a remote session's events relayed
  here (sage/fleet/relays.py): open, approving (a client here answers its approvals),
  ended (its ``exited`` came), dropped (unsubscribed).
- :class:`ResyncState`, :data:`RESYNC_TRANSITIONS`: the registry against the runner
  (sage/fleet/registry_keeper.py): needed, listing the runner, comparing with the
  registry, synced; an outage or a dropped lifecycle event makes it needed again.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final, Generic, TypeVar

from sage.errors import IllegalTransition

__all__ = (
    "CLAIM_TRANSITIONS",
    "MEMBERSHIP_TRANSITIONS",
    "RELAY_TRANSITIONS",
    "RESYNC_TRANSITIONS",
    "ClaimState",
    "Machine",
    "MembershipState",
    "RelayState",
    "ResyncState",
)

S = TypeVar("S", bound=enum.Enum)


class Machine(Generic[S]):
    """One lifecycle: ``state``, moved along ``table`` only (see the module docstring)."""

    def __init__(self, name: str, table: Mapping[S, frozenset[S]], start: S) -> None:
        self.name = name
        self.table = table
        self.state = start

    def may(self, new: S) -> bool:
        """Whether the table allows a move to ``new`` now (staying is always allowed)."""
        return new is self.state or new in self.table[self.state]

    def move(self, new: S) -> None:
        """The one place the state changes; IllegalTransition if the table refuses."""
        if new is self.state:
            return
        if new not in self.table[self.state]:
            raise IllegalTransition(self.name, str(self.state.value), str(new.value))
        self.state = new

    @property
    def over(self) -> bool:
        """Whether the state is final (the table allows no move from it)."""
        return not self.table[self.state]

    def __repr__(self) -> str:
        return f"<{self.name}: {self.state.value}>"


class ClaimState(enum.Enum):
    """A lost node's session as this node tries to adopt it."""

    PLANNED = "planned"  # adoptable, and this node is among its adopters
    WAITING = "waiting"  # its claim read; waiting for the nodes ranked before this one
    RACING = "racing"  # the update naming the revision read is on its way
    WON = "won"  # this node's update made it the one winner
    RESTORING = "restoring"  # its transcript back under the principal's home, the runner asked
    ADOPTED = "adopted"  # the runner runs it here (or keeps it asleep)
    RELEASED = "released"  # a refusal of this node's own: the claim went back for the next
    FAILED = "failed"  # this node could not run it: given back to the lost node, for good
    LOST = "lost"  # another node's update came first
    TAKEN_BEFORE = "taken_before"  # sage_claims named another node already: never again
    OWNER_BACK = "owner_back"  # its node's heartbeats came back: it keeps its sessions


_CLAIM_OVER = frozenset(
    {
        ClaimState.ADOPTED,
        ClaimState.RELEASED,
        ClaimState.FAILED,
        ClaimState.LOST,
        ClaimState.TAKEN_BEFORE,
        ClaimState.OWNER_BACK,
    }
)

CLAIM_TRANSITIONS: Final[dict[ClaimState, frozenset[ClaimState]]] = {
    # a read that fails ends the try (FAILED here means no more of it on this node)
    ClaimState.PLANNED: frozenset({ClaimState.WAITING, ClaimState.TAKEN_BEFORE, ClaimState.FAILED}),
    ClaimState.WAITING: frozenset({ClaimState.RACING, ClaimState.OWNER_BACK, ClaimState.FAILED}),
    ClaimState.RACING: frozenset({ClaimState.WON, ClaimState.LOST, ClaimState.FAILED}),
    ClaimState.WON: frozenset({ClaimState.RESTORING, ClaimState.RELEASED, ClaimState.FAILED}),
    ClaimState.RESTORING: frozenset({ClaimState.ADOPTED, ClaimState.RELEASED, ClaimState.FAILED}),
    **{state: frozenset() for state in _CLAIM_OVER},
}


class MembershipState(enum.Enum):
    """This node in the fleet."""

    JOINING = "joining"  # connected, its first heartbeat not yet stored
    LIVE = "live"  # its heartbeats are stored
    FAILING = "failing"  # its last heartbeat was not stored (logged once)
    LEAVING = "leaving"  # its last record (stopped) on its way
    LEFT = "left"


MEMBERSHIP_TRANSITIONS: Final[dict[MembershipState, frozenset[MembershipState]]] = {
    # (a first heartbeat that fails ends the join; one in the loop means failing)
    MembershipState.JOINING: frozenset(
        {MembershipState.LIVE, MembershipState.FAILING, MembershipState.LEAVING}
    ),
    MembershipState.LIVE: frozenset({MembershipState.FAILING, MembershipState.LEAVING}),
    MembershipState.FAILING: frozenset({MembershipState.LIVE, MembershipState.LEAVING}),
    MembershipState.LEAVING: frozenset({MembershipState.LEFT}),
    MembershipState.LEFT: frozenset(),
}


class RelayState(enum.Enum):
    """A remote session's events, relayed here."""

    OPEN = "open"  # subscribed at the owner's subject: its events are republished here
    APPROVING = "approving"  # a client here answers its approvals: the owner is told so
    ENDED = "ended"  # its exited came: no more events
    DROPPED = "dropped"  # unsubscribed (nobody watches, it ended, or another relay took it)


RELAY_TRANSITIONS: Final[dict[RelayState, frozenset[RelayState]]] = {
    RelayState.OPEN: frozenset({RelayState.APPROVING, RelayState.ENDED, RelayState.DROPPED}),
    RelayState.APPROVING: frozenset({RelayState.ENDED, RelayState.DROPPED}),
    RelayState.ENDED: frozenset({RelayState.DROPPED}),
    RelayState.DROPPED: frozenset(),
}


class ResyncState(enum.Enum):
    """The registry's agreement with the runner."""

    NEEDED = "needed"  # at start, after an outage, after a lifecycle event was dropped
    LISTING = "listing"  # the runner's sessions asked (an exited meanwhile is noted)
    COMPARING = "comparing"  # the registry read and made to agree
    SYNCED = "synced"


RESYNC_TRANSITIONS: Final[dict[ResyncState, frozenset[ResyncState]]] = {
    ResyncState.NEEDED: frozenset({ResyncState.LISTING}),
    # no runner yet (it starts after the router), or none: needed still
    ResyncState.LISTING: frozenset({ResyncState.COMPARING, ResyncState.NEEDED}),
    # the registry unreadable: needed still
    ResyncState.COMPARING: frozenset({ResyncState.SYNCED, ResyncState.NEEDED}),
    ResyncState.SYNCED: frozenset({ResyncState.NEEDED}),
}
