"""The runner's half of the node's fleet lease (sage/lease.py tells why and when).

- **Grants** (:meth:`FleetLease.follow`): ``sage.v1.fleet.lease`` from the supervisor
  (any other source is ignored and logged) extends the lease.
- **Gates** (:meth:`FleetLease.require`, :meth:`FleetLease.held`): the launcher asks
  before it starts any child (a spawn, a wake, an adoption, a respawn, a spare), the
  send before it writes a turn, the tool path before it runs a child's tool call.
  Without the lease each is refused ``fleet_lease_lost``.  Before the first grant
  after the runner starts (``pending``) a start waits for it, at most
  :data:`FIRST_GRANT_WAIT` ``x lost_after``.
- **Fencing** (:meth:`FleetLease.watch`): once a lease it held has expired, every
  session with a child is fenced (capsules/runner/hibernation.py,
  ``Hibernation.fence``: the child killed at once, the session hibernated), again
  every :data:`~sage.lease.FENCE_POLL` while the lease stays lost (a child that a
  start in flight launched meanwhile goes too); audited ``fleet_lease_lost`` and
  ``fleet_lease_regained``.

Without ``[fleet]`` there is no lease: every gate passes and nothing is fenced.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, Callable
from typing import Any, Final

import anyio
import msgspec
import structlog

from bus import Envelope
from capsules.runner.errors import SessionError
from capsules.runner.sessions import Session, SessionState, SessionTable
from sage.config import Config, FleetConfig
from sage.contract.codes import ErrorCode
from sage.contract.sessions import SUPERVISOR_SOURCE, LeaseGrant
from sage.lease import FENCE_POLL, Lease

__all__ = ("FIRST_GRANT_WAIT", "LEASE_LOST", "FleetLease")

log = structlog.get_logger("sage.runner")

LEASE_LOST: Final = ErrorCode.FLEET_LEASE_LOST
LAPSE_WINDOW: Final = 5.0
"""Seconds after a lapse of the lease in which a child's end is taken as its fence."""
FIRST_GRANT_WAIT: Final = 2.0
"""A start before the first grant waits at most this many times ``lost_after``."""
FENCED_STATES: Final = frozenset(
    {
        SessionState.STARTING,
        SessionState.RUNNING,
        SessionState.RESPAWNING,
        SessionState.WAKING,
        SessionState.HIBERNATING,
        SessionState.STOPPING,
    }
)
"""States whose child a lost lease kills (a stopping session's goes too, and the session
ends as its stop says)."""


class FleetLease:
    """See the module docstring."""

    def __init__(
        self,
        config_of: Callable[[], Config],
        sessions: SessionTable,
        fence: Callable[[Session], None],
        audit: Callable[[str, dict[str, Any]], None],
        lease: Lease | None = None,
    ) -> None:
        self._config_of = config_of
        self.sessions = sessions
        self._fence = fence
        self._audit = audit
        self.lease = lease or Lease()
        self._granted = anyio.Event()
        self.fenced = 0
        """Children killed because the lease was lost (``astrid status``)."""

    @property
    def active(self) -> bool:
        """Whether the node is in a fleet (else there is no lease to hold)."""
        return self._config_of().fleet is not None

    def held(self) -> bool:
        return not self.active or self.lease.held()

    def lapsed(self) -> bool:
        """Whether a child that ends now may have been killed for a lost lease: the
        lease is not held, or ran out in the last :data:`LAPSE_WINDOW` seconds (the
        fence may kill before the runner, frozen with its supervisor, notes it)."""
        return self.active and self.lease.lapsed_within(LAPSE_WINDOW)

    def refusal(self) -> str | None:
        """Why a child's tool call may not run now (None: it may)."""
        if self.held():
            return None
        return f"{LEASE_LOST}: this node lost its fleet lease; no tool runs until it is back"

    async def require(self, what: str) -> None:
        """Return when the node holds its lease; ``fleet_lease_lost`` if it does not
        (``what``: the action refused, for the message)."""
        if not self.active:
            return
        lease = self.lease
        if lease.pending:  # the runner just started: the next heartbeat grants it
            with anyio.move_on_after(FIRST_GRANT_WAIT * self._fleet().lost_after):
                while lease.pending:
                    await self._granted.wait()
        if not lease.held():
            raise SessionError(
                LEASE_LOST,
                f"this node cannot {what} now: it lost its fleet lease (no heartbeat"
                " reached NATS in time: a partition or a paused supervisor), so another"
                " node may run its sessions; it takes them back once NATS answers",
            )

    async def follow(self, grants: AsyncIterable[Envelope]) -> None:
        """Take the supervisor's grants for ever."""
        async for envelope in grants:
            if envelope.source != SUPERVISOR_SOURCE or envelope.principal is not None:
                log.warning("fleet.lease_grant_ignored", source=envelope.source)
                continue
            try:
                grant = msgspec.json.decode(envelope.payload, type=LeaseGrant)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("fleet.lease_grant_bad", error=str(exc))
                continue
            first = self.lease.pending
            if self.lease.grant(grant.until) and not first:
                log.info("fleet.lease_regained", losses=self.lease.losses)
                self._audit("fleet_lease_regained", {"losses": self.lease.losses})
            if first:
                log.info("fleet.lease_held", term=grant.term)
            self._granted.set()
            self._granted = anyio.Event()

    async def watch(self) -> None:
        """Fence every session's child once the lease is lost, for ever."""
        while True:
            if not self.active or self.lease.pending:
                await self._next_grant(1.0)
                continue
            remaining = self.lease.remaining()
            if remaining > 0:
                await self._next_grant(remaining)
                continue
            if self.lease.expire():
                log.warning("fleet.lease_lost", term=self._fleet().lease)
            killed = self.fence_all()
            if killed:
                self._audit(
                    "fleet_lease_lost", {"children_killed": killed, "at": round(time.time(), 3)}
                )
            await anyio.sleep(FENCE_POLL)

    def _fleet(self) -> FleetConfig:
        fleet = self._config_of().fleet
        assert fleet is not None
        return fleet

    async def _next_grant(self, within: float) -> None:
        with anyio.move_on_after(within):
            await self._granted.wait()

    def fence_all(self) -> int:
        """Kill the child of every session that has one (see the module docstring);
        how many were killed now."""
        killed = 0
        for session in list(self.sessions.values()):
            proc = session.proc
            if (
                proc is None
                or session.fenced
                or (proc.child is not None and not proc.child.running)
            ):
                continue
            if session.state in FENCED_STATES:
                self._fence(session)
                killed += 1
        self.fenced += killed
        return killed
