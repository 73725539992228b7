"""Warm spares: ``claude`` children started ahead of the spawn that takes them.

A real ``claude -p`` takes about 300 ms from start to its ``initialize``
answer; a spare moves that out of ``astrid sage spawn``.  This module is the
sans-IO core of the pool: which spares exist, which one a spawn may take, and
which must go.  It starts and stops nothing; :mod:`capsules.runner.spare_keeper`
is the thin shell that does, and asks it.  Times come from the caller (an
injected clock), so every decision is tested without a process.

What a spare is:

- **Prepared for one principal and one kind**, with its session id and Claude
  session UUID chosen in advance (both are in its environment, hook token and
  identity file path).  A kind (:data:`Kind`) is a working folder and a model
  as a spawn resolves them: the default one (the home and the principal's
  model), and those of its ``[[principals]] spare_kinds``.  So only a spawn
  that names no ``session_id`` and asks for that folder and model can take it
  (:meth:`SparePool.claim`).
- **Checked before it is handed out.**  The spawn prepares its launch for the
  spare's ids as a cold one would; the spare is used only when
  :class:`SpareInputs` are equal: the argv's ``flags_hash``, a digest of the
  identity text, a digest of the environment without the hook token (settings,
  API key), the uid it runs as, and the binary's identity (path, device,
  inode, size, mtime).  A
  difference is *stale*: the spare is discarded and the spawn starts cold.
- **Used once.**  A claimed spare leaves the pool for good; the keeper starts
  the next one.
- **Bounded.**  At most ``per_principal`` spares (starting or ready) per
  kind of each eligible principal (:meth:`SparePool.surplus` drops the rest); one older
  than ``max_age`` seconds is discarded, never handed out
  (:meth:`SparePool.expired`); after a failed start the next spare of that
  principal and kind waits, 1 s doubling to a minute (:meth:`SparePool.failed`).
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Generic, TypeVar

from capsules.runner.command import Launch
from sage.errors import IllegalTransition

__all__ = (
    "DEFAULT_KIND",
    "RETRY_FIRST",
    "RETRY_MAX",
    "SPARE_TRANSITIONS",
    "Kind",
    "Spare",
    "SpareInputs",
    "SparePool",
    "SpareState",
    "binary_identity",
    "env_digest",
    "inputs_of",
)

RETRY_FIRST = 1.0
"""Seconds before a principal's next spare after one failed; doubled per failure in a row."""
RETRY_MAX = 60.0

Kind = tuple[str, str]
"""What a spare is for: (working folder, model) as a spawn resolves them, ``""`` the
principal's default for either."""
DEFAULT_KIND: Final[Kind] = ("", "")

Targets = Mapping[str, Sequence[Kind]]
"""The spares to keep: per eligible principal, its kinds (the default one first)."""

H = TypeVar("H")
"""What the shell keeps with a spare (its process); opaque to the pool."""

TOKEN_VAR = "ASTRID_HOOK_TOKEN"


class SpareState(enum.Enum):
    STARTING = "starting"  # spawned, ``initialize`` not yet answered
    READY = "ready"  # initialized, waiting for its first user turn
    CLAIMED = "claimed"  # a spawn took it (or is checking it)
    DISCARDED = "discarded"  # died, stale, too old, or the pool closed


SPARE_TRANSITIONS: dict[SpareState, frozenset[SpareState]] = {
    SpareState.STARTING: frozenset({SpareState.READY, SpareState.DISCARDED}),
    SpareState.READY: frozenset({SpareState.CLAIMED, SpareState.DISCARDED}),
    SpareState.CLAIMED: frozenset(),
    SpareState.DISCARDED: frozenset(),
}


@dataclass(frozen=True)
class SpareInputs:
    """Everything a launch was decided from that a later spawn must match."""

    flags_hash: str
    identity: str
    env: str
    binary: tuple[str, int, int, int, int]
    prefix: tuple[str, ...] = ()
    """What runs before argv: ``setpriv`` to the child's uid (a root supervisor)."""


