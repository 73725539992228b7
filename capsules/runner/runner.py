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

Every check of a spawn (id, principal, mode, duplicate, per-principal cap)
happens with no ``await`` between the cap check and the new session taking
its place in the table, so two spawns cannot both pass the cap.  Each session
runs as a task of the runner; its ``exited`` event is published exactly
once, after the child is reaped.  Records in the state store outlive the
supervisor: on start, sessions that were live are resumed (``[sessions]
resume = true``) or ended with reason ``supervisor_restart``.

Hibernation (``[sessions] hibernate_after``, ``max_live``): an idle session's
child is stopped and the session stays in the table, and in the store, as
``hibernated``; the next send wakes it with ``--resume``.  The live children
are bounded by :class:`~capsules.runner.live_slots.LiveSlots`; to make room
the least recently used idle session hibernates.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
import uuid
from collections.abc import AsyncIterable, Awaitable, Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import BusError, Envelope
from capsules.runner.admin import Admin
from capsules.runner.approval_desk import ApprovalDesk
from capsules.runner.approvals import Verdict
from capsules.runner.claude_process import ClaudeProcess, Ending, EndReason, SessionError
from capsules.runner.command import Launch, remove_session_files
from capsules.runner.hibernation import Hibernation
from capsules.runner.history import EventHistory
from capsules.runner.launcher import Launcher
from capsules.runner.mcp import McpServer
from capsules.runner.messages import (
    AdoptRequest,
    IdentitySaved,
    InterruptRequest,
    SendRequest,
    SessionRequest,
    SessionsRequest,
    SpawnRequest,
    ToolsChanged,
    WakeRequest,
    YieldRequest,
)
from capsules.runner.principals import SettingsError
from capsules.runner.sessions import (
    ASLEEP,
    LIVE,
    AfterChild,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
    new_session_id,
)
from capsules.runner.spare_keeper import SpareKeeper, Warm
from capsules.runner.spares import Spare
from capsules.runner.workplace import chosen_model, work_folder
from sage import replies
from sage.capsule.context import CapsuleContext
from sage.capsule.sessions import session_owner
from sage.claude.hooks import IN_BAND_HOOKS, callback_id
from sage.claude.protocol import (
    CanUseToolRequest,
    HookCallbackRequest,
    HookMatcher,
    McpMessageRequest,
)
from sage.config import NAME_PATTERN, Config, PrincipalConfig
from sage.contract.sessions import CLAIMS_TOPIC, TurnEnd, Verb, turn_size, turn_too_large
from sage.errors import SageError
from sage.usage.admission import admit

__all__ = ("Runner", "SessionRecord", "run")

log = structlog.get_logger("sage.runner")

Handler = Callable[[Envelope], Awaitable[dict[str, Any]]]
"""A request handler: the envelope in, the reply out (it may raise; see ``_answer``)."""
HOOKS = {name: [HookMatcher(None, [callback_id(name)])] for name in IN_BAND_HOOKS}
"""Registered at every child's ``initialize``: every hook event sage hooks arrives
in-band, answered by the approval desk, so a headless turn starts no hook process
(the installer writes command hooks for REPL principals only)."""


CLAIMS_DEADLINE = 10.0
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")


