"""Hibernation: idle sessions give up their ``claude`` child and wake on the next send.

``[sessions] hibernate_after`` hibernates a session idle that long (its child
initialized, no turn in flight, no control request of the CLI's unanswered);
``[sessions] max_live`` bounds the sessions' live children on the host
(:class:`~capsules.runner.live_slots.LiveSlots`): a spawn or a wake past it
first hibernates the least recently used idle session, and waits for its slot.
The per-principal cap (``[limits] max_sessions_per_principal``) counts live
sessions the same way.

To hibernate (:meth:`Hibernation.begin`), the session's record is saved as
``hibernated`` first, so a supervisor that dies while the child stops finds
it asleep, then the child gets the gentle stop sequence; once it is reaped
(:meth:`Hibernation.hibernated`) the session sleeps with no child, keeping its
id, record and conversation.  A wake (:meth:`Hibernation.awake`) takes a live
slot and starts a child with ``--resume`` on the same conversation; a child
that ends before it answers ``initialize`` ends the session ``resume_failed``
(:meth:`Hibernation.resume_failed`).

What it needs of the runner is :class:`Keeper`; no I/O of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import structlog

from capsules.runner.admission import Join, judge
from capsules.runner.conversation import EndReason
from capsules.runner.errors import SessionError
from capsules.runner.history import EventHistory
from capsules.runner.live_slots import LiveSlots, share
from capsules.runner.principals import SettingsError
from capsules.runner.sessions import (
    ASLEEP,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
)
from sage.config import Config, PrincipalConfig

if TYPE_CHECKING:
    from capsules.runner.claude_process import ClaudeProcess, Ending

__all__ = ("Hibernation", "Keeper")

log = structlog.get_logger("sage.runner")

ROOM_POLL = 0.05
"""Seconds between two looks for room under a principal's cap while a wake waits."""


