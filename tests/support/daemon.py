"""A real supervisor process for tests: started with a config in a temp folder."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from sage.process import tie_to_parent

ASTRID = [sys.executable, "-m", "sage.cli"]


def short_dir() -> Path:
    """A temp folder with a short path (AF_UNIX paths are limited to 107 bytes).

    Mode 0711, as ``/var/lib`` is for a real state folder: a root supervisor's
    ``claude`` children run as their principals' uids and must pass through it
    to their homes and the socket (they cannot list it)."""
    root = Path(tempfile.mkdtemp(prefix="sg", dir="/tmp"))
    root.chmod(0o711)
    return root


def node_root() -> Path:
    """A :func:`short_dir` for a supervisor whose socket other uids (mapped principals,
    an unmapped uid) must reach: they traverse its folder, so it is 0755."""
    root = short_dir()
    root.chmod(0o755)
    return root


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children first found, from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                ppid = int(file.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def descendant_argvs(root: int) -> dict[int, list[str]]:
    """The argv of every live process below ``root``, by pid; one that exits between
    the listing and the read of its command line is left out (it runs nothing)."""
    found: dict[int, list[str]] = {}
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                found[pid] = [part.decode() for part in file.read().split(b"\0") if part]
        except OSError:
            continue
    return found


class Daemon:
    def __init__(self, root: Path, extra: str = "", env: dict[str, str] | None = None) -> None:
        self.root = root
        self.config = root / "supervisor.toml"
        self.config.write_text(f'[supervisor]\nstate_dir = "state"\n{extra}')
        self.socket = root / "state" / "run" / "astrid.sock"
        self.env = {**os.environ, **(env or {})}
        self.log_path = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.prefix: list[str] = []
        """Run before the supervisor's argv (``setpriv --bounding-set ...``: a unit's caps)."""
        self._log: BinaryIO | None = None
        self.startup_s = 0.0

    def start(self, timeout: float = 15.0) -> Daemon:
        return self.launch().wait_ready(timeout)

    def launch(self) -> Daemon:
        """Start the process; call from the thread that lives as long as the test run
        (its death signal is tied to the thread that forks)."""
        self._t0 = time.monotonic()
        if self._log is not None:  # started again (after a kill): the last log is done
            self._log.close()
        # the log goes to a file: a pipe nobody drains would block the daemon
        self._log = self.log_path.open("ab")
        self._offset = self._log.tell()  # a restarted daemon appends to the same log
        self.proc = subprocess.Popen(
            [*self.prefix, *ASTRID, "supervisor", "run", "--config", str(self.config)],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            env=self.env,
            # a test run that dies (a timeout's os._exit) must not leave daemons behind
            preexec_fn=tie_to_parent(signal.SIGTERM, os.getpid()),
        )
        return self

    def wait_ready(self, timeout: float = 15.0) -> Daemon:
        """Wait for the supervisor's ready line (may run in a worker thread)."""
        assert self.proc is not None
        deadline = self._t0 + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if b'"supervisor.ready"' in self.log_path.read_bytes()[self._offset :]:
                self.startup_s = time.monotonic() - self._t0
                return self
            time.sleep(0.01)
        self.stop()
        raise AssertionError(f"supervisor did not become ready; log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        """What the supervisor wrote to stderr so far (JSON lines)."""
        return self.log_path.read_text(errors="replace")

    def log_events(self, event: str) -> list[dict[str, Any]]:
        """The log's records of ``event``, in order (lines that are no JSON are passed)."""
        found = []
        for line in self.log().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == event:
                found.append(record)
        return found

    def run_refused(self, timeout: float = 20.0) -> subprocess.CompletedProcess[str]:
        """Run the supervisor in the foreground where it must refuse to start and end by
        itself: its exit code and output."""
        return subprocess.run(
            [*ASTRID, "supervisor", "run", "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
        )

    def astrid(
        self, *args: str, input: bytes | None = None, timeout: float = 20.0
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*ASTRID, *args, "--config", str(self.config)],
            input=input.decode() if input is not None else None,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
        )

    def status(self) -> Any:
        result = self.astrid("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            # a supervisor that does not stop: kill it and all it started, by pid
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            code = self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code


@contextlib.contextmanager
def all_running(daemons: Mapping[str, Daemon], ready: float = 30.0) -> Iterator[dict[str, Daemon]]:
    """Launch every supervisor of ``daemons`` at once (nodes of one fleet join together),
    wait until each is ready (30 s: several nodes joining a fresh cluster on a loaded
    host), and stop them all when the block ends, however it ends."""
    try:
        for daemon in daemons.values():
            daemon.launch()
        for daemon in daemons.values():
            daemon.wait_ready(ready)
        yield dict(daemons)
    finally:
        for daemon in daemons.values():
            daemon.stop()
