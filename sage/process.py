"""Child processes that cannot outlive the supervisor, and the way to stop them.

:meth:`Child.spawn` starts a program in a session and process group of its
own (``setsid``) with ``PR_SET_PDEATHSIG``, so the kernel kills it when
the supervisor dies, however it dies, and a signal to the group reaches
whatever it started.  Its three pipes are non-blocking and moved by anyio:
:meth:`Child.read_stdout` / :meth:`Child.read_stderr` return chunks as
they come, :meth:`Child.write` writes whole buffers (the caller keeps one
writer per child).  Exit is seen through a pidfd, not through end of file,
so a grandchild that holds the pipes open cannot hide the exit.

:func:`stop` is the stop sequence: end the input, wait ``grace``, SIGTERM
to the group, wait ``grace``, SIGKILL to the group.  Once the leader has
exited, what is left of its group is killed before the leader is reaped
(while its pid is still reserved, so the signal cannot hit a stranger).

Spawn from the event loop's thread: the death signal is tied to the thread
that forked, and that thread lives as long as the supervisor.

A child that must run as another uid gets it through its argv (``setpriv
--reuid ... --pdeathsig KILL --``, sage.security.runas): a uid change clears the
death signal, so the program that changes it sets it again.  The
supervisor, root then, still signals the child's group across the change.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import select
import signal
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import anyio
import msgspec

from sage.errors import ProcessError

__all__ = ("Child", "ExitStatus", "Ring", "stop", "tie_to_parent")

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_prctl = _libc.prctl
_prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
_prctl.restype = ctypes.c_int


def tie_to_parent(sig: int, parent: int) -> Callable[[], None]:
    """What runs in the child between fork and exec: tie its life to ``parent``."""

    def preexec() -> None:
        if _prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent:  # the parent died before prctl took hold
            os._exit(126)

    return preexec


class Ring:
    """The last ``size`` bytes written to it, and how many were written in all."""

    __slots__ = ("_buf", "size", "total")

    def __init__(self, size: int) -> None:
        self.size = size
        self.total = 0
        self._buf = bytearray()

    def append(self, data: bytes) -> None:
        self.total += len(data)
        if len(data) >= self.size:
            self._buf[:] = data[-self.size :]
            return
        self._buf += data
        excess = len(self._buf) - self.size
        if excess > 0:
            del self._buf[:excess]

    def tail(self) -> bytes:
        return bytes(self._buf)

    def text(self, limit: int | None = None) -> str:
        """The tail as text (undecodable bytes replaced), at most ``limit`` bytes of it."""
        data = self._buf if limit is None else self._buf[-limit:]
        return bytes(data).decode("utf-8", errors="replace")


class ExitStatus(msgspec.Struct, frozen=True):
    """How a child ended: an exit code, or the signal that killed it."""

    exit_code: int | None = None
    signal: int | None = None

    @classmethod
    def from_returncode(cls, returncode: int) -> ExitStatus:
        if returncode < 0:
            return cls(signal=-returncode)
        return cls(exit_code=returncode)

    def describe(self) -> str:
        if self.signal is not None:
            try:
                return f"killed by {signal.Signals(self.signal).name}"
            except ValueError:
                return f"killed by signal {self.signal}"
        return f"exit code {self.exit_code}"


class Child:
    """One running child process; see the module docstring."""

    def __init__(self, popen: subprocess.Popen[bytes], pidfd: int) -> None:
        self._popen = popen
        self.pid = popen.pid
        self._pidfd = pidfd
        assert popen.stdin is not None
        assert popen.stdout is not None
        assert popen.stderr is not None
        self._stdin: int | None = popen.stdin.fileno()
        self._stdout: int | None = popen.stdout.fileno()
        self._stderr: int | None = popen.stderr.fileno()
        for fd in (self._stdin, self._stdout, self._stderr):
            os.set_blocking(fd, False)
        self.status: ExitStatus | None = None
        self._exited = anyio.Event()
        self._waiting = False

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        death_signal: int = signal.SIGKILL,
        pass_fds: Sequence[int] = (),
    ) -> Child:
        """Start ``argv`` with exactly ``env`` (nothing of ours leaks) in ``cwd``."""
        if not argv:
            raise ProcessError("cannot start a process: empty command line")
        try:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                close_fds=True,
                pass_fds=tuple(pass_fds),
                preexec_fn=tie_to_parent(death_signal, os.getpid()),
                bufsize=0,  # only the raw descriptors are used: no buffer objects
            )
        except subprocess.SubprocessError as exc:
            raise ProcessError(f"cannot start {Path(argv[0]).name}: {exc}") from exc
        except OSError as exc:
            raise ProcessError(
                f"cannot start {argv[0]}: {exc.strerror or exc}"
                + (
                    f" (in {cwd})"
                    if isinstance(exc, NotADirectoryError | FileNotFoundError)
                    else ""
                )
            ) from exc
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError as exc:  # pragma: no cover - kernels before 5.3
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
            raise ProcessError(f"pidfd_open failed: {exc.strerror}") from exc
        return cls(popen, pidfd)

    # -- pipes -------------------------------------------------------------

    async def read_stdout(self, max_bytes: int = 65536) -> bytes:
        """The next chunk of stdout; ``b""`` at end of file (or once closed)."""
        return await self._read("_stdout", max_bytes)

    async def read_stderr(self, max_bytes: int = 65536) -> bytes:
        """The next chunk of stderr; ``b""`` at end of file (or once closed)."""
        return await self._read("_stderr", max_bytes)

    async def _read(self, name: str, max_bytes: int) -> bytes:
        while True:
            fd: int | None = getattr(self, name)
            if fd is None:
                return b""
            try:
                return os.read(fd, max_bytes)
            except BlockingIOError:
                pass
            except OSError:
                return b""
            try:
                await anyio.wait_readable(fd)
            except anyio.ClosedResourceError:
                return b""

    async def write(self, data: bytes | memoryview) -> None:
        """Write all of ``data`` to stdin; ProcessError if the child no longer reads it."""
        view = memoryview(data)
        while view:
            fd = self._stdin
            if fd is None:
                raise ProcessError(f"process {self.pid}: input is closed")
            try:
                written = os.write(fd, view)
            except BlockingIOError:
                try:
                    await anyio.wait_writable(fd)
                except anyio.ClosedResourceError:
                    raise ProcessError(f"process {self.pid}: input is closed") from None
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise ProcessError(f"process {self.pid} stopped reading its input") from None
            view = view[written:]

    @property
    def stdin_open(self) -> bool:
        return self._stdin is not None

    def close_stdin(self) -> None:
        """End the child's input (it sees end of file)."""
        self._close("_stdin", self._popen.stdin)

    def close_output(self) -> None:
        """Stop reading stdout and stderr; readers waiting on them return ``b""``."""
        self._close("_stdout", self._popen.stdout)
        self._close("_stderr", self._popen.stderr)

    def _close(self, name: str, file: object) -> None:
        fd: int | None = getattr(self, name)
        if fd is None:
            return
        setattr(self, name, None)
        anyio.notify_closing(fd)
        close = getattr(file, "close", None)
        if close is not None:
            with contextlib.suppress(OSError):
                close()

    # -- life --------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Not reaped yet (it may have exited: see :meth:`has_exited`)."""
        return self.status is None

    def has_exited(self) -> bool:
        """Has the leader exited, reaped or not? (never blocks)."""
        return self.status is not None or self._zombie()

    def signal_group(self, sig: int) -> bool:
        """Send ``sig`` to the child's process group; False if nobody is left to get it."""
        if self.status is not None:
            return False
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:  # pragma: no cover - a member changed uid
            return False
        return True

    async def wait(self) -> ExitStatus:
        """Wait for the child to exit (not for its pipes to close); reap it once."""
        if self.status is not None:
            return self.status
        if self._waiting:
            await self._exited.wait()
            assert self.status is not None
            return self.status
        self._waiting = True
        try:
            while not self._zombie():
                await anyio.wait_readable(self._pidfd)
            return self._reap()
        finally:
            self._waiting = False

    def _zombie(self) -> bool:
        """Has the leader exited? (pidfd readable; it is not reaped yet)."""
        readable, _, _ = select.select([self._pidfd], [], [], 0)
        return bool(readable)

    def _reap(self) -> ExitStatus:
        # the leader is a zombie: its pid (the group id) cannot be reused yet,
        # so what it left behind in its group can be killed safely
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        returncode = self._popen.wait()
        self.status = ExitStatus.from_returncode(returncode)
        anyio.notify_closing(self._pidfd)
        os.close(self._pidfd)
        self._pidfd = -1
        self._exited.set()
        return self.status

    def close(self) -> None:
        """Close every pipe (the child must have been waited for, or is killed now)."""
        if self.status is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        self.close_stdin()
        self.close_output()


async def stop(
    child: Child,
    *,
    grace: float,
    end_input: Callable[[], Awaitable[None]] | None = None,
) -> ExitStatus:
    """The stop sequence: end input, then SIGTERM the group, then SIGKILL it.

    ``end_input`` replaces the first step (closing stdin) when the caller has a
    gentler way to ask, e.g. an interrupt over the control protocol.  Each step
    gets ``grace`` seconds.  Returns once the child is reaped.
    """
    if child.status is not None:
        return child.status
    if end_input is not None:
        with anyio.move_on_after(grace):
            await end_input()
    child.close_stdin()
    with anyio.move_on_after(grace):
        return await child.wait()
    child.signal_group(signal.SIGTERM)
    with anyio.move_on_after(grace):
        return await child.wait()
    child.signal_group(signal.SIGKILL)
    return await child.wait()
