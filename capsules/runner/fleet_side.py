"""The fleet's side of sessions: what a supervisor of the fleet asks of this runner.

The fleet (sage/fleet/) knows NATS; the runner does not.  The supervisor's fleet
side asks, over the local bus, as an admin (every principal is refused):

- ``slots``: the host's load for the node's heartbeat, with the sessions counted by
  the state their listing rows show (:func:`~capsules.runner.listing.listed_state`);
- ``adopt``: run here a session a lost node ran, under its own id, ``--resume`` on
  its conversation (or asleep, as it slept there), under the admission of a spawn
  (capsules/runner/admission.py);
- ``yield.<sid>``: another node runs the session now: this node's copy is fenced,
  it ends ``failed_over``;
- ``conversation.<sid>``: what a replica of a live session's conversation needs.

And this runner asks the fleet (:meth:`FleetSide.taken_elsewhere`, the claims
check): which of the sessions it left live another node took meanwhile.  Sessions
are named by principal and id across the fleet, so the check takes a mapping of
id to principal.  A session kept asleep because the fleet could not say is asked
about again before it wakes (:meth:`FleetSide.still_here`).  docs/fleet.md,
"Failover", tells the fleet's half.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import structlog

from bus import BusError, Envelope
from capsules.runner.admission import Join, judge, taken_by_another
from capsules.runner.claude_process import EndReason
from capsules.runner.errors import SessionError
from capsules.runner.hibernation import Hibernation
from capsules.runner.history import EventHistory
from capsules.runner.listing import listed_state
from capsules.runner.messages import AdoptRequest, YieldRequest
from capsules.runner.session_life import Audit, SessionEvent, SessionLife
from capsules.runner.sessions import (
    ASLEEP,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
    valid_id,
)
from capsules.runner.workplace import chosen_model, work_folder
from sage.capsule.context import CapsuleContext
from sage.config import Config, PrincipalConfig
from sage.contract.sessions import CLAIMS_TOPIC

__all__ = ("CLAIMS_DEADLINE", "FleetSide")

log = structlog.get_logger("sage.runner")

CLAIMS_DEADLINE = 10.0
"""Seconds the claims check waits for the fleet's router before the fleet cannot say."""
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


