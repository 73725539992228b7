"""Out-of-process capsules: one child process per ``[worker]`` manifest, on its own socketpair.

A capsule whose ``Capsule.toml`` has a ``[worker]`` table is never imported
into the supervisor.  :class:`WorkerRunner` starts its command as a child
(:meth:`sage.process.Child.spawn`: own session and process group, killed
with the supervisor) in the capsule's folder, with a minimal environment
(:func:`worker_env`).  The child inherits one end of a fresh
``socketpair(AF_UNIX, SOCK_STREAM)`` as ``ASTRID_BUS_FD``; the supervisor
serves the other end with :meth:`bus.server.BusServer.adopt` under the
identity it fixed, ``capsule:<name>`` with the manifest's ACL, so there is
nothing the worker could claim or forge.  ``ASTRID_READY_FD`` is the write
end of a pipe on which the worker says ``READY=1`` (its ``ctx.ready()``).

The restart loop is :class:`sage.daemon.capsule_host.CapsuleRunner`'s: the worker's
"main" runs the child until it exits.  Exit code 0 is a finished capsule
(``stopped``, not restarted); any other end is a crash, restarted by the
same :class:`~sage.daemon.capsule_host.RestartPolicy`, then ``failed`` and audited.
When the supervisor stops, the child gets the stop sequence
(:func:`sage.process.stop`: end of input, SIGTERM, SIGKILL, each after a
grace) while its bus connection stays open, so it can say goodbye.  Its
stdout and stderr are drained line by line into the supervisor's log
(``capsule.output``), each line cut at :data:`MAX_LINE` bytes; a line that is
a JSON object (the worker's own structlog output) is nested as ``entry``.

An installed capsule's worker (a :class:`WorkerSandbox` given) runs in
bubblewrap, the forge's sandbox (:func:`sandbox_command`): its folder
read-only, the interpreter's minimal set read-only (:func:`python_paths`),
private size-capped ``/tmp`` and ``/dev/shm``, the host's network only
with ``[sandbox] network = true``, nothing of the supervisor's but the
socketpair and the ready pipe.  As root, bwrap mounts as root and
``setpriv`` inside drops to the capsule's own uid (``[capsules]
uid_base``, :class:`sage.security.uids.SandboxUids`); otherwise bwrap
confines in a user namespace as the supervisor's uid.  No working bwrap:
the start fails (a crash), never an unsandboxed worker.  See
docs/security.md, Workers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import site
import socket
import stat
import sys
import sysconfig
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusServer
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import CapsuleManifest, WorkerSpec
from sage.config import Config
from sage.daemon.capsule_host import CapsuleMain, CapsuleRunner
from sage.errors import ProcessError, SandboxError
from sage.forge.mounts import ResolvedBind, open_binds
from sage.forge.sandbox import build_args, ensure_sandbox, seccomp_program
from sage.forge.sandbox import (
    memfd as _memfd,
)
from sage.process import Child, ExitStatus, Ring, stop
from sage.security.bwrap import BwrapProbe, launcher
from sage.security.uids import SandboxUids
from sage.state import StateStore

__all__ = (
    "MAX_LINE",
    "PASSED_ENV",
    "LineSplitter",
    "WorkerExited",
    "WorkerRunner",
    "WorkerSandbox",
    "capsule_uids",
    "python_paths",
    "sandbox_command",
    "sandbox_uid",
    "worker_argv",
    "worker_env",
)

log = structlog.get_logger("sage.daemon.workers")

MAX_LINE = 4096
"""Bytes of one output line that reach the log; the rest of the line is dropped."""
PASSED_ENV = ("PATH", "HOME", "LANG")
"""The only variables of the supervisor's environment a worker sees."""
STOP_GRACE = 1.0
"""Seconds per stop step (capped at a third of ``supervisor.shutdown_grace``)."""
_DRAIN_GRACE = 1.0  # seconds to read what an exited worker left in its pipes
_PYTHONS = frozenset({"python", "python3"})
_LEVELS = frozenset({"debug", "info", "warning", "error"})


