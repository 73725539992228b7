"""In-process capsules: each run with its context, restarts by a policy, state changes.

The supervisor starts the capsules named in ``[supervisor] capsules`` (folders
under the built-in ``capsules`` package, or paths), each described by its
manifest (sage/capsule/manifest.py).  Each runs with a
:class:`~sage.capsule.context.CapsuleContext` whose identity carries an ACL made
from its manifest, so the bus refuses anything it did not declare.  A capsule that
raises is restarted with exponential backoff; after ``max_restarts`` in ``window``
seconds it is given up (state ``failed``) and that is audited.  Every change
of state is published on ``sage.v1.capsules.changed``.  A manifest with a
``[worker]`` table is not imported: :mod:`sage.daemon.workers` runs it as a child
process under the same policy.
"""

from __future__ import annotations

import difflib
import enum
import importlib
import importlib.util
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog

from bus import Acl, Bus, BusError, Identity
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import CapsuleManifest
from sage.config import Config
from sage.errors import ConfigError, IllegalTransition
from sage.state import StateStore

__all__ = (
    "CapsuleRunner",
    "CapsuleState",
    "RestartPolicy",
    "builtin_capsules_dir",
    "capsule_folder",
)

log = structlog.get_logger("sage.daemon.capsule_host")


class CapsuleState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


_TRANSITIONS: dict[CapsuleState, frozenset[CapsuleState]] = {
    CapsuleState.STARTING: frozenset({CapsuleState.RUNNING, CapsuleState.STOPPED}),
    CapsuleState.RUNNING: frozenset(
        {CapsuleState.BACKOFF, CapsuleState.FAILED, CapsuleState.STOPPED}
    ),
    CapsuleState.BACKOFF: frozenset({CapsuleState.RUNNING, CapsuleState.STOPPED}),
    CapsuleState.FAILED: frozenset(),
    CapsuleState.STOPPED: frozenset(),
}
STATE_TOPIC = "sage.v1.capsules.changed"
"""Published by the supervisor on every change: ``{"capsule": name, "state": value}``."""


@dataclass
class RestartPolicy:
    """When to restart a crashed capsule (pure: the caller passes the clock)."""

    max_restarts: int = 5
    window: float = 60.0
    base_delay: float = 0.1
    max_delay: float = 10.0
    crashes: list[float] = field(default_factory=list)

    def on_crash(self, now: float) -> float | None:
        """Seconds to wait before the next start, or None to give up."""
        self.crashes = [t for t in self.crashes if now - t < self.window]
        self.crashes.append(now)
        if len(self.crashes) > self.max_restarts:
            return None
        return float(min(self.max_delay, self.base_delay * 2 ** (len(self.crashes) - 1)))


CapsuleMain = Callable[[CapsuleContext], Awaitable[None]]


