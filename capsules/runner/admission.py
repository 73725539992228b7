"""Admission: whether a session may join the host's live (or logical) sessions now.

One decision for the three ways a session comes to need a place: a spawn
(:attr:`Join.SPAWN`), another node's session adopted here (:attr:`Join.ADOPT`,
or :attr:`Join.ADOPT_ASLEEP` when it slept there and sleeps on here) and a
hibernated session woken (:attr:`Join.WAKE`).  :func:`decide` is sans-IO: it takes
what the session table and the host's slots say at one instant (:class:`Seen`)
and the bounds in force (:class:`Limits`), and returns an :class:`Admission`:
admitted, admitted once an idle session of the principal hibernates to make room
(``make_room``), or refused with its code and the text the caller reads.

The bounds: ``[limits] max_sessions_per_principal`` live sessions (or the
principal's share of ``[sessions] max_live`` when that is less: see
:meth:`~capsules.runner.hibernation.Hibernation.live_cap`), ``[limits]
max_logical_sessions_per_principal`` sessions in all, hibernated ones included,
and for an adoption a live slot free or soon (a spawn waits for its slot in
:meth:`~capsules.runner.hibernation.Hibernation.slot_for`; an adoption leaves the
session to a node with room).

:func:`judge` is the thin shell: it reads the table, decides, and begins the
hibernation a ``make_room`` asks for, with no ``await``: the caller adds the
session to the table before its next ``await``, so two joins cannot both pass a
cap.  A spending budget is another admission (sage/usage/admission.py), asked by
the request handlers themselves.
"""

from __future__ import annotations

import enum
from typing import Protocol

import msgspec
import structlog

from capsules.runner.errors import SessionError
from capsules.runner.live_slots import LiveSlots
from capsules.runner.sessions import Session, SessionTable
from sage.capsule.sessions import session_owner
from sage.config import Config
from sage.contract.codes import ErrorCode
from sage.errors import SageError
from sage.state import StateStore

__all__ = (
    "Admission",
    "Join",
    "Limits",
    "Room",
    "Seen",
    "decide",
    "judge",
    "taken_by_another",
)

log = structlog.get_logger("sage.runner")


class Join(enum.Enum):
    """How a session comes to need a place on this host."""

    SPAWN = "spawn"  # a new session, live
    ADOPT = "adopt"  # another node's session, live: a slot now or soon, else host_full
    ADOPT_ASLEEP = "adopt_asleep"  # another node's, asleep: it takes no live place
    WAKE = "wake"  # a hibernated session of the table, live again


class Seen(msgspec.Struct, frozen=True, kw_only=True):
    """What the session table and the host's slots say, at one instant."""

    taken: bool = False
    """The session id is in the table already."""
    live: int = 0
    """The principal's live sessions."""
    logical: int = 0
    """The principal's sessions, hibernated ones included."""
    idle: bool = False
    """One of the principal's sessions is idle: it may hibernate to make room."""
    host_room: bool = True
    """A live slot of the host is free, or will be without waiting on a turn."""
    host_live: int = 0
    """The host's live children (for a ``host_full`` refusal's text)."""


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """The bounds in force for one principal."""

    cap: int
    """Live sessions it may have (its share of ``max_live`` when that is less)."""
    note: str = ""
    """Why ``cap`` is a share of ``max_live`` ("" when the per-principal cap rules)."""
    logical_cap: int
    hibernation: bool
    """``[sessions] hibernation`` (a refusal says none of the sessions was idle)."""
    may_hibernate: bool
    """Hibernation runs: an idle session may hibernate to make room."""
    max_live: int = 0
    wake_wait: float = 0.0


class Admission(msgspec.Struct, frozen=True):
    """A decision: admitted (``code`` None), perhaps once an idle session of the
    principal hibernates (``make_room``); or refused, for ``code``."""

    code: ErrorCode | None = None
    message: str = ""
    make_room: bool = False

    @property
    def admitted(self) -> bool:
        return self.code is None

    def error(self) -> SessionError:
        assert self.code is not None
        return SessionError(self.code.value, self.message)


