"""A session of the runner: its record, its state and the table of its changes.

A session outlives its children: it runs one ``claude`` child, or several when
it is respawned (an identity refresh), and it ends once.  Its state
(:class:`SessionState`, the table is :data:`SESSION_TRANSITIONS`):

- ``STARTING``: in the table, its first child not yet spawned;
- ``RUNNING``: a child serves it;
- ``RESPAWNING``: a new child was asked for (``respawn_reason``) and has not yet
  answered ``initialize``; every child that dies meanwhile is retried, up to
  ``[sessions] max_respawns`` attempts in a row;
- ``STOPPING``: an operator stopped it; whatever the child does next, it ends;
- ``ENDED``: its end is recorded (or its first start failed);
- ``INTERRUPTED``: the supervisor stopped under it; the record says so and the
  next supervisor resumes or ends it;
- ``HIBERNATING``: idle, its child is being stopped to free the host
  (``[sessions] hibernate_after``, ``max_live``); an operator's stop still wins.  Or,
  from any state with a child, ``fenced``: the node lost its fleet lease and the
  child is killed at once (sage/lease.py);
- ``HIBERNATED``: no child; the session keeps its id and conversation, and the
  next send wakes it;
- ``WAKING``: a new child with ``--resume`` was asked for and has not yet
  answered ``initialize``; if it never does, the session ends ``resume_failed``.

What the state store keeps (:class:`SessionRecord`) has a coarser state
(:class:`RecordState`): ``running``, ``interrupted``, ``hibernated`` or ``ended``.
A record is ``hibernated`` from the moment hibernation starts, so a supervisor
that dies while the child stops finds the session hibernated, not running.
"""

from __future__ import annotations

import enum
import re
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final

import anyio
import msgspec

from sage.config import NAME_PATTERN, PrincipalConfig
from sage.contract.sessions import EndReason, RecordState, SessionState
from sage.errors import IllegalTransition, SageError

if TYPE_CHECKING:
    from capsules.runner.claude_process import ClaudeProcess, Ending

__all__ = (
    "ASLEEP",
    "LIVE",
    "SESSION_TRANSITIONS",
    "AfterChild",
    "RecordState",
    "Session",
    "SessionRecord",
    "SessionState",
    "SessionTable",
    "new_session_id",
    "valid_id",
)


_OVER = frozenset({SessionState.ENDED, SessionState.INTERRUPTED})

SESSION_TRANSITIONS: Final[dict[SessionState, frozenset[SessionState]]] = {
    # HIBERNATING from STARTING, RESPAWNING and WAKING: fenced (the node lost its lease)
    SessionState.STARTING: frozenset(
        {
            SessionState.RUNNING,
            SessionState.RESPAWNING,
            SessionState.STOPPING,
            SessionState.HIBERNATING,
        }
        | _OVER
    ),
    SessionState.RUNNING: frozenset(
        {SessionState.RESPAWNING, SessionState.STOPPING, SessionState.HIBERNATING} | _OVER
    ),
    SessionState.RESPAWNING: frozenset(
        {SessionState.RUNNING, SessionState.STOPPING, SessionState.HIBERNATING} | _OVER
    ),
    SessionState.STOPPING: _OVER,
    SessionState.ENDED: frozenset(),
    SessionState.INTERRUPTED: frozenset(),
    SessionState.HIBERNATING: frozenset({SessionState.HIBERNATED, SessionState.STOPPING} | _OVER),
    # a hibernated session has no child: a stop ends it at once (ENDED)
    SessionState.HIBERNATED: frozenset({SessionState.WAKING, SessionState.ENDED}),
    # back to HIBERNATED: no live slot came (host_full), nothing was started
    SessionState.WAKING: frozenset(
        {
            SessionState.RUNNING,
            SessionState.STOPPING,
            SessionState.HIBERNATED,
            SessionState.HIBERNATING,
        }
        | _OVER
    ),
}

