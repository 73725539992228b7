"""Sessions: start-up overhead and turn latency of the supervisor, and its memory per session.

(a) Start-up, with the pinned Claude Code CLI against the Messages API
    stand-in.  Reference: the bare ``claude`` with the very argv and
    environment the runner builds (:func:`capsules.runner.command.build_launch`
    on the supervisor's own config, so the same home too), driven by the e2e
    host (:class:`tests.support.host.Host`): process start to the ``initialize``
    control_response, with the runner's hook matchers.  Ours: a
    ``sage.v1.request.spawn`` over the socket to the session's
    ``sage.v1.event.<sid>.init`` event.  Rounds are interleaved (bare, ours,
    bare, ours ...) so machine noise hits both alike; medians in the table,
    p90 on the console.
(b) A turn: the bare CLI's user line to its ``result`` against a
    ``sage.v1.request.send.<sid>`` to the session's ``done`` event, in the
    same rounds, right after start-up.
(c) Memory: the supervisor's RSS (``VmRSS`` of the supervisor process, not
    its children) before and after 200 idle sessions of the CLI test double
    (tests/support/fake_claude.py) have sent ``init``, spawned in batches;
    KiB per session, and the time the 200 took, against 200 bare doubles
    started the same way (same batches, same argv) to their ``initialize``
    answers by the e2e host in this process.

Every process started here is stopped and every temp folder removed, also
on failure; the double's processes are checked to be gone at the end.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from capsules.runner.command import Launch, build_launch
from capsules.runner.session_life import HOOKS
from sage.claude.protocol import OutgoingState, ResultMessage, encode_initialize, encode_user_turn
from sage.config import load_config
from tests.bench.report import Report, percentile
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.host import Host
from tests.support.procs import alive, marked, rss_kib
from tests.support.sage_harness import Events, Sage, running_sage, sage_config
from tests.support.standin import Standin, Text

ROOT = Path(__file__).resolve().parents[2]
CLAUDE_BIN = ROOT / ".tools/node_modules/@anthropic-ai/claude-code-linux-x64/claude"
FAKE = FAKE_CLAUDE

ROUNDS = 20
IDLE_SESSIONS = 200
BATCH = 20
API_KEY = "sk-bench"
LIMITS = "[limits]\nmax_sessions_per_principal = 1000\ninit_timeout = 60.0\nstop_grace = 2.0\n"


# -- helpers --------------------------------------------------------------------


def _remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    if root.exists():
        print(f"  sessions: WARNING: could not remove {root}", flush=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _leftovers(sage_root: Path) -> list[int]:
    """Children of the supervisor at ``sage_root`` that outlived it (none expected)."""
    socket = sage_root / "state" / "run" / "astrid.sock"
    return marked(f"ASTRID_SOCKET={socket}".encode())


async def _reap_leftovers(sage_root: Path, within: float = 5.0) -> list[int]:
    """Wait for the supervisor's children to be gone; kill and return any that stay."""
    deadline = time.monotonic() + within
    left = _leftovers(sage_root)
    while left and time.monotonic() < deadline:
        await anyio.sleep(0.1)
        left = _leftovers(sage_root)
    for pid in left:
        _kill_group(pid)
    return left


# -- (a) + (b): the real CLI, bare and supervised -------------------------------------


