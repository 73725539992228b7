"""Spare sandboxes: a python sandbox started ahead of the call that will use it.

A fresh bubblewrap sandbox costs a python tool about 1.4x its bare start
here (namespaces, mounts, then the interpreter's own start inside them),
and the forge's goal is 1.3x.  The cost cannot be cut much inside one
call, so it is moved out of it: the pool keeps, per kind of sandbox, one
that has already started ``python3 /forge/spare.py`` (the loader,
:mod:`sage.forge.spare_loader`) and waits on its stdin.  A call takes it,
hands it the tool, its environment and its input, and the pool starts the
next spare while the tool runs.

What a spare is, and is not:

- **Used once.**  A spare runs exactly one tool and then ends like any
  sandbox; nothing of one call is left for the next.
- **The same sandbox.**  A kind (:class:`SpareKind`) is every setting of
  the sandbox that is not per call: interpreter, network, loopback, all the
  limits.  The per-call parts (tool, secrets in its environment, input) go
  through the pipe.  Calls whose sandbox needs more get a fresh one:
  ``x-bind`` mounts (they are mounted at start), bash tools, environment
  names that the interpreter or libc reads at start (``PYTHON*``, ``LD_*``,
  ``LC_*``, ``LANG``, ``GLIBC_*``, ``MALLOC_*``, ``HOME``, ``TZ``), a tool
  bigger than :data:`MAX_TOOL_BYTES`.
- **Differences a tool can see** (docs/forge-sandbox.md lists them all):
  ``/forge`` is a small private tmpfs (mode 0555 once the tool is in it,
  mode bits only), the loader is at ``/forge/spare.py`` and one frame
  above the tool's, and the CPU limit also counts the interpreter's start
  (about 20 ms).  The wall clock starts at the hand-over.
- **Bounded.**  At most ``size`` spares wait at once (the least recently
  used kind gives way), a spare older than ``max_idle`` seconds is thrown
  away rather than used, and :meth:`SparePool.aclose` kills them all.
  Spares die with the supervisor (``--die-with-parent`` and the death
  signal), like any sandbox.

Under a steady stream of calls the spare for the next call is still
starting when it comes; that call then waits for it, which costs about as
much as a fresh sandbox.  The gain is for calls spaced further apart than
one sandbox start (about 30 ms here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import anyio

from sage.errors import ProcessError
from sage.forge.sandbox import (
    IMPL_PATH,
    LOADER_PATH,
    Limits,
    SandboxResult,
    SandboxSpec,
    Started,
    ensure_sandbox,
    nproc_limit,
    sandbox_env,
    start_sandbox,
    supervise,
)
from sage.security.bwrap import BwrapProbe

__all__ = (
    "LOADER_INCOMPLETE",
    "MAX_TOOL_BYTES",
    "SpareKind",
    "SparePool",
    "handover",
    "kind_of",
    "spare_forge_bytes",
    "spare_nproc",
)

MAX_TOOL_BYTES = 512 * 1024
"""Largest tool a spare takes; its ``/forge`` tmpfs is twice that."""
READY = b"R"
TAKEN = b"T"
LOADER_INCOMPLETE = 125
"""The loader's exit status when its input ends before a whole hand-over."""
READY_TIMEOUT = 2.0
"""Seconds a call waits for a spare to say it is ready, or to take the hand-over;
then the spare is dropped and the call starts a fresh sandbox."""
_STARTUP_ENV = ("PYTHON", "LD_", "LC_", "LANG", "GLIBC_", "MALLOC_")
_STARTUP_NAMES = frozenset({"HOME", "TZ"})
"""Environment the interpreter or libc reads at start: a spare started without it."""
SPARE_TASKS = 3
"""Tasks a waiting spare runs: bwrap, its init, the interpreter."""
_LOADER = Path(__file__).with_name("spare_loader.py")


@dataclass(frozen=True)
class SpareKind:
    """Everything about a sandbox that is not per call."""

    interpreter: str
    network: bool
    loopback: bool
    limits: Limits


def kind_of(spec: SandboxSpec) -> SpareKind | None:
    """The kind of spare that can run ``spec``; None when it needs a fresh sandbox."""
    if spec.binds or spec.impl_path != IMPL_PATH or len(spec.argv) != 2:
        return None
    if spec.argv[1] != IMPL_PATH or not Path(spec.argv[0]).name.startswith("python"):
        return None
    if len(spec.impl) > MAX_TOOL_BYTES:
        return None
    if any(name.startswith(_STARTUP_ENV) or name in _STARTUP_NAMES for name in spec.env):
        return None
    return SpareKind(spec.argv[0], spec.network, spec.loopback, spec.limits)


def spare_forge_bytes() -> int:
    """Size of a spare's private ``/forge`` tmpfs: the largest tool, and room to spare."""
    return MAX_TOOL_BYTES + 64 * 1024


def handover(spec: SandboxSpec, nproc: int) -> bytes:
    """What the loader reads before the tool's input: lengths, RLIMIT_NPROC, environment, tool."""
    env = b"".join(f"{k}={v}".encode() + b"\0" for k, v in spec.env.items())
    head = b"".join(n.to_bytes(4, "big") for n in (len(env), len(spec.impl), nproc))
    return head + env + spec.impl


