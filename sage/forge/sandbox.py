"""Run one forged tool inside bubblewrap: the options, limits, output capture.

The pure half builds: :func:`build_args` writes the bwrap options for the binds
sage/forge/mounts.py checked (:func:`~sage.forge.mounts.check_binds`).  The thin
async half, :func:`run_sandboxed`, has the checked paths opened as checked
(:func:`~sage.forge.mounts.open_binds`) and hands bwrap the descriptors
(``--ro-bind-fd``/``--bind-fd``), so what is mounted is what was checked, whatever
is swapped in later.

The sandbox: every namespace unshared (``--share-net`` only when the
persona's policy allows the network), nested user namespaces disabled, no
capabilities, a clean environment, ``/usr`` read-only (the merged-``/usr``
links recreated), a few ``/etc`` files (``ld.so.cache``; DNS and TLS roots
only with the network), a fresh ``/proc`` of its own pid namespace, a
minimal ``/dev`` (read-only), private size-capped tmpfs ``/tmp`` and
``/dev/shm`` (the only writable filesystems: :meth:`Limits.writable_bytes`), the tool at
``/forge/tool.py`` and the binds at their own absolute paths, and a seccomp
filter (:func:`seccomp_program`) that refuses the memory a tool could hold
outside those (memfds, System V shm and message queues) and foreign ABIs.  Options,
environment (with the secrets) and the tool travel in memfds
(``--args FD``, ``--ro-bind-data FD``): nothing of them shows in ``ps``.

When the supervisor is root, bwrap runs as ``Limits.sandbox_uid`` (the
principal's own uid from ``[forge] sandbox_uid_base``, see
:mod:`sage.security.uids`; no supplementary groups) in an unprivileged user namespace, so
RLIMIT_NPROC is enforced (it is not for root) and the tool can only open
what that uid could; binds are refused unless that uid may reach them.  The
rlimits (CPU, address space, file size, open files, processes, core 0) are
set by ``prlimit`` just before bwrap, the uid and the death signal by
``setpriv`` (:func:`sage.security.bwrap.launcher`), so the supervisor spawns with
``vfork`` and never copies its address space.  The wall clock SIGKILLs bwrap's
process group; ``--die-with-parent`` then kills the pid namespace's init,
and with it every process of the sandbox, daemonized or not.

Start-up probe: :func:`ensure_sandbox` runs the minimal sandbox once as the
sandbox uid (cached); when it fails every call raises
``SandboxError("sandbox_unavailable")`` - forge fails closed.
See docs/forge-sandbox.md for what is and is not contained.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import struct
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import anyio

from sage.errors import ProcessError, SandboxError
from sage.files import private_dir
from sage.forge import mounts
from sage.forge.mounts import Bind, ResolvedBind
from sage.process import Child, Ring
from sage.security.bwrap import BwrapProbe, launcher, probe_bwrap
from sage.security.uids import DEFAULT_UID_BASE

if TYPE_CHECKING:
    from sage.config import ForgeConfig

__all__ = (
    "IMPL_PATH",
    "LOADER_PATH",
    "Limits",
    "SandboxProbe",
    "SandboxResult",
    "SandboxSpec",
    "Spares",
    "Started",
    "build_args",
    "ensure_sandbox",
    "nproc_limit",
    "run_sandboxed",
    "seccomp_program",
    "start_sandbox",
    "supervise",
)

IMPL_PATH = "/forge/tool.py"
LOADER_PATH = "/forge/spare.py"
SHIM_DIR = "/forge/site"
_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_ALWAYS = ("ld.so.cache", "localtime")
_ETC_NETWORK = (
    "resolv.conf",
    "hosts",
    "nsswitch.conf",
    "host.conf",
    "gai.conf",
    "ssl",
    "ca-certificates",
    "ca-certificates.conf",
)
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# -- the data --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one call may use."""

    wall_clock: float
    cpu_seconds: int
    memory_bytes: int
    file_bytes: int
    open_files: int
    max_processes: int
    output_cap: int
    sandbox_uid: int = DEFAULT_UID_BASE
    """Uid (and gid) bwrap runs as when the supervisor is root: the principal's own
    (:class:`sage.security.uids.SandboxUids`), never one another program uses."""
    spill_cap: int = 256 * 1024 * 1024
    """Stdout bytes spilled to the artifact at most; past it the sandbox is killed."""
    stderr_tail: int = 8192
    tmp_bytes: int = 0
    """Size of the private /tmp tmpfs; 0: ``file_bytes``."""
    shm_bytes: int = 8 * 1024 * 1024
    """Size of the private /dev/shm tmpfs (POSIX shared memory, semaphores)."""

    def writable_bytes(self, forge_bytes: int = 0) -> int:
        """Bytes one call may write to its filesystems at most: /tmp, /dev/shm (and a spare's /forge).

        Every other mount is read-only (``x-bind`` ``rw`` paths aside: host
        folders the operator chose), so this caps the memory a call's files hold.
        """
        return (self.tmp_bytes or self.file_bytes) + self.shm_bytes + forge_bytes

    @classmethod
    def from_config(cls, config: ForgeConfig) -> Limits:
        return cls(
            wall_clock=config.wall_clock,
            cpu_seconds=config.cpu_seconds,
            memory_bytes=config.memory_bytes,
            file_bytes=config.file_bytes,
            open_files=config.open_files,
            max_processes=config.max_processes,
            output_cap=config.output_cap,
            sandbox_uid=config.sandbox_uid_base,
        )


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    """One call: what to run, with what, where."""

    argv: list[str]
    impl: bytes
    stdin: bytes
    limits: Limits
    binds: tuple[Bind, ...] = ()
    network: bool = False
    loopback: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    artifacts_dir: Path | None = None
    forbidden: tuple[Path, ...] = ()
    impl_path: str = IMPL_PATH