def inputs_of(launch: Launch, binary: Path) -> SpareInputs:
    """What ``launch`` was decided from, as a spare and its taker compare it."""
    return SpareInputs(
        flags_hash=launch.flags_hash,
        identity=launch.identity_digest,
        env=env_digest(launch.env),
        binary=binary_identity(binary),
        prefix=launch.prefix,
    )


def env_digest(env: Mapping[str, str]) -> str:
    """A digest of ``env`` without the hook token (minted per child)."""
    digest = hashlib.sha256()
    for name in sorted(env):
        if name != TOKEN_VAR:
            digest.update(f"{name}={env[name]}\0".encode())
    return "sha256:" + digest.hexdigest()


def binary_identity(path: Path) -> tuple[str, int, int, int, int]:
    """The binary as a spare saw it: replaced in place or anew, it differs."""
    try:
        st = os.stat(path)
    except OSError:
        return (str(path), -1, -1, -1, -1)
    return (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(eq=False)
class Spare(Generic[H]):
    """One spare: its ids, what it was launched from, its state and age."""

    session_id: str
    claude_session: str
    principal_id: str
    cwd: str
    model: str
    born: float
    handle: H
    inputs: SpareInputs | None = None
    state: SpareState = SpareState.STARTING
    reason: str = ""
    """Why it was discarded."""
    gone: bool = False
    """Discarded, and its process is gone too (:meth:`SparePool.left`)."""

    @property
    def kind(self) -> Kind:
        return (self.cwd, self.model)

    def move(self, new: SpareState) -> None:
        if new is self.state:
            return
        if new not in SPARE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"spare {self.session_id}", self.state.value, new.value)
        self.state = new