def _nproc_per_userns() -> bool:
    """Linux 5.14 and later count RLIMIT_NPROC per user namespace (ucounts)."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (5, 14)


def spare_nproc(limits: Limits) -> int:
    """The RLIMIT_NPROC the loader sets at the hand-over.

    Since Linux 5.14 a process's count is the processes of its uid in its
    own user namespace, the sandbox's: bwrap's init, the interpreter and the
    tool's children, checked against the limit it has now, and, a level up,
    the host-wide count against the limit its namespace was created with
    (the one the spare started with).  So ``max_processes + 2`` gives the
    tool exactly ``max_processes``, whatever runs elsewhere.  Before 5.14
    the count is host-wide: the fresh sandbox's formula, counted now.
    """
    if _nproc_per_userns():
        return limits.max_processes + 2
    return nproc_limit(limits, running=SPARE_TASKS)


@dataclass
class _Spare:
    sandbox: Started
    born: float
    ready: bool = False

    def discard(self) -> None:
        child = self.sandbox.child
        child.signal_group(signal.SIGKILL)
        child.close()
        with contextlib.suppress(OSError):
            os.close(self.sandbox.status_r)


class SparePool:
    """At most ``size`` spare sandboxes, one per kind; see the module docstring."""

    def __init__(self, size: int = 2, *, max_idle: float = 300.0) -> None:
        self.size = size
        self.max_idle = max_idle
        self._spares: OrderedDict[SpareKind, _Spare] = OrderedDict()
        self._dead: list[_Spare] = []
        self._loader = _LOADER.read_bytes()
        self._closed = False
        self.taken = 0
        """Calls that ran in a spare."""
        self.missed = 0
        """Calls that could have, but found none ready (or a broken one)."""

    def __len__(self) -> int:
        return len(self._spares)

    async def run(self, spec: SandboxSpec, tools: BwrapProbe) -> SandboxResult | None:
        """Run ``spec`` in a spare; None when it cannot take one (the caller starts a fresh one).

        None also when the spare fails before the tool is handed over: the
        tool has not run, so a fresh sandbox may run it.
        """
        kind = kind_of(spec) if self.size > 0 and not self._closed else None
        if kind is None:
            return None
        sandbox_env(spec.env, shim=False)  # the same checks as for a fresh sandbox
        spare = await self._take(kind)
        if spare is not None and not await self._hand_over(spare, spec):
            spare = None
        if spare is None:
            self.missed += 1
            self._refill(kind, tools)
            await self._reap()
            return None
        self.taken += 1
        sandbox = dataclasses.replace(spare.sandbox, at=time.monotonic())
        await self._reap()
        return await supervise(sandbox, spec, handed_over=lambda: self._refill(kind, tools))

    async def _hand_over(self, spare: _Spare, spec: SandboxSpec) -> bool:
        """Give the spare its tool (not yet its input); False, the spare dropped, if it fails.

        RLIMIT_NPROC is set now, not when the spare started: sandboxes that
        ran meanwhile must not widen it (the loader can only lower it); see
        :func:`spare_nproc`.
        """
        try:
            nproc = spare_nproc(spec.limits)
            with anyio.move_on_after(READY_TIMEOUT):
                await spare.sandbox.child.write(handover(spec, nproc))
                # the loader says it holds the tool; a spare that died (or is
                # dying) says nothing, and the call is not the tool's failure
                if await spare.sandbox.child.read_stdout(1) == TAKEN:
                    return True
        except ProcessError:
            pass
        except BaseException:
            self._bury(spare)
            raise
        self._bury(spare)
        return False

    async def _take(self, kind: SpareKind) -> _Spare | None:
        spare = self._spares.pop(kind, None)
        if spare is None:
            return None
        try:
            fit = time.monotonic() - spare.born <= self.max_idle and await self._wait_ready(spare)
        except BaseException:  # cancelled while waiting: the spare is nobody's now
            self._bury(spare)
            raise
        if not fit:
            self._bury(spare)
            return None
        return spare

    async def _wait_ready(self, spare: _Spare) -> bool:
        if not spare.ready:
            with anyio.move_on_after(READY_TIMEOUT):
                first = await spare.sandbox.child.read_stdout(1)
                spare.ready = first == READY
        return spare.ready and not spare.sandbox.child.has_exited()

    def _refill(self, kind: SpareKind, tools: BwrapProbe) -> None:
        if self.size <= 0 or self._closed or kind in self._spares:
            return
        while len(self._spares) >= self.size:
            _, oldest = self._spares.popitem(last=False)
            self._bury(oldest)
        try:
            sandbox = start_sandbox(
                tools,
                argv=[kind.interpreter, LOADER_PATH],
                limits=kind.limits,
                env=sandbox_env({}, shim=kind.network),
                network=kind.network,
                loopback=kind.loopback,
                loader=self._loader,
                forge_bytes=spare_forge_bytes(),
            )
        except Exception:  # no spare: the next call starts a fresh sandbox, which will say why
            return
        self._spares[kind] = _Spare(sandbox, born=time.monotonic())

    def _bury(self, spare: _Spare) -> None:
        spare.discard()
        self._dead.append(spare)

    async def _reap(self) -> None:
        dead, self._dead = self._dead, []
        for spare in dead:
            with anyio.CancelScope(shield=True):
                await spare.sandbox.child.wait()

    async def prime(self, spec: SandboxSpec) -> bool:
        """Start a spare for ``spec``'s kind now and wait until it is ready.

        False when ``spec`` cannot run in a spare or none could be started.
        """
        kind = kind_of(spec) if self.size > 0 and not self._closed else None
        if kind is None:
            return False
        self._refill(kind, await ensure_sandbox(uid=spec.limits.sandbox_uid))
        await self.settle()
        spare = self._spares.get(kind)
        return spare is not None and spare.ready

    async def settle(self) -> None:
        """Wait until every spare has said it is ready (for benchmarks and tests).

        Not while calls run: it would read a spare's stdout beside them.
        """
        for spare in list(self._spares.values()):
            await self._wait_ready(spare)

    async def aclose(self) -> None:
        """Kill and reap every spare; none is started after this (calls get fresh sandboxes)."""
        self._closed = True
        while self._spares:
            _, spare = self._spares.popitem()
            self._bury(spare)
        await self._reap()