class _Bare:
    """The bare CLI started exactly as the runner would start it for ``alice``."""

    def __init__(self, config_path: Path, binary: Path = CLAUDE_BIN) -> None:
        self.config = load_config(config_path)
        principal = self.config.principal("alice")
        assert principal is not None
        self.principal = principal
        self.binary = binary
        self.n = 0

    def launch(self, sid: str, *, claude_session: str = "", resume: bool = False) -> Launch:
        """The runner's argv and environment (for a fresh conversation, or ``resume`` of
        ``claude_session``); writes the identity file (untimed)."""
        return build_launch(
            self.config,
            self.principal,
            session_id=sid,
            claude_session=claude_session or str(uuid.uuid4()),
            binary=self.binary,
            token="bench-token",
            api_key=None,
            identity=None,
            resume=resume,
        )

    async def round(self, with_turn: bool) -> tuple[float, float, float | None]:
        """(seconds to the process, seconds to initialize answered, seconds for a turn)."""
        self.n += 1
        launch = self.launch(f"bare{self.n}")
        turn_s: float | None = None
        t0 = time.perf_counter()
        proc = await anyio.open_process(
            launch.argv, env=launch.env, cwd=launch.cwd, start_new_session=True
        )
        t_proc = time.perf_counter() - t0
        host = Host(proc)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(host.read_stdout)
                tg.start_soon(host.drain_stderr)
                with anyio.fail_after(60):
                    outcome = await host.request(
                        "initialize", lambda rid: encode_initialize(rid, HOOKS)
                    )
                t_init = time.perf_counter() - t0
                if outcome.state is not OutgoingState.COMPLETED:
                    raise RuntimeError(f"bare claude: initialize failed: {outcome}")
                if with_turn:
                    t1 = time.perf_counter()
                    with anyio.fail_after(60):
                        await host.write(encode_user_turn("hello"))
                        await host.until(ResultMessage)
                    turn_s = time.perf_counter() - t1
                await self.stop(host, proc)
                tg.cancel_scope.cancel()
        finally:
            await _reap(proc, launch)
        return t_proc, t_init, turn_s

    async def stop(self, host: Host, proc: Process) -> None:
        """The runner's stop: close stdin, let it exit, then signal the group."""
        await host.close_stdin()
        with anyio.move_on_after(self.config.limits.stop_grace):
            await proc.wait()
        _kill_group(proc.pid)
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await proc.wait()


async def _reap(proc: Process, launch: Launch) -> None:
    """Whatever happened: the bare CLI's group killed and reaped, its identity file gone."""
    _kill_group(proc.pid)
    with anyio.CancelScope(shield=True):
        await proc.aclose()
    with contextlib.suppress(OSError):
        launch.identity_file.unlink(missing_ok=True)
        launch.identity_file.parent.rmdir()


async def _ours_round(
    sage: Sage, n: int, with_turn: bool
) -> tuple[float, float, float | None, dict[str, float]]:
    """(seconds to the spawn reply, seconds to init, seconds for a turn, offsets of events)."""
    sid = f"ours{n}"
    events: Events = await sage.events(sid)
    seen: dict[str, float] = {}
    reply: dict[str, Any] = {}
    t_reply = 0.0
    turn_s: float | None = None

    async def spawn() -> None:
        nonlocal reply, t_reply
        reply = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "session_id": sid}, within=60
        )
        t_reply = time.perf_counter() - t0

    try:
        async with anyio.create_task_group() as tg:
            t0 = time.perf_counter()
            tg.start_soon(spawn)
            while True:
                name, _ = await events.next(within=60)
                seen.setdefault(name, time.perf_counter() - t0)
                if name == "init":
                    break
                if name in ("exited", "error"):
                    raise RuntimeError(f"session {sid} ended before init: {events.seen}")
        t_init = seen["init"]
        if not reply.get("ok"):
            raise RuntimeError(f"spawn {sid} failed: {reply}")
        if with_turn:
            t1 = time.perf_counter()
            answer = await sage.send(sid, "hello")
            if not answer.get("ok"):
                raise RuntimeError(f"send to {sid} failed: {answer}")
            await events.until("done", within=60)
            turn_s = time.perf_counter() - t1
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            # the stop also keeps the principal's session count down; its failure
            # must not hide the error that brought us here
            await sage.request(f"sage.v1.request.stop.{sid}", {}, within=30)
            await events.subscription.close()
    return t_reply, t_init, turn_s, seen