class Keeper(Protocol):
    """What hibernation asks of the runner."""

    @property
    def config(self) -> Config: ...

    @property
    def sessions(self) -> SessionTable: ...

    @property
    def history(self) -> EventHistory: ...

    def principal(self, name: str) -> PrincipalConfig | None: ...

    def audit(self, kind: str, payload: dict[str, Any]) -> None: ...

    def session_event(self, sid: str, name: str, payload: dict[str, Any]) -> None: ...

    def soon(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None: ...

    async def save(self, record: SessionRecord) -> None: ...

    async def scrub(self, session: Session) -> None: ...

    async def start(self, session: Session, *, resume: bool, initial: str | None) -> int: ...

    async def ended(self, session: Session, ending: Ending | None, reason: str) -> None: ...


class Hibernation:
    """See the module docstring."""

    def __init__(self, keeper: Keeper) -> None:
        self.keeper = keeper
        self.slots = LiveSlots(0, 0)  # bounded by the config in configure()
        self.enabled = False
        self.wake_wait = 30.0

    def configure(self) -> None:
        """Read ``[sessions]`` once, at the runner's start (the knobs are not reloaded)."""
        cfg = self.keeper.config.sessions
        self.slots = LiveSlots(cfg.max_live, cfg.wake_queue)
        self.enabled = cfg.hibernation
        self.wake_wait = cfg.wake_wait

    # -- going to sleep -------------------------------------------------------------

    def begin(self, session: Session, why: str) -> None:
        """Stop idle ``session``'s child to free the host; the session sleeps once it
        is reaped (:meth:`hibernated`).  No ``await`` here: the caller chose
        ``session`` as idle, and nothing else may choose it meanwhile."""
        proc = session.proc
        assert proc is not None
        session.hibernate()
        session.record.state = RecordState.HIBERNATED
        session.record.hibernated_at = time.time()
        log.info("session.hibernating", session_id=session.id, why=why)
        self.keeper.soon(self._put_to_sleep, session, proc, why)

    def fence(self, session: Session) -> None:
        """The node lost its fleet lease (capsules/runner/fleet_lease.py): kill the
        session's child now, whatever it was doing; the session sleeps once it is
        reaped, as a hibernation, and a send wakes it once the lease is back.  A
        stopping session's child is killed too, and the session ends as its stop says."""
        proc = session.proc
        assert proc is not None
        self.fenced(session)
        proc.fence()

    def fenced(self, session: Session) -> None:
        """``session``'s child is killed, or ended, while the node holds no lease (the
        fence process may have been first: sage/fence.py): it hibernates, never ends."""
        session.fenced = True
        if session.state is not SessionState.STOPPING:
            if session.state is not SessionState.HIBERNATING:
                session.hibernate()
            session.record.state = RecordState.HIBERNATED
            session.record.hibernated_at = session.record.hibernated_at or time.time()
        log.warning("session.fenced", session_id=session.id)
        if session.state is SessionState.HIBERNATING:
            self.keeper.soon(self._put_to_sleep, session, None, "fenced")

    async def _put_to_sleep(self, session: Session, proc: ClaudeProcess | None, why: str) -> None:
        """Save the record, announce ``hibernating``, stop ``proc`` (None: its child is
        killed already, a fence)."""
        # the record first: a supervisor that dies now finds the session hibernated
        await self.keeper.save(session.record)
        if session.state is not SessionState.HIBERNATING:
            return  # a stop came first, or the child went by itself: nothing to announce
        self.keeper.session_event(
            session.id,
            "hibernating",
            {"principal_id": session.record.principal_id, "session_id": session.id, "why": why},
        )
        if proc is not None:
            await proc.stop(EndReason.HIBERNATE)

    async def hibernated(self, session: Session) -> None:
        """The child of a hibernating session is reaped: it sleeps, keeping its id."""
        keeper = self.keeper
        record = session.record
        record.state, record.pid = RecordState.HIBERNATED, None
        record.turns, record.cost_usd = session.turns, session.cost_usd
        with anyio.CancelScope(shield=True):
            await keeper.save(record)
            await keeper.scrub(session)  # the child's hook token is no use to anyone now
        if session.state is not SessionState.HIBERNATING:  # a stop (or a yield) came
            await keeper.ended(session, session.ending, session.end_reason or EndReason.STOPPED)
            return
        session.hibernated()
        keeper.session_event(
            session.id,
            "hibernated",
            {
                "principal_id": record.principal_id,
                "session_id": session.id,
                "turns": session.turns,
                "hibernated_at": record.hibernated_at,
            },
        )
        keeper.history.ended(session.id)  # its ring joins the ended ones' (bounded)
        keeper.audit(
            "session_hibernated", {"principal_id": record.principal_id, "session_id": session.id}
        )

    # -- room -----------------------------------------------------------------------

    def live_cap(self, principal: str) -> tuple[int, str]:
        """The live sessions ``principal`` may have: ``[limits] max_sessions_per_principal``,
        or its share of ``[sessions] max_live`` when that is less (live_slots.share); and
        a note saying so for a refusal ("" when the per-principal cap rules)."""
        cap = self.keeper.config.limits.max_sessions_per_principal
        if not self.slots.limit:
            return cap, ""
        others = {self.keeper.sessions[sid].record.principal_id for sid in self.keeper.sessions}
        others.discard(principal)
        fair = share(self.slots.limit, len(others))
        if not others or fair >= cap:  # alone on the host: the slots' queue decides
            return cap, ""
        return fair, (
            f" (its share of [sessions] max_live = {self.slots.limit}: a slot is kept for"
            f" each other principal with sessions, {len(others)} now)"
        )

    def room_soon(self) -> bool:
        """Whether a live slot is free or will be without waiting on a turn: an idle
        session can hibernate for it, or one hibernates already (its slot comes back
        once its child is reaped: an admission may just have begun it)."""
        sessions = self.keeper.sessions
        return (
            self.slots.free
            or sessions.least_recent_idle() is not None
            or any(sessions[sid].state is SessionState.HIBERNATING for sid in sessions)
        )

    async def slot_for(self, session: Session) -> None:
        """A live slot for ``session``'s child: at once, or after an idle session
        hibernates to make room, waiting up to ``[sessions] wake_wait`` (else
        :class:`SessionError` ``host_full``)."""
        if self.slots.try_take(session):
            return
        self.slots.may_wait(self.wake_wait)  # a request refused at once puts nobody to sleep
        self._make_room(arriving=1)
        await self.slots.take(session, self.wake_wait)

    def _make_room(self, arriving: int = 0) -> None:
        """The host is at ``[sessions] max_live``: for every wait (those queued, and
        ``arriving`` about to be) not yet covered by a hibernating session, hibernate the
        least recently used idle one."""
        sessions = self.keeper.sessions
        hibernating = sum(1 for s in sessions.values() if s.state is SessionState.HIBERNATING)
        for _ in range(self.slots.waiting + arriving - hibernating):
            victim = sessions.least_recent_idle()
            if victim is None:
                return
            self.begin(victim, "max_live")

    def nudge(self) -> None:
        """A session may have turned idle (a turn ended): make room for those waiting now,
        not at the next look.  The session is idle only once the ``done`` event has gone
        out, so the look runs in a task of its own."""
        if self.slots.waiting:
            self.keeper.soon(self._look)

    async def _look(self) -> None:
        self._make_room()

    async def run(self) -> None:
        """Hibernate sessions idle for ``[sessions] hibernate_after``; make room for
        spawns and wakes that wait for a slot when a session turns idle."""
        cfg = self.keeper.config.sessions
        if not cfg.hibernation:
            return
        period = min(5.0, max(0.1, cfg.hibernate_after / 4)) if cfg.hibernate_after else 0.5
        while True:
            await anyio.sleep(period)
            if cfg.hibernate_after:
                due = self.keeper.sessions.idle_since(time.monotonic() - cfg.hibernate_after)
                for session in due:
                    self.begin(session, "idle")
            if self.slots.waiting:
                self._make_room()

    # -- waking ---------------------------------------------------------------------

    async def awake(self, session: Session) -> None:
        """Return once ``session`` is not asleep: wake it if it is hibernated, wait for
        a hibernation or another wake under way to be over."""
        while True:
            if session.state is SessionState.HIBERNATED:
                await self._wake(session)
            elif session.state in ASLEEP or (
                session.state is SessionState.WAKING and session.proc is None
            ):
                waking = session.state is SessionState.WAKING
                if session.settled is not None:
                    await session.settled.wait()
                else:
                    await anyio.sleep(0.01)
                now: SessionState = session.state  # (it changed while we waited)
                if waking and now is SessionState.HIBERNATED and session.wake_error:
                    raise session.wake_error  # the wake we waited for failed: so do we
            elif session.between_children:  # an identity refresh: the next child takes it
                await session.changed_child.wait()
            else:
                session.last_active = time.monotonic()
                return

    async def _wake(self, session: Session) -> None:
        """Start a child with ``--resume`` for hibernated ``session``; returns once it
        runs (its turns wait for ``initialize``)."""
        keeper = self.keeper
        principal = session.record.principal_id
        # at the principal's cap (or share of max_live), one of its sessions still busy
        # or starting: wait for it to go idle and sleep, as a wake waits for a slot
        deadline = time.monotonic() + self.wake_wait
        while True:
            admission = judge(
                Join.WAKE,
                session.id,
                principal,
                sessions=keeper.sessions,
                room=self,
                config=keeper.config,
            )
            if admission.admitted:
                break
            if time.monotonic() >= deadline:
                raise admission.error()
            await anyio.sleep(ROOM_POLL)
        if session.state is not SessionState.HIBERNATED:
            return  # woken (or stopped) meanwhile: the caller looks again
        try:
            session.principal = keeper.principal(principal) or session.principal
        except SettingsError as exc:
            raise SessionError(exc.code, str(exc)) from None
        session.wake()  # other sends wait for this wake (settled)
        session.wake_error = None
        try:
            await self.slot_for(session)
            session.last_active = time.monotonic()
            keeper.session_event(
                session.id,
                "waking",
                {
                    "principal_id": principal,
                    "session_id": session.id,
                    "hibernated_at": session.record.hibernated_at,
                },
            )
            await keeper.start(session, resume=True, initial=None)
        except SessionError as exc:
            # no child ran: no slot, or a refusal before the launch (the binary, the key,
            # the home): the conversation is intact, the session sleeps on
            await self._wake_failed(session, exc)
            raise
        keeper.session_event(session.id, "resumed", {"principal_id": principal, "reason": "wake"})

    async def _wake_failed(self, session: Session, exc: SessionError) -> None:
        """A wake that started no child: back to sleep, or, stopped meanwhile, ended."""
        self.slots.give_back(session)  # (the session's task gave it back, if it ran)
        if session.state in (SessionState.STOPPING, SessionState.ENDED):
            await self.keeper.ended(session, None, EndReason.STOPPED)
            raise SessionError(
                "session_ended", f"session {session.id!r} was stopped while it woke"
            ) from None
        session.wake_error = exc
        session.sleep_on()
        self.keeper.history.ended(session.id)  # its ring stays bounded with the asleep

    async def resume_failed(self, session: Session, ending: Ending | None) -> None:
        """A woken child ended before it answered ``initialize``: the conversation could
        not be resumed (its transcript gone or unreadable, the CLI failing)."""
        why = ending.reason if ending is not None else "not launched"
        detail = (ending.stderr_tail.strip().splitlines() or [""])[-1] if ending else ""
        reason = f"{EndReason.RESUME_FAILED}: {why}" + (f" ({detail[:200]})" if detail else "")
        self.keeper.audit(
            "resume_failed",
            {
                "principal_id": session.record.principal_id,
                "session_id": session.id,
                "reason": reason,
            },
        )
        await self.keeper.ended(session, ending, reason)
