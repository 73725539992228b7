"""Process checks for the benchmarks and the tests: is a pid alive, who carries a marker,
which processes a process started."""

from __future__ import annotations

import contextlib
import os
import threading
import time

__all__ = ("ProcessWatch", "alive", "children_cpu_ticks", "marked", "rss_kib")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def rss_kib(pid: int) -> int:
    """``VmRSS`` of ``pid`` (that process alone), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def marked(marker: bytes) -> list[int]:
    """Live processes, other than this one, whose environment contains ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def children_cpu_ticks(pid: int) -> int:
    """Clock ticks of CPU the reaped children of ``pid`` used (cutime + cstime)."""
    fields = _stat(pid)
    if fields is None:
        raise ProcessLookupError(pid)
    return int(fields[13]) + int(fields[14])


class ProcessWatch:
    """Every process started below ``root`` while the watch runs.

    A thread samples ``/proc`` (this kernel has no ``/proc/<pid>/task/*/children``)
    every ``interval`` seconds, reading the parent of each pid it has not seen
    yet, so a sample costs a directory listing.  A child that lives a few
    milliseconds can slip between two samples; :attr:`children_cpu` (the CPU
    ticks of the children ``root`` reaped meanwhile, from its ``cutime`` and
    ``cstime``) still counts it when it ran for a tick or more."""

    def __init__(self, root: int, interval: float = 0.0005) -> None:
        self.root = root
        self.interval = interval
        self.seen: dict[int, list[str]] = {}
        """Pid to argv of each descendant seen."""
        self.children_cpu = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._cpu0 = 0

    def __enter__(self) -> ProcessWatch:
        self._cpu0 = children_cpu_ticks(self.root)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(ProcessLookupError):
            self.children_cpu = children_cpu_ticks(self.root) - self._cpu0

    def _run(self) -> None:
        parents: dict[int, int] = {}
        tree = {self.root}
        while not self._stop.is_set():
            for entry in os.listdir("/proc"):
                if not entry.isdigit() or int(entry) in parents:
                    continue
                fields = _stat(entry)
                if fields is None:
                    continue
                pid, ppid = int(entry), int(fields[1])
                parents[pid] = ppid
                if ppid in tree:
                    tree.add(pid)
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as f:
                            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
                    except OSError:
                        argv = []
                    self.seen[pid] = argv
            time.sleep(self.interval)