ASLEEP: Final = frozenset({SessionState.HIBERNATING, SessionState.HIBERNATED})
"""States that hold no live slot a spawn or a wake could wait for (a hibernating
session's child is on its way out)."""


class AfterChild(enum.Enum):
    """What follows the end of a session's child (:meth:`Session.after_child`)."""

    END = "end"  # the session ends, for the child's reason
    RESPAWN = "respawn"  # another child, with --resume
    HIBERNATE = "hibernate"  # no child until the next send wakes the session
    ABANDON = "abandon"  # too many respawns in a row: the session ends respawn_abandoned


LIVE: Final = frozenset({RecordState.RUNNING, RecordState.INTERRUPTED})
"""Records a supervisor start finds live: resumed or ended (``supervisor_restart``)."""


def valid_id(value: str) -> bool:
    """Whether ``value`` may name a session (or a node): 1-64 of ``[A-Za-z0-9_-]``."""
    return re.match(NAME_PATTERN, value) is not None


def new_session_id() -> str:
    """A session id when the spawn names none: ``s`` and 12 hex digits."""
    return f"s{uuid.uuid4().hex[:12]}"


class SessionRecord(msgspec.Struct, kw_only=True):
    """What the state store keeps of a session (namespace ``sessions``)."""

    session_id: str
    principal_id: str
    claude_session: str
    state: RecordState = RecordState.RUNNING
    pid: int | None = None
    started_at: float = 0.0
    ended_at: float | None = None
    turns: int = 0
    cost_usd: float = 0.0
    flags_hash: str = ""
    reason: str = ""
    exit_code: int | None = None
    signal: int | None = None
    cwd: str = ""
    """The working folder the spawn chose (resolved); empty: the principal's home."""
    model: str = ""
    """The model the spawn chose; empty: the principal's configured one."""
    hibernated_at: float | None = None
    """When the session last hibernated (its state says whether it still is)."""
    spoken: bool = False
    """The conversation (``claude_session``) has finished a turn, so the CLI keeps a
    transcript of it: a child started without that transcript ends ``resume_failed``
    instead of starting afresh (sage/claude/conversation.py)."""