async def _cli(report: Report) -> None:
    if not CLAUDE_BIN.is_file():
        raise SystemExit(
            f"bench_sessions: Claude Code CLI not found at {CLAUDE_BIN}: run `make setup`"
        )
    standin = Standin(default=Text("ok"))
    await standin.start()
    root = short_dir()
    try:
        env = {"ANTHROPIC_API_KEY": API_KEY, **standin.offline_env()}
        async with running_sage(sage_config(CLAUDE_BIN, env, extra=LIMITS), root=root) as sage:
            bare = _Bare(sage.daemon.config)
            print("  sessions: warming up (one bare, one supervised)", flush=True)
            await bare.round(with_turn=True)  # page cache, the home's first files
            await _ours_round(sage, 0, with_turn=True)
            b_proc: list[float] = []
            b_init: list[float] = []
            b_turn: list[float] = []
            o_reply: list[float] = []
            o_init: list[float] = []
            o_turn: list[float] = []
            o_spawned: list[float] = []
            for i in range(1, ROUNDS + 1):
                tp, ti, tt = await bare.round(with_turn=True)
                b_proc.append(tp)
                b_init.append(ti)
                assert tt is not None
                b_turn.append(tt)
                tr, oi, ot, seen = await _ours_round(sage, i, with_turn=True)
                o_reply.append(tr)
                o_init.append(oi)
                assert ot is not None
                o_turn.append(ot)
                o_spawned.append(seen.get("spawned", float("nan")))
                print(
                    f"  sessions: round {i}/{ROUNDS}: start bare {ti * 1e3:.0f} ms,"
                    f" ours {oi * 1e3:.0f} ms (reply {tr * 1e3:.0f}, spawned event"
                    f" {o_spawned[-1] * 1e3:.0f}); turn bare {tt * 1e3:.0f} ms,"
                    f" ours {ot * 1e3:.0f} ms",
                    flush=True,
                )
    finally:
        await standin.stop()
        left = await _reap_leftovers(root)
        _remove(root)
        if left:
            raise RuntimeError(f"claude processes outlived the supervisor: {left}")

    med = statistics.median
    print(
        f"  sessions: start p90: bare {percentile(b_init, 0.9) * 1e3:.0f} ms,"
        f" ours {percentile(o_init, 0.9) * 1e3:.0f} ms; turn p90: bare"
        f" {percentile(b_turn, 0.9) * 1e3:.0f} ms, ours {percentile(o_turn, 0.9) * 1e3:.0f} ms",
        flush=True,
    )
    print(
        f"  sessions: start medians: bare Popen {med(b_proc) * 1e3:.1f} ms;"
        f" ours spawn reply {med(o_reply) * 1e3:.1f} ms, spawned event"
        f" {med(o_spawned) * 1e3:.1f} ms, init {med(o_init) * 1e3:.1f} ms;"
        f" overhead {(med(o_init) - med(b_init)) * 1e3:+.1f} ms",
        flush=True,
    )
    report.add(
        "sessions",
        f"start to init, real CLI (median of {ROUNDS})",
        med(o_init) * 1e3,
        "ms",
        reference=med(b_init) * 1e3,
        reference_name="bare claude to initialize answer",
        goal="within 5 % (ratio <= 1.05)",
        higher_is_better=False,
    )
    report.add(
        "sessions",
        f"turn send to done, real CLI (median of {ROUNDS})",
        med(o_turn) * 1e3,
        "ms",
        reference=med(b_turn) * 1e3,
        reference_name="bare claude user line to result",
        higher_is_better=False,
    )


# -- (c) memory with idle sessions of the double ----------------------------------------


async def _batch(
    sage: Sage, sids: list[str], inits: set[str], arrived: Callable[[], Awaitable[None]]
) -> list[int]:
    pids: list[int] = []

    async def one(sid: str) -> None:
        reply = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "session_id": sid}, within=60
        )
        if not reply.get("ok"):
            raise RuntimeError(f"spawn {sid} failed: {reply}")
        pids.append(int(reply["pid"]))

    async with anyio.create_task_group() as tg:
        for sid in sids:
            tg.start_soon(one, sid)
    with anyio.fail_after(60):
        while not set(sids) <= inits:
            await arrived()
    return pids


async def _bare_doubles(config_path: Path, n: int, batch: int) -> float:
    """Seconds for ``n`` bare doubles, ``batch`` at a time, to answer ``initialize``.

    They stay up until all ``n`` are (as the supervised ones do), then are stopped.
    """
    bare = _Bare(config_path, binary=FAKE)
    launches = [bare.launch(f"bareidle{i}") for i in range(n)]
    procs: list[Any] = []
    hosts: list[Host] = []
    async with anyio.create_task_group() as tg:

        async def one(launch: Launch) -> None:
            proc = await anyio.open_process(
                launch.argv, env=launch.env, cwd=launch.cwd, start_new_session=True
            )
            procs.append(proc)
            host = Host(proc)
            hosts.append(host)
            tg.start_soon(host.read_stdout)
            tg.start_soon(host.drain_stderr)
            outcome = await host.request("initialize", lambda rid: encode_initialize(rid, HOOKS))
            if outcome.state is not OutgoingState.COMPLETED:
                raise RuntimeError(f"bare double: initialize failed: {outcome}")

        try:
            t0 = time.perf_counter()
            with anyio.fail_after(120):
                for start in range(0, n, batch):
                    async with anyio.create_task_group() as btg:
                        for launch in launches[start : start + batch]:
                            btg.start_soon(one, launch)
            elapsed = time.perf_counter() - t0
        finally:
            with anyio.CancelScope(shield=True):
                for host in hosts:
                    with contextlib.suppress(Exception):
                        await host.close_stdin()
                with anyio.move_on_after(bare.config.limits.stop_grace):
                    for proc in procs:
                        await proc.wait()
                for proc in procs:
                    _kill_group(proc.pid)
                for proc in procs:
                    await proc.aclose()
                for launch in launches:
                    with contextlib.suppress(OSError):
                        launch.identity_file.unlink(missing_ok=True)
                        launch.identity_file.parent.rmdir()
            tg.cancel_scope.cancel()
    return elapsed


