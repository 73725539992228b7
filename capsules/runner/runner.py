"""The session runner: spawn, send, stop, interrupt and list sessions over the bus.

Requests (each answered with ``{"ok": true, ...}`` or ``{"ok": false,
"error": CODE, "message": TEXT}``):

- ``sage.v1.request.spawn`` ``{principal_id, session_id?, initial_message?}``
- ``sage.v1.request.send.<sid>`` ``{text}``
- ``sage.v1.request.stop.<sid>``, ``sage.v1.request.interrupt.<sid>``
- ``sage.v1.request.wake.<sid>`` ``{}``: wake a hibernated session (a send does too)
- ``sage.v1.request.sessions`` ``{}``: the caller's sessions (all for an admin)
- ``sage.v1.request.slots`` ``{}`` (admins): the host's live slots and sessions, which
  a fleet node's heartbeat carries (sage/fleet/nodes.py, ``NodeLoad``)
- ``sage.v1.request.adopt`` ``{session_id, principal_id, claude_session, from_node, ...}``
  and ``sage.v1.request.conversation.<sid>``: the supervisor's fleet side only (an
  admin; refused to every principal): run a session another node lost here, under
  its own id with ``--resume``, and what a replica of a conversation needs
  (docs/fleet.md, "Failover").  ``sage.v1.request.yield.<sid>`` ``{node}`` (the same
  side only): ``node`` runs the session now, this node's copy ends ``failed_over``.
  The runner knows nothing of NATS.

The principals' administration (settings, install, the principals listing)
is :mod:`capsules.runner.admin`; tool-call approvals and hook callbacks are
:mod:`capsules.runner.approval_desk`.  The runner subscribes for them and routes
their requests there.

Who may do what: a request carries the principal the bus verified for the
caller's connection (``None`` for an admin uid or an in-process capsule).
A caller acts only for its own principal; an admin for any.

Every check of a spawn (id, principal, mode, duplicate, the caps of
capsules/runner/admission.py) happens with no ``await`` between the cap check and
the new session taking its place in the table, so two spawns cannot both pass
the cap.

The Runner is a thin shell: it subscribes, answers each request in a task of
its own (:meth:`Runner._answer`, the one reply path) and wires the parts that own
one thing each: a session's task and its end (session_life.py), admission
(admission.py), the fleet's side (fleet_side.py), start-up (startup.py), the
listing rows (listing.py), hibernation (hibernation.py) and the spares
(spare_keeper.py).  docs/architecture.md draws the map.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import BusError, Envelope
from capsules.runner import listing
from capsules.runner.admin import Admin
from capsules.runner.admission import Join, judge, taken_by_another
from capsules.runner.approval_desk import ApprovalDesk
from capsules.runner.approvals import Verdict
from capsules.runner.claude_process import ClaudeProcess, Ending, EndReason, SessionError
from capsules.runner.fleet_lease import FleetLease
from capsules.runner.fleet_side import FleetSide
from capsules.runner.hibernation import Hibernation
from capsules.runner.history import EventHistory
from capsules.runner.launcher import Launcher
from capsules.runner.mcp import McpServer
from capsules.runner.messages import (
    IdentitySaved,
    InterruptRequest,
    SendRequest,
    SessionRequest,
    SessionsRequest,
    SpawnRequest,
    ToolsChanged,
    WakeRequest,
)
from capsules.runner.principals import SettingsError
from capsules.runner.session_life import HOOKS, SessionLife, quietly
from capsules.runner.sessions import (
    ASLEEP,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
    new_session_id,
    valid_id,
)
from capsules.runner.spare_keeper import SpareKeeper
from capsules.runner.startup import Startup
from capsules.runner.workplace import chosen_model, work_folder
from sage import replies
from sage.capsule.context import CapsuleContext
from sage.claude.protocol import CanUseToolRequest, HookCallbackRequest, McpMessageRequest
from sage.config import Config, PrincipalConfig
from sage.contract.sessions import LEASE_TOPIC, TurnEnd, Verb, turn_size, turn_too_large
from sage.errors import SageError
from sage.usage.admission import admit

__all__ = ("Runner", "SessionRecord", "run")

log = structlog.get_logger("sage.runner")

Handler = Callable[[Envelope], Awaitable[dict[str, Any]]]
"""A request handler: the envelope in, the reply out (it may raise; see ``_answer``)."""


class Runner:
    """The runner capsule's state and handlers; see the module docstring."""

    def __init__(self, ctx: CapsuleContext) -> None:
        self.ctx = ctx
        self.sessions = SessionTable()
        self.mcp = McpServer(ctx)
        self.admin = Admin(
            ctx,
            publish=self._publish,
            audit=self.audit,
            sessions_of=lambda name: sum(
                1 for s in self.sessions.values() if s.record.principal_id == name
            ),
            refresh_identity=lambda name: self.life.refresh_identity(name),
        )
        self.desk = ApprovalDesk(
            ctx, rules=self.admin, publish=self._publish, event=self.session_event, audit=self.audit
        )
        self.launcher = Launcher(ctx, self.admin, audit=self.audit, event=self.session_event)
        self.history = EventHistory()
        self.spares = SpareKeeper(ctx, self.admin, self.launcher, self.mcp, hooks=HOOKS)
        self.hibernation = Hibernation(self)
        self._tg: anyio.abc.TaskGroup | None = None
        self.life = SessionLife(
            ctx,
            self.sessions,
            hibernation=self.hibernation,
            launcher=self.launcher,
            spares=self.spares,
            history=self.history,
            host=self,
            audit=self.audit,
            session_event=self.session_event,
            tasks=lambda: self._tg,
        )
        self.lease = FleetLease(
            lambda: ctx.config, self.sessions, self.hibernation.fence, self.audit
        )
        self.launcher.lease = self.lease.require  # no child starts without the lease
        self.mcp.refusal = self.lease.refusal  # nor runs a tool call
        self.life.lease_lapsed = self.lease.lapsed  # a child gone then was fenced
        self.fleet = FleetSide(
            ctx,
            self.sessions,
            life=self.life,
            hibernation=self.hibernation,
            history=self.history,
            principal=self.principal,
            audit=self.audit,
            session_event=self.session_event,
        )
        self.startup = Startup(
            ctx,
            self.sessions,
            life=self.life,
            fleet=self.fleet,
            hibernation=self.hibernation,
            launcher=self.launcher,
            history=self.history,
            principal=self.principal,
            migrate_settings=self.admin.migrate_settings,
            session_event=self.session_event,
        )

    @property
    def config(self) -> Config:
        return self.ctx.config

    # -- life -------------------------------------------------------------

    async def run(self) -> None:
        ctx = self.ctx
        subscriptions = {
            "sage.v1.request.spawn": self._spawn,
            "sage.v1.request.send.*": self._send,
            "sage.v1.request.stop.*": self._stop,
            "sage.v1.request.interrupt.*": self._interrupt,
            "sage.v1.request.wake.*": self._wake_request,
            "sage.v1.request.sessions": self._list,
            "sage.v1.request.session.*": self._session,
            "sage.v1.request.approvals": self.desk.listing,
            "sage.v1.request.approve.*": self.desk.approve,
            # either may make a principal eligible for spares, or no longer
            "sage.v1.request.settings.set": self._then_spares(self.admin.set_settings),
            "sage.v1.request.install": self._then_spares(self.admin.install),
            "sage.v1.request.principals": self.admin.list_principals,
            "sage.v1.request.slots": self.fleet.slots,
            "sage.v1.request.adopt": self.fleet.adopt,
            "sage.v1.request.conversation.*": self.fleet.conversation,
            "sage.v1.request.yield.*": self.fleet.yield_request,
        }
        self.hibernation.configure()
        self.launcher.resolve_binary()
        # subscribed before anything else: requests that come during the
        # reconciliation wait in their queues instead of finding no responder
        subscribed = {pattern: ctx.subscribe(pattern) for pattern in subscriptions}
        changed = ctx.subscribe("sage.v1.tools.changed")
        catalogue = ctx.subscribe("sage.v1.tools.list")
        identities = ctx.subscribe("tool.v1.execute.save_identity.result")
        grants = ctx.subscribe(LEASE_TOPIC)
        # the bridge publishes its list when it changes: ask for it, now that we listen
        self._publish("sage.v1.tools.describe", {})
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.mcp.follow, catalogue)
            tg.start_soon(self.launcher.check_version)  # spawns (reconcile's too) wait
            tg.start_soon(self.lease.follow, grants)  # and, in a fleet, for the lease
            tg.start_soon(self.lease.watch)
            await self.startup.reconcile()
            self.startup.sweep_folders()
            for pattern, handler in subscriptions.items():
                tg.start_soon(self._serve, subscribed[pattern], handler)
            tg.start_soon(self._tools_changed, changed)
            tg.start_soon(self._identity_saved, identities)
            tg.start_soon(self.spares.run, tg)
            tg.start_soon(self.hibernation.run)
            ctx.ready()

    def _then_spares(self, handler: Handler) -> Handler:
        """``handler``, then a look at the spares (the keeper looks at most 30 s apart)."""

        async def handle(request: Envelope) -> dict[str, Any]:
            try:
                return await handler(request)
            finally:
                self.spares.wake()

        return handle

    async def _serve(self, requests: AsyncIterable[Envelope], handler: Handler) -> None:
        async for request in requests:
            # each request in its own task: a slow stop does not hold up a spawn
            assert self._tg is not None
            self._tg.start_soon(self._answer, request, handler)

    async def _answer(self, request: Envelope, handler: Handler) -> None:
        """Run one request's handler and reply: the one reply path of the runner.

        Handlers share the task group of the sessions, so nothing a handler raises
        may leave here: a bug is logged and answered ``internal_error``, and the
        live sessions go on."""
        try:
            reply = await handler(request)
        except SageError as exc:  # SessionError and its kin: the reason is their code
            reply = replies.from_error(exc)
        except msgspec.ValidationError as exc:
            reply = replies.error("bad_request", str(exc))
        except msgspec.DecodeError as exc:
            reply = replies.error("bad_request", f"not JSON: {exc}")
        except Exception as exc:  # a handler bug must not take the sessions down
            log.exception("runner.handler_failed", topic=request.topic)
            reply = replies.error(
                "internal_error",
                f"the runner failed on {request.topic} ({type(exc).__name__});"
                " see the supervisor's log",
            )
        if request.reply_to:
            try:
                self.ctx.reply(request, reply)
            except BusError as exc:  # (too large, most likely): the caller still hears why
                log.warning("runner.reply_failed", topic=request.topic, error=str(exc))
                with contextlib.suppress(BusError):
                    self.ctx.reply(
                        request,
                        replies.error(
                            "reply_failed", f"the answer could not be sent ({exc.code}): {exc}"
                        ),
                    )

    def soon(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        """Run ``func(*args)`` in a task of the sessions' task group."""
        assert self._tg is not None
        self._tg.start_soon(func, *args)

    def _publish(
        self, topic: str, payload: dict[str, Any], principal: str | None = None
    ) -> Envelope | None:
        """Publish; the envelope belongs to ``principal`` (else the payload's
        ``principal_id``), so other principals' users do not see it."""
        if principal is None:
            claimed = payload.get("principal_id")
            principal = claimed if isinstance(claimed, str) and claimed else None
        try:
            return self.ctx.publish(topic, payload, on_behalf_of=principal)
        except BusError as exc:
            log.error("runner.publish_failed", topic=topic, error=str(exc))
            return None

    def audit(self, kind: str, payload: dict[str, Any]) -> None:
        self._publish(f"sage.v1.audit.{kind}", payload)

    # -- Keeper: what hibernation asks, the session's life answers ------------------

    async def save(self, record: SessionRecord) -> None:
        await self.life.save(record)

    async def scrub(self, session: Session) -> None:
        await self.life.scrub(session)

    async def start(self, session: Session, *, resume: bool, initial: str | None) -> int:
        return await self.life.start(session, resume=resume, initial=initial)

    async def ended(self, session: Session, ending: Ending | None, reason: str) -> None:
        await self.life.ended(session, ending, reason)

    # -- principals: the session side's way to the administration ------------------

    def principal(self, name: str) -> PrincipalConfig | None:
        """The principal with its stored settings in force (see :meth:`Admin.principal`)."""
        return self.admin.principal(name)

    # -- spawn ----------------------------------------------------------------

    def _reject(
        self, request: Envelope, principal_id: str, reason: str, message: str, **extra: Any
    ) -> SessionError:
        # seen by the caller's principal (the claim only when an admin asked)
        self._publish(
            "sage.v1.event.session_rejected",
            {"principal_id": principal_id, "reason": reason, "message": message, **extra},
            request.principal or principal_id,
        )
        return SessionError(reason, message)

    async def _spawn(self, request: Envelope) -> dict[str, Any]:
        req = msgspec.json.decode(request.payload, type=SpawnRequest)
        config = self.config
        who = req.principal_id
        if request.principal is not None and request.principal != who:
            raise self._reject(
                request, who, "not_authorized", f"you may not act for principal {who!r}"
            )
        try:
            principal = self.principal(who)
        except SettingsError as exc:
            raise self._reject(request, who, exc.code, str(exc)) from None
        if principal is None:
            raise self._reject(
                request, who, "unknown_principal", f"no principal {who!r} is configured"
            )
        sid = new_session_id() if req.session_id is None else req.session_id
        if not valid_id(sid):
            raise self._reject(
                request, who, "invalid_session_id", "session ids are 1-64 of [A-Za-z0-9_-]"
            )
        if principal.interaction_mode == "repl":
            raise self._reject(
                request,
                who,
                "interaction_mode_is_repl",
                f"principal {who!r} uses a terminal (repl): run `astrid sage repl {who}`"
                " instead, or switch it with `astrid sage settings"
                f" {who} --interaction-mode headless`",
            )
        try:
            cwd = work_folder(principal, config.home_of(principal), req.cwd)
            model = chosen_model(principal, req.model)
        except SessionError as exc:
            raise self._reject(request, who, exc.code, str(exc)) from None
        try:  # a principal over a budget starts nothing (sage/usage/admission.py)
            await admit(self.ctx, who, Verb.SPAWN, sid)
        except SageError as exc:
            raise self._reject(request, who, exc.code, str(exc)) from None
        if sid.startswith("repl-") or await taken_by_another(self.ctx.state, sid, who):
            # an ended session's id stays its principal's: its record, history and
            # session-scoped tools must not pass to someone else
            raise self._reject(
                request, who, "duplicate_session", f"session {sid!r} exists", session_id=sid
            )
        admission = judge(
            Join.SPAWN, sid, who, sessions=self.sessions, room=self.hibernation, config=config
        )
        if not admission.admitted:
            refused = admission.error()
            extra = {"session_id": sid} if refused.code == "duplicate_session" else {}
            raise self._reject(request, who, refused.code, str(refused), **extra)
        # a spawn that names no session id may take a spare (its ids are chosen already)
        # (not while the host is full: the spare would wait, uncounted, for a slot)
        spare = (
            self.spares.claim(who, cwd, model)
            if req.session_id is None and self.hibernation.slots.free
            else None
        )
        if spare is not None and spare.session_id in self.sessions:  # a named spawn took its id
            self.spares.drop(spare, "id_taken")
            spare = None
        record = SessionRecord(
            session_id=sid if spare is None else spare.session_id,
            principal_id=who,
            claude_session=str(uuid.uuid4()) if spare is None else spare.claude_session,
            started_at=time.time(),
            cwd=cwd,
            model=model,
        )
        sid = record.session_id
        session = Session(record, principal, last_active=time.monotonic())
        self.sessions.add(session)  # taken before the first await: no race past the cap
        try:
            pid = await self.life.start(
                session, resume=False, initial=req.initial_message, spare=spare
            )
        except SessionError as exc:
            self.sessions.remove(session)
            self._publish(
                "sage.v1.event.session_rejected",
                {"principal_id": who, "reason": exc.code, "message": str(exc)},
            )
            raise
        return {"ok": True, "session_id": sid, "pid": pid}

    async def _wake_request(self, request: Envelope) -> dict[str, Any]:
        session = await self._target(request)
        msgspec.json.decode(request.payload or b"{}", type=WakeRequest)
        await admit(self.ctx, session.record.principal_id, Verb.WAKE, session.id)
        was = session.state
        await self.fleet.still_here(session)
        await self.hibernation.awake(session)
        return {"ok": True, "session_id": session.id, "woken": was in ASLEEP}

    async def _target(self, request: Envelope) -> Session:
        sid = request.topic.rsplit(".", 1)[1]
        # a session of someone else looks the same as none at all
        session = self.sessions.visible(sid, request.principal)
        if session is not None:
            return session
        record = await listing.visible_record(self.ctx.state, request.principal, sid)
        # one another node of the fleet took over runs there now: not this node's to answer
        if record is not None and record.reason == EndReason.FAILED_OVER:
            raise SessionError("unknown_session", f"session {sid!r} runs on another node now")
        if record is not None and record.state is RecordState.ENDED:
            raise SessionError("session_ended", f"session {sid!r} {listing.ended_text(record)}")
        raise SessionError("unknown_session", f"no session {sid!r}")

    def _proc(self, session: Session) -> ClaudeProcess:
        if session.state is SessionState.ENDED:
            raise SessionError(
                "session_ended", f"session {session.id!r} {listing.ended_text(session.record)}"
            )
        if session.state in ASLEEP:
            raise SessionError(
                "hibernated", f"session {session.id!r} is hibernated: a send wakes it"
            )
        if session.proc is None:
            raise SessionError("not_ready", f"session {session.id!r} is starting")
        return session.proc

    async def _send(self, request: Envelope) -> dict[str, Any]:
        session = await self._target(request)
        req = msgspec.json.decode(request.payload, type=SendRequest)
        if req.session_id is not None and req.session_id != session.id:
            raise SessionError("bad_request", "session_id does not match the topic")
        size, limit = turn_size(req.text), self.config.limits.stdin_quota
        if size > limit:  # at once: no wake, no child, for a turn that cannot be written
            log.warning("session.send_refused", session_id=session.id, size=size, limit=limit)
            self.session_event(
                session.id,
                "error",
                {
                    "principal_id": session.record.principal_id,
                    "session_id": session.id,
                    "reason": "payload_too_large",
                },
            )
            raise SessionError("payload_too_large", turn_too_large(size, limit))
        await admit(self.ctx, session.record.principal_id, Verb.SEND, session.id)
        session.sending += 1  # from its wake to its turn written, the session is not idle
        try:
            await self.fleet.still_here(session)
            await self.hibernation.awake(session)
            proc = self._proc(session)
            await self.lease.require("write a turn")
            return await self._write_turn(session, proc, req.text)
        finally:
            session.sending -= 1

    async def _write_turn(self, session: Session, proc: ClaudeProcess, text: str) -> dict[str, Any]:
        try:
            turn = await proc.send(text)
        except SessionError as exc:
            if exc.code == "payload_too_large":
                proc._error("payload_too_large")
            raise
        return {"ok": True, "session_id": session.id, "turn": turn}

    async def _stop(self, request: Envelope) -> dict[str, Any]:
        session = await self._target(request)
        await self.life.stop(session, EndReason.STOPPED)
        return {"ok": True, "session_id": session.id}

    async def _interrupt(self, request: Envelope) -> dict[str, Any]:
        session = await self._target(request)
        try:
            why = msgspec.json.decode(request.payload or b"{}", type=InterruptRequest)
        except (msgspec.DecodeError, msgspec.ValidationError):
            why = InterruptRequest()  # a person's interrupt needs no payload
        because = None
        if why.why is not None and request.principal is None:  # the usage ledger's
            because = (TurnEnd(why.why), why.message)
        result = await self._proc(session).interrupt(because=because)
        return {"ok": True, "session_id": session.id, **result}

    async def _list(self, request: Envelope) -> dict[str, Any]:
        req = msgspec.json.decode(request.payload or b"{}", type=SessionsRequest)
        return await listing.sessions_reply(self.ctx.state, self.sessions, request.principal, req)

    async def _session(self, request: Envelope) -> dict[str, Any]:
        sid = request.topic.rsplit(".", 1)[1]
        req = msgspec.json.decode(request.payload or b"{}", type=SessionRequest)
        return await listing.session_reply(
            self.ctx.state, self.sessions, self.history, request.principal, sid, req
        )

    # -- tools changed / identity refresh -------------------------------------------

    async def _tools_changed(self, envelopes: AsyncIterable[Envelope]) -> None:
        async for envelope in envelopes:
            try:
                msg = msgspec.json.decode(envelope.payload, type=ToolsChanged)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            targets = [
                s.proc
                for s in list(self.sessions.values())
                if s.proc is not None and msg.session_id in (None, s.id)
            ]
            if msg.session_id is None:  # the spares' CLIs hold a tool list too
                targets += self.spares.procs()
            for proc in targets:
                assert self._tg is not None
                self._tg.start_soon(
                    quietly, lambda p=proc, server=msg.server: p.tools_changed(server)
                )

    async def _identity_saved(self, envelopes: AsyncIterable[Envelope]) -> None:
        async for envelope in envelopes:
            try:
                msg = msgspec.json.decode(envelope.payload, type=IdentitySaved)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            principal = envelope.principal  # the verified publisher, never the payload
            if not msg.success or principal is None:
                continue
            self.life.refresh_identity(principal)

    # -- Host: what a ClaudeProcess asks of the runner -------------------------------

    def session_event(
        self, sid: str, name: str, payload: dict[str, Any], principal: str | None = None
    ) -> None:
        envelope = self._publish(f"sage.v1.event.{sid}.{name}", payload, principal)
        if envelope is not None:  # kept for watch --replay
            self.history.record(sid, envelope.id, name, envelope.ts, payload)

    def event(self, proc: ClaudeProcess, name: str, payload: dict[str, Any]) -> None:
        session = self.sessions.get(proc.session_id)
        if name == "init":
            payload["claude_code_version"] = self.launcher.version
            payload["tools"] = [f"mcp__sage__{tool.get('name', '')}" for tool in self.mcp.tools]
        if session is not None:
            session.last_active = time.monotonic()
            if name == "done":  # it may be idle now: a spawn or wake waiting needs no poll
                self.hibernation.nudge()
            if name == "init":
                waking = session.state is SessionState.WAKING
                session.ready()
                session.woken()
                if waking:  # its record said hibernated until the woken child was up
                    session.record.state = session.record_state()
                    self.soon(self.save, session.record)
        self.session_event(proc.session_id, name, payload, proc.principal_id)
        who = {"principal_id": proc.principal_id, "session_id": proc.session_id}
        if name == "permission_denied":  # the CLI decided a tool call by itself
            self.audit("permission_denied", {**payload, **who})
        elif name == "error" and payload.get("reason") == EndReason.PERMISSION_MODE_MISMATCH:
            self.audit(
                "permission_mode_mismatch",
                {
                    **who,
                    "expected": payload.get("expected"),
                    "got": payload.get("got"),
                    "where": payload.get("where"),
                    "claude_code_version": self.launcher.version,
                },
            )

    async def mcp_message(self, proc: ClaudeProcess, request: McpMessageRequest) -> Any:
        return await self.mcp.handle(proc, request)

    async def can_use_tool(self, proc: ClaudeProcess, request: CanUseToolRequest) -> Verdict:
        return await self.desk.can_use_tool(proc, request)

    async def hook_callback(
        self, proc: ClaudeProcess, request: HookCallbackRequest
    ) -> dict[str, Any]:
        return await self.desk.hook_callback(proc, request)


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point."""
    await Runner(ctx).run()