@dataclass(eq=False)
class Session:
    """A session in the runner's table; see the module docstring.  Compared and hashed
    by identity: a later session under the same id is another one."""

    record: SessionRecord
    principal: PrincipalConfig
    state: SessionState = SessionState.STARTING
    proc: ClaudeProcess | None = None  # the child now (or last) serving it
    respawn_reason: str | None = None  # why a new child is wanted (RESPAWNING)
    respawns: int = 0  # attempts since the last child that became ready
    turns: int = 0  # of earlier children
    cost_usd: float = 0.0
    token_hash: str = ""
    key_source: str = "none"  # principal | operator | claude.env | none (spawn audit)
    ending: Ending | None = None
    done: anyio.Event = field(default_factory=anyio.Event)
    last_active: float = 0.0  # monotonic: the last send, event or wake (least recently used)
    settled: anyio.Event | None = None  # set when a hibernation or a wake is over
    wake_error: SageError | None = None  # why the last wake put it back to sleep
    sending: int = 0  # sends between their wake and their turn written: not idle
    fenced: bool = False  # its child was killed for a lost fleet lease: it hibernates
    end_reason: str | None = None  # why it ends whatever its child says (a fleet's fence)
    counted: ClaudeProcess | None = None  # the last child whose turns are in ``turns``
    replaced: ClaudeProcess | None = None  # the child a respawn stops (it takes no turn)
    refresh_due: bool = False  # an identity refresh waits for the running turn to end
    changed_child: anyio.Event = field(default_factory=anyio.Event)  # set when ``proc`` is
    # replaced or the session is over (a send waits on it through a respawn)

    @property
    def id(self) -> str:
        return self.record.session_id

    def count(self, proc: ClaudeProcess) -> None:
        """Add what a child that ended did, once: its turns and cost; a finished turn
        means the conversation has spoken (its transcript must be there to resume)."""
        if proc is self.counted:
            return
        self.counted = proc
        self.turns += proc.turn.finished
        self.cost_usd += proc.turn.cost_usd
        if proc.turn.finished:
            self.record.spoken = True

    def totals(self) -> tuple[int, float]:
        """The turns and cost of the whole session: earlier children's and the one
        serving it now (not yet counted)."""
        proc = self.proc
        if proc is None or proc is self.counted:
            return self.turns, self.cost_usd
        return self.turns + proc.turn.finished, self.cost_usd + proc.turn.cost_usd

    def move(self, new: SessionState) -> None:
        """The one place the state changes, along :data:`SESSION_TRANSITIONS`."""
        if new is self.state:
            return
        if new not in SESSION_TRANSITIONS[self.state]:
            raise IllegalTransition(f"session {self.id}", self.state.value, new.value)
        self.state = new

    def may(self, new: SessionState) -> bool:
        """Whether the table allows a change to ``new`` now."""
        return new is self.state or new in SESSION_TRANSITIONS[self.state]

    def respawn(self, reason: str) -> bool:
        """Ask for a new child for ``reason``; False when the session is stopping or over."""
        if not self.may(SessionState.RESPAWNING):
            return False
        self.move(SessionState.RESPAWNING)
        self.respawn_reason = reason
        self.replaced = self.proc
        return True

    def stop(self) -> None:
        """An operator's stop: no respawn, the session ends with its child."""
        if self.state in _OVER:
            return  # it ended as the stop came
        self.move(SessionState.STOPPING)
        self.respawn_reason = None

    def ready(self) -> None:
        """A child answered ``initialize``: a respawn is over, its count starts again."""
        if self.state is SessionState.RESPAWNING and self.respawns:
            self.move(SessionState.RUNNING)  # the respawned child is up
            self.respawn_reason = None
        self.respawns = 0

    def after_child(self, reason: str | None, max_respawns: int) -> AfterChild:
        """What follows a child's end for ``reason`` (None: a new child could not be
        launched); a respawn counts an attempt (``respawns``)."""
        if self.state is SessionState.STOPPING or reason == EndReason.STOPPED:
            return AfterChild.END
        if self.state is SessionState.HIBERNATING:
            return AfterChild.HIBERNATE  # whatever the stopping child said last
        if self.state is SessionState.WAKING:
            return AfterChild.END  # it never answered initialize: the runner says why
        # a child that ended for anything but a respawn before the new one came up
        failed = reason is None or (
            reason != EndReason.RESPAWN and self.state is SessionState.RESPAWNING
        )
        if not failed and reason != EndReason.RESPAWN:
            return AfterChild.END  # an ordinary end
        # a refresh was asked for, or a respawned child died before it was ready
        self.respawns += 1
        if self.respawns > max_respawns:
            return AfterChild.ABANDON
        return AfterChild.RESPAWN

    def hibernate(self) -> None:
        """Begin to hibernate: the child is to stop (only an idle, running session)."""
        self.move(SessionState.HIBERNATING)
        self.settled = anyio.Event()

    def hibernated(self) -> None:
        """The child is gone: the session sleeps until a send wakes it."""
        self.move(SessionState.HIBERNATED)
        self.proc = None
        self.fenced = False
        self._settle()

    def wake(self) -> None:
        """Begin to wake: a child with ``--resume`` is to start."""
        self.move(SessionState.WAKING)
        self.settled = anyio.Event()

    def sleep_on(self) -> None:
        """The wake found no live slot: the session sleeps as before."""
        self.move(SessionState.HIBERNATED)
        self._settle()

    def woken(self) -> None:
        """The woken child answered ``initialize``: the session runs again."""
        if self.state is SessionState.WAKING:
            self.move(SessionState.RUNNING)
        self._settle()

    def _settle(self) -> None:
        if self.settled is not None:
            self.settled.set()
            self.settled = None

    def over(self) -> None:
        """The session ended or was interrupted: nothing waits on it any more."""
        self._settle()
        self.done.set()
        self.changed_child.set()

    def attach(self, proc: ClaudeProcess) -> None:
        """``proc`` serves the session now; whoever waited for a new child goes on."""
        self.proc = proc
        self.changed_child.set()
        self.changed_child = anyio.Event()

    @property
    def between_children(self) -> bool:
        """Respawning, and its child is still the one being replaced (or none yet): a
        turn waits for the next child instead of being refused as the old one goes."""
        return self.state is SessionState.RESPAWNING and (
            self.proc is None or self.proc is self.replaced
        )

    @property
    def live(self) -> bool:
        """Whether it has a child, or is about to (it counts against the live limits)."""
        return self.state not in ASLEEP and self.state not in _OVER

    @property
    def idle(self) -> bool:
        """Running, initialized, no turn in flight: it may hibernate."""
        proc = self.proc
        return (
            self.state is SessionState.RUNNING
            and not self.sending
            and proc is not None
            and proc.initialized
            and proc.idle
        )

    def record_state(self) -> RecordState:
        """What the store says of the session now."""
        if self.state is SessionState.ENDED:
            return RecordState.ENDED
        if self.state is SessionState.INTERRUPTED:
            return RecordState.INTERRUPTED
        if self.state in ASLEEP or self.state is SessionState.WAKING:
            return RecordState.HIBERNATED  # until the woken child is up: nothing to lose
        return RecordState.RUNNING


