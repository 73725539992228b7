"""`make soak`: fuzz a real supervisor's socket while a canary client keeps working.

Starts a supervisor (the echo capsule, principal alice = uid 65533, the socket
open to group nogroup) in a temp folder, forks fuzz workers (two as root, an
admin; one as alice, a mapped non-admin; one as uid 65532, mapped to nothing)
that send ``--cases`` cases between them (:mod:`tests.soak.fuzz`), and keeps a
canary client doing request/reply and publish/subscribe round trips through the
supervisor the whole time.  Then it prints one table and exits non-zero if the
supervisor crashed, a canary round trip failed or took over 5 s (a hang), a
connection handler raised, the log stopped being JSON lines, resident memory or
open descriptors grew past a bound, or fewer cases than asked were sent.

Bounded: the fuzzing stops after ``--minutes`` (default 7) whatever it has sent;
the whole run stays under 10 minutes.  Needs root (the workers take other
uids).  ``--seed`` replays the same case sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from bus import BusClient
from sage.process import tie_to_parent
from tests.soak.fuzz import GENERATORS, WorkerSpec, run_worker
from tests.support.daemon import Daemon, short_dir

ALICE, UNMAPPED = 65533, 65532
CANARY_DEADLINE = 5.0
"""A canary round trip slower than this counts as a hang."""
RSS_GROWTH_LIMIT = 96 * 1024 * 1024
"""Growth of the supervisor's resident memory from start to end, after ``malloc_trim``.

The peak during a run is several hundred MiB (outboxes of up to 64 MiB a
connection, in-process queues of 1024 envelopes of up to 1 MiB), and glibc
keeps much of the freed heap: the end RSS as it is measures the allocator.
``malloc_trim(0)``, called in the supervisor through gdb, returns that, so the
rest is what the supervisor still holds."""
FD_GROWTH_LIMIT = 3
SETTLE = 20.0
"""Seconds the supervisor gets to close the fuzzers' connections after they stop."""