def _log_line(out: Any, line: str) -> None:
    """One output line as ``capsule.output``: a JSON log entry (sage.capsule.worker's own
    logging) nested as ``entry`` at its level, so secrets in it are redacted
    here too; anything else as ``line``."""
    entry: Any = None
    if line.startswith("{"):
        with contextlib.suppress(msgspec.DecodeError):
            entry = msgspec.json.decode(line)
    if isinstance(entry, dict):
        level = entry.get("level")
        emit = getattr(out, level if level in _LEVELS else "info")
        emit("capsule.output", entry=entry)
    else:
        out.info("capsule.output", line=line)


class WorkerExited(ProcessError):
    """A worker process ended other than by exiting with code 0 (a crash)."""


class LineSplitter:
    """Bytes in, complete lines out, none longer than ``limit`` bytes (pure)."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self._buf = bytearray()
        self._skipping = False  # inside a line already cut at the limit

    def feed(self, data: bytes) -> list[str]:
        """The lines ``data`` completes (a cut line once, when it reaches the limit)."""
        lines: list[str] = []
        start = 0
        while start < len(data):
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if not self._skipping:
                self._buf += piece
                if len(self._buf) >= self.limit:
                    lines.append(self._text(self._buf[: self.limit]) + " [cut]")
                    self._buf.clear()
                    self._skipping = end < 0
                elif end >= 0:
                    lines.append(self._text(self._buf))
                    self._buf.clear()
            elif end >= 0:
                self._skipping = False
            if end < 0:
                break
            start = end + 1
        return lines

    def end(self) -> list[str]:
        """At end of file: the last line if it had no newline."""
        rest, self._buf = self._buf, bytearray()
        self._skipping = False
        return [self._text(rest)] if rest else []

    @staticmethod
    def _text(data: bytes | bytearray) -> str:
        return bytes(data).decode("utf-8", errors="replace").rstrip("\r")


def worker_argv(spec: WorkerSpec, folder: Path) -> list[str]:
    """The command line: ``python``/``python3`` is the supervisor's own interpreter
    (so the worker imports the same sage); a first element with a ``/`` that is
    not absolute is relative to the capsule's folder; a bare name goes to PATH."""
    first, *rest = spec.command
    if first in _PYTHONS:
        first = sys.executable
    elif "/" in first and not os.path.isabs(first):
        first = str(folder / first)
    return [first, *rest]


