"""The supervisor's capsules as a set an admin can change while it serves.

Each capsule runs in a cancel scope of its own inside the supervisor's task
group, so one can be stopped without touching the others.  A runner whose run
ended is never reused (``stopped`` and ``failed`` are final states): a restart
builds a new runner from the same source (a built-in name, a path from
``[supervisor] capsules``, or an installed folder) and starts it.

Requests (admins only: a caller that acts for a principal is refused), each
answered with the one reply shape (:mod:`sage.replies`):

- ``sage.v1.request.capsule.load {name, replace?}``: start a capsule that
  ``astrid capsule install`` copied in; with ``replace`` a running one of that
  name is stopped first (``install --force`` of a live capsule);
- ``sage.v1.request.capsule.restart {name}``: stop any capsule and start it
  again from its source;
- ``sage.v1.request.capsule.remove {name}``: stop an installed capsule and
  delete its folder; a built-in one is refused (it comes from the config).

Only an admin's own connection (source ``cli:<uid>``, no principal) is
answered: not a user (who always acts for a principal), not a capsule
(whatever its manifest lets it publish).

Each is audited (``sage.v1.audit.capsule_loaded`` / ``capsule_restarted`` /
``capsule_removed``, with the requester's ``source``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Envelope
from sage import replies
from sage.capsule.manifest import load_manifest
from sage.capsule.privileges import grants, revoke
from sage.daemon.capsule_host import CapsuleRunner
from sage.daemon.install import installed_folders, uninstall
from sage.errors import ConfigError, SageError

__all__ = ("CAPSULE_REQUESTS", "CapsuleSet", "Source")

log = structlog.get_logger("sage.daemon.capsule_set")

CAPSULE_REQUESTS = "sage.v1.request.capsule.*"
"""The admin requests this module answers: load, restart, remove."""
STOP_WITHIN = 10.0
"""Seconds a stopping capsule has to end (a worker is killed before that)."""
READY_WITHIN = 10.0
"""Seconds a load or restart waits for the new capsule to say it serves (``ctx.ready()``)."""


class CapsuleRequestError(SageError):
    """A capsule request was refused; ``code`` says why."""

    code = "bad_request"


@dataclass(frozen=True)
class Source:
    """Where a capsule comes from: a ``[supervisor] capsules`` entry, or an installed folder."""

    entry: str
    installed: bool = False


class _Load(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    replace: bool = False


class _Named(msgspec.Struct, forbid_unknown_fields=True):
    name: str


@dataclass
class _Running:
    runner: CapsuleRunner
    source: Source
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)


T = TypeVar("T")
Build = Callable[[Source], CapsuleRunner]
Audit = Callable[[str, dict[str, Any]], None]


class CapsuleSet:
    """Capsules by name, each with its source and, once started, its own scope."""

    def __init__(self, build: Build, audit: Audit, state_dir: Callable[[], Path]) -> None:
        self._build = build
        self._audit = audit
        self._state_dir = state_dir
        self._entries: dict[str, _Running] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    # -- building ---------------------------------------------------------

    def add(self, source: Source) -> CapsuleRunner:
        """Build and keep the runner of ``source`` (not started); its name must be free."""
        runner = self._build(source)
        name = runner.manifest.name
        if name in self._entries:
            raise ConfigError(f"capsule {name!r} is named twice")
        self._entries[name] = _Running(runner, source)
        return runner

    @property
    def runners(self) -> list[CapsuleRunner]:
        return [entry.runner for entry in self._entries.values()]

    def describe(self) -> list[dict[str, Any]]:
        given = self._grants()
        rows = []
        for name, entry in self._entries.items():
            row = entry.runner.describe()
            if entry.source.installed and name in given:
                row["privileged"] = msgspec.to_builtins(given[name])
            rows.append(row)
        return rows

    def _grants(self) -> dict[str, Any]:
        try:
            return grants(self._state_dir())
        except ConfigError as exc:  # shown, never fatal: nothing starts without a good one
            log.error("capsule_set.grants_unreadable", error=str(exc))
            return {}

    def _audit_privileged(self, entry: _Running) -> None:
        """An installed capsule that holds privileged patterns starts: say so, with the grant."""
        name = entry.runner.manifest.name
        given = self._grants().get(name) if entry.source.installed else None
        if given is not None:
            self._audit(
                "sage.v1.audit.capsule_privileged",
                {"capsule": name, **msgspec.to_builtins(given)},
            )

    # -- running ----------------------------------------------------------

    def start_all(self, tg: anyio.abc.TaskGroup) -> None:
        """Start every capsule in ``tg``; later loads and restarts start there too."""
        self._tg = tg
        for entry in self._entries.values():
            self._audit_privileged(entry)
            tg.start_soon(self._run, entry)

    async def _run(self, entry: _Running) -> None:
        try:
            with entry.scope:
                await entry.runner.run()
        finally:
            entry.done.set()

    async def _stop(self, entry: _Running) -> None:
        """Cancel its scope and wait for its end; one that will not end is left as it is."""
        entry.scope.cancel()
        with anyio.move_on_after(STOP_WITHIN):
            await entry.done.wait()
        if not entry.done.is_set():
            raise CapsuleRequestError(
                f"capsule {entry.runner.manifest.name!r} did not stop within {STOP_WITHIN:g} s;"
                " nothing was replaced or removed",
                code="stop_timeout",
            )

    async def _start(self, entry: _Running) -> bool:
        """Start it; True once it serves (its ``ctx.ready()``, or its first run ended),
        False when it did not say so within :data:`READY_WITHIN`."""
        assert self._tg is not None, "start_all first"
        self._entries[entry.runner.manifest.name] = entry
        self._audit_privileged(entry)
        self._tg.start_soon(self._run, entry)
        with anyio.move_on_after(READY_WITHIN):
            await entry.runner.ready.wait()
        return entry.runner.ready.is_set()

    # -- requests ---------------------------------------------------------

    async def answer(self, request: Envelope) -> dict[str, Any]:
        """The reply to one capsule request; a refusal never raises."""
        verb = request.topic.rpartition(".")[2]
        try:
            # an admin's own connection only: users act for a principal, and a capsule
            # (principal-less, its ACL whatever its manifest declared) is no operator
            if request.principal is not None or not request.source.startswith("cli:"):
                raise CapsuleRequestError(
                    f"only an admin may {verb} capsules", code="not_authorized"
                )
            if verb == "load":
                load = _decode(request.payload, _Load)
                return await self._load(load.name, load.replace, request.source)
            if verb == "restart":
                return await self._restart(_decode(request.payload, _Named).name, request.source)
            if verb == "remove":
                return await self._remove(_decode(request.payload, _Named).name, request.source)
            raise CapsuleRequestError(f"unknown capsule request {verb!r}", code="unknown_request")
        except SageError as exc:
            return replies.from_error(exc)
        except Exception as exc:  # a bug here must not end the supervisor's responder
            log.exception("capsule_set.request_failed", topic=request.topic)
            return replies.error(
                "internal_error", f"the capsule {verb} failed ({type(exc).__name__}); see the log"
            )

    async def _load(self, name: str, replace: bool, source: str) -> dict[str, Any]:
        entry = self._entries.get(name)
        live = entry is not None and entry.runner.state.value not in ("failed", "stopped")
        if live and not replace:
            raise CapsuleRequestError(
                f"capsule {name!r} runs already; install it with --force to replace it",
                code="running",
            )
        if entry is not None and not entry.source.installed:
            raise CapsuleRequestError(
                f"capsule {name!r} is built in; an installed capsule may not take its name",
                code="name_taken",
            )
        folder = self._installed(name)
        if folder is None:
            raise CapsuleRequestError(f"no installed capsule {name!r}", code="not_installed")
        fresh = self._fresh(Source(str(folder), installed=True))
        if entry is not None:
            await self._stop(entry)
        ready = await self._start(fresh)
        manifest = fresh.runner.manifest
        self._audit(
            "sage.v1.audit.capsule_loaded",
            {
                "capsule": manifest.name,
                "version": manifest.package.version,
                "source": source,
                "replaced": entry is not None,
            },
        )
        log.info("capsule.loaded", capsule=name, replaced=entry is not None)
        return replies.ok(capsule=manifest.name, replaced=entry is not None, ready=ready)

    async def _restart(self, name: str, source: str) -> dict[str, Any]:
        entry = self._known(name)
        fresh = self._fresh(entry.source)  # built first: a broken source leaves the old running
        await self._stop(entry)
        ready = await self._start(fresh)
        self._audit(
            "sage.v1.audit.capsule_restarted",
            {"capsule": name, "version": fresh.runner.manifest.package.version, "source": source},
        )
        log.info("capsule.restarted", capsule=name, ready=ready)
        return replies.ok(capsule=name, ready=ready)

    async def _remove(self, name: str, source: str) -> dict[str, Any]:
        entry = self._known(name)
        if not entry.source.installed:
            raise CapsuleRequestError(
                f"capsule {name!r} is built in: take it out of [supervisor] capsules instead",
                code="builtin",
            )
        await self._stop(entry)
        del self._entries[name]
        try:
            folder = uninstall(self._state_dir(), name, Path(entry.source.entry))
            revoke(self._state_dir(), name)
        except (OSError, ConfigError) as exc:
            raise CapsuleRequestError(
                f"capsule {name!r} is stopped but its copy could not be deleted: {exc}",
                code="remove_failed",
            ) from None
        self._audit(
            "sage.v1.audit.capsule_removed",
            {"capsule": name, "version": entry.runner.manifest.package.version, "source": source},
        )
        log.info("capsule.removed", capsule=name, folder=str(folder))
        return replies.ok(capsule=name)

    # -- inside -----------------------------------------------------------

    def _known(self, name: str) -> _Running:
        entry = self._entries.get(name)
        if entry is None:
            raise CapsuleRequestError(f"no capsule {name!r}", code="unknown_capsule")
        return entry

    def _fresh(self, source: Source) -> _Running:
        try:
            return _Running(self._build(source), source)
        except ConfigError as exc:
            raise CapsuleRequestError(str(exc), code="bad_capsule") from None

    def _installed(self, name: str) -> Path | None:
        for folder in installed_folders(self._state_dir()):
            try:
                if load_manifest(folder).name == name:
                    return folder
            except ConfigError:
                continue
        return None


def _decode(payload: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(payload, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CapsuleRequestError(f'expected {{"name": NAME}}: {exc}', code="bad_request") from None