def _check_id(value: str) -> bool:
    return re.match(NAME_PATTERN, value) is not None


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
            refresh_identity=self._refresh_identity,
        )
        self.desk = ApprovalDesk(
            ctx, rules=self.admin, publish=self._publish, event=self.session_event, audit=self.audit
        )
        self.launcher = Launcher(ctx, self.admin, audit=self.audit, event=self.session_event)
        self.history = EventHistory()
        self.spares = SpareKeeper(ctx, self.admin, self.launcher, self.mcp, hooks=HOOKS)
        self.hibernation = Hibernation(self)
        self._tg: anyio.abc.TaskGroup | None = None
        self._unsure: set[str] = set()
        """Sessions kept asleep at start because the fleet could not say whether another
        node took them: asked again before they wake."""

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
            "sage.v1.request.slots": self._slots,
            "sage.v1.request.adopt": self._adopt_request,
            "sage.v1.request.conversation.*": self._conversation,
            "sage.v1.request.yield.*": self._yield_request,
        }
        self.hibernation.configure()
        self.launcher.resolve_binary()
        # subscribed before anything else: requests that come during the
        # reconciliation wait in their queues instead of finding no responder
        subscribed = {pattern: ctx.subscribe(pattern) for pattern in subscriptions}
        changed = ctx.subscribe("sage.v1.tools.changed")
        catalogue = ctx.subscribe("sage.v1.tools.list")
        identities = ctx.subscribe("tool.v1.execute.save_identity.result")
        # the bridge publishes its list when it changes: ask for it, now that we listen
        self._publish("sage.v1.tools.describe", {})
        async with anyio.create_task_group() as tg:
            self._tg = tg
            tg.start_soon(self.mcp.follow, catalogue)
            tg.start_soon(self.launcher.check_version)  # spawns (reconcile's too) wait
            await self._reconcile()
            self._sweep_folders()
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

    # -- records --------------------------------------------------------------

    async def save(self, record: SessionRecord) -> None:
        try:
            await self.ctx.state.put("sessions", record.session_id, msgspec.to_builtins(record))
        except SageError as exc:
            log.error("runner.record_failed", session_id=record.session_id, error=str(exc))

    # -- principals: the session side's way to the administration ------------------

    def principal(self, name: str) -> PrincipalConfig | None:
        """The principal with its stored settings in force (see :meth:`Admin.principal`)."""
        return self.admin.principal(name)

    async def _principal_key(self, name: str) -> str | None:
        return await self.admin.principal_key(name)

    async def _migrate_settings(self) -> None:
        await self.admin.migrate_settings()

    async def _reconcile(self) -> None:
        """Sessions the last supervisor left live: resume them or end them."""
        store = self.ctx.state
        await self._migrate_settings()
        records = [
            msgspec.convert(value, SessionRecord) for _, value in await store.items("sessions")
        ]
        # nothing of ours runs yet: every token left from a child is stale; a REPL's
        # (minted by the hooks capsule for a terminal outside us) is its own, and expires
        for key, value in await store.items("hook_tokens"):
            if not (isinstance(value, dict) and value.get("kind") == "repl"):
                await store.delete("hook_tokens", key)
        records = [
            r
            for r in records
            if (r.state is RecordState.HIBERNATED or r.state in LIVE)
            and r.session_id not in self.sessions
        ]
        elsewhere = await self._taken_elsewhere({r.session_id: r.principal_id for r in records})
        for record in records:
            asleep = record.state is RecordState.HIBERNATED
            if record.pid:  # a hibernation the last supervisor did not see through, too
                _kill_leftover(record.pid, record.claude_session)
            if elsewhere is not None and record.session_id in elsewhere:
                # another node of the fleet took it while this one was lost: it runs
                # there now, and a second child on its conversation must never start
                log.info(
                    "session.failed_over_elsewhere",
                    session_id=record.session_id,
                    node=elsewhere[record.session_id],
                )
                session = Session(record, PrincipalConfig(name=record.principal_id))
                await self.ended(session, None, EndReason.FAILED_OVER)
                continue
            # the fleet cannot say whether another node runs it: no child now, it sleeps
            unsure = elsewhere is None and self.config.sessions.resume
            try:
                principal = self.principal(record.principal_id)
            except SettingsError as exc:
                log.error(
                    "runner.settings_unusable", principal_id=record.principal_id, error=str(exc)
                )
                principal = None
            # a sleeping session needs only its principal to be configured: settings that
            # cannot be read now refuse its wake (which says why), not its existence
            keeper = principal or (
                self.config.principal(record.principal_id) if asleep or unsure else None
            )
            if keeper is not None and (
                asleep
                or unsure
                or (self.config.sessions.resume and not self.hibernation.slots.free)
            ):
                if unsure:
                    self._unsure.add(record.session_id)
                # it sleeps on (or, past max_live, starts to): the next send wakes it
                record.state, record.pid = RecordState.HIBERNATED, None
                record.hibernated_at = record.hibernated_at or time.time()
                self.sessions.add(
                    Session(
                        record,
                        keeper,
                        state=SessionState.HIBERNATED,
                        turns=record.turns,
                        cost_usd=record.cost_usd,
                    )
                )
                if not asleep:
                    await self.save(record)
                if self.config.fleet is not None:  # the registry says it sleeps (its claim
                    # at this start wrote it running): a node that adopts it keeps it asleep
                    self.session_event(
                        record.session_id,
                        "hibernated",
                        {
                            "principal_id": record.principal_id,
                            "session_id": record.session_id,
                            "turns": record.turns,
                            "hibernated_at": record.hibernated_at,
                            "reason": "supervisor_restart",
                        },
                    )
                    self.history.ended(record.session_id)
                continue
            if (
                self.config.sessions.resume
                and principal is not None
                and self.launcher.binary is not None
            ):
                session = Session(record, principal, turns=record.turns, cost_usd=record.cost_usd)
                self.sessions.add(session)
                try:
                    await self.start(session, resume=True, initial=None)
                except SessionError as exc:
                    self.sessions.remove(session)
                    await self.ended(session, None, f"{EndReason.RESUME_FAILED}: {exc}")
                    continue
                self.session_event(
                    record.session_id,
                    "resumed",
                    {"principal_id": record.principal_id, "reason": "supervisor_restart"},
                )
            else:
                session = Session(record, principal or PrincipalConfig(name=record.principal_id))
                await self.ended(session, None, EndReason.SUPERVISOR_RESTART)

    async def _taken_elsewhere(self, sids: dict[str, str]) -> dict[str, str] | None:
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

    def _sweep_folders(self) -> None:
        """Identity folders no live session owns: a spare's, left by a supervisor that
        died (a spare has no record, so no reconciliation ends it)."""
        folder = self.config.state_dir / "sessions"
        try:
            names = [entry.name for entry in os.scandir(folder) if entry.is_dir()]
        except OSError:
            return
        for name in names:
            if name not in self.sessions:
                remove_session_files(self.config, name)

    # -- spawn ----------------------------------------------------------------

    async def _taken_by_another(self, sid: str, principal: str) -> bool:
        """Whether a stored session (the runner's or a REPL's) of that id is another's."""
        try:
            owner = await session_owner(self.ctx.state, sid)
        except SageError as exc:
            log.error("runner.session_check_failed", session_id=sid, error=str(exc))
            return True  # unknown: refuse rather than hand over someone's id
        return owner is not None and owner != principal

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

    def _over_cap(self, sid: str, pid_: str, *, asleep: bool) -> SessionError | None:
        """Why a new session ``sid`` of ``pid_`` may not join (a spawn's, or an adoption's)
        under the per-principal caps: ``duplicate_session`` or ``principal_limit``; None
        when it may.  A session that joins ``asleep`` counts against the logical cap
        only; one that joins live may hibernate an idle session of the principal to
        make room (:meth:`Hibernation.room_for`)."""
        (cap, note), logical_cap = (
            self.hibernation.live_cap(pid_),  # the cap, or the principal's share of max_live
            self.config.limits.max_logical_sessions_per_principal,
        )
        refusal = self.sessions.refusal(sid, pid_, None if asleep else cap, logical_cap)
        if refusal == "duplicate_session":
            return SessionError("duplicate_session", f"session {sid!r} exists")
        if refusal != "principal_limit":
            return None
        if len(self.sessions.of(pid_)) >= logical_cap:
            return SessionError(
                "principal_limit",
                f"principal {pid_!r} has {logical_cap} sessions already, hibernated"
                " ones included ([limits] max_logical_sessions_per_principal)",
            )
        if asleep or self.hibernation.room_for(pid_):
            return None
        return SessionError(
            "principal_limit",
            f"principal {pid_!r} has {cap} live sessions already{note}"
            + (", none of them idle" if self.config.sessions.hibernation else ""),
        )

    async def _spawn(self, request: Envelope) -> dict[str, Any]:
        req = msgspec.json.decode(request.payload, type=SpawnRequest)
        config = self.config
        pid_ = req.principal_id
        if request.principal is not None and request.principal != pid_:
            raise self._reject(
                request, pid_, "not_authorized", f"you may not act for principal {pid_!r}"
            )
        try:
            principal = self.principal(pid_)
        except SettingsError as exc:
            raise self._reject(request, pid_, exc.code, str(exc)) from None
        if principal is None:
            raise self._reject(
                request, pid_, "unknown_principal", f"no principal {pid_!r} is configured"
            )
        sid = new_session_id() if req.session_id is None else req.session_id
        if not _check_id(sid):
            raise self._reject(
                request, pid_, "invalid_session_id", "session ids are 1-64 of [A-Za-z0-9_-]"
            )
        if principal.interaction_mode == "repl":
            raise self._reject(
                request,
                pid_,
                "interaction_mode_is_repl",
                f"principal {pid_!r} uses a terminal (repl): run `astrid sage repl {pid_}`"
                " instead, or switch it with `astrid sage settings"
                f" {pid_} --interaction-mode headless`",
            )
        try:
            cwd = work_folder(principal, config.home_of(principal), req.cwd)
            model = chosen_model(principal, req.model)
        except SessionError as exc:
            raise self._reject(request, pid_, exc.code, str(exc)) from None
        try:  # a principal over a budget starts nothing (sage/usage/admission.py)
            await admit(self.ctx, pid_, Verb.SPAWN, sid)
        except SageError as exc:
            raise self._reject(request, pid_, exc.code, str(exc)) from None
        if sid.startswith("repl-") or await self._taken_by_another(sid, pid_):
            # an ended session's id stays its principal's: its record, history and
            # session-scoped tools must not pass to someone else
            raise self._reject(
                request, pid_, "duplicate_session", f"session {sid!r} exists", session_id=sid
            )
        refused = self._over_cap(sid, pid_, asleep=False)
        if refused is not None:
            extra = {"session_id": sid} if refused.code == "duplicate_session" else {}
            raise self._reject(request, pid_, refused.code, str(refused), **extra)
        # a spawn that names no session id may take a spare (its ids are chosen already)
        # (not while the host is full: the spare would wait, uncounted, for a slot)
        spare = (
            self.spares.claim(pid_, cwd, model)
            if req.session_id is None and self.hibernation.slots.free
            else None
        )
        if spare is not None and spare.session_id in self.sessions:  # a named spawn took its id
            self.spares.drop(spare, "id_taken")
            spare = None
        record = SessionRecord(
            session_id=sid if spare is None else spare.session_id,
            principal_id=pid_,
            claude_session=str(uuid.uuid4()) if spare is None else spare.claude_session,
            started_at=time.time(),
            cwd=cwd,
            model=model,
        )
        sid = record.session_id
        session = Session(record, principal, last_active=time.monotonic())
        self.sessions.add(session)  # taken before the first await: no race past the cap
        try:
            pid = await self.start(session, resume=False, initial=req.initial_message, spare=spare)
        except SessionError as exc:
            self.sessions.remove(session)
            self._publish(
                "sage.v1.event.session_rejected",
                {"principal_id": pid_, "reason": exc.code, "message": str(exc)},
            )
            raise
        return {"ok": True, "session_id": sid, "pid": pid}

    async def start(
        self,
        session: Session,
        *,
        resume: bool,
        initial: str | None,
        spare: Spare[Warm] | None = None,
    ) -> int:
        """Start the session's task once it has a live slot (it may wait for one, up to
        ``[sessions] wake_wait``, else ``host_full``); returns once its first child
        runs (its pid).  The task gives the slot back when it returns."""
        assert self._tg is not None
        try:
            await self.hibernation.slot_for(session)
        except SessionError:
            if spare is not None:
                self.spares.drop(spare, "host_full")
            raise
        try:
            pid: int = await self._tg.start(self._run_session, session, resume, initial, spare)
        except SessionError:
            raise
        except (SageError, OSError) as exc:
            raise SessionError("spawn_failed", str(exc)) from None
        return pid

    async def _run_session(
        self,
        session: Session,
        resume: bool,
        initial: str | None,
        spare: Spare[Warm] | None = None,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """The life of a session's children: one, or several when it is respawned, until
        it ends or hibernates; the first may be a spare's (``spare``), when it matches
        what a cold start would be.  The session's live slot is given back on return."""
        try:
            await self._children(session, resume, initial, spare, task_status=task_status)
        finally:
            self.hibernation.slots.give_back(session)

    async def _children(
        self,
        session: Session,
        resume: bool,
        initial: str | None,
        spare: Spare[Warm] | None,
        *,
        task_status: anyio.abc.TaskStatus[int],
    ) -> None:
        ending: Ending | None = None
        first = True
        try:
            adopted = False  # the first child is the spare's, which has run and ended
            if spare is not None:
                adopted = await self._take(session, spare, initial, task_status=task_status)
                if not adopted:  # stale: a cold start, with a conversation of its own
                    session.record.claude_session = str(uuid.uuid4())
            while True:
                if adopted:
                    adopted = False
                    ending = session.ending
                    if session.proc is not None:
                        session.count(session.proc)
                else:
                    try:
                        launch = await self.launcher.prepare(session, resume=resume)
                        proc = self._process(session, launch, initial)
                        async with anyio.create_task_group() as tg:
                            pid: int = await tg.start(self._incarnation, session, proc)
                            await self._spawned(
                                session, launch, pid, first=first, resume=launch.resume
                            )
                            if first:
                                task_status.started(pid)
                    except (SageError, OSError) as exc:
                        if first:
                            raise
                        log.warning("session.respawn_failed", session_id=session.id, error=str(exc))
                        ending = None
                    else:
                        ending = session.ending
                        assert ending is not None
                        session.count(proc)
                first = False
                waking = session.state is SessionState.WAKING
                step = session.after_child(
                    ending.reason if ending is not None else None,
                    self.config.sessions.max_respawns,
                )
                if step is AfterChild.HIBERNATE:
                    await self.hibernation.hibernated(session)
                    return
                if step is AfterChild.END and waking:  # --resume never got it initialized
                    await self.hibernation.resume_failed(session, ending)
                    return
                if step is AfterChild.END:
                    break
                if step is AfterChild.ABANDON:
                    await self._abandon(session, ending)
                    return
                resume, initial = True, None
        except anyio.get_cancelled_exc_class():
            # its record says hibernated already; a waking child has taken no turn yet
            asleep = session.state in ASLEEP or session.state is SessionState.WAKING
            if session.may(SessionState.INTERRUPTED):
                session.move(SessionState.INTERRUPTED)
            if session.proc is not None and not asleep:  # what it did, for the next start
                session.count(session.proc)
            session.record.turns, session.record.cost_usd = session.totals()
            with anyio.CancelScope(shield=True), anyio.move_on_after(2):
                if asleep:  # the next supervisor finds it hibernated, whatever resume says
                    session.record.state, session.record.pid = RecordState.HIBERNATED, None
                else:
                    session.record.state = RecordState.INTERRUPTED
                    session.record.reason = EndReason.SUPERVISOR_SHUTDOWN.value
                await self.save(session.record)
                await self.scrub(session)
            self.sessions.remove(session)
            session.over()
            raise
        except (SageError, OSError):
            if session.state is SessionState.WAKING:  # the wake says why, and it sleeps on
                session.proc = None
                raise
            session.move(SessionState.ENDED)
            self.sessions.remove(session)
            session.over()
            raise  # the first start failed: the spawn request says why
        reason = ending.reason if ending is not None else EndReason.EXITED
        await self.ended(session, ending, session.end_reason or reason)

    async def _abandon(self, session: Session, ending: Ending | None) -> None:
        self.audit(
            "respawn_abandoned",
            {
                "principal_id": session.principal.name,
                "session_id": session.id,
                "attempts": session.respawns - 1,
                "reason": session.respawn_reason or "",
            },
        )
        await self.ended(session, ending, EndReason.RESPAWN_ABANDONED)

    async def _slots(self, request: Envelope) -> dict[str, Any]:
        """The host's load: live children (held slots), ``max_live`` (None: no bound),
        idle sessions (what may hibernate to make room) and hibernated ones."""
        if request.principal is not None:
            raise SessionError("not_authorized", "only an admin may read the host's slots")
        slots = self.hibernation.slots
        sessions = [self.sessions[sid] for sid in self.sessions]
        states: dict[str, int] = {}
        for session in sessions:
            state = _listed_state(session)
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

    async def _adopt_request(self, request: Envelope) -> dict[str, Any]:
        """Run a session a lost node ran, here, under its own id: ``--resume`` on its
        conversation, whose transcript the fleet restored already (docs/fleet.md)."""
        if request.principal is not None:
            raise SessionError(
                "not_authorized", "only the supervisor adopts another node's session"
            )
        req = msgspec.json.decode(request.payload, type=AdoptRequest)
        sid, pid_ = req.session_id, req.principal_id
        if not (_check_id(sid) and _check_id(req.from_node)) or sid.startswith("repl-"):
            raise SessionError("invalid_session_id", "session ids are 1-64 of [A-Za-z0-9_-]")
        if not _UUID.match(req.claude_session):
            raise SessionError("bad_request", "claude_session is not a uuid")
        principal = self.principal(pid_)
        if principal is None:
            raise SessionError("unknown_principal", f"no principal {pid_!r} is configured")
        if principal.interaction_mode == "repl":
            raise SessionError("interaction_mode_is_repl", f"principal {pid_!r} uses a terminal")
        cwd = work_folder(principal, self.config.home_of(principal), req.cwd or None)
        model = chosen_model(principal, req.model or None)
        if await self._taken_by_another(sid, pid_):
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
        # the caps of a spawn: a node that cannot take it refuses, and the next node may
        refused = self._over_cap(sid, pid_, asleep=req.asleep)
        if refused is not None:
            raise refused
        node = self.config.fleet.node if self.config.fleet is not None else ""
        record = SessionRecord(
            session_id=sid,
            principal_id=pid_,
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
            await self.save(record)
            self.session_event(
                sid,
                "hibernated",
                {
                    "principal_id": pid_,
                    "session_id": sid,
                    "turns": req.turns,
                    "hibernated_at": record.hibernated_at,
                    "from_node": req.from_node,
                },
            )
            self.history.ended(sid)  # its ring stays bounded with the asleep
            self._failed_over(req, node, None)
            return {"ok": True, "session_id": sid, "pid": None, "hibernated": True}
        slots = self.hibernation.slots
        if not self.hibernation.room_soon():
            # a spawn would wait for a slot; an adoption leaves it to a node with room
            raise SessionError(
                "host_full",
                f"the host runs {len(slots)} sessions of max_live {slots.limit}, none idle",
            )
        session = Session(
            record,
            principal,
            turns=req.turns,
            cost_usd=req.cost_usd,  # its cost goes on too
            last_active=time.monotonic(),
        )
        self.sessions.add(session)
        try:
            pid = await self.start(session, resume=not req.fresh, initial=None)
        except SessionError as exc:
            self.sessions.remove(session)
            if exc.code == "host_full":  # no slot came: nothing of it ran here, nor ends
                session.over()
                raise
            await self.ended(session, None, f"{EndReason.RESUME_FAILED}: {exc}")
            raise
        self.session_event(
            sid,
            "resumed",
            {"principal_id": pid_, "reason": "failover", "from_node": req.from_node},
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

    async def _yield_request(self, request: Envelope) -> dict[str, Any]:
        """Another node of the fleet runs this session now (it took it over while this
        node was judged lost): this node's copy ends ``failed_over``, its child stopped
        at once (docs/fleet.md, "Failover").  The supervisor's fleet side only."""
        if request.principal is not None:
            raise SessionError(
                "not_authorized", "only the supervisor yields a session to another node"
            )
        sid = request.topic.rsplit(".", 1)[1]
        req = msgspec.json.decode(request.payload or b"{}", type=YieldRequest)
        if not _check_id(req.node):
            raise SessionError("bad_request", "node is 1-64 of [A-Za-z0-9_-]")
        session = self.sessions.get(sid)
        if session is None:
            raise SessionError("unknown_session", f"no session {sid!r} here")
        await self.fence(session, req.node)
        return {"ok": True, "session_id": sid, "node": req.node}

    async def _still_here(self, session: Session) -> None:
        """Before a session kept asleep at start, when the fleet could not say whether
        another node took it, wakes: ask again.  Taken: it ends ``failed_over`` here
        (``unknown_session``: the fleet's router finds it there); the fleet still
        cannot say: ``fleet_unavailable``, and it sleeps on (never a second child)."""
        sid = session.id
        if sid not in self._unsure:
            return
        elsewhere = await self._taken_elsewhere({sid: session.record.principal_id})
        if elsewhere is None:
            raise SessionError(
                "fleet_unavailable",
                f"session {sid!r} sleeps until the fleet can say whether another node"
                " took it over (NATS unreachable?); try again",
            )
        self._unsure.discard(sid)
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
        self._unsure.discard(session.id)
        if session.state is SessionState.HIBERNATED:  # no child: it ends now
            await self.ended(session, None, EndReason.FAILED_OVER)
            return
        session.stop()
        if session.proc is not None:
            await session.proc.stop(EndReason.FAILED_OVER)
        with anyio.move_on_after(self.config.limits.stop_grace * 3 + 5):
            await session.done.wait()

    async def _conversation(self, request: Envelope) -> dict[str, Any]:
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

    async def _wake_request(self, request: Envelope) -> dict[str, Any]:
        session = await self._target(request)
        msgspec.json.decode(request.payload or b"{}", type=WakeRequest)
        await admit(self.ctx, session.record.principal_id, Verb.WAKE, session.id)
        was = session.state
        await self._still_here(session)
        await self.hibernation.awake(session)
        return {"ok": True, "session_id": session.id, "woken": was in ASLEEP}

    async def _take(
        self,
        session: Session,
        spare: Spare[Warm],
        initial: str | None,
        *,
        task_status: anyio.abc.TaskStatus[int],
    ) -> bool:
        """Serve ``session`` with ``spare``'s child when a cold start would launch the
        same (else False: the spare is stopped); returns once that child has ended."""
        try:
            check = await self.launcher.prepare(session, resume=False, files=False)
        except BaseException:
            self.spares.drop(spare, "spawn_refused")
            raise
        if not self.spares.check(spare, check):
            return False
        warm = spare.handle
        assert warm.launch is not None
        assert warm.proc is not None
        session.token_hash = warm.session.token_hash  # the spare's own token, stored now
        async with anyio.create_task_group() as tg:
            pid: int = await tg.start(self._adopt, session, warm)
            await self._spawned(session, warm.launch, pid, first=True, resume=False, spare=True)
            self.event(warm.proc, "init", self.spares.hand_over(spare, self))
            if initial:
                session.sending += 1  # not idle until the first turn is written
                tg.start_soon(_quietly, lambda: _send(session, warm.proc, initial))
            task_status.started(pid)
            self.spares.wake()  # the next spare starts now, in the background
        return True

    async def _adopt(
        self, session: Session, warm: Warm, *, task_status: anyio.abc.TaskStatus[int]
    ) -> None:
        """The session's side of a spare's child: it runs in the spare's task already."""
        proc = warm.proc
        assert proc is not None
        assert proc.pid is not None
        session.attach(proc)
        if session.state is SessionState.STARTING:  # (a stop may have come first)
            session.move(SessionState.RUNNING)
        task_status.started(proc.pid)
        await warm.ended.wait()
        if warm.ending is None:  # the spare's task was cancelled: the runner is stopping
            await anyio.sleep_forever()
        session.ending = warm.ending
        with contextlib.suppress(OSError):
            proc.launch.identity_file.unlink(missing_ok=True)

    def _process(self, session: Session, launch: Launch, initial: str | None) -> ClaudeProcess:
        return ClaudeProcess.within(
            self.config.limits,
            session.id,
            session.principal.name,
            launch,
            self,
            hooks=HOOKS,
            initial_message=initial,
        )

    async def _incarnation(
        self, session: Session, proc: ClaudeProcess, *, task_status: anyio.abc.TaskStatus[int]
    ) -> None:
        session.attach(proc)
        if session.state is SessionState.STARTING:
            session.move(SessionState.RUNNING)
        elif session.state is SessionState.STOPPING:  # stopped before the child was there
            proc.end(EndReason.STOPPED)
        session.ending = await proc.run(task_status=task_status)
        with contextlib.suppress(OSError):
            proc.launch.identity_file.unlink(missing_ok=True)

    async def _spawned(
        self,
        session: Session,
        launch: Launch,
        pid: int,
        *,
        first: bool,
        resume: bool,
        spare: bool = False,
    ) -> None:
        record = session.record
        record.pid = pid
        record.state = session.record_state()  # running, while a child serves it
        record.flags_hash = launch.flags_hash
        await self.save(record)
        try:
            await self.ctx.state.put(
                "hook_tokens",
                session.id,
                {"sha256": session.token_hash, "principal_id": record.principal_id},
            )
        except SageError as exc:
            log.error("runner.token_not_saved", session_id=session.id, error=str(exc))
        if launch.identity_fallback:
            self.audit(
                "identity_fallback",
                {"principal_id": session.principal.name, "session_id": session.id},
            )
        if first:
            self.session_event(
                session.id,
                "spawned",
                {"principal_id": record.principal_id, "session_id": session.id, "pid": pid},
            )
        elif session.respawn_reason is not None:
            self.session_event(
                session.id,
                "respawned",
                {
                    "principal_id": record.principal_id,
                    "reason": session.respawn_reason,
                    "flags_hash": launch.flags_hash,
                    "pid": pid,
                },
            )
        self.audit(
            "spawn",
            {
                "principal_id": record.principal_id,
                "session_id": session.id,
                "pid": pid,
                "flags_hash": launch.flags_hash,
                "uid": os.getuid() if launch.uid is None else launch.uid,
                "auth_mode": session.principal.auth_mode,
                "key_source": session.key_source,
                "interaction_mode": session.principal.interaction_mode,
                "resume": resume,
                "spare": spare,
            },
        )

    async def ended(self, session: Session, ending: Ending | None, reason: str) -> None:
        record = session.record
        session.move(SessionState.ENDED)
        record.state = session.record_state()
        record.reason = str(reason)
        record.ended_at = time.time()
        record.turns = session.turns
        record.cost_usd = session.cost_usd
        if ending is not None:
            record.exit_code, record.signal = ending.status.exit_code, ending.status.signal
        payload: dict[str, Any] = (
            ending.payload() if ending is not None else {"exit_code": None, "signal": None}
        )
        payload["reason"] = record.reason
        payload["principal_id"] = record.principal_id
        self.sessions.remove(session)
        with anyio.CancelScope(shield=True):
            await self.save(record)
            await self.scrub(session)
            # before exited and done: whoever saw the end finds the history settled
            await self._prune_history(record.principal_id)
        self.session_event(session.id, "exited", payload)
        self.history.ended(session.id)
        session.over()
        log.info("session.exited", session_id=session.id, reason=record.reason)

    async def _prune_history(self, principal: str) -> None:
        """Keep the newest ``[sessions] history`` ended records of ``principal``."""
        keep = self.config.sessions.history
        try:
            ended = sorted(
                (
                    (value.get("ended_at") or 0.0, key)
                    for key, value in await self.ctx.state.items("sessions")
                    if isinstance(value, dict)
                    and value.get("state") == "ended"
                    and value.get("principal_id") == principal
                ),
                reverse=True,
            )
            for _, key in ended[keep:]:
                await self.ctx.state.delete("sessions", key)
        except SageError as exc:
            log.error("runner.history_prune_failed", principal_id=principal, error=str(exc))

    async def _visible_record(self, request: Envelope, sid: str) -> SessionRecord | None:
        """The stored record of session ``sid`` if the requester may see it (its
        principal's, or an admin's); another principal's looks like none."""
        if not _check_id(sid):
            return None
        try:
            value = await self.ctx.state.get("sessions", sid)
            record = msgspec.convert(value, SessionRecord) if isinstance(value, dict) else None
        except (SageError, msgspec.ValidationError):
            return None
        if record is None or request.principal not in (None, record.principal_id):
            return None
        return record

    async def scrub(self, session: Session) -> None:
        try:
            await self.ctx.state.delete("hook_tokens", session.id)
        except SageError as exc:
            log.error("runner.scrub_failed", session_id=session.id, error=str(exc))
        remove_session_files(self.config, session.id)

    # -- per-session requests -------------------------------------------------------

    async def _target(self, request: Envelope) -> Session:
        sid = request.topic.rsplit(".", 1)[1]
        # a session of someone else looks the same as none at all
        session = self.sessions.visible(sid, request.principal)
        if session is not None:
            return session
        record = await self._visible_record(request, sid)
        # one another node of the fleet took over runs there now: not this node's to answer
        if record is not None and record.reason == EndReason.FAILED_OVER:
            raise SessionError("unknown_session", f"session {sid!r} runs on another node now")
        if record is not None and record.state is RecordState.ENDED:
            raise SessionError("session_ended", f"session {sid!r} {_ended_text(record)}")
        raise SessionError("unknown_session", f"no session {sid!r}")

    def _proc(self, session: Session) -> ClaudeProcess:
        if session.state is SessionState.ENDED:
            raise SessionError(
                "session_ended", f"session {session.id!r} {_ended_text(session.record)}"
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
            await self._still_here(session)
            await self.hibernation.awake(session)
            proc = self._proc(session)
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
        if session.state is SessionState.HIBERNATED:  # no child: it ends now
            await self.ended(session, None, EndReason.STOPPED)
            return {"ok": True, "session_id": session.id}
        session.stop()
        if session.proc is not None:
            await session.proc.stop(EndReason.STOPPED)
        with anyio.move_on_after(self.config.limits.stop_grace * 3 + 5):
            await session.done.wait()
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

    def _live_row(self, session: Session) -> dict[str, Any]:
        proc = session.proc
        row: dict[str, Any] = (
            proc.describe()
            if proc is not None
            else {
                "session_id": session.id,
                "principal_id": session.record.principal_id,
                "pid": None,
                "state": "starting",
            }
        )
        row["state"] = _listed_state(session)
        # the turns and cost of the whole session, its earlier children's included
        row["turns"], row["cost_usd"] = session.totals()
        row["started_at"] = session.record.started_at
        row["age_s"] = round(time.time() - session.record.started_at, 1)  # the session's
        row["hibernated_at"] = session.record.hibernated_at
        row["cwd"] = session.record.cwd
        row["model"] = session.record.model
        return row

    async def _list(self, request: Envelope) -> dict[str, Any]:
        req = msgspec.json.decode(request.payload or b"{}", type=SessionsRequest)
        live = self.sessions.visible_to(request.principal)
        ended: list[dict[str, Any]] = []
        if req.all:
            try:
                stored = await self.ctx.state.items("sessions")
            except SageError as exc:
                raise SessionError("state_failed", str(exc)) from None
            ended = sorted(
                (
                    value
                    for _, value in stored
                    if isinstance(value, dict)
                    and value.get("state") == "ended"
                    and request.principal in (None, value.get("principal_id"))
                ),
                key=lambda value: value.get("ended_at") or 0.0,
                reverse=True,
            )
        # one page: only its rows are built (a host may hold thousands of sessions)
        total = len(live) + len(ended)
        start, end = req.offset, req.offset + req.limit
        rows = [self._live_row(s) for s in live[start:end]]
        rows += [
            _ended_row(msgspec.convert(value, SessionRecord))
            for value in ended[max(0, start - len(live)) : max(0, end - len(live))]
        ]
        more = end < total
        return {"ok": True, "sessions": rows, "total": total, "next_offset": end if more else None}

    async def _session(self, request: Envelope) -> dict[str, Any]:
        """One session, live or ended, and its last events (``replay``) for watch."""
        sid = request.topic.rsplit(".", 1)[1]
        req = msgspec.json.decode(request.payload or b"{}", type=SessionRequest)
        session = self.sessions.visible(sid, request.principal)
        if session is not None:
            row = self._live_row(session)
        else:
            record = await self._visible_record(request, sid)
            if record is None:
                raise SessionError("unknown_session", f"no session {sid!r}")
            row = _ended_row(record)
        events = self.history.last(sid, req.replay)
        return {"ok": True, "session": row, "events": events}

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
                    _quietly, lambda p=proc, server=msg.server: p.tools_changed(server)
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
            self._refresh_identity(principal)

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

    def _refresh_identity(self, principal: str) -> None:
        """Respawn ``principal``'s live sessions (``--resume``) with the identity now in force,
        each once its running turn (if any) has ended: a refresh never cuts a turn short;
        its spares, started with the old one, are replaced.  A hibernated session takes
        the new identity when it wakes."""
        self.spares.stale(principal)
        assert self._tg is not None
        for session in list(self.sessions.values()):
            if (
                session.record.principal_id == principal
                and session.proc is not None
                and not session.refresh_due
            ):
                session.refresh_due = True
                self._tg.start_soon(self._respawn_when_idle, session)

    async def _respawn_when_idle(self, session: Session) -> None:
        """Once ``session`` is idle (no turn, approval or tool call under way), stop its
        child to start the next one; nothing when it ends or sleeps meanwhile."""
        try:
            while session.state not in ASLEEP and not session.done.is_set():
                proc = session.proc
                if session.idle and proc is not None:
                    if session.respawn("identity_refresh"):
                        await proc.stop(EndReason.RESPAWN)
                    return
                await anyio.sleep(0.05)
        finally:
            session.refresh_due = False


def _listed_state(session: Session) -> str:
    """The state a session's listing row shows: its child's (``ready``, ``busy``, ...),
    or between children the session's own (``hibernated``, ``waking``, ``respawning``)."""
    if session.state in ASLEEP or session.state in (
        SessionState.WAKING,
        SessionState.RESPAWNING,
    ):
        return session.state.value
    return session.proc.state.value if session.proc is not None else "starting"


def _ended_row(record: SessionRecord) -> dict[str, Any]:
    return {
        "session_id": record.session_id,
        "principal_id": record.principal_id,
        "state": record.state,
        "reason": record.reason,
        "exit_code": record.exit_code,
        "signal": record.signal,
        "turns": record.turns,
        "cost_usd": record.cost_usd,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "pid": None,
        "cwd": record.cwd,
        "model": record.model,
    }


def _ended_text(record: SessionRecord) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.ended_at or 0.0))
    how = f"exit code {record.exit_code}" if record.exit_code is not None else ""
    if record.signal is not None:
        how = f"signal {record.signal}"
    return f"ended at {when} ({record.reason}{', ' + how if how else ''})"


async def _quietly(func: Callable[[], Awaitable[Any]]) -> None:
    with contextlib.suppress(SessionError):
        await func()


async def _send(session: Session, proc: ClaudeProcess | None, text: str) -> None:
    """A spare's initial message, once the session has its child (``sending`` counted)."""
    try:
        if proc is not None:
            await proc.send(text)
    finally:
        session.sending -= 1


def _kill_leftover(pid: int, claude_session: str) -> None:
    """A child of a dead supervisor that is somehow still there (PDEATHSIG should have)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            argv = file.read().split(b"\0")
    except OSError:
        return
    mine = {f"--session-id={claude_session}".encode(), f"--resume={claude_session}".encode()}
    if mine & set(argv):  # only a process started for this very session
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point."""
    await Runner(ctx).run()
