"""In-process capsules: manifests, a bus handle bound to each capsule's ACL, restarts.

A capsule is a folder with a ``Capsule.toml``::

    [package]
    name = "echo"
    version = "0.1.0"
    entry = "capsules.echo:run"      # module:function, an async function (ctx)

    [publish]
    patterns = ["demo.v1.echo.>"]
    [subscribe]
    patterns = ["demo.v1.echo"]

The supervisor starts the capsules named in ``[supervisor] capsules`` (folders
under the built-in ``capsules`` package, or paths).  Each runs with a
:class:`CapsuleContext` whose identity carries an ACL made from its manifest,
so the bus refuses anything it did not declare.  A capsule that raises is
restarted with exponential backoff; after ``max_restarts`` in ``window``
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
from typing import Any, TypeVar

import anyio
import msgspec
import structlog

from bus import Acl, Bus, BusError, Envelope, Identity, Subscription
from sage.config import NAME_PATTERN, Config
from sage.daemon.state import StateStore
from sage.errors import CapsuleError, ConfigError, StateError

__all__ = (
    "CapsuleContext",
    "CapsuleManifest",
    "CapsuleRunner",
    "CapsuleSandbox",
    "CapsuleState",
    "RestartPolicy",
    "WorkerSpec",
    "builtin_capsules_dir",
    "capsule_folder",
    "load_manifest",
)

log = structlog.get_logger("sage.daemon.capsule_host")

T = TypeVar("T")


class _Package(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = msgspec.field(default="")
    version: str = "0.0.0"
    entry: str = ""
    description: str = ""


class _Patterns(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    patterns: list[str] = []


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[worker]``: run the capsule as a child process instead (see sage.daemon.workers)."""

    command: list[str]
    """argv; a first element with a ``/`` is relative to the capsule's folder."""
    env: dict[str, str] = {}
    """Added to the worker's minimal environment (``ASTRID_*`` names are reserved)."""


class CapsuleSandbox(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[sandbox]``: what an installed capsule's sandboxed worker may reach (sage.daemon.workers)."""

    network: bool = False
    """True: the host's network (its interfaces, DNS and TLS roots); false: a network
    namespace of its own with only a loopback interface.  Ignored for capsules that
    are not installed (built-in, or named in ``[supervisor] capsules``)."""


class CapsuleManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    package: _Package
    publish: _Patterns = _Patterns()
    subscribe: _Patterns = _Patterns()
    worker: WorkerSpec | None = None
    sandbox: CapsuleSandbox = CapsuleSandbox()

    @property
    def name(self) -> str:
        return self.package.name


_ENTRY_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$"
"""``module`` (its sage.capsule.sdk ``@tool``/``@subscribe`` functions) or ``module:function``."""


def load_manifest(folder: Path) -> CapsuleManifest:
    """Read and check ``folder/Capsule.toml``; raise ConfigError naming what is wrong."""
    import re

    path = folder / "Capsule.toml"
    try:
        manifest = msgspec.toml.decode(path.read_bytes(), type=CapsuleManifest)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not re.match(NAME_PATTERN, manifest.name):
        raise ConfigError(f"{path}: package.name must match {NAME_PATTERN}")
    worker = manifest.worker
    if worker is None and not re.match(_ENTRY_PATTERN, manifest.package.entry):
        raise ConfigError(f"{path}: package.entry must be 'module' or 'module:function'")
    if worker is not None:  # package.entry is not used: the command says what runs
        if not worker.command or not all(worker.command):
            raise ConfigError(f"{path}: worker.command must be a list of non-empty strings")
        for key in worker.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ConfigError(f"{path}: worker.env: {key!r} is not a variable name")
            if key.startswith("ASTRID_"):
                raise ConfigError(f"{path}: worker.env: {key} is reserved (ASTRID_*)")
    try:
        Acl(manifest.publish.patterns, manifest.subscribe.patterns)
    except BusError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return manifest


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


class CapsuleContext:
    """What a capsule's code gets: the bus, as the capsule, within its ACL."""

    def __init__(
        self,
        bus: Bus,
        identity: Identity,
        manifest: CapsuleManifest,
        *,
        config_of: Callable[[], Config] = Config,
        state_of: Callable[[], StateStore | None] = lambda: None,
        ready: anyio.Event | None = None,
    ) -> None:
        self.bus = bus
        self._ready = ready
        self.identity = identity
        self.manifest = manifest
        self.log = log.bind(capsule=manifest.name)
        self._subscriptions: list[Subscription] = []
        self._config_of = config_of
        self._state_of = state_of

    def ready(self) -> None:
        """Say the capsule serves its topics; the supervisor reports READY after all have."""
        if self._ready is not None:
            self._ready.set()

    @property
    def config(self) -> Config:
        """The supervisor's config as it is now (a reload replaces it)."""
        return self._config_of()

    @property
    def state(self) -> StateStore:
        """The supervisor's state store, for records that outlive a restart."""
        store = self._state_of()
        if store is None:
            raise StateError("the state store is not open")
        return store

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> Envelope:
        """Publish as the capsule; ``on_behalf_of`` makes the envelope private to
        that principal (its users see it, other users do not)."""
        return self.bus.publish(self.identity, topic, payload, on_behalf_of=on_behalf_of)

    def subscribe(self, pattern: str) -> Subscription:
        """A subscription that lasts until the capsule's run ends (or it is closed)."""
        sub = self.bus.subscribe(pattern, self.identity)
        self._subscriptions.append(sub)
        return sub

    async def open(self, pattern: str) -> Subscription:
        """:meth:`subscribe` as the SDK calls it: async, so the same capsule code
        runs against a remote bus, where subscribing is a round trip."""
        return self.subscribe(pattern)

    def close(self) -> None:
        """End every subscription this run opened (called by the runner)."""
        for sub in self._subscriptions:
            sub.close()
        self._subscriptions.clear()

    def reply(self, request: Envelope, payload: Any) -> bool:
        if request.reply_to is None:
            return False
        return self.bus.reply(self.identity, request.reply_to, payload)

    async def request(
        self,
        topic: str,
        payload: Any,
        *,
        deadline: float | None = None,
        on_behalf_of: str | None = None,
    ) -> Envelope:
        """Request as the capsule; ``on_behalf_of`` as for :meth:`publish`."""
        return await self.bus.request(
            self.identity, topic, payload, deadline=deadline, on_behalf_of=on_behalf_of
        )

    async def ask(
        self,
        answers: str,
        send: Callable[[], object],
        answer: Callable[[Envelope], T | None],
        *,
        deadline: float,
    ) -> T | None:
        """Ask over plain topics: subscribe to ``answers``, ``send()``, then wait.

        For a question whose answer comes as a publish on a topic of its own
        (``...result.<cid>``) rather than as a bus reply.  Subscribing first means
        no answer is missed however fast it comes.  ``answer`` turns each envelope
        on ``answers`` into the answer, or None to keep waiting (another request's
        answer, a progress step).  None when no answer came within ``deadline``
        seconds; what ``send`` raises is raised.
        """
        with self.bus.subscribe(answers, self.identity) as envelopes:
            send()
            with anyio.move_on_after(deadline):
                async for envelope in envelopes:
                    found = answer(envelope)
                    if found is not None:
                        return found
        return None


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
            raise CapsuleError(f"capsule {self.manifest.name}: {self.state.value} -> {state.value}")
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