def worker_env(
    spec: WorkerSpec,
    name: str,
    *,
    bus_fd: int,
    ready_fd: int,
    log_level: str,
    base: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """The worker's whole environment: :data:`PASSED_ENV` from ``base``,
    ``PYTHONUNBUFFERED=1``, the manifest's ``env``, then the ``ASTRID_*`` names."""
    env = {key: base[key] for key in PASSED_ENV if key in base}
    env.setdefault("PATH", os.defpath)
    env["PYTHONUNBUFFERED"] = "1"  # print() lines reach the log as they are written
    env.update(spec.env)
    env.update(
        ASTRID_CAPSULE=name,
        ASTRID_BUS_FD=str(bus_fd),
        ASTRID_READY_FD=str(ready_fd),
        ASTRID_LOG_LEVEL=log_level,
    )
    return env


_SECCOMP = seccomp_program()
SANDBOX_ENV = {"HOME": "/tmp", "TMPDIR": "/tmp", "PYTHONDONTWRITEBYTECODE": "1"}
"""Set over :func:`worker_env` inside the sandbox: the supervisor's HOME is not there."""


@dataclass(frozen=True, kw_only=True)
class WorkerSandbox:
    """How an installed capsule's worker is confined (docs/security.md, Workers)."""

    uids: SandboxUids | None
    """``capsule name -> uid`` (``[capsules] uid_base``); needed when the supervisor is root."""
    network: bool = False
    """The manifest's ``[sandbox] network``: the host's network, else only a loopback."""
    tmp_bytes: int = 64 * 1024 * 1024
    shm_bytes: int = 8 * 1024 * 1024
    max_processes: int = 256
    """RLIMIT_NPROC of the capsule's uid (threads count), as root only."""


def capsule_uids(config: Config) -> SandboxUids:
    """The installed capsules' uid table: ``<state_dir>/capsule_uids.json``, ``[capsules]``."""
    return SandboxUids(
        config.state_dir,
        config.capsules.uid_base,
        config.capsules.uid_count,
        name="capsule_uids",
        setting="[capsules] uid",
    )


def sandbox_uid(sandbox: WorkerSandbox, name: str) -> int | None:
    """The uid capsule ``name`` runs as: its own when we are root, else None (ours)."""
    if os.geteuid() != 0:
        return None
    if sandbox.uids is None:
        raise SandboxError("sandbox_uid_unavailable", "no capsule uid table: root runs no capsule")
    return sandbox.uids.uid_for(name)


def python_paths(executable: str = sys.executable) -> tuple[list[str], list[tuple[str, str]]]:
    """What the worker's Python needs read-only: (paths to bind, ``(target, link)`` symlinks).

    The interpreter's binary (and ``executable`` as a link to it, so that a
    venv is found by its ``pyvenv.cfg``), the base standard library with
    ``lib-dynload``, ``libpython`` when it is shared, the venv's
    ``pyvenv.cfg`` and site-packages (the user's site-packages when it is on
    ``sys.path``), and the folders of the ``sage`` and
    ``bus`` packages (an editable install points outside site-packages).
    Nothing under ``/usr`` (bound whole); nothing that is inside another.
    """
    import bus
    import sage

    links: list[tuple[str, str]] = []
    real = os.path.realpath(executable)
    link = os.path.abspath(executable)
    if real != link and not _inside(link, "/usr"):  # /usr has its own links already
        links.append((real, link))
    wanted = [real]
    if sys.prefix != sys.base_prefix:
        wanted.append(os.path.join(sys.prefix, "pyvenv.cfg"))
    base = {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}
    wanted += [sysconfig.get_path("stdlib", vars=base), sysconfig.get_path("platstdlib", vars=base)]
    dynload = sysconfig.get_config_var("DESTSHARED")
    if isinstance(dynload, str):
        wanted.append(dynload)
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libdir, library = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("LDLIBRARY")
        if isinstance(libdir, str) and isinstance(library, str):
            wanted.append(os.path.join(libdir, library))
    wanted += site.getsitepackages()
    user_site = site.getusersitepackages()
    if site.ENABLE_USER_SITE and user_site in sys.path:  # a `pip install --user` sage
        wanted.append(user_site)
    wanted += [os.path.dirname(p) for p in (sage.__file__, bus.__file__) if p]
    paths: list[str] = []
    for path in sorted({os.path.realpath(p) for p in wanted}, key=lambda p: (len(p), p)):
        if not os.path.exists(path) or _inside(path, "/usr"):
            continue
        if not any(_inside(path, kept) for kept in paths):
            paths.append(path)
    return paths, links


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def _resolved(path: str) -> ResolvedBind:
    info = os.stat(path)
    return ResolvedBind(
        path=Path(path),
        mode="ro",
        dev=info.st_dev,
        ino=info.st_ino,
        is_dir=stat.S_ISDIR(info.st_mode),
        requested=Path(path),
    )


def sandbox_command(
    tools: BwrapProbe,
    sandbox: WorkerSandbox,
    *,
    argv: Sequence[str],
    env: Mapping[str, str],
    folder: Path,
    uid: int | None,
    workdir: Path | None = None,
) -> tuple[list[str], list[int]]:
    """The command that runs ``argv`` in the worker's sandbox, and the descriptors it
    needs passed (the caller closes them once the child started).

    The forge's sandbox (:func:`sage.forge.sandbox.build_args`: every namespace
    unshared, ``--share-net`` only with ``network``, no capabilities, ``/usr``
    and the interpreter read-only, size-capped ``/tmp`` and ``/dev/shm``, the
    rest of ``/`` read-only) around the capsule's ``folder`` (read-only, the
    working folder), started by :func:`sage.security.bwrap.launcher` as ``uid``.  The
    host paths are bound from descriptors the supervisor opened.
    ``workdir`` (inside ``folder``) is the working folder instead of ``folder``.
    """
    for name, value in env.items():
        if "\0" in value:
            raise SandboxError("bad_env", f"environment value of {name} holds a NUL byte")
    paths, links = python_paths()
    real_folder = os.path.realpath(folder)
    binds = [_resolved(p) for p in (*paths, real_folder)]
    fds = open_binds(binds)
    try:
        seccomp_fd = None
        if _SECCOMP is not None:  # the forge's: no memfds, System V shm or queues, one ABI
            seccomp_fd = _memfd("worker-seccomp", _SECCOMP)
            fds.append(seccomp_fd)
        args = build_args(
            env=env,
            binds=list(zip(binds, fds[: len(binds)], strict=True)),
            impl_fd=None,
            status_fd=None,
            network=sandbox.network,
            tmp_bytes=sandbox.tmp_bytes,
            shm_bytes=sandbox.shm_bytes,
            hostname="capsule",
            chdir=real_folder if workdir is None else os.path.realpath(workdir),
            symlinks=links,
            userns=uid is None,
            keep_caps=() if uid is None else ("CAP_SETUID", "CAP_SETGID"),
            seccomp_fd=seccomp_fd,
        )
        args_fd = _memfd("worker-args", b"".join(a.encode() + b"\0" for a in args))
        fds.append(args_fd)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    if uid is None:  # our own uid: bwrap confines in a user namespace of its own
        prefix = launcher(tools, rlimits=(("core", 0, 0),))
        return [*prefix, tools.path, "--args", str(args_fd), "--", *argv], fds
    # root: bwrap mounts as root (the state folder and the interpreter may be out of
    # the uid's reach), then setpriv, inside, drops to the uid and every capability;
    # the uid is the capsule's alone, so RLIMIT_NPROC counts only its processes
    nproc = sandbox.max_processes
    inner = launcher(tools, uid=uid, rlimits=(("core", 0, 0), ("nproc", nproc, nproc)))
    return [tools.path, "--args", str(args_fd), "--", *inner, *argv], fds


class WorkerRunner(CapsuleRunner):
    """Runs one ``[worker]`` capsule as a child process; restarts as CapsuleRunner does."""

    def __init__(
        self,
        bus: Bus,
        manifest: CapsuleManifest,
        audit: Callable[[str, dict[str, Any]], None],
        *,
        folder: Path,
        server_of: Callable[[], BusServer | None],
        config_of: Callable[[], Config] = Config,
        state_of: Callable[[], StateStore | None] = lambda: None,
        publish: Callable[[str, dict[str, Any]], None] = lambda topic, payload: None,
        sandbox: WorkerSandbox | None = None,
    ) -> None:
        """``sandbox``: run the worker confined (installed capsules); None: as today,
        a plain child of the supervisor (capsules the operator named in the config)."""
        if manifest.worker is None:
            raise ValueError(f"capsule {manifest.name} has no [worker] table")
        self.spec: WorkerSpec = manifest.worker
        self.folder = folder.resolve()
        self.pid: int | None = None
        """The running worker's pid, if one runs."""
        self._server_of = server_of
        self.sandbox = sandbox
        super().__init__(
            bus, manifest, audit, config_of=config_of, state_of=state_of, publish=publish
        )

    def _entry(self) -> CapsuleMain:
        """Nothing is imported: each run of the capsule is a run of its child."""
        return self._run_worker

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "pid": self.pid}

    async def _run_worker(self, ctx: CapsuleContext) -> None:
        """Start the worker, serve it until it exits; a crash raises WorkerExited."""
        server = self._server_of()
        if server is None:
            raise ProcessError("the bus server is not serving")
        config = self._config_of()
        name = self.manifest.name
        sandbox = self.sandbox
        tools: BwrapProbe | None = None
        uid: int | None = None
        if sandbox is not None:  # fail closed: no working bwrap, no worker
            uid = sandbox_uid(sandbox, name)
            tools = await ensure_sandbox(uid=None)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ready_r, ready_w = os.pipe()
        extra: list[int] = []
        try:
            argv = worker_argv(self.spec, self.folder)
            env = worker_env(
                self.spec,
                name,
                bus_fd=theirs.fileno(),
                ready_fd=ready_w,
                log_level=config.supervisor.log_level,
            )
            cwd = self.folder
            if sandbox is not None and tools is not None:
                argv, extra = sandbox_command(
                    tools,
                    sandbox,
                    argv=argv,
                    env={**env, **SANDBOX_ENV},
                    folder=self.folder,
                    uid=uid,
                )
                env, cwd = {}, Path("/")
            child = Child.spawn(argv, env=env, cwd=cwd, pass_fds=(theirs.fileno(), ready_w, *extra))
        except BaseException:
            ours.close()
            os.close(ready_r)
            raise
        finally:  # the child has its copies; ours would hide its exit from the other ends
            theirs.close()
            os.close(ready_w)
            for fd in extra:
                os.close(fd)
        self.pid = child.pid
        log.info(
            "capsule.worker_started",
            capsule=name,
            pid=child.pid,
            sandbox=None if sandbox is None else {"uid": uid, "network": sandbox.network},
        )
        tail = Ring(MAX_LINE)
        grace = min(STOP_GRACE, config.supervisor.shutdown_grace / 3)
        try:
            status = await self._supervise(ctx, server, child, ours, ready_r, tail, grace)
        finally:
            self.pid = None
        if status.exit_code == 0:
            return
        last = tail.text().strip().rsplit("\n", 1)[-1][-300:]
        raise WorkerExited(f"worker {status.describe()}" + (f": {last}" if last else ""))

    async def _supervise(
        self,
        ctx: CapsuleContext,
        server: BusServer,
        child: Child,
        sock: socket.socket,
        ready_fd: int,
        tail: Ring,
        grace: float,
    ) -> ExitStatus:
        """Wait for the child; on cancellation, stop it.  Its companions (bus
        connection, drains, ready pipe) are shielded, so they outlive a cancel
        until the child is gone."""
        done = anyio.Event()
        try:
            async with anyio.create_task_group() as tg:
                scope: anyio.CancelScope = await tg.start(
                    self._companions, ctx, server, child, sock, ready_fd, tail, done
                )
                try:
                    await child.wait()
                finally:
                    with anyio.CancelScope(shield=True):
                        status = await stop(child, grace=grace)  # at once if it has exited
                        log.info(
                            "capsule.worker_exited",
                            capsule=self.manifest.name,
                            pid=child.pid,
                            status=status.describe(),
                        )
                        with anyio.move_on_after(_DRAIN_GRACE):
                            await done.wait()
                        scope.cancel()
                        await done.wait()
        finally:
            child.close()
            sock.close()
            anyio.notify_closing(ready_fd)
            os.close(ready_fd)
        return status

    async def _companions(
        self,
        ctx: CapsuleContext,
        server: BusServer,
        child: Child,
        sock: socket.socket,
        ready_fd: int,
        tail: Ring,
        done: anyio.Event,
        *,
        task_status: anyio.abc.TaskStatus[anyio.CancelScope],
    ) -> None:
        try:
            with anyio.CancelScope(shield=True) as scope:
                task_status.started(scope)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(
                        functools.partial(server.adopt, sock, self.identity, pid=child.pid)
                    )
                    tg.start_soon(self._drain, child.read_stdout, "stdout", None, child.pid)
                    tg.start_soon(self._drain, child.read_stderr, "stderr", tail, child.pid)
                    tg.start_soon(self._watch_ready, ready_fd, ctx)
        finally:
            done.set()

    async def _drain(
        self,
        read: Callable[[], Awaitable[bytes]],
        stream: str,
        tail: Ring | None,
        pid: int,
    ) -> None:
        """Log each line the worker writes, so its pipe never fills."""
        lines = LineSplitter()
        out = log.bind(capsule=self.manifest.name, pid=pid, stream=stream)
        while chunk := await read():
            if tail is not None:
                tail.append(chunk)
            for line in lines.feed(chunk):
                _log_line(out, line)
        for line in lines.end():
            _log_line(out, line)

    async def _watch_ready(self, fd: int, ctx: CapsuleContext) -> None:
        """Call ``ctx.ready()`` when the worker writes ``READY=1`` to its ready pipe."""
        os.set_blocking(fd, False)
        seen = b""
        while True:
            try:
                chunk = os.read(fd, 256)
            except BlockingIOError:
                try:
                    await anyio.wait_readable(fd)
                except anyio.ClosedResourceError:
                    return
                continue
            except OSError:
                return
            if not chunk:
                return
            seen = (seen + chunk)[-64:]
            if b"READY=1" in seen:
                log.info("capsule.worker_ready", capsule=self.manifest.name)
                ctx.ready()
                return
