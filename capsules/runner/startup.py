"""Start-up: the sessions the last supervisor left live, resumed, kept asleep or ended.

Records in the state store outlive the supervisor.  At start, each record the
last one left ``running``, ``interrupted`` or ``hibernated`` meets its
:class:`Fate` (:func:`fate`, sans-IO, one record at a time):

- :attr:`Step.FAILED_OVER`: another node of the fleet took it while this one was
  lost; it runs there now, and a second child on its conversation must never
  start: it ends ``failed_over`` here;
- :attr:`Step.SLEEP`: it was asleep, or the fleet cannot say whether another node
  took it (``unsure``: asked again before it wakes), or the host is at
  ``[sessions] max_live``: it sleeps, and the next send wakes it;
- :attr:`Step.RESUME`: ``[sessions] resume = true``, its principal usable and the
  ``claude`` binary found: a child with ``--resume`` now;
- :attr:`Step.END`: anything else, ``supervisor_restart``.

A sleeping session needs only its principal to be configured: settings that
cannot be read now refuse its wake (which says why), not its existence.  The
shell (:class:`Startup`) reads the store, asks the fleet once for all of them
(capsules/runner/fleet_side.py), and carries each fate out in turn (whether a
live slot is free is read before each, as resumes take slots).
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog

from capsules.runner.claude_process import EndReason
from capsules.runner.command import remove_session_files
from capsules.runner.errors import SessionError
from capsules.runner.fleet_side import FleetSide
from capsules.runner.hibernation import Hibernation
from capsules.runner.history import EventHistory
from capsules.runner.launcher import Launcher
from capsules.runner.principals import SettingsError
from capsules.runner.session_life import SessionEvent, SessionLife
from capsules.runner.sessions import (
    LIVE,
    RecordState,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
)
from sage.capsule.context import CapsuleContext
from sage.config import Config, PrincipalConfig

__all__ = ("Fate", "Startup", "Step", "fate", "left_live")

log = structlog.get_logger("sage.runner")


class Step(enum.Enum):
    """What start-up does with a session the last supervisor left live."""

    FAILED_OVER = "failed_over"
    SLEEP = "sleep"
    RESUME = "resume"
    END = "end"


class Fate(msgspec.Struct, frozen=True):
    """A record's step; ``node`` runs it (FAILED_OVER); ``unsure``: it sleeps because
    the fleet could not say; ``keeper``: the principal a sleeping or resumed session
    keeps (None for an end)."""

    step: Step
    node: str | None = None
    unsure: bool = False
    keeper: PrincipalConfig | None = None


def left_live(records: list[SessionRecord], present: Callable[[str], bool]) -> list[SessionRecord]:
    """The records start-up looks at: live or hibernated, not in the table already."""
    return [
        r
        for r in records
        if (r.state is RecordState.HIBERNATED or r.state in LIVE) and not present(r.session_id)
    ]


def fate(
    record: SessionRecord,
    *,
    elsewhere: dict[str, str] | None,
    resume: bool,
    principal: PrincipalConfig | None,
    configured: PrincipalConfig | None,
    binary: bool,
    room: bool,
) -> Fate:
    """The fate of ``record``: ``elsewhere`` is the fleet's answer (id -> node; None:
    it cannot say), ``resume`` ``[sessions] resume``, ``principal`` its principal with
    its settings (None: unknown, or its settings unusable), ``configured`` the bare
    configured one, ``binary`` whether ``claude`` was found, ``room`` whether a live
    slot is free."""
    if elsewhere is not None and record.session_id in elsewhere:
        return Fate(Step.FAILED_OVER, node=elsewhere[record.session_id])
    asleep = record.state is RecordState.HIBERNATED
    unsure = elsewhere is None and resume  # no child now: it sleeps
    keeper = principal or (configured if asleep or unsure else None)
    if keeper is not None and (asleep or unsure or (resume and not room)):
        return Fate(Step.SLEEP, unsure=unsure, keeper=keeper)
    if resume and principal is not None and binary:
        return Fate(Step.RESUME, keeper=principal)
    return Fate(Step.END, keeper=principal)


class Startup:
    """The shell of start-up; see the module docstring."""

    def __init__(
        self,
        ctx: CapsuleContext,
        sessions: SessionTable,
        *,
        life: SessionLife,
        fleet: FleetSide,
        hibernation: Hibernation,
        launcher: Launcher,
        history: EventHistory,
        principal: Callable[[str], PrincipalConfig | None],
        migrate_settings: Callable[[], Awaitable[None]],
        session_event: SessionEvent,
    ) -> None:
        self.ctx = ctx
        self.sessions = sessions
        self.life = life
        self.fleet = fleet
        self.hibernation = hibernation
        self.launcher = launcher
        self.history = history
        self.principal = principal
        self.migrate_settings = migrate_settings
        self.session_event = session_event

    @property
    def config(self) -> Config:
        return self.ctx.config

    async def reconcile(self) -> None:
        """Sessions the last supervisor left live: resume them, keep them asleep, or
        end them."""
        store = self.ctx.state
        await self.migrate_settings()
        stored = [
            msgspec.convert(value, SessionRecord) for _, value in await store.items("sessions")
        ]
        # nothing of ours runs yet: every token left from a child is stale; a REPL's
        # (minted by the hooks capsule for a terminal outside us) is its own, and expires
        for key, value in await store.items("hook_tokens"):
            if not (isinstance(value, dict) and value.get("kind") == "repl"):
                await store.delete("hook_tokens", key)
        records = left_live(stored, lambda sid: sid in self.sessions)
        elsewhere = await self.fleet.taken_elsewhere(
            {r.session_id: r.principal_id for r in records}
        )
        for record in records:
            if record.pid:  # a hibernation the last supervisor did not see through, too
                _kill_leftover(record.pid, record.claude_session)
            try:
                principal = (
                    None
                    if elsewhere is not None and record.session_id in elsewhere
                    else self.principal(record.principal_id)
                )
            except SettingsError as exc:
                log.error(
                    "runner.settings_unusable", principal_id=record.principal_id, error=str(exc)
                )
                principal = None
            chosen = fate(
                record,
                elsewhere=elsewhere,
                resume=self.config.sessions.resume,
                principal=principal,
                configured=self.config.principal(record.principal_id),
                binary=self.launcher.binary is not None,
                room=bool(self.hibernation.slots.free),
            )
            await self._carry_out(record, chosen)

    async def _carry_out(self, record: SessionRecord, chosen: Fate) -> None:
        sid = record.session_id
        if chosen.step is Step.FAILED_OVER:
            log.info("session.failed_over_elsewhere", session_id=sid, node=chosen.node)
            session = Session(record, PrincipalConfig(name=record.principal_id))
            await self.life.ended(session, None, EndReason.FAILED_OVER)
        elif chosen.step is Step.SLEEP:
            assert chosen.keeper is not None
            await self._sleep(record, chosen.keeper, unsure=chosen.unsure)
        elif chosen.step is Step.RESUME:
            assert chosen.keeper is not None
            session = Session(record, chosen.keeper, turns=record.turns, cost_usd=record.cost_usd)
            self.sessions.add(session)
            try:
                await self.life.start(session, resume=True, initial=None)
            except SessionError as exc:
                self.sessions.remove(session)
                await self.life.ended(session, None, f"{EndReason.RESUME_FAILED}: {exc}")
                return
            self.session_event(
                sid,
                "resumed",
                {"principal_id": record.principal_id, "reason": "supervisor_restart"},
            )
        else:
            keeper = chosen.keeper or PrincipalConfig(name=record.principal_id)
            await self.life.ended(Session(record, keeper), None, EndReason.SUPERVISOR_RESTART)

    async def _sleep(self, record: SessionRecord, keeper: PrincipalConfig, *, unsure: bool) -> None:
        """It sleeps on (or, past max_live, starts to): the next send wakes it."""
        asleep = record.state is RecordState.HIBERNATED
        if unsure:
            self.fleet.unsure.add(record.session_id)
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
            await self.life.save(record)
        if self.config.fleet is not None:  # the registry says it sleeps (its claim at this
            # start wrote it running): a node that adopts it keeps it asleep
            payload: dict[str, Any] = {
                "principal_id": record.principal_id,
                "session_id": record.session_id,
                "turns": record.turns,
                "hibernated_at": record.hibernated_at,
                "reason": "supervisor_restart",
            }
            self.session_event(record.session_id, "hibernated", payload)
            self.history.ended(record.session_id)

    def sweep_folders(self) -> None:
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