def decide(join: Join, sid: str, principal: str, seen: Seen, limits: Limits) -> Admission:
    """Whether session ``sid`` of ``principal`` may join as ``join``; see the module
    docstring.  A wake's session is in the table already: only the live cap counts."""
    if join is not Join.WAKE:
        if seen.taken:
            return Admission(ErrorCode.DUPLICATE_SESSION, f"session {sid!r} exists")
        if seen.logical >= limits.logical_cap:
            return Admission(
                ErrorCode.PRINCIPAL_LIMIT,
                f"principal {principal!r} has {limits.logical_cap} sessions already, hibernated"
                " ones included ([limits] max_logical_sessions_per_principal)",
            )
        if join is Join.ADOPT_ASLEEP:
            return Admission()
    make_room = False
    if seen.live >= limits.cap:
        if not (seen.idle and limits.may_hibernate):
            return Admission(ErrorCode.PRINCIPAL_LIMIT, _over_cap(join, principal, limits))
        make_room = True  # its idle session hibernates: its slot comes back soon
    if join is Join.ADOPT and not (make_room or seen.host_room):
        # a spawn would wait for a slot; an adoption leaves it to a node with room
        return Admission(
            ErrorCode.HOST_FULL,
            f"the host runs {seen.host_live} sessions of max_live {limits.max_live}, none idle",
        )
    return Admission(make_room=make_room)


def _over_cap(join: Join, principal: str, limits: Limits) -> str:
    if join is Join.WAKE:  # it waited for one of them to go idle, in vain
        return (
            f"principal {principal!r} has {limits.cap} live sessions{limits.note}, none idle"
            f" within {limits.wake_wait:g} s ([sessions] wake_wait)"
        )
    return f"principal {principal!r} has {limits.cap} live sessions already{limits.note}" + (
        ", none of them idle" if limits.hibernation else ""
    )


class Room(Protocol):
    """What :func:`judge` asks of hibernation (the keeper of the live slots)."""

    @property
    def slots(self) -> LiveSlots: ...

    @property
    def enabled(self) -> bool: ...

    def live_cap(self, principal: str) -> tuple[int, str]: ...

    def room_soon(self) -> bool: ...

    def begin(self, session: Session, why: str) -> None: ...


def judge(
    join: Join, sid: str, principal: str, *, sessions: SessionTable, room: Room, config: Config
) -> Admission:
    """Read the table, :func:`decide`, and begin the hibernation a ``make_room`` asks
    for (no ``await``: see the module docstring).  The caller raises a refusal
    (:meth:`Admission.error`), or for a wake waits and asks again."""
    cap, note = room.live_cap(principal)
    seen = Seen(
        taken=sid in sessions and join is not Join.WAKE,
        live=len(sessions.live_of(principal)),
        logical=len(sessions.of(principal)),
        idle=sessions.least_recent_idle(principal) is not None,
        host_room=join is not Join.ADOPT or room.room_soon(),
        host_live=len(room.slots),
    )
    limits = Limits(
        cap=cap,
        note=note,
        logical_cap=config.limits.max_logical_sessions_per_principal,
        hibernation=config.sessions.hibernation,
        may_hibernate=room.enabled,
        max_live=room.slots.limit,
        wake_wait=config.sessions.wake_wait,
    )
    decision = decide(join, sid, principal, seen, limits)
    if decision.make_room:
        victim = sessions.least_recent_idle(principal)
        assert victim is not None
        room.begin(victim, "principal_limit")
    return decision


async def taken_by_another(state: StateStore, sid: str, principal: str) -> bool:
    """Whether a stored session (the runner's or a REPL's) of id ``sid`` is another
    principal's: an ended session's id stays its principal's, so its record, history
    and session-scoped tools never pass to someone else."""
    try:
        owner = await session_owner(state, sid)
    except SageError as exc:
        log.error("runner.session_check_failed", session_id=sid, error=str(exc))
        return True  # unknown: refuse rather than hand over someone's id
    return owner is not None and owner != principal