WORKERS = (
    ("admin", None, 0.3),
    ("admin", None, 0.3),
    ("user alice", ALICE, 0.25),
    ("unmapped", UNMAPPED, 0.15),
)
"""(label, uid or None for root, share of the cases)."""


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def trimmed_rss(pid: int) -> int | None:
    """The RSS after glibc gave its free heap back (``malloc_trim(0)`` through gdb), or None
    without gdb."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return None
    subprocess.run(
        [gdb, "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"],
        capture_output=True,
        timeout=60,
        check=False,
    )
    time.sleep(0.2)
    return rss(pid)


def mib(n: float) -> str:
    return f"{n / 1024 / 1024:.1f} MiB"


@dataclass
class Canary:
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rss_peak: int = 0


def reap(workers: dict[int, int], *, overran: bool) -> None:
    """Note the exit status of each worker that ended; kill them all if they ``overran``."""
    for pid, status in list(workers.items()):
        if status >= 0:
            continue
        if overran:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            workers[pid] = 137
            continue
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            workers[pid] = os.waitstatus_to_exitcode(code) & 0xFF


async def run_canary(
    socket_path: Path, supervisor: int, workers: dict[int, int], deadline: float
) -> Canary:
    """Round trips until every worker has exited (``workers``: pid -> exit status, filled in).

    A worker still running 45 s past the fuzzing ``deadline`` is killed (status 137)."""
    out = Canary()
    async with (
        BusClient.connect(socket_path, name="canary-responder") as responder,
        BusClient.connect(socket_path, name="canary") as client,
    ):
        requests = await responder.subscribe("canary.v1.echo")
        ticks = await client.subscribe("canary.v1.tick")

        async def answer() -> None:
            async for request in requests:
                responder.reply(request, request.data())

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            n = 0
            next_sample = 0.0
            while any(v < 0 for v in workers.values()):
                reap(workers, overran=time.monotonic() > deadline + 45)
                n += 1
                started = time.perf_counter()
                try:
                    with anyio.fail_after(CANARY_DEADLINE):
                        reply = await client.request(
                            "canary.v1.echo", {"n": n}, deadline=CANARY_DEADLINE
                        )
                        assert reply.data() == {"n": n}, reply.data()
                        client.publish("canary.v1.tick", {"n": n})
                        while (await ticks.get()).data() != {"n": n}:
                            pass
                    out.latencies.append(time.perf_counter() - started)
                except Exception as exc:  # every failure is a finding
                    out.failures.append(f"round trip {n}: {type(exc).__name__}: {exc}")
                    if len(out.failures) > 20:
                        break
                if time.monotonic() > next_sample:
                    next_sample = time.monotonic() + 1.0
                    with contextlib.suppress(OSError, RuntimeError):
                        out.rss_peak = max(out.rss_peak, rss(supervisor))
                await anyio.sleep(0.02)
            tg.cancel_scope.cancel()
    return out


async def settle(socket_path: Path) -> tuple[bool, int]:
    """Wait until only our own connection is left; (answered, connections)."""
    deadline = time.monotonic() + SETTLE
    left = -1
    while time.monotonic() < deadline:
        try:
            async with BusClient.connect(socket_path, name="soak-status") as client:
                status = (await client.request("sage.v1.request.status", {}, deadline=5)).data()
            left = status["connections"]["connections"]
            if left <= 1:
                return True, left
        except Exception:  # still settling
            pass
        await anyio.sleep(0.5)
    return left >= 0, left


def read_log(path: Path) -> tuple[int, list[str], dict[str, int]]:
    """(lines, lines that are not JSON objects, count of each event worth reporting)."""
    bad: list[str] = []
    events: dict[str, int] = {}
    lines = path.read_bytes().splitlines()
    for raw in lines:
        try:
            line = json.loads(raw)
            assert isinstance(line, dict)
        except (ValueError, AssertionError):
            bad.append(raw[:200].decode(errors="replace"))
            continue
        event = str(line.get("event"))
        if line.get("level") in ("error", "critical") or event in (
            "bus.connection_failed",
            "bus.disconnect",
            "bus.refused",
        ):
            events[event] = events.get(event, 0) + 1
    return len(lines), bad, events


def fork_worker(spec: WorkerSpec, socket_path: Path, deadline: float) -> tuple[int, int]:
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read)
            tie_to_parent(signal.SIGKILL, parent)()
            run_worker(spec, socket_path, deadline, write)
        except BaseException as exc:  # report, never return into the parent
            os.write(2, f"soak worker {spec.index}: {type(exc).__name__}: {exc}\n".encode())
            code = 1
        os._exit(code)
    os.close(write)
    return pid, read


def read_report(fd: int) -> dict[str, Any]:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    os.close(fd)
    if not chunks:
        return {"cases": 0, "error": "no report"}
    report: dict[str, Any] = json.loads(b"".join(chunks))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--seed", default="", help="replay a run (printed at its start)")
    parser.add_argument("--cases", type=int, default=100_000, help="cases over all workers")
    parser.add_argument("--minutes", type=float, default=7.0, help="fuzzing time limit")
    parser.add_argument("--keep", action="store_true", help="keep the temp folder and log")
    args = parser.parse_args(argv)
    if os.getuid() != 0:
        print("soak: needs root (its workers take other uids)", file=sys.stderr)
        return 2
    seed = args.seed or secrets.token_hex(4)
    print(f"soak: seed {seed} (replay: make soak SEED={seed})", flush=True)
    root = short_dir()
    root.chmod(0o755)  # the other uids reach the state folder (0750, group nogroup)
    daemon = Daemon(
        root,
        'capsules = ["echo"]\n'
        '[socket]\ngroup = "nogroup"\n'
        f'[[principals]]\nname = "alice"\nuids = [{ALICE}]\n',
    )
    started = time.monotonic()
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    rss_start, fds_start = rss(pid), fds(pid)
    deadline = time.monotonic() + args.minutes * 60
    specs = [
        WorkerSpec(i, label, uid, round(args.cases * share) + 1, seed)
        for i, (label, uid, share) in enumerate(WORKERS)
    ]
    print(f"soak: supervisor pid {pid}, {len(specs)} workers, {args.cases} cases", flush=True)
    pipes: dict[int, int] = {}
    statuses: dict[int, int] = {}
    for spec in specs:
        worker, fd = fork_worker(spec, daemon.socket, deadline)
        pipes[worker] = fd
        statuses[worker] = -1
    canary = anyio.run(run_canary, daemon.socket, pid, statuses, deadline)
    reports = [read_report(pipes[w]) for w in pipes]
    for worker, status in statuses.items():
        if status < 0:  # the canary gave up early: wait for the workers' own deadline
            statuses[worker] = os.waitstatus_to_exitcode(os.waitpid(worker, 0)[1])
    fuzz_s = time.monotonic() - started
    crashed = daemon.proc.poll() is not None
    answered, left = (False, -1) if crashed else anyio.run(settle, daemon.socket)
    time.sleep(0.5)
    rss_end, fds_end = (0, 0) if crashed else (rss(pid), fds(pid))
    rss_trimmed = None if crashed else trimmed_rss(pid)
    exit_code = daemon.stop()
    lines, not_json, events = read_log(daemon.log_path)

    cases = sum(int(r.get("cases", 0)) for r in reports)
    lat = sorted(canary.latencies)
    p50 = statistics.median(lat) if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
    handler_errors = events.get("bus.connection_failed", 0)
    error_lines = sum(n for e, n in events.items() if e not in ("bus.disconnect", "bus.refused"))
    checks = {
        "cases sent": cases >= args.cases,
        "supervisor crashes": not crashed and exit_code == 0,
        "hangs": not canary.failures and answered,
        "connection handler errors": handler_errors == 0,
        "log is JSON lines": not not_json,
        "RSS growth": (rss_trimmed if rss_trimmed is not None else rss_end) - rss_start
        <= RSS_GROWTH_LIMIT,
        "fd growth": fds_end - fds_start <= FD_GROWTH_LIMIT,
        "workers exited 0": all(s == 0 for s in statuses.values()),
    }
    per_worker = ", ".join(f"{r.get('label')} {r.get('cases')}" for r in reports)
    rows = [
        ("seed", seed),
        ("wall clock", f"{fuzz_s:.0f} s (fuzzing limit {args.minutes:g} min)"),
        ("cases sent", f"{cases} ({per_worker})"),
        (
            "frames / bytes sent",
            f"{sum(r.get('frames', 0) for r in reports)} / "
            f"{mib(sum(r.get('bytes', 0) for r in reports))}",
        ),
        ("connections opened", str(sum(r.get("connections", 0) for r in reports))),
        ("supervisor crashes", f"{int(crashed)} (exit code at stop: {exit_code})"),
        (
            "hangs (canary round trips failed or > 5 s)",
            f"{len(canary.failures)} of {len(lat) + len(canary.failures)}",
        ),
        (
            "canary p50 / p99 / max",
            f"{p50 * 1000:.1f} / {p99 * 1000:.1f} / "
            f"{(lat[-1] if lat else float('nan')) * 1000:.1f} ms",
        ),
        (
            "supervisor RSS start / peak / end",
            f"{mib(rss_start)} / {mib(max(canary.rss_peak, rss_end))} / {mib(rss_end)}",
        ),
        (
            "RSS at the end after malloc_trim",
            "n/a (no gdb: the end RSS is checked)"
            if rss_trimmed is None
            else f"{mib(rss_trimmed)} (growth {mib(rss_trimmed - rss_start)},"
            f" limit {mib(RSS_GROWTH_LIMIT)})",
        ),
        ("open fds start / end", f"{fds_start} / {fds_end} (limit +{FD_GROWTH_LIMIT})"),
        ("connections left after settling", str(left)),
        ("log lines / not JSON", f"{lines} / {len(not_json)}"),
        ("connection handler errors", str(handler_errors)),
        ("error-level log lines", str(error_lines)),
        ("slow-consumer and other disconnects", str(events.get("bus.disconnect", 0))),
        ("refused hellos", str(events.get("bus.refused", 0))),
        ("send stalls (2 s)", str(sum(r.get("send_stalls", 0) for r in reports))),
    ]
    kinds: dict[str, int] = {}
    for report in reports:
        for kind, count in report.get("kinds", {}).items():
            kinds[kind] = kinds.get(kind, 0) + count
    width = max(len(k) for k, _ in rows)
    print()
    print(f"| {'figure'.ljust(width)} | value")
    print(f"|-{'-' * width}-|------")
    for key, value in rows:
        print(f"| {key.ljust(width)} | {value}")
    print()
    print("cases by kind: " + ", ".join(f"{k} {kinds.get(k, 0)}" for k in GENERATORS))
    failed = [name for name, ok in checks.items() if not ok]
    for failure in canary.failures[:5]:
        print(f"canary: {failure}")
    for line in not_json[:5]:
        print(f"not JSON: {line}")
    if failed:
        for report in reports:
            print(f"worker {report.get('seed')} last cases: {report.get('last')}")
        print(f"soak: FAILED ({', '.join(failed)}); seed {seed}, log {daemon.log_path}")
        return 1
    print(f"soak: passed; seed {seed}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