class SessionTable(Mapping[str, Session]):
    """The runner's live sessions by id.

    A spawn checks :meth:`refusal` and takes its place with :meth:`add` before
    its first ``await``, so two spawns cannot both pass the per-principal cap; a
    session leaves with :meth:`remove` when it ends.  Another principal's
    session is invisible to a caller (:meth:`visible`)."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}

    def __getitem__(self, sid: str) -> Session:
        return self._by_id[sid]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def of(self, principal_id: str) -> list[Session]:
        """The sessions of ``principal_id`` in the table, hibernated ones included."""
        return [s for s in self._by_id.values() if s.record.principal_id == principal_id]

    def live_of(self, principal_id: str) -> list[Session]:
        """The sessions of ``principal_id`` with a child, or about to have one."""
        return [s for s in self.of(principal_id) if s.live]

    def least_recent_idle(self, principal_id: str | None = None) -> Session | None:
        """The idle session (of ``principal_id``; None: anyone's) used least recently:
        the one to hibernate to make room."""
        idle = [
            s
            for s in self._by_id.values()
            if s.idle and principal_id in (None, s.record.principal_id)
        ]
        return min(idle, key=lambda s: s.last_active, default=None)

    def idle_since(self, before: float) -> list[Session]:
        """Idle sessions last active before ``before`` (monotonic): due to hibernate."""
        return [s for s in self._by_id.values() if s.idle and s.last_active < before]

    def add(self, session: Session) -> None:
        if session.id in self._by_id:
            raise IllegalTransition(f"session {session.id}", "live", "added again")
        self._by_id[session.id] = session

    def remove(self, session: Session) -> None:
        """Take ``session`` out (if it is the one under its id)."""
        if self._by_id.get(session.id) is session:
            del self._by_id[session.id]

    def visible(self, sid: str, principal: str | None) -> Session | None:
        """Session ``sid`` if the caller (``principal``; None: an admin) may see it."""
        session = self._by_id.get(sid)
        if session is not None and principal in (None, session.record.principal_id):
            return session
        return None

    def visible_to(self, principal: str | None) -> list[Session]:
        return [s for s in self._by_id.values() if principal in (None, s.record.principal_id)]
