"""The installer capsule: (re)writes a principal's home when the runner asks.

Requests, from the session runner (``astrid sage install`` / ``settings``):

- ``sage.v1.install.run`` ``{principal_id, request_id, force?, config}``
- ``sage.v1.install.relink`` ``{principal_id, request_id, config}``

``config`` is ``{interaction_mode, auth_mode, model?, max_turns?}``.  For each
request the installer publishes its steps on ``sage.v1.install.status``
``{principal_id, request_id, step}`` and exactly one
``sage.v1.install.complete`` ``{principal_id, request_id, success,
home_path?, error?, config?, changed}``, whatever happens.  A successful
``run`` is audited as ``sage.v1.audit.install_choices`` ``{principal_id,
interaction_mode, auth_mode}``.

The files are those of :mod:`capsules.installer.files`: settings (hooks for
the events the installed ``claude`` knows, by its version), ``.mcp.json``,
``CLAUDE.md`` and the marker.  Each is written
atomically (temp file in the same folder, fsync, rename, 0600) and only
when its content differs (``changed`` lists those written; ``force``
rewrites all); temp files a crashed earlier write left behind are removed
first.  Requests of one principal run one at a time.  The principal must be
configured, its home must not be a symlink, another uid's, or writable by
others (the same check the runner makes before a spawn).  Under a root
supervisor the home and its files belong to the uid the principal's
children run as (sage/security/runas.py), and are written without following any
link in the home (:func:`sage.claude.homes.write_in_home`).
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import time
from pathlib import Path
from typing import Any, Literal

import anyio
import msgspec

from bus import BusError, Envelope
from capsules.installer import files
from sage.capsule.context import CapsuleContext
from sage.claude.binary import FLOOR, read_claude_version, resolve_claude_binary
from sage.claude.homes import (
    INSTALL_MARKER,
    USER_CONFIG,
    answered_config,
    own_home,
    unsafe_home,
    write_in_home,
)
from sage.config import NAME_PATTERN
from sage.errors import SageError
from sage.files import write_replace
from sage.security.runas import RunAs, SessionUids, emit_launcher

__all__ = ("Installer", "run")

SETTINGS = Path(".claude") / "settings.local.json"
CLAUDE_MD = Path("CLAUDE.md")
MCP_JSON = Path(".mcp.json")
MARKER = INSTALL_MARKER
EMIT_LAUNCHER = Path(".astrid") / "astrid-emit"


class _Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    interaction_mode: Literal["headless", "repl"] = "headless"
    auth_mode: Literal["api_key", "subscription"] = "api_key"
    model: str = ""
    max_turns: int = 0


class _Request(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    principal_id: str
    config: _Config
    request_id: str | None = None
    force: bool = False


class InstallFailed(SageError):
    """A home could not be (re)written; the message says why."""

    code = "install_failed"


def _command(name: str) -> str:
    """``name`` (astrid-emit, astrid) next to the running interpreter (the venv's),
    else as found on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


class Installer:
    def __init__(self, ctx: CapsuleContext) -> None:
        self.ctx = ctx
        self._locks: dict[str, anyio.Lock] = {}
        self._versions: dict[Path, str] = {}

    async def claude_version(self) -> str:
        """The version of the claude sessions will run, which decides the hook events
        written; the floor's when it cannot be read (the runner refuses to spawn then)."""
        try:
            binary = resolve_claude_binary(self.ctx.config)
            if binary not in self._versions:
                self._versions[binary] = await read_claude_version(binary)
            return self._versions[binary]
        except SageError as exc:
            self.ctx.log.warning("installer.claude_version_unknown", error=str(exc), using=FLOOR)
            return FLOOR

    def _publish(self, topic: str, payload: dict[str, Any], principal: str | None) -> None:
        try:
            self.ctx.publish(topic, payload, on_behalf_of=principal)
        except BusError as exc:
            self.ctx.log.error("installer.publish_failed", topic=topic, error=str(exc))

    async def handle(self, envelope: Envelope) -> None:
        relink = envelope.topic.endswith(".relink")
        try:
            raw = msgspec.json.decode(envelope.payload, type=dict[str, Any])
        except (msgspec.DecodeError, msgspec.ValidationError):
            raw = {}
        claimed = raw.get("principal_id")
        name = claimed if isinstance(claimed, str) else ""
        rid = raw.get("request_id") if isinstance(raw.get("request_id"), str) else None
        principal = name if _valid(name) else None
        done: dict[str, Any] = {"principal_id": name, "request_id": rid, "success": False}
        try:
            request = msgspec.json.decode(envelope.payload, type=_Request)
            if principal is None:
                raise InstallFailed(f"principal id {name!r} is not [A-Za-z0-9_-]{{1,64}}")
            async with self._locks.setdefault(principal, anyio.Lock()):
                done.update(await self._install(request, rid))
            done["success"] = True
        except msgspec.ValidationError as exc:
            done["error"] = f"bad request: {exc}"
        except msgspec.DecodeError as exc:
            done["error"] = f"bad request: not JSON: {exc}"
        except InstallFailed as exc:
            done["error"] = str(exc)
        except OSError as exc:
            done["error"] = f"cannot write the home: {exc}"
        finally:
            self._publish("sage.v1.install.complete", done, principal)
        if done["success"] and not relink:
            config = done["config"]
            self._publish(
                "sage.v1.audit.install_choices",
                {
                    "principal_id": name,
                    "interaction_mode": config["interaction_mode"],
                    "auth_mode": config["auth_mode"],
                },
                principal,
            )

    def _step(self, name: str, rid: str | None, step: str) -> None:
        self._publish(
            "sage.v1.install.status", {"principal_id": name, "request_id": rid, "step": step}, name
        )

    async def _install(self, request: _Request, rid: str | None) -> dict[str, Any]:
        name = request.principal_id
        principal = self.ctx.config.principal(name)
        if principal is None:
            raise InstallFailed(f"no principal {name!r} is configured")
        home = self.ctx.config.home_of(principal)
        config = msgspec.to_builtins(request.config)
        self._step(name, rid, "home")
        try:
            run_as = SessionUids(self.ctx.config).run_as(principal)
        except SageError as exc:
            raise InstallFailed(f"no uid for the principal's sessions: {exc}") from None
        problem = unsafe_home(home, None if run_as is None else run_as.uid)
        if problem is not None:
            raise InstallFailed(f"unsafe home: {problem}")
        if run_as is None:
            home.mkdir(mode=0o700, parents=True, exist_ok=True)
        else:  # the children's own (supervisor root): written without following its links
            config_ = self.ctx.config
            own_home(
                home,
                run_as.uid,
                run_as.gid,
                homes_dir=config_.homes_dir if home.parent == config_.homes_dir else None,
            )
        self._step(name, rid, "scrub")
        for folder in (home, home / ".claude", home / ".astrid"):
            for stale in (
                folder.glob(".*.tmp") if folder.is_dir() and not folder.is_symlink() else ()
            ):
                with contextlib.suppress(OSError):
                    stale.unlink()
        version = await self.claude_version()
        changed: list[str] = []
        emit = _command("astrid-emit")
        launcher = None if run_as is None else emit_launcher(run_as)
        if run_as is not None and launcher is not None:
            # sage's Python is out of the child's reach: hooks run a launcher of its own
            if _read(home / EMIT_LAUNCHER) != launcher or request.force:
                write_in_home(home, EMIT_LAUNCHER, launcher, run_as.uid, run_as.gid, mode=0o700)
                changed.append(str(EMIT_LAUNCHER))
            emit = str(home / EMIT_LAUNCHER)
        contents = {
            str(SETTINGS): files.settings_local(config, emit, version),
            str(MCP_JSON): files.mcp_json(
                name, _command("astrid"), str(self.ctx.config.socket_path)
            ),
            str(CLAUDE_MD): files.claude_md(name, config),
        }
        for rel, step in ((SETTINGS, "settings"), (MCP_JSON, "mcp"), (CLAUDE_MD, "claude_md")):
            self._step(name, rid, step)
            if _write(home, rel, contents[str(rel)], force=request.force, run_as=run_as):
                changed.append(str(rel))
        if config.get("interaction_mode") == "repl":  # a terminal asks what a pipe does not
            self._step(name, rid, "claude_config")
            current = _read_own(home / USER_CONFIG)
            answered = answered_config(current, home)
            if answered != current and _write(
                home, USER_CONFIG, answered, force=True, run_as=run_as
            ):
                changed.append(str(USER_CONFIG))
        self._step(name, rid, "marker")
        mark = files.marker(name, config, version, contents)
        previous = _read_json(home / MARKER)
        if request.force or changed or not _same_marker(previous, mark):
            mark["installed_at"] = time.time()
            _put(home, MARKER, msgspec.json.encode(mark), run_as)
            changed.append(str(MARKER))
        return {"home_path": str(home), "config": config, "changed": changed}


def _valid(name: str) -> bool:
    import re

    return re.match(NAME_PATTERN, name) is not None


def _write(home: Path, rel: Path, data: bytes, *, force: bool, run_as: RunAs | None) -> bool:
    """Write ``home/rel`` when its content differs (or ``force``); True if written."""
    path = home / rel
    if not force:
        with contextlib.suppress(OSError):
            if path.read_bytes() == data:
                return False
    if path.is_symlink():
        raise InstallFailed(f"{path} is a symbolic link; refusing to write through it")
    _put(home, rel, data, run_as)
    return True


def _put(home: Path, rel: Path, data: bytes, run_as: RunAs | None) -> None:
    if run_as is None:
        write_replace(home / rel, data)
    else:
        write_in_home(home, rel, data, run_as.uid, run_as.gid)


def _read_own(path: Path) -> bytes | None:
    """A regular file in the home, read without following a link (the home is the child's);
    None when it is missing or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return file.read(1 << 20)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _read_json(path: Path) -> Any:
    try:
        return msgspec.json.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return None


def _same_marker(previous: Any, new: dict[str, Any]) -> bool:
    if not isinstance(previous, dict):
        return False
    return {k: v for k, v in previous.items() if k != "installed_at"} == new


async def run(ctx: CapsuleContext) -> None:
    installer = Installer(ctx)
    requests = ctx.subscribe("sage.v1.install.*")
    ctx.ready()
    async with anyio.create_task_group() as tg:
        async for envelope in requests:
            if envelope.topic.rsplit(".", 1)[1] in ("run", "relink"):
                tg.start_soon(installer.handle, envelope)
