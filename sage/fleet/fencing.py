"""Fencing: a node judged lost while it still ran gives up what another node took.

Sans-IO; the router (sage/fleet/router.py) runs it.  A node frozen (SIGSTOP, a
long pause) or cut off from NATS past ``lost_after`` keeps its sessions and their
children, while the other nodes judge it lost and one of them adopts each of its
sessions that resume (sage/fleet/failover.py): the one-winner race in the
``sage_claims`` bucket then names the adopter.  Back, the node must end its own
copy, else two ``claude`` children run one conversation.

- **When it looks.** :func:`may_have_been_lost`: its heartbeat loop saw the last
  successful beat older than half of ``lost_after`` (by the monotonic clock, which
  runs on through a SIGSTOP), or its beats failed and came back (a NATS outage):
  the router looks at once.  Besides, a slow sweep every :data:`SWEEP_BEATS`
  heartbeats looks at every local session, :data:`BATCH` at a time
  (:class:`Sweep`), so a fence missed once is found later.
- **What it ends.** :func:`runs_elsewhere`: a session whose ``sage_claims`` key names
  another node, not ``failed`` (a failed adoption gives the session back).
"""

from __future__ import annotations

from collections.abc import Iterable

from sage.fleet.routes import Claim

__all__ = ("BATCH", "SWEEP_BEATS", "Sweep", "may_have_been_lost", "runs_elsewhere")

SWEEP_BEATS = 5
"""Heartbeats between two slow sweeps over this node's sessions."""
BATCH = 256
"""Sessions whose claim one sweep reads at most (the next sweep goes on from there)."""


def may_have_been_lost(
    last_beat: float, now: float, lost_after: float, *, failing: bool = False
) -> bool:
    """Whether the other nodes may have judged this node lost, as of a heartbeat that
    just succeeded: the one before it succeeded at ``last_beat`` (monotonic seconds),
    it succeeds at ``now``.  Half of ``lost_after`` is the bound: the others judge by a
    wall clock that may be ahead of ours.  ``failing``: beats failed in between (an
    outage of NATS, however short: a look costs little)."""
    return failing or now - last_beat > lost_after / 2


def runs_elsewhere(node: str, claim: Claim | None) -> str | None:
    """The node that runs a session of ``node`` now, by its ``sage_claims`` value:
    another node holds it by a claim that did not fail; None: the session is still
    ``node``'s."""
    if claim is None or claim.holder == node or claim.failed:
        return None
    return claim.holder


class Sweep:
    """Which of this node's sessions a sweep looks at: every one, :data:`BATCH` at a
    time, in the order of their ids, the next sweep going on where the last stopped."""

    def __init__(self, batch: int = BATCH) -> None:
        self.batch = batch
        self._after = ""

    def next(self, here: Iterable[str]) -> list[str]:
        """The next at most ``batch`` session ids of ``here``, after the last one given
        (from the start again once past the end)."""
        ids = sorted(here)
        rest = [sid for sid in ids if sid > self._after]
        chosen = (rest or ids)[: self.batch]
        if len(chosen) < self.batch and rest:  # past the end: wrap around
            chosen += [sid for sid in ids if sid <= self._after][: self.batch - len(chosen)]
        self._after = chosen[-1] if chosen and len(chosen) < len(ids) else ""
        return chosen