@dataclass(frozen=True)
class SandboxResult:
    """How a call ended and what it printed."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stdout_total_bytes: int
    stdout_truncated: bool
    stdout_artifact: Path | None
    stderr_tail: bytes
    timed_out: bool
    duration: float
    label: str
    stdout_truncated_at_bytes: int | None = None
    spill_capped: bool = False
    """Stdout passed ``Limits.spill_cap``: the sandbox was killed, the artifact is partial."""


def label_of(network: bool, loopback: bool) -> str:
    if not network:
        return "bwrap"
    return "bwrap+net" if loopback else "bwrap+net-noloop"


# -- the bwrap options (pure) -----------------------------------------------


def sandbox_env(extra: Mapping[str, str], *, shim: bool) -> dict[str, str]:
    """The sandbox's whole environment: a clean base, the caller's extras, the shim's path."""
    env = dict(_BASE_ENV)
    for name, value in extra.items():
        if not _ENV_NAME.fullmatch(name):
            raise SandboxError("bad_env", f"environment name {name!r} is not valid")
        if "\0" in value:
            raise SandboxError("bad_env", f"environment value of {name} holds a NUL byte")
        env[name] = value
    if shim:
        env["PYTHONPATH"] = SHIM_DIR + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def build_args(
    *,
    env: Mapping[str, str],
    binds: Sequence[tuple[ResolvedBind, int]],
    impl_fd: int | None,
    status_fd: int | None,
    network: bool,
    shim_fd: int | None = None,
    tmp_bytes: int = 64 * 1024 * 1024,
    shm_bytes: int = 8 * 1024 * 1024,
    impl_path: str = IMPL_PATH,
    root: Path = Path("/"),
    loader_fd: int | None = None,
    forge_bytes: int = 0,
    seccomp_fd: int | None = None,
    hostname: str = "forge",
    chdir: str = "/tmp",
    symlinks: Sequence[tuple[str, str]] = (),
    userns: bool = True,
    keep_caps: Sequence[str] = (),
) -> list[str]:
    """The bwrap options (they go through ``--args FD``; the command follows ``--``).

    A fresh sandbox gets the tool read-only at ``impl_path``.  A spare (see
    :mod:`sage.forge.spares`) gets no tool (``impl_fd`` None) but a private
    tmpfs of ``forge_bytes`` at ``/forge`` and the loader at
    :data:`LOADER_PATH`, which writes the tool there when it is handed one.
    The only writable filesystems are those tmpfs, each with its size cap
    (``SandboxError("bad_limits")`` for a size that is not positive: a tmpfs
    without one would take up to half the host's memory).

    Installed capsules' workers (:mod:`sage.daemon.workers`) use the same sandbox
    with no tool, their own ``hostname`` and ``chdir`` (their folder, a
    ``ro`` bind), ``symlinks`` (``(target, link)``, made after the binds)
    for the interpreter's path, and no ``status_fd``; as root, with
    ``userns`` False (bwrap run by root mounts what the capsule's uid could
    not reach, in the host's user namespace) and ``keep_caps``
    (``CAP_SETUID``, ``CAP_SETGID``) for the ``setpriv`` that then drops to that uid.
    """
    for name, size in (("/tmp", tmp_bytes), ("/dev/shm", shm_bytes)):
        if size <= 0:
            raise SandboxError("bad_limits", f"the {name} tmpfs needs a size cap, got {size}")
    if userns:
        args = ["--unshare-all"]
        if network:
            args.append("--share-net")
        args += ["--unshare-user", "--disable-userns"]
    else:  # root's bwrap, in the host's user namespace (every other one unshared)
        args = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup"]
        if not network:
            args.append("--unshare-net")
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for cap in keep_caps:
        args += ["--cap-add", cap]
    args += ["--hostname", hostname, "--clearenv"]
    for name, value in env.items():
        args += ["--setenv", name, value]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in _TOP_LEVEL:
        host = root / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            args += ["--ro-bind", f"/{name}", f"/{name}"]
    # root's bwrap makes the folders it needs 0700, out of the dropped uid's reach
    made: set[str] = set()

    def dirs(paths: Iterable[str]) -> list[str]:
        return [] if userns else _parent_dirs(paths, made)

    etc = [f"/etc/{n}" for n in _ETC_ALWAYS + (_ETC_NETWORK if network else ())]
    etc = [path for path in etc if (root / path[1:]).exists()]
    args += dirs(etc)
    for path in etc:
        args += ["--ro-bind-try", path, path]
    shared = [] if userns else ["--perms", "1777"]  # as in the host: every uid may write
    # bwrap's /dev is a tmpfs with no size cap (its /dev/shm a folder in it, half the
    # host's memory): /dev/shm is a capped tmpfs of its own and /dev read-only (below)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += [*shared, "--size", str(shm_bytes), "--tmpfs", "/dev/shm"]
    args += [*shared, "--size", str(tmp_bytes), "--tmpfs", "/tmp"]
    if forge_bytes > 0:
        args += ["--size", str(forge_bytes), "--tmpfs", "/forge"]
    if impl_fd is not None:
        args += ["--perms", "0444", "--ro-bind-data", str(impl_fd), impl_path]
    if loader_fd is not None:
        args += ["--perms", "0444", "--ro-bind-data", str(loader_fd), LOADER_PATH]
    if shim_fd is not None:
        args += ["--perms", "0444", "--ro-bind-data", str(shim_fd), f"{SHIM_DIR}/sitecustomize.py"]
    args += dirs([str(b.path) for b, _ in binds] + [link for _, link in symlinks])
    for bind, fd in binds:
        option = "--ro-bind-fd" if bind.mode == "ro" else "--bind-fd"
        args += [option, str(fd), str(bind.path)]
    for target, link in symlinks:
        args += ["--symlink", target, link]
    # bwrap's root and /dev are tmpfs the sandbox uid may write, with no size cap:
    # read-only once everything is mounted (/tmp, /dev/shm and a spare's /forge are
    # capped mounts of their own; --remount-ro is not recursive)
    args += ["--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    if status_fd is not None:
        args += ["--json-status-fd", str(status_fd)]
    args += ["--chdir", chdir]
    return args


def _parent_dirs(paths: Iterable[str], made: set[str]) -> list[str]:
    """``--perms 0755 --dir`` for each folder above ``paths`` not made yet (parents first)."""
    args: list[str] = []
    for path in paths:
        for parent in reversed(Path(path).parents):
            text = str(parent)
            if text != "/" and text not in made and text not in ("/tmp", "/dev", "/proc"):
                made.add(text)
                args += ["--perms", "0755", "--dir", text]
    return args


# -- the seccomp filter ------------------------------------------------------

_DENIED_CALLS = ("memfd_create", "shmget", "msgget")
"""Memory a tool could hold outside its capped file systems and RLIMIT_AS: memfds
(RLIMIT_FSIZE each, as many as it may open), System V shared memory (kept when
detached, up to the namespace's shmall) and message queues."""
_ARCHES: dict[str, tuple[int, dict[str, int], int | None]] = {
    # machine: (AUDIT_ARCH_*, syscall numbers, x32 bit to refuse)
    "x86_64": (0xC000003E, {"memfd_create": 319, "shmget": 29, "msgget": 68}, 0x40000000),
    "aarch64": (0xC00000B7, {"memfd_create": 279, "shmget": 194, "msgget": 186}, None),
}
_BPF_LD_W_ABS, _BPF_JEQ_K, _BPF_JGE_K, _BPF_RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_RET_EPERM = 0x00050000 | errno.EPERM


def seccomp_program(machine: str | None = None) -> bytes | None:
    """The classic-BPF filter bwrap loads (``--seccomp FD``) before it runs the tool.

    :data:`_DENIED_CALLS` fail with ``EPERM``; a syscall of another ABI (32-bit
    ``int 0x80``, x32) kills the process, as those have numbers of their own.
    None on a machine it does not know (the sandbox then runs without it).
    """
    found = _ARCHES.get(machine or os.uname().machine)
    if found is None:
        return None
    arch, numbers, x32 = found
    denied = [numbers[name] for name in _DENIED_CALLS]
    # (code, jt, jf, k); jumps count the instructions skipped
    prog: list[tuple[int, int, int, int]] = [
        (_BPF_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_BPF_JEQ_K, 1, 0, arch),
        (_BPF_RET_K, 0, 0, _RET_KILL_PROCESS),
        (_BPF_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    to_deny = len(denied) + (1 if x32 is not None else 0)  # tests before "allow"
    if x32 is not None:
        prog.append((_BPF_JGE_K, to_deny, 0, x32))
    for index, number in enumerate(denied):
        remaining = len(denied) - index - 1
        prog.append((_BPF_JEQ_K, remaining + 1, 0, number))
    prog += [(_BPF_RET_K, 0, 0, _RET_ALLOW), (_BPF_RET_K, 0, 0, _RET_EPERM)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def _shim_source(loopback: bool) -> bytes:
    source = (Path(__file__).with_name("sitecustomize.py")).read_bytes()
    if loopback:
        source = source.replace(b"\nALLOW_LOOPBACK = False\n", b"\nALLOW_LOOPBACK = True\n", 1)
    return source


_SHIMS: dict[bool, bytes] = {}
_SECCOMP = seccomp_program()


# -- the probe --------------------------------------------------------------


class SandboxProbe:
    """A cached "does bwrap work here, as the sandbox uid" (see :func:`ensure_sandbox`)."""

    retry_after = 30.0

    def __init__(self) -> None:
        self._ok: dict[int | None, BwrapProbe] = {}
        self._failed: dict[int | None, tuple[float, str]] = {}
        self._lock = anyio.Lock()

    async def ensure(self, uid: int | None = None) -> BwrapProbe:
        """The working probe; ``SandboxError("sandbox_unavailable")`` when bwrap does not work."""
        key = uid if os.geteuid() == 0 else None
        found = self._ok.get(key)
        if found is not None:
            return found
        async with self._lock:
            found = self._ok.get(key)
            if found is not None:
                return found
            failed = self._failed.get(key)
            if failed is None or time.monotonic() - failed[0] > self.retry_after:
                probe = await probe_bwrap(uid=key)
                if probe.ok:
                    self._ok[key] = probe
                    self._failed.pop(key, None)
                    return probe
                failed = (time.monotonic(), probe.reason)
                self._failed[key] = failed
        raise SandboxError(
            "sandbox_unavailable",
            f"no working bubblewrap sandbox ({failed[1]}); forge refuses to run tools"
            " (see `astrid doctor`)",
        )

    def forget(self) -> None:
        self._ok.clear()
        self._failed.clear()


_PROBE = SandboxProbe()


async def ensure_sandbox(*, uid: int | None = DEFAULT_UID_BASE) -> BwrapProbe:
    """Fail closed: ``SandboxError("sandbox_unavailable", why)`` unless bwrap works (cached)."""
    return await _PROBE.ensure(uid)


# -- running ----------------------------------------------------------------


def _count_tasks(uid: int) -> int:
    """Tasks (threads count for RLIMIT_NPROC) ``uid`` runs now."""
    count = 0
    try:
        names = os.listdir("/proc")
    except OSError:
        return 0
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            count += len(os.listdir(f"/proc/{name}/task"))
        except OSError:
            continue
    return count


def run_as(limits: Limits) -> int | None:
    """The uid bwrap is switched to: the sandbox uid when we are root, else None (our own)."""
    return limits.sandbox_uid if os.geteuid() == 0 else None


def nproc_limit(limits: Limits, *, running: int = 0) -> int:
    """RLIMIT_NPROC for a sandbox: what its uid runs now, plus ``max_processes``, plus 2.

    The 2 are bwrap and its init, which do not exist yet for a fresh
    sandbox; ``running`` is how many of the counted tasks are the sandbox's
    own already (a spare: bwrap, its init and the interpreter, 3), taken off
    so that the tool and its children get ``max_processes`` either way.
    """
    switched = run_as(limits)
    uid = os.getuid() if switched is None else switched
    return _count_tasks(uid) - running + limits.max_processes + 2


def _rlimits(limits: Limits, nproc: int) -> tuple[tuple[str, int, int], ...]:
    """The rlimits (prlimit's names) bwrap, and so the whole sandbox, starts with."""
    cpu = max(1, limits.cpu_seconds)
    return (
        ("cpu", cpu, cpu + 1),
        ("as", limits.memory_bytes, limits.memory_bytes),
        ("fsize", limits.file_bytes, limits.file_bytes),
        ("nofile", limits.open_files, limits.open_files),
        ("core", 0, 0),
        ("nproc", nproc, nproc),
    )


def memfd(name: str, data: bytes) -> int:
    """A sealed-off copy of ``data`` in memory (an fd to hand to bwrap's ``--*-data``)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Stdout:
    """The first ``cap`` bytes in memory; past the cap, everything spilled to a file."""

    def __init__(self, cap: int, spill_cap: int, artifacts_dir: Path | None) -> None:
        self.cap = cap
        self.spill_cap = spill_cap
        self.artifacts_dir = artifacts_dir
        self.head = bytearray()
        self.total = 0
        self.artifact: Path | None = None
        self._fd: int | None = None
        self.over_spill = False

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap - len(self.head)
        if room > 0:
            self.head += data[:room]
        if self.total <= self.cap:
            return
        if self._fd is None and self.artifacts_dir is not None and self.artifact is None:
            private_dir(self.artifacts_dir)
            path = self.artifacts_dir / "full_stdout.bin"
            self._fd = os.open(
                path,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            self.artifact = path
            # everything before this chunk, then the chunk
            self._write(bytes(self.head[: self.total - len(data)]))
        self._write(data)
        if self.total > self.spill_cap:
            self.over_spill = True

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            return
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _drain(fd: int) -> bytes:
    out = bytearray()
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _decode_exit(code: int | None, sig: int | None) -> tuple[int | None, int | None]:
    """bwrap reports a tool killed by signal N as exit 128+N; report it as the signal."""
    if code is not None and 128 < code < 128 + 65:
        return None, code - 128
    return code, sig


class Spares(Protocol):
    """Sandboxes started ahead of calls (:class:`sage.forge.spares.SparePool`).

    Declared here, below the pool, so that the sandbox needs nothing of it.
    """

    async def run(self, spec: SandboxSpec, tools: BwrapProbe) -> SandboxResult | None:
        """Run ``spec`` in a spare; None when none can take it (a fresh sandbox runs it)."""
        ...


async def run_sandboxed(spec: SandboxSpec, spares: Spares | None = None) -> SandboxResult:
    """Run ``spec`` in a sandbox of its own; ``SandboxError`` when it cannot be set up.

    With ``spares``, a call that a spare sandbox can take (see
    :mod:`sage.forge.spares`) runs in one started ahead of it; any other
    call, or one that finds no spare, gets a fresh sandbox.
    """
    limits = spec.limits
    switched = run_as(limits)
    if switched is None:
        uid, gids = os.getuid(), (os.getgid(), *os.getgroups())
    else:
        uid, gids = switched, (switched,)
    tools = await _PROBE.ensure(limits.sandbox_uid)
    if not spec.argv:
        raise SandboxError("bad_command", "empty command line")
    resolved = mounts.check_binds(spec.binds, spec.forbidden, uid=uid, gids=gids)
    if spares is not None and not resolved:
        result = await spares.run(spec, tools)
        if result is not None:
            return result
    started = start_sandbox(
        tools,
        argv=spec.argv,
        limits=limits,
        env=sandbox_env(spec.env, shim=spec.network),
        network=spec.network,
        loopback=spec.loopback,
        binds=resolved,
        impl=spec.impl,
        impl_path=spec.impl_path,
    )
    return await supervise(started, spec)


@dataclass(frozen=True)
class Started:
    """A sandbox that is running: its bwrap, the read end of its status pipe, when it began."""

    child: Child
    status_r: int
    at: float


def start_sandbox(
    tools: BwrapProbe,
    *,
    argv: Sequence[str],
    limits: Limits,
    env: Mapping[str, str],
    network: bool,
    loopback: bool,
    binds: Sequence[ResolvedBind] = (),
    impl: bytes | None = None,
    impl_path: str = IMPL_PATH,
    loader: bytes | None = None,
    forge_bytes: int = 0,
) -> Started:
    """Start bwrap around ``argv`` (the binds are opened here, as checked); returns at once."""
    opened: list[int] = []
    status_r = status_w = -1
    try:
        bind_fds = mounts.open_binds(binds)
        opened += bind_fds
        impl_fd = loader_fd = shim_fd = None
        if impl is not None:
            impl_fd = memfd("forge-tool", impl)
            opened.append(impl_fd)
        if loader is not None:
            loader_fd = memfd("forge-loader", loader)
            opened.append(loader_fd)
        if network:
            source = _SHIMS.get(loopback)
            if source is None:
                source = _SHIMS[loopback] = _shim_source(loopback)
            shim_fd = memfd("forge-shim", source)
            opened.append(shim_fd)
        seccomp_fd = None
        if _SECCOMP is not None:
            seccomp_fd = memfd("forge-seccomp", _SECCOMP)
            opened.append(seccomp_fd)
        status_r, status_w = os.pipe()
        args = build_args(
            env=env,
            binds=list(zip(binds, bind_fds, strict=True)),
            impl_fd=impl_fd,
            status_fd=status_w,
            network=network,
            shim_fd=shim_fd,
            tmp_bytes=limits.tmp_bytes or limits.file_bytes,
            shm_bytes=limits.shm_bytes,
            impl_path=impl_path,
            loader_fd=loader_fd,
            forge_bytes=forge_bytes,
            seccomp_fd=seccomp_fd,
        )
        args_fd = memfd("forge-args", b"".join(a.encode() + b"\0" for a in args))
        opened.append(args_fd)
        nproc = nproc_limit(limits)
        prefix = launcher(tools, uid=run_as(limits), rlimits=_rlimits(limits, nproc))
        at = time.monotonic()
        try:
            # no preexec_fn and no user=: Python spawns with vfork (see sage.security.bwrap.launcher)
            popen = subprocess.Popen(
                [*prefix, tools.path, "--args", str(args_fd), "--", *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={},
                cwd="/",
                start_new_session=True,
                close_fds=True,
                pass_fds=(*opened, status_w),
                bufsize=0,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            if status_r >= 0:
                os.close(status_r)
            raise SandboxError("sandbox_failed", f"cannot start bwrap: {exc}") from exc
    finally:
        for fd in opened:
            os.close(fd)
        if status_w >= 0:
            os.close(status_w)
    try:
        pidfd = os.pidfd_open(popen.pid)
    except OSError as exc:  # pragma: no cover - kernels before 5.3
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()
        os.close(status_r)
        raise SandboxError("sandbox_failed", f"pidfd_open failed: {exc.strerror}") from exc
    return Started(Child(popen, pidfd), status_r, at)


async def supervise(
    sandbox: Started,
    spec: SandboxSpec,
    *,
    handed_over: Callable[[], None] | None = None,
) -> SandboxResult:
    """Feed ``spec.stdin``, collect the output under the limits, reap; the result.

    ``handed_over`` runs once all of the input is written (a spare starts
    its successor then, while the tool runs).
    """
    child, status_r, started = sandbox.child, sandbox.status_r, sandbox.at
    limits = spec.limits
    out = _Stdout(limits.output_cap, limits.spill_cap, spec.artifacts_dir)
    err = Ring(limits.stderr_tail)
    timed_out = False
    try:

        async def feed_stdin() -> None:
            with contextlib.suppress(ProcessError):
                await child.write(spec.stdin)
            child.close_stdin()
            if handed_over is not None:
                with contextlib.suppress(Exception):  # never at the cost of the running tool
                    handed_over()

        stdout_done = anyio.Event()
        stderr_done = anyio.Event()

        async def read_stdout() -> None:
            try:
                while chunk := await child.read_stdout():
                    out.feed(chunk)
                    if out.over_spill:
                        child.signal_group(signal.SIGKILL)
                        return
            finally:
                stdout_done.set()

        async def read_stderr() -> None:
            try:
                while chunk := await child.read_stderr():
                    err.append(chunk)
            finally:
                stderr_done.set()

        async with anyio.create_task_group() as readers:
            readers.start_soon(read_stdout)
            readers.start_soon(read_stderr)
            readers.start_soon(feed_stdin)
            with anyio.move_on_after(limits.wall_clock) as scope:
                await child.wait()
            if scope.cancelled_caught:
                timed_out = True
                child.signal_group(signal.SIGKILL)
                await child.wait()
            # bwrap is gone, and with it its pid namespace: the pipes end; never hang on them
            with anyio.move_on_after(2.0):
                await stdout_done.wait()
                await stderr_done.wait()
            readers.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            child.close()
            if child.status is None:
                await child.wait()
            out.close()
        os.set_blocking(status_r, False)
        status = _drain(status_r)
        os.close(status_r)
    duration = time.monotonic() - started
    assert child.status is not None
    if b'"child-pid"' not in status and not timed_out:
        said = err.text(400).strip()
        raise SandboxError(
            "sandbox_failed",
            f"bwrap could not set up the sandbox ({child.status.describe()}): {said}",
        )
    exit_code, sig = _decode_exit(child.status.exit_code, child.status.signal)
    truncated = out.total > limits.output_cap
    return SandboxResult(
        exit_code=exit_code,
        signal=sig,
        stdout=bytes(out.head),
        stdout_total_bytes=out.total,
        stdout_truncated=truncated,
        stdout_artifact=out.artifact,
        stderr_tail=err.tail(),
        timed_out=timed_out,
        duration=duration,
        label=label_of(spec.network, spec.loopback),
        stdout_truncated_at_bytes=limits.output_cap if truncated else None,
        spill_capped=out.over_spill,
    )