@dataclass
class SparePool(Generic[H]):
    """The spares waiting, per principal; see the module docstring."""

    per_principal: int
    max_age: float
    clock: Callable[[], float]
    _spares: dict[str, Spare[H]] = field(default_factory=dict)
    _retry: dict[tuple[str, Kind], tuple[float, float]] = field(default_factory=dict)
    """Per principal whose last spare failed: (not before, the pause that led there)."""
    _leaving: dict[tuple[str, Kind], int] = field(default_factory=dict)
    """Discarded spares whose process still runs (it stops), per principal and kind:
    they count against ``per_principal`` until :meth:`left`, so a replacement never
    runs beside the spare it replaces."""

    def __len__(self) -> int:
        return len(self._spares)

    def spares(self) -> list[Spare[H]]:
        return list(self._spares.values())

    def of(self, principal_id: str) -> list[Spare[H]]:
        return [s for s in self._spares.values() if s.principal_id == principal_id]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._spares

    def wanted(self, targets: Targets) -> list[tuple[str, Kind]]:
        """One entry per spare to start now: each kind of each eligible principal short
        of ``per_principal`` spares (starting ones count, and discarded ones still
        stopping), once per missing spare;
        none for a principal whose last spare failed less than its pause ago."""
        now = self.clock()
        out: list[tuple[str, Kind]] = []
        for name, kinds in targets.items():
            mine = self.of(name)
            for kind in dict.fromkeys(kinds):
                if self._retry.get((name, kind), (0.0, 0.0))[0] > now:
                    continue  # its last spare failed: that kind pauses, not the others
                have = sum(1 for s in mine if s.kind == kind) + self._leaving.get((name, kind), 0)
                out += [(name, kind)] * max(0, self.per_principal - have)
        return out

    def failed(self, principal_id: str, kind: Kind = DEFAULT_KIND) -> float:
        """A spare of ``principal_id`` and ``kind`` could not start or died unused: the next
        of that kind waits
        :data:`RETRY_FIRST` seconds, doubling with each failure in a row up to
        :data:`RETRY_MAX`.  Returns the pause."""
        key = (principal_id, kind)
        pause = min(RETRY_MAX, self._retry.get(key, (0.0, RETRY_FIRST / 2))[1] * 2)
        self._retry[key] = (self.clock() + pause, pause)
        return pause

    def surplus(self, targets: Targets) -> list[Spare[H]]:
        """Discard and return the spares nobody should have now: of a principal no
        longer eligible or a kind no longer wanted, or past ``per_principal`` of a
        kind (the newest go first)."""
        gone: list[Spare[H]] = []
        for name, kind in {(s.principal_id, s.kind) for s in self._spares.values()}:
            mine = sorted((s for s in self.of(name) if s.kind == kind), key=lambda s: s.born)
            keep = self.per_principal if kind in targets.get(name, ()) else 0
            gone += mine[keep:]
        for spare in gone:
            self.discard(spare, "not_wanted")
        return gone

    def add(self, spare: Spare[H]) -> None:
        if spare.session_id in self._spares or spare.state is not SpareState.STARTING:
            raise IllegalTransition(f"spare {spare.session_id}", spare.state.value, "added")
        self._spares[spare.session_id] = spare

    def ready(self, spare: Spare[H], inputs: SpareInputs) -> bool:
        """The spare answered ``initialize``; False when it had already left the pool."""
        if self._spares.get(spare.session_id) is not spare:
            return False
        spare.inputs = inputs
        spare.move(SpareState.READY)
        self._retry.pop((spare.principal_id, spare.kind), None)  # it starts: no more pause
        return True

    def claim(self, principal_id: str, cwd: str, model: str) -> Spare[H] | None:
        """Take the oldest ready spare of ``principal_id`` for ``cwd`` and ``model``
        that is young enough; it leaves the pool (used once).  The caller then
        compares its inputs (:meth:`matches`) before using it."""
        now = self.clock()
        for spare in sorted(self.of(principal_id), key=lambda s: s.born):
            if (
                spare.state is SpareState.READY
                and spare.cwd == cwd
                and spare.model == model
                and now - spare.born <= self.max_age
            ):
                spare.move(SpareState.CLAIMED)
                del self._spares[spare.session_id]
                return spare
        return None

    @staticmethod
    def matches(spare: Spare[H], inputs: SpareInputs) -> bool:
        """Whether a spawn prepared now with ``inputs`` may use ``spare``."""
        return spare.inputs is not None and spare.inputs == inputs

    def discard(self, spare: Spare[H], reason: str) -> bool:
        """``spare`` goes (died, stale, too old, closing); False when it had left already."""
        if self._spares.get(spare.session_id) is not spare:
            return False
        del self._spares[spare.session_id]
        spare.move(SpareState.DISCARDED)
        spare.reason = reason
        key = (spare.principal_id, spare.kind)
        self._leaving[key] = self._leaving.get(key, 0) + 1
        return True

    def left(self, spare: Spare[H]) -> None:
        """A discarded spare's process is gone (or never ran): its place may be filled."""
        if spare.state is not SpareState.DISCARDED or spare.gone:
            return
        spare.gone = True
        key = (spare.principal_id, spare.kind)
        count = self._leaving.get(key, 0) - 1
        if count > 0:
            self._leaving[key] = count
        else:
            self._leaving.pop(key, None)

    def expired(self) -> list[Spare[H]]:
        """Discard and return the spares older than ``max_age``."""
        now = self.clock()
        old = [s for s in self._spares.values() if now - s.born > self.max_age]
        for spare in old:
            self.discard(spare, "too_old")
        return old

    def stale(self, principal_id: str) -> list[Spare[H]]:
        """Discard and return ``principal_id``'s spares (its identity or settings changed)."""
        gone = self.of(principal_id)
        for spare in gone:
            self.discard(spare, "stale")
        return gone

    def close(self) -> list[Spare[H]]:
        """Discard and return every spare (the runner stops)."""
        gone = self.spares()
        for spare in gone:
            self.discard(spare, "closing")
        return gone

    def next_look(self) -> float | None:
        """When the pool next needs a look (clock time): the oldest spare passes
        ``max_age``, or a pause after a failure ends; None: nothing is due."""
        now = self.clock()
        moments = [s.born + self.max_age for s in self._spares.values()]
        moments += [when for when, _ in self._retry.values() if when > now]
        return min(moments, default=None)
