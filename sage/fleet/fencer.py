"""Fencing's shell: this node ends its copy of each session another node took.

The decisions are sage/fleet/fencing.py's (sans-IO): when to look
(:func:`~sage.fleet.fencing.may_have_been_lost` sets ``member.returned``; a slow
:class:`~sage.fleet.fencing.Sweep` besides) and what runs elsewhere
(:func:`~sage.fleet.fencing.runs_elsewhere`).  :class:`Fencer` reads the
``sage_claims`` keys, deletes this node's registry claim to each session taken, and
asks the runner to yield it (``sage.v1.request.yield.<sid>``: it ends ``failed_over``).
Back after it may have been judged lost, the node also claims the others again, so
an adoption under way loses its race (:meth:`~sage.fleet.failover.Failover.take_back`).
"""

from __future__ import annotations

import contextlib

import anyio
import structlog

from sage.contract.codes import ErrorCode
from sage.contract.sessions import Verb, YieldRequest
from sage.errors import FleetError
from sage.fleet.failover import Failover
from sage.fleet.fencing import BATCH, SWEEP_BEATS, Sweep, runs_elsewhere
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import describe, nats_errors
from sage.fleet.routes import CLAIMS, REGISTRY, registry_key
from sage.fleet.runner_link import RunnerLink

__all__ = ("Fencer",)

log = structlog.get_logger("sage.fleet.router")


class Fencer:
    """Looks for this node's sessions (``here``, the registry keeper's) another node runs
    now, and ends them here (see the module docstring)."""

    def __init__(
        self,
        member: FleetMember,
        runner: RunnerLink,
        failover: Failover | None,
        here: dict[str, str],
    ) -> None:
        self.member = member
        self.node = member.node
        self.runner = runner
        self.failover = failover
        self.here = here

    async def keep(self) -> None:
        """Look at once when the node may have been judged lost and is back, else every
        :data:`~sage.fleet.fencing.SWEEP_BEATS` heartbeats, a batch at a time."""
        sweep = Sweep()
        every = SWEEP_BEATS * self.member.config.heartbeat
        while True:
            returned = False
            with anyio.move_on_after(every):
                await self.member.returned.wait()
                returned = True
            if returned:
                self.member.returned = anyio.Event()
                sids = sorted(self.here)  # all of them, now, and claimed again
            else:
                sids = sweep.next(self.here)
            if sids and self.member.connected:
                await self.fence(sids, take_back=returned)

    async def fence(self, sids: list[str], *, take_back: bool = False) -> list[str]:
        """End ``failed_over`` each of ``sids`` (sessions here) whose ``sage_claims`` key
        names another node; the sessions still this node's are returned (those whose
        claim could not be read too: the next sweep looks again).  ``take_back`` (the
        node is back after it may have been judged lost): the others are claimed again
        for this node, so an adoption under way loses its race."""
        if self.member.claims is None:
            return sids
        principals = {sid: self.here.get(sid, "") for sid in sids}
        elsewhere: dict[str, str] = {}
        unread: set[str] = set()
        for at in range(0, len(sids), BATCH):
            batch = sids[at : at + BATCH]
            try:
                with nats_errors(f"the {CLAIMS} bucket"), anyio.fail_after(10.0):
                    if take_back and self.failover is not None:
                        mine = {sid: principals[sid] for sid in batch if principals[sid]}
                        elsewhere |= await self.failover.take_back(mine)
                        continue
                    for sid in batch:
                        if not principals[sid]:
                            continue  # ended meanwhile
                        claim, _ = await self.member.claim_of(principals[sid], sid)
                        node = runs_elsewhere(self.node, claim)
                        if node is not None:
                            elsewhere[sid] = node
            except FleetError as exc:
                log.warning(
                    "fleet.fence_check_failed",
                    sessions=len(batch),
                    code=exc.code,
                    error=describe(exc),
                )
                unread |= set(batch) - elsewhere.keys()
        registry = self.member.registry
        for sid, node in sorted(elsewhere.items()):
            log.warning("fleet.fenced", session_id=sid, node=node)
            if not take_back and registry is not None:  # (take_back deleted it already)
                # this node's entry goes first: beside the adopter's, a conflict
                with (
                    contextlib.suppress(FleetError),
                    nats_errors(f"the {REGISTRY} bucket"),
                    anyio.move_on_after(5.0),
                ):
                    await registry.delete(registry_key(self.node, sid))
            reply = await self.runner.ask_as_supervisor(Verb.YIELD, sid, YieldRequest(node=node))
            if not reply.get("ok") and reply.get("error") != ErrorCode.UNKNOWN_SESSION:
                log.error("fleet.fence_failed", session_id=sid, node=node, reply=reply)
                continue  # still here: the next sweep tries again
            self.here.pop(sid, None)
        return [sid for sid in sids if sid not in elsewhere or sid in unread]
