"""Breakers: per-tool rate, per-session forge count, per-tool failure breaker.

Each failure breaker is an explicit state machine (:class:`State`) with one
transition method, :meth:`FailureBreaker._to`, which reports every change
so the service can audit ``breaker_open`` / ``breaker_closed``.  The clock
is injected (monotonic seconds) so tests can move time.
"""

from __future__ import annotations

import enum
import threading
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from sage.forge.policy import Breakers as BreakerPolicy

__all__ = ("BreakerBoard", "FailureBreaker", "State", "Trip")

Clock = Callable[[], float]


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class Trip:
    """A refusal: which breaker, for what, when it resets (clock seconds)."""

    breaker: str
    name: str
    reset_at: float


Transition = Callable[[str, str, State, float], None]
"""(breaker, name, new state, reset_at) on every state change."""


class FailureBreaker:
    def __init__(self, name: str, on_change: Transition) -> None:
        self.name = name
        self.state = State.CLOSED
        self.failures = 0
        self.reset_at = 0.0
        self.probing = False
        self._on_change = on_change

    def _to(self, state: State, reset_at: float = 0.0) -> None:
        if state is self.state:
            return
        self.state = state
        self.reset_at = reset_at
        self._on_change("failure", self.name, state, reset_at)

    def admit(self, now: float) -> float | None:
        """None when a call may go; else the reset time."""
        if self.state is State.OPEN:
            if now < self.reset_at:
                return self.reset_at
            self._to(State.HALF_OPEN)
        if self.state is State.HALF_OPEN:
            if self.probing:
                return now
            self.probing = True
        return None

    def record(self, ok: bool, now: float, threshold: int, cooldown: float) -> None:
        self.probing = False
        if ok:
            self.failures = 0
            self._to(State.CLOSED)
            return
        self.failures += 1
        if self.state is State.HALF_OPEN or self.failures >= threshold > 0:
            self._to(State.OPEN, now + cooldown)


class BreakerBoard:
    """All breakers of one forge service."""

    def __init__(self, clock: Clock, on_change: Transition) -> None:
        self.clock = clock
        self.on_change = on_change
        self._lock = threading.Lock()
        self._calls: dict[str, deque[float]] = defaultdict(deque)
        self._forges: dict[str, int] = defaultdict(int)
        self._failures: dict[str, FailureBreaker] = {}
        self._rate_open: set[str] = set()
        self._forge_open: set[str] = set()

    def failure(self, name: str) -> FailureBreaker:
        if name not in self._failures:
            self._failures[name] = FailureBreaker(name, self.on_change)
        return self._failures[name]

    def admit_call(self, name: str, policy: BreakerPolicy) -> Trip | None:
        with self._lock:
            now = self.clock()
            window = self._calls[name]
            while window and window[0] <= now - 60.0:
                window.popleft()
            if policy.per_tool_rpm > 0 and len(window) >= policy.per_tool_rpm:
                reset = window[0] + 60.0
                if name not in self._rate_open:
                    self._rate_open.add(name)
                    self.on_change("rate", name, State.OPEN, reset)
                return Trip("rate", name, reset)
            if name in self._rate_open:
                self._rate_open.discard(name)
                self.on_change("rate", name, State.CLOSED, 0.0)
            reset_at = self.failure(name).admit(now)
            if reset_at is not None:
                return Trip("failure", name, reset_at)
            window.append(now)
            return None

    def record(self, name: str, ok: bool, policy: BreakerPolicy) -> None:
        with self._lock:
            self.failure(name).record(
                ok, self.clock(), policy.failure_threshold, policy.failure_cooldown_seconds
            )

    def admit_forge(self, session: str | None, policy: BreakerPolicy) -> Trip | None:
        """Count one forge of ``session``; a Trip when the session used its allowance."""
        if session is None:
            return None
        with self._lock:
            limit = policy.per_session_forge_count
            if limit > 0 and self._forges[session] >= limit:
                if session not in self._forge_open:
                    self._forge_open.add(session)
                    self.on_change("forge_count", session, State.OPEN, 0.0)
                return Trip("forge_count", session, 0.0)
            self._forges[session] += 1
            return None

    # -- across restarts -------------------------------------------------------

    def export(self) -> dict[str, Any]:
        """What :meth:`restore` needs: failure breakers not at rest, sessions' forge counts.

        Reset times are given as seconds from now (the clock is monotonic and
        does not survive a restart).  Rate windows are not kept: a restart
        forgets the last minute's calls.
        """
        with self._lock:
            now = self.clock()
            failures = {
                name: {
                    "state": b.state.value,
                    "failures": b.failures,
                    "reset_in": max(0.0, b.reset_at - now) if b.state is State.OPEN else 0.0,
                }
                for name, b in self._failures.items()
                if b.state is not State.CLOSED or b.failures
            }
            return {"failures": failures, "forges": dict(self._forges)}

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Take back what :meth:`export` gave; bad entries are skipped.

        A breaker saved half-open comes back open with its cooldown over, so
        the next call is its probe.
        """
        now = self.clock()
        with self._lock:
            for name, entry in _items(saved.get("failures")):
                if not isinstance(entry, dict):
                    continue
                state, failures = entry.get("state"), entry.get("failures")
                if state not in ("closed", "open", "half_open"):
                    continue
                if not _count(failures):
                    continue
                breaker = self.failure(name)
                breaker.failures = failures
                if state != "closed":
                    reset_in = entry.get("reset_in")
                    wait = reset_in if isinstance(reset_in, int | float) else 0.0
                    breaker.state = State.OPEN
                    breaker.reset_at = now + max(0.0, float(wait))
            for session, count in _items(saved.get("forges")):
                if _count(count):
                    self._forges[session] = count


def _items(value: Any) -> list[tuple[str, Any]]:
    if not isinstance(value, dict):
        return []
    return [(k, v) for k, v in value.items() if isinstance(k, str)]


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
