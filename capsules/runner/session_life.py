"""The life of a session's task, in one place: its children, its end, its record.

:meth:`SessionLife.start` takes a live slot for the session (it may wait for one,
capsules/runner/hibernation.py) and starts its task in the runner's task group;
the task (:meth:`SessionLife._run_session`) runs one ``claude`` child after another,
the first perhaps a spare's (capsules/runner/spare_keeper.py), until the session
ends, hibernates or is abandoned after too many respawns in a row; the
supervisor's stop (a cancellation) leaves its record ``interrupted``, or
``hibernated``, for the next start.  :meth:`SessionLife.ended` is the one end of
a session: its record saved, its hook token and files scrubbed, its principal's
history pruned, then ``exited`` published exactly once.  The audit rows of a
child's start (``spawn``, ``identity_fallback``) and of a session given up
(``respawn_abandoned``) are written here too.

It asks nothing of the runner but what it is given: the session table, the
parts that launch and hold children, and the runner as the children's
:class:`~capsules.runner.claude_process.Host`.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import anyio.abc
import msgspec
import structlog

from capsules.runner.claude_process import ClaudeProcess, Ending, EndReason, Host
from capsules.runner.command import Launch, remove_session_files
from capsules.runner.errors import SessionError
from capsules.runner.hibernation import Hibernation
from capsules.runner.history import EventHistory
from capsules.runner.launcher import Launcher
from capsules.runner.sessions import (
    ASLEEP,
    AfterChild,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
)
from capsules.runner.spare_keeper import SpareKeeper, Warm
from capsules.runner.spares import Spare
from sage.capsule.context import CapsuleContext
from sage.claude.hooks import IN_BAND_HOOKS, callback_id
from sage.claude.protocol import HookMatcher
from sage.config import Config
from sage.errors import SageError

__all__ = ("HOOKS", "SessionLife", "quietly")

log = structlog.get_logger("sage.runner")

INTERRUPTED_EXIT: Final = "interrupted_exit"
"""The ``reason`` of a respawn after a child exited with an error just after an
interrupted turn (Conversation.resumable): it resumes the conversation."""
IDENTITY_REFRESH: Final = "identity_refresh"
"""The ``reason`` of a respawn for a principal's new identity."""

HOOKS = {name: [HookMatcher(None, [callback_id(name)])] for name in IN_BAND_HOOKS}
"""Registered at every child's ``initialize``: every hook event sage hooks arrives
in-band, answered by the approval desk, so a headless turn starts no hook process
(the installer writes command hooks for REPL principals only)."""

Audit = Callable[[str, dict[str, Any]], None]
SessionEvent = Callable[[str, str, dict[str, Any]], None]


class SessionLife:
    """See the module docstring."""

    def __init__(
        self,
        ctx: CapsuleContext,
        sessions: SessionTable,
        *,
        hibernation: Hibernation,
        launcher: Launcher,
        spares: SpareKeeper,
        history: EventHistory,
        host: Host,
        audit: Audit,
        session_event: SessionEvent,
        tasks: Callable[[], anyio.abc.TaskGroup | None],
    ) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.hibernation = hibernation
        self.launcher = launcher
        self.spares = spares
        self.history = history
        self.host = host
        self.audit = audit
        self.session_event = session_event
        self._tasks = tasks
        """The runner's task group (the sessions'), once it runs."""
        self.lease_lapsed: Callable[[], bool] = lambda: False
        """Whether the node's fleet lease is lost or just ran out (capsules/runner/
        fleet_lease.py): a child that ends then was fenced, and its session hibernates."""

    @property
    def config(self) -> Config:
        return self.ctx.config

    @property
    def _tg(self) -> anyio.abc.TaskGroup:
        tg = self._tasks()
        assert tg is not None
        return tg

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
                        if ending is not None:
                            self._resume_if_interrupted(session, session.proc, ending)
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
                        self._resume_if_interrupted(session, proc, ending)
                first = False
                if not session.fenced and self.lease_lapsed():  # the fence killed it
                    self.hibernation.fenced(session)
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

    def _resume_if_interrupted(self, session: Session, proc: ClaudeProcess, ending: Ending) -> None:
        """A child that exited with an error right after an interrupted turn (the floor
        CLI does: Conversation.resumable) is followed by one that resumes it."""
        status = ending.status
        if proc.conversation.resumable(status.exit_code, status.signal, time.monotonic()):
            log.warning(
                "session.resumed_after_interrupt", session_id=session.id, exit_code=status.exit_code
            )
            session.respawn(INTERRUPTED_EXIT)

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
            pid: int = await tg.start(self._spare_child, session, warm)
            await self._spawned(session, warm.launch, pid, first=True, resume=False, spare=True)
            self.host.event(warm.proc, "init", self.spares.hand_over(spare, self.host))
            if initial:
                session.sending += 1  # not idle until the first turn is written
                tg.start_soon(quietly, lambda: _send(session, warm.proc, initial))
            task_status.started(pid)
            self.spares.wake()  # the next spare starts now, in the background
        return True

    async def _spare_child(
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
            self.host,
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

    async def scrub(self, session: Session) -> None:
        try:
            await self.ctx.state.delete("hook_tokens", session.id)
        except SageError as exc:
            log.error("runner.scrub_failed", session_id=session.id, error=str(exc))
        remove_session_files(self.config, session.id)

    def refresh_identity(self, principal: str) -> None:
        """Respawn ``principal``'s live sessions (``--resume``) with the identity now in force,
        each once its running turn (if any) has ended: a refresh never cuts a turn short;
        its spares, started with the old one, are replaced.  A hibernated session takes
        the new identity when it wakes."""
        self.spares.stale(principal)
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
                    if session.respawn(IDENTITY_REFRESH):
                        await proc.stop(EndReason.RESPAWN)
                    return
                await anyio.sleep(0.05)
        finally:
            session.refresh_due = False

    async def stop(self, session: Session, reason: EndReason) -> None:
        """End ``session`` for ``reason`` (an operator's stop, a fence): a hibernated one
        at once (it has no child), else its child is stopped; returns once it ended (or
        after three stop graces and five seconds)."""
        if session.state is SessionState.HIBERNATED:  # no child: it ends now
            await self.ended(session, None, reason)
            return
        session.stop()
        if session.proc is not None:
            await session.proc.stop(reason)
        with anyio.move_on_after(self.config.limits.stop_grace * 3 + 5):
            await session.done.wait()

    async def save(self, record: SessionRecord) -> None:
        try:
            await self.ctx.state.put("sessions", record.session_id, msgspec.to_builtins(record))
        except SageError as exc:
            log.error("runner.record_failed", session_id=record.session_id, error=str(exc))


async def quietly(func: Callable[[], Awaitable[Any]]) -> None:
    """Run ``func``; a refusal (the session went meanwhile) is nobody's business."""
    with contextlib.suppress(SessionError):
        await func()


async def _send(session: Session, proc: ClaudeProcess | None, text: str) -> None:
    """A spare's initial message, once the session has its child (``sending`` counted)."""
    try:
        if proc is not None:
            await proc.send(text)
    finally:
        session.sending -= 1