class FleetSide:
    """See the module docstring."""

    def __init__(
        self,
        ctx: CapsuleContext,
        sessions: SessionTable,
        *,
        life: SessionLife,
        hibernation: Hibernation,
        history: EventHistory,
        principal: Callable[[str], PrincipalConfig | None],
        audit: Audit,
        session_event: SessionEvent,
    ) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.life = life
        self.hibernation = hibernation
        self.history = history
        self.principal = principal
        self.audit = audit
        self.session_event = session_event
        self.unsure: set[str] = set()
        """Sessions kept asleep at start because the fleet could not say whether another
        node took them: asked again before they wake."""

    @property
    def config(self) -> Config:
        return self.ctx.config

    async def slots(self, request: Envelope) -> dict[str, Any]:
        """The host's load: live children (held slots), ``max_live`` (None: no bound),
        idle sessions (what may hibernate to make room) and hibernated ones."""
        if request.principal is not None:
            raise SessionError("not_authorized", "only an admin may read the host's slots")
        slots = self.hibernation.slots
        sessions = [self.sessions[sid] for sid in self.sessions]
        states: dict[str, int] = {}
        for session in sessions:
            state = listed_state(session)
            states[state] = states.get(state, 0) + 1
        return {
            "ok": True,
            "live": len(slots),
            "max_live": slots.limit or None,
            "idle": sum(1 for s in sessions if s.idle),
            "hibernated": sum(1 for s in sessions if s.state in ASLEEP),
            "waiting": slots.waiting,
            "states": states,
        }

    async def adopt(self, request: Envelope) -> dict[str, Any]:
        """Run a session a lost node ran, here, under its own id: ``--resume`` on its
        conversation, whose transcript the fleet restored already (docs/fleet.md)."""
        if request.principal is not None:
            raise SessionError(
                "not_authorized", "only the supervisor adopts another node's session"
            )
        req = msgspec.json.decode(request.payload, type=AdoptRequest)
        sid, who = req.session_id, req.principal_id
        if not (valid_id(sid) and valid_id(req.from_node)) or sid.startswith("repl-"):
            raise SessionError("invalid_session_id", "session ids are 1-64 of [A-Za-z0-9_-]")
        if not _UUID.match(req.claude_session):
            raise SessionError("bad_request", "claude_session is not a uuid")
        principal = self.principal(who)
        if principal is None:
            raise SessionError("unknown_principal", f"no principal {who!r} is configured")
        if principal.interaction_mode == "repl":
            raise SessionError("interaction_mode_is_repl", f"principal {who!r} uses a terminal")
        cwd = work_folder(principal, self.config.home_of(principal), req.cwd or None)
        model = chosen_model(principal, req.model or None)
        if await taken_by_another(self.ctx.state, sid, who):
            raise SessionError("duplicate_session", f"session {sid!r} exists")
        holder = next(
            (
                o
                for o in self.sessions
                if self.sessions[o].record.claude_session == req.claude_session
            ),
            None,
        )
        if holder is not None:  # never two sessions (two children) on one conversation
            raise SessionError(
                "duplicate_session", f"session {holder!r} here holds the conversation of {sid!r}"
            )
        # the caps of a spawn, and a live slot free or soon: a node that cannot take it
        # refuses, and the next node may
        admission = judge(
            Join.ADOPT_ASLEEP if req.asleep else Join.ADOPT,
            sid,
            who,
            sessions=self.sessions,
            room=self.hibernation,
            config=self.config,
        )
        if not admission.admitted:
            raise admission.error()
        node = self.config.fleet.node if self.config.fleet is not None else ""
        record = SessionRecord(
            session_id=sid,
            principal_id=who,
            claude_session=req.claude_session,
            started_at=min(req.started_at, time.time()) or time.time(),  # its age goes on
            cwd=cwd,
            model=model,
            turns=req.turns,
            spoken=req.turns > 0 and not req.fresh,
        )
        if req.asleep:  # it slept on the lost node: it sleeps here, and takes no slot
            record.state, record.hibernated_at = RecordState.HIBERNATED, time.time()
            session = Session(
                record,
                principal,
                state=SessionState.HIBERNATED,
                turns=req.turns,
                cost_usd=req.cost_usd,
            )
            self.sessions.add(session)
            await self.life.save(record)
            self.session_event(
                sid,
                "hibernated",
                {
                    "principal_id": who,
                    "session_id": sid,
                    "turns": req.turns,
                    "hibernated_at": record.hibernated_at,
                    "from_node": req.from_node,
                },
            )
            self.history.ended(sid)  # its ring stays bounded with the asleep
            self._failed_over(req, node, None)
            return {"ok": True, "session_id": sid, "pid": None, "hibernated": True}
        session = Session(
            record,
            principal,
            turns=req.turns,
            cost_usd=req.cost_usd,  # its cost goes on too
            last_active=time.monotonic(),
        )
        self.sessions.add(session)
        try:
            pid = await self.life.start(session, resume=not req.fresh, initial=None)
        except SessionError as exc:
            self.sessions.remove(session)
            if exc.code == "host_full":  # no slot came: nothing of it ran here, nor ends
                session.over()
                raise
            await self.life.ended(session, None, f"{EndReason.RESUME_FAILED}: {exc}")
            raise
        self.session_event(
            sid,
            "resumed",
            {"principal_id": who, "reason": "failover", "from_node": req.from_node},
        )
        self._failed_over(req, node, pid)
        return {"ok": True, "session_id": sid, "pid": pid}

    def _failed_over(self, req: AdoptRequest, node: str, pid: int | None) -> None:
        self.audit(
            "session_failed_over",
            {
                "principal_id": req.principal_id,
                "session_id": req.session_id,
                "from_node": req.from_node,
                "node": node,
                "pid": pid,
                "conversation": not req.fresh,
                "asleep": req.asleep,
            },
        )

    async def yield_request(self, request: Envelope) -> dict[str, Any]:
        """Another node of the fleet runs this session now (it took it over while this
        node was judged lost): this node's copy ends ``failed_over``, its child stopped
        at once (docs/fleet.md, "Failover").  The supervisor's fleet side only."""
        if request.principal is not None:
            raise SessionError(
                "not_authorized", "only the supervisor yields a session to another node"
            )
        sid = request.topic.rsplit(".", 1)[1]
        req = msgspec.json.decode(request.payload or b"{}", type=YieldRequest)
        if not valid_id(req.node):
            raise SessionError("bad_request", "node is 1-64 of [A-Za-z0-9_-]")
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError("unknown_session", f"no session {sid!r} here")
        await self.fence(session, req.node)
        return {"ok": True, "session_id": sid, "node": req.node}

    async def still_here(self, session: Session) -> None:
        """Before a session kept asleep at start, when the fleet could not say whether
        another node took it, wakes: ask again.  Taken: it ends ``failed_over`` here
        (``unknown_session``: the fleet's router finds it there); the fleet still
        cannot say: ``fleet_unavailable``, and it sleeps on (never a second child)."""
        sid = session.id
        if sid not in self.unsure:
            return
        elsewhere = await self.taken_elsewhere({sid: session.record.principal_id})
        if elsewhere is None:
            raise SessionError(
                "fleet_unavailable",
                f"session {sid!r} sleeps until the fleet can say whether another node"
                " took it over (NATS unreachable?); try again",
            )
        self.unsure.discard(sid)
        node = elsewhere.get(sid)
        if node is not None and sid in self.sessions:
            await self.fence(session, node)
            raise SessionError("unknown_session", f"session {sid!r} runs on another node now")

    async def fence(self, session: Session, node: str) -> None:
        """End ``session`` here ``failed_over``: ``node`` runs it now.  Audited
        ``session_fenced`` (with the child's pid, if one ran); returns once it ended.
        Fenced already (the return and the sweep may both ask): it waits for that end."""
        if session.end_reason == EndReason.FAILED_OVER:
            with anyio.move_on_after(self.config.limits.stop_grace * 3 + 5):
                await session.done.wait()
            return
        proc = session.proc
        pid = proc.pid if proc is not None and session.state not in ASLEEP else None
        log.warning("session.fenced", session_id=session.id, node=node, pid=pid)
        self.audit(
            "session_fenced",
            {
                "principal_id": session.record.principal_id,
                "session_id": session.id,
                "node": node,
                "pid": pid,
                "state": session.state.value,
            },
        )
        session.end_reason = EndReason.FAILED_OVER
        self.unsure.discard(session.id)
        await self.life.stop(session, EndReason.FAILED_OVER)

    async def conversation(self, request: Envelope) -> dict[str, Any]:
        """What a replica of a live session's conversation needs (the supervisor only)."""
        if request.principal is not None:
            raise SessionError("not_authorized", "only the supervisor reads this")
        sid = request.topic.rsplit(".", 1)[1]
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError("unknown_session", f"no session {sid!r}")
        record = session.record
        turns, cost_usd = session.totals()
        return {
            "ok": True,
            "session_id": sid,
            "principal_id": record.principal_id,
            "claude_session": record.claude_session,
            "cwd": record.cwd,
            "model": record.model,
            "turns": turns,
            "cost_usd": cost_usd,
            "started_at": record.started_at,
        }

    async def taken_elsewhere(self, sids: dict[str, str]) -> dict[str, str] | None:
        """Of ``sids`` (id -> principal: sessions this node left live), those another node of the fleet
        runs now (id -> node): the fleet's router asks the registry, and claims the rest
        for this node.  ``{}`` without a fleet; None when the fleet cannot say."""
        if self.config.fleet is None or not sids:
            return {}
        try:
            answer = await self.ctx.request(
                CLAIMS_TOPIC,
                {"session_ids": sorted(sids), "principals": sids},
                deadline=CLAIMS_DEADLINE,
            )
            reply = msgspec.json.decode(answer.payload)
        except (BusError, msgspec.DecodeError) as exc:
            log.warning("runner.fleet_claims_unknown", error=str(exc), sessions=len(sids))
            return None
        found = reply.get("elsewhere") if isinstance(reply, dict) and reply.get("ok") else None
        if not isinstance(found, dict):
            log.warning("runner.fleet_claims_unknown", reply=reply, sessions=len(sids))
            return None
        return {str(sid): str(node) for sid, node in found.items()}