async def _memory(report: Report) -> None:
    root = short_dir()
    pids: list[int] = []
    try:
        config = sage_config(
            FAKE, {"FAKE_CLAUDE_MODE": "", "ANTHROPIC_API_KEY": API_KEY}, extra=LIMITS
        )
        async with running_sage(config, root=root) as sage:
            supervisor = sage.daemon.proc
            assert supervisor is not None
            spid = supervisor.pid
            inits: set[str] = set()
            subscription = await sage.client.subscribe("sage.v1.event.*.init")

            async def arrived() -> None:
                envelope = await subscription.get()
                inits.add(envelope.topic.split(".")[3])

            cold = rss_kib(spid)
            # one session first: code paths and lazy imports run once, not per session
            pids += await _batch(sage, ["warm"], inits, arrived)
            await sage.request("sage.v1.request.stop.warm", {}, within=30)
            print(f"  sessions: {IDLE_SESSIONS} bare doubles ({BATCH} at once) ...", flush=True)
            bare_s = await _bare_doubles(sage.daemon.config, IDLE_SESSIONS, BATCH)
            print(f"  sessions: {IDLE_SESSIONS} bare doubles up in {bare_s:.1f} s", flush=True)
            await anyio.sleep(0.5)
            before = rss_kib(spid)
            print(
                f"  sessions: supervisor RSS cold {cold:,} KiB, after a warm-up session"
                f" {before:,} KiB",
                flush=True,
            )
            t0 = time.perf_counter()
            for start in range(0, IDLE_SESSIONS, BATCH):
                sids = [f"idle{i}" for i in range(start, min(start + BATCH, IDLE_SESSIONS))]
                pids += await _batch(sage, sids, inits, arrived)
                if (start // BATCH) % 5 == 4:
                    print(
                        f"  sessions: {len(inits) - 1} idle sessions up,"
                        f" supervisor RSS {rss_kib(spid):,} KiB",
                        flush=True,
                    )
            spawn_s = time.perf_counter() - t0
            await anyio.sleep(1.0)  # let the children's handshakes settle
            after = rss_kib(spid)
            listing = await sage.request("sage.v1.request.sessions", {})
            live = len(listing["sessions"])
            if live != IDLE_SESSIONS:
                raise RuntimeError(f"{live} sessions listed, expected {IDLE_SESSIONS}")
            per = (after - before) / IDLE_SESSIONS
            print(
                f"  sessions: supervisor RSS {before:,} -> {after:,} KiB with"
                f" {IDLE_SESSIONS} sessions ({per:.1f} KiB each, cold-based"
                f" {(after - cold) / IDLE_SESSIONS:.1f}); spawned in {spawn_s:.1f} s",
                flush=True,
            )
            t_stop = time.perf_counter()
        print(
            f"  sessions: supervisor stopped with {IDLE_SESSIONS} sessions in"
            f" {time.perf_counter() - t_stop:.1f} s",
            flush=True,
        )
    finally:
        left = await _reap_leftovers(root)
        left += [pid for pid in pids if alive(pid) and pid not in left]
        for pid in left:
            _kill_group(pid)
        _remove(root)
    if left:
        raise RuntimeError(f"fake_claude processes outlived the supervisor: {sorted(left)}")
    print(f"  sessions: all {len(pids)} fake_claude processes are gone", flush=True)
    report.add(
        "sessions",
        f"supervisor RSS per idle session ({IDLE_SESSIONS}, double)",
        per,
        "KiB/session",
        goal="< 100 KiB per session",
        higher_is_better=False,
    )
    report.add(
        "sessions",
        f"time to spawn {IDLE_SESSIONS} sessions to init ({BATCH} at once)",
        spawn_s,
        "s",
        reference=bare_s,
        reference_name=f"{IDLE_SESSIONS} bare doubles to initialize answer",
        higher_is_better=False,
    )


def run(report: Report) -> None:
    anyio.run(_cli, report)
    anyio.run(_memory, report)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