class CapsuleRunner:
    """Runs one capsule and restarts it by its policy."""

    def __init__(
        self,
        bus: Bus,
        manifest: CapsuleManifest,
        audit: Callable[[str, dict[str, Any]], None],
        *,
        config_of: Callable[[], Config] = Config,
        state_of: Callable[[], StateStore | None] = lambda: None,
        publish: Callable[[str, dict[str, Any]], None] = lambda topic, payload: None,
    ) -> None:
        """``audit`` and ``publish`` publish as the supervisor: audit events, and
        :data:`STATE_TOPIC` on every change of :attr:`state`."""
        self._publish = publish
        self._config_of = config_of
        self._state_of = state_of
        self.ready = anyio.Event()
        """Set when the capsule's first run called ``ctx.ready()``, ended or crashed."""
        self.manifest = manifest
        self.state = CapsuleState.STARTING
        self.restarts = 0
        self.last_error = ""
        self.policy = RestartPolicy()
        self._bus = bus
        self._audit = audit
        self.identity = Identity(
            source=f"capsule:{manifest.name}",
            acl=Acl(manifest.publish.patterns, manifest.subscribe.patterns),
        )
        self._main = self._entry()

    def _entry(self) -> CapsuleMain:
        """The entry's async function; a module alone, or a ``sage.capsule.sdk.Capsule``,
        runs as ``Capsule.run``."""
        from sage.capsule.sdk import Capsule

        module_name, _, func = self.manifest.package.entry.partition(":")
        try:
            module = importlib.import_module(module_name)
            main = getattr(module, func) if func else Capsule.from_module(module)
        except (ImportError, AttributeError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"capsule {self.manifest.name}: cannot load {self.manifest.package.entry}: {exc}"
            ) from exc
        if isinstance(main, Capsule):
            return main.run
        entry: CapsuleMain = main
        return entry

    def _set_state(self, state: CapsuleState) -> None:
        """The one place the state changes; each change is published on STATE_TOPIC."""
        if state is self.state:
            return
        if state not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"capsule {self.manifest.name}", self.state.value, state.value)
        self.state = state
        try:
            self._publish(STATE_TOPIC, {"capsule": self.manifest.name, "state": state.value})
        except BusError as exc:  # a closed bus (the supervisor is going away)
            log.info("capsule.state_not_published", capsule=self.manifest.name, error=str(exc))

    async def run(self) -> None:
        main = self._main
        name = self.manifest.name
        while True:
            self._set_state(CapsuleState.RUNNING)
            log.info("capsule.started", capsule=name, restarts=self.restarts)
            ctx = CapsuleContext(
                self._bus,
                self.identity,
                self.manifest,
                config_of=self._config_of,
                state_of=self._state_of,
                ready=self.ready,
            )
            try:
                await main(ctx)
            except anyio.get_cancelled_exc_class():
                self._set_state(CapsuleState.STOPPED)
                raise
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error(
                    "capsule.crashed",
                    capsule=name,
                    error=self.last_error,
                    trace=traceback.format_exc(limit=5),
                )
            else:
                self._set_state(CapsuleState.STOPPED)
                log.info("capsule.finished", capsule=name)
                return
            finally:
                ctx.close()
                self.ready.set()  # a crash or an end also ends the wait for it
            delay = self.policy.on_crash(time.monotonic())
            if delay is None:
                self._set_state(CapsuleState.FAILED)
                self._audit(
                    "sage.v1.audit.capsule_failed",
                    {"capsule": name, "restarts": self.restarts, "error": self.last_error},
                )
                return
            self._set_state(CapsuleState.BACKOFF)
            self.restarts += 1
            try:
                await anyio.sleep(delay)
            except anyio.get_cancelled_exc_class():
                self._set_state(CapsuleState.STOPPED)
                raise

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.manifest.name,
            "version": self.manifest.package.version,
            "state": self.state.value,
            "restarts": self.restarts,
            "last_error": self.last_error,
        }


def missing_capsule(name_or_path: str) -> str | None:
    """Why ``[supervisor] capsules`` entry ``name_or_path`` names no capsule (a folder
    without a ``Capsule.toml``; a built-in name that does not exist, with the nearest one),
    or None when it names one."""
    folder = capsule_folder(name_or_path)
    if (folder / "Capsule.toml").is_file():
        return None
    if "/" in name_or_path:
        return f"supervisor.capsules: {name_or_path}: no Capsule.toml in that folder"
    built_in = sorted(
        p.name for p in builtin_capsules_dir().iterdir() if (p / "Capsule.toml").is_file()
    )
    close = difflib.get_close_matches(name_or_path, built_in, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (
        f"supervisor.capsules: no built-in capsule {name_or_path!r}{hint};"
        f" built in: {', '.join(built_in)}; a path must contain a '/'"
    )


def capsule_folder(name_or_path: str) -> Path:
    """A built-in capsule's folder by name, or a folder given as a path."""
    if "/" in name_or_path:
        return Path(name_or_path)
    return builtin_capsules_dir() / name_or_path


def builtin_capsules_dir() -> Path:
    """The folder of the capsules that ship with sage (the ``capsules`` package).

    Found, not imported: sage loads a capsule through its manifest's entry
    point, and imports nothing of ``capsules/`` itself.
    """
    spec = importlib.util.find_spec("capsules")
    if spec is None or spec.origin is None:
        raise ConfigError("the built-in capsules (the capsules package) are not installed")
    return Path(spec.origin).parent
