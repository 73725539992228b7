"""sage beside its peers: the Claude Agent SDK and the bare CLI, on the same binary.

What a program that drives Claude Code would otherwise pick is the Claude
Agent SDK; what none can beat is the CLI alone.  All three run the pinned
Claude Code binary against the same Messages API stand-in, in one run:

- **SDK**: ``ClaudeSDKClient`` (``cli_path`` the same binary), an in-process MCP
  server ``sage`` with the tool ``greet``, pre-allowed (tests/bench/peers.py).
- **bare**: ``claude -p`` in stream-json with no hook, no MCP server, no
  settings, driven by the e2e host: no tool rows.
- **sage**: a supervisor (runner, tools, greeter, installer, hooks) with alice
  installed headless and ``mcp__sage__greet`` pre-allowed, driven by its bus
  client, and for the warm turn also by ``astrid sage send``.  A second
  supervisor with ``[sessions] spares = 1`` gives the cold start with a spare.

Rounds (``ROUNDS``, at least 15; ``SAGE_BENCH_PEER_ROUNDS`` changes it) take
each measure of each contender once, the contenders' order turning each
round so drift hits all alike; p50 in the table, p90 on the console:

- cold: from nothing to the first text of "hi" (sage: the spawn request, the
  send queued behind ``initialize``; SDK: ``connect``, ``query``; bare: process
  start, ``initialize``, the user line);
- warm turn "hi" on a session up since the start: first text, end of turn;
- tool call: the stand-in's own clock, from the end of its ``tool_use``
  answer to the request that carries the ``tool_result`` (the CLI's hooks,
  permission, the MCP round trip through whoever serves the tool);
- whole tool turn: "greet Ada" to the end of the turn.

Then, for each contender in its own process (tests/bench/peer_driver.py, so
the memory is its own), ``SESSIONS`` sessions at once, ``TURNS`` turns each
(``CONCURRENCY_ROUNDS`` runs each, alternating): the wall time, and the peak
RSS and PSS summed over every process (the driver, its ``claude`` children;
for sage also the supervisor and its children), sampled every 100 ms.  Last,
the controller's RSS with one idle session: sage's supervisor process against
the SDK's Python process.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import msgspec

from tests.bench.peers import (
    GREET,
    TOOL_PROMPT,
    BareSession,
    SageSession,
    SdkSession,
    Timing,
    responder,
    tree_memory,
)
from tests.bench.report import Report, percentile
from tests.support.daemon import short_dir
from tests.support.procs import rss_kib
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.spares import ready_spares
from tests.support.standin import Standin, ToolUse

ROOT = Path(__file__).resolve().parents[2]
CLAUDE_BIN = ROOT / ".tools/node_modules/@anthropic-ai/claude-code-linux-x64/claude"
ROUNDS = int(os.environ.get("SAGE_BENCH_PEER_ROUNDS", "15"))  # fewer: a quick look only
SESSIONS = 20
TURNS = 3
CONCURRENCY_ROUNDS = int(os.environ.get("SAGE_BENCH_PEER_CONCURRENCY", "3"))
ASTRID = Path(sys.executable).parent / "astrid"
LIMITS = "[limits]\nmax_sessions_per_principal = 1000\ninit_timeout = 60.0\nstop_grace = 2.0\n"


def _config(url_env: dict[str, str], spares: int) -> str:
    return sage_config(
        CLAUDE_BIN,
        {"ANTHROPIC_API_KEY": "sk-bench-peer", **url_env},
        capsules='["runner", "tools", "greeter", "installer", "hooks"]',
        extra=LIMITS + f"[sessions]\nspares = {spares}\nspare_max_age = 3600.0\n",
        principal_extra=f'allowed_tools = ["{GREET}"]\n',
    )


async def _installed(sage: Sage) -> None:
    """alice installed headless, the greeter's tool in the catalogue."""
    reply = await sage.request("sage.v1.request.install", {"principal_id": "alice"})
    if not reply.get("ok"):
        raise RuntimeError(f"install failed: {reply}")
    with anyio.fail_after(30):
        while not (await sage.request("sage.v1.request.tools", {}))["tools"]:  # noqa: ASYNC110
            await anyio.sleep(0.05)


class Samples:
    """Seconds per measure, in rounds."""

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {}

    def add(self, name: str, seconds: float) -> None:
        self.values.setdefault(name, []).append(seconds)

    def p50(self, name: str) -> float:
        return statistics.median(self.values[name]) * 1e3

    def p90(self, name: str) -> float:
        return percentile(self.values[name], 0.9) * 1e3


def _tool_call(standin: Standin, since: int) -> float:
    """Seconds from the end of the stand-in's tool_use answer (a request after the
    ``since``-th) to the arrival of the request that carries its result."""
    messages = standin.messages[since:]
    for asked, answered in itertools.pairwise(messages):
        if isinstance(asked.reply, ToolUse) and answered.tool_results():
            return answered.received - asked.answered
    raise RuntimeError(f"no tool call among {len(messages)} requests")


async def _astrid_send(config: Path, sid: str) -> Timing:
    """``astrid sage send SID hi``: its first output (the text) and its exit."""
    t0 = time.perf_counter()
    first = 0.0
    async with await anyio.open_process(
        [str(ASTRID), "sage", "send", sid, "hi", "--config", str(config)]
    ) as proc:
        assert proc.stdout is not None
        async for chunk in proc.stdout:
            if chunk and not first:
                first = time.perf_counter() - t0
        code = await proc.wait()
    if code != 0:
        raise RuntimeError(f"astrid sage send exited {code}")
    return Timing(first, time.perf_counter() - t0)


class Rounds:
    """The latency rounds: every contender's sessions and what they measure."""

    def __init__(self, standin: Standin, a: Sage, b: Sage, homes: Path) -> None:
        self.standin = standin
        self.a = a
        self.b = b
        self.homes = homes
        self.samples = Samples()
        self.n = 0
        self.warm: dict[str, Any] = {}

    def home(self, kind: str) -> Path:
        self.n += 1
        path = self.homes / f"{kind}{self.n}"
        path.mkdir(parents=True)
        return path

    @contextlib.asynccontextmanager
    async def warm_sessions(self) -> AsyncIterator[None]:
        url = self.standin.url
        async with contextlib.AsyncExitStack() as stack:
            self.warm["sage"] = await stack.enter_async_context(
                SageSession.open(self.a.client, "warm")
            )
            self.warm["sdk"] = await stack.enter_async_context(
                SdkSession.open(CLAUDE_BIN, url, self.home("sdk"))
            )
            self.warm["bare"] = await stack.enter_async_context(
                BareSession.open(CLAUDE_BIN, url, self.home("bare"))
            )
            yield

    # -- one measure each ---------------------------------------------------------

    async def cold_sage(self) -> None:
        t0 = time.perf_counter()
        async with SageSession.open(self.a.client, f"cold{self.n}", wait_init=False) as s:
            self.n += 1
            self.samples.add("cold sage", (await s.turn("hi", t0)).first)

    async def cold_sage_spare(self) -> None:
        await ready_spares(self.b, within=60)  # untimed: the spare of this round is up
        await anyio.sleep(0.2)
        t0 = time.perf_counter()
        async with SageSession.open(self.b.client, None) as s:
            self.samples.add("cold sage spare", (await s.turn("hi", t0)).first)

    async def cold_sdk(self) -> None:
        home = self.home("sdk")
        t0 = time.perf_counter()
        async with SdkSession.open(CLAUDE_BIN, self.standin.url, home) as s:
            self.samples.add("cold sdk", (await s.turn("hi", t0)).first)

    async def cold_bare(self) -> None:
        home = self.home("bare")
        t0 = time.perf_counter()
        async with BareSession.open(CLAUDE_BIN, self.standin.url, home) as s:
            self.samples.add("cold bare", (await s.turn("hi", t0)).first)

    async def warm_turn(self, kind: str) -> None:
        timing = await self.warm[kind].turn("hi")
        self.samples.add(f"warm first {kind}", timing.first)
        self.samples.add(f"warm end {kind}", timing.end)

    async def warm_astrid(self) -> None:
        timing = await _astrid_send(self.a.daemon.config, "warm")
        self.samples.add("warm first astrid", timing.first)
        self.samples.add("warm end astrid", timing.end)

    async def tool_turn(self, kind: str) -> None:
        since = len(self.standin.messages)
        timing = await self.warm[kind].turn(TOOL_PROMPT)
        self.samples.add(f"tool call {kind}", _tool_call(self.standin, since))
        self.samples.add(f"tool turn {kind}", timing.end)

    def measures(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        return [
            self.cold_sage,
            self.cold_sage_spare,
            self.cold_sdk,
            self.cold_bare,
            lambda: self.warm_turn("sage"),
            self.warm_astrid,
            lambda: self.warm_turn("sdk"),
            lambda: self.warm_turn("bare"),
            lambda: self.tool_turn("sage"),
            lambda: self.tool_turn("sdk"),
        ]

    async def run(self, rounds: int, *, warm_up: bool = False) -> None:
        measures = self.measures()
        for i in range(rounds):
            k = i % len(measures)
            for measure in measures[k:] + measures[:k]:  # the order turns each round
                await measure()
            if not warm_up:
                s = self.samples
                print(
                    f"  peer: round {i + 1}/{rounds}: cold sage {s.values['cold sage'][-1] * 1e3:.0f}"
                    f" / spare {s.values['cold sage spare'][-1] * 1e3:.0f}"
                    f" sdk {s.values['cold sdk'][-1] * 1e3:.0f}"
                    f" bare {s.values['cold bare'][-1] * 1e3:.0f} ms;"
                    f" warm end sage {s.values['warm end sage'][-1] * 1e3:.0f}"
                    f" astrid {s.values['warm end astrid'][-1] * 1e3:.0f}"
                    f" sdk {s.values['warm end sdk'][-1] * 1e3:.0f}"
                    f" bare {s.values['warm end bare'][-1] * 1e3:.0f} ms;"
                    f" tool call sage {s.values['tool call sage'][-1] * 1e3:.0f}"
                    f" sdk {s.values['tool call sdk'][-1] * 1e3:.0f} ms",
                    flush=True,
                )
        if warm_up:
            self.samples = Samples()


# -- many sessions at once, each contender in its own process ------------------------------


def _driver(kind: str, url: str, home: Path, socket: Path | None, *extra: str) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "tests.bench.peer_driver",
        kind,
        "--binary",
        str(CLAUDE_BIN),
        "--url",
        url,
        "--home",
        str(home),
        "--sessions",
        str(SESSIONS),
        "--turns",
        str(TURNS),
        *extra,
    ]
    if socket is not None:
        argv += ["--socket", str(socket)]
    return argv


async def _concurrent(
    kind: str, url: str, home: Path, supervisor: Sage | None
) -> tuple[float, int, int]:
    """(wall seconds, peak RSS KiB, peak PSS KiB) of ``SESSIONS`` x ``TURNS`` of ``kind``."""
    socket = supervisor.daemon.socket if supervisor is not None else None
    peak = [0, 0]
    stop = threading.Event()
    async with await anyio.open_process(
        _driver(kind, url, home, socket), cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    ) as proc:
        roots = [proc.pid]
        if supervisor is not None:
            assert supervisor.daemon.proc is not None
            roots.append(supervisor.daemon.proc.pid)

        def sample() -> None:
            while not stop.wait(0.1):
                rss, pss = tree_memory(roots)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            assert proc.stdout is not None
            out = b"".join([chunk async for chunk in proc.stdout])
            code = await proc.wait()
        finally:
            stop.set()
            sampler.join()
    if code != 0:
        raise RuntimeError(f"the {kind} driver exited {code}")
    result = msgspec.json.decode(out.splitlines()[-1])
    if result["turns"] != SESSIONS * TURNS:
        raise RuntimeError(f"the {kind} driver took {result['turns']} turns")
    return float(result["wall"]), peak[0], peak[1]


async def _sdk_idle_rss(url: str, home: Path) -> int:
    """The SDK's Python process with one session up, after one turn: its VmRSS."""
    async with await anyio.open_process(
        _driver("sdk", url, home, None, "--idle"),
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdin is not None
        line = b""
        async for chunk in proc.stdout:
            line += chunk
            if line.endswith(b"\n"):
                break
        await proc.stdin.aclose()
        await proc.wait()
    return int(msgspec.json.decode(line)["rss_kib"])


# -- the run ---------------------------------------------------------------------------------


async def _bench(report: Report) -> None:
    if not CLAUDE_BIN.is_file():
        raise SystemExit(f"bench_peer: Claude Code CLI not found at {CLAUDE_BIN}: run `make setup`")
    standin = Standin(responder=responder)
    await standin.start()
    homes = short_dir()
    homes.mkdir(parents=True, exist_ok=True)
    roots = (short_dir(), short_dir())
    concurrency: dict[str, list[tuple[float, int, int]]] = {}
    try:
        env = standin.offline_env()
        async with running_sage(_config(env, 0), root=roots[0]) as a:
            await _installed(a)
            async with running_sage(_config(env, 1), root=roots[1]) as b:
                await _installed(b)
                rounds = Rounds(standin, a, b, homes)
                async with rounds.warm_sessions():
                    print("  peer: warming up (one round)", flush=True)
                    await rounds.run(1, warm_up=True)
                    assert a.daemon.proc is not None
                    supervisor_rss = rss_kib(a.daemon.proc.pid)
                    await rounds.run(ROUNDS)
            # the spares' supervisor is gone: nothing else runs while sessions pile up
            sdk_rss = await _sdk_idle_rss(standin.url, homes / "idle")
            for i in range(CONCURRENCY_ROUNDS):
                for kind in ("bare", "sdk", "sage"):
                    home = homes / f"many-{kind}-{i}"
                    got = await _concurrent(kind, standin.url, home, a if kind == "sage" else None)
                    concurrency.setdefault(kind, []).append(got)
                    print(
                        f"  peer: {SESSIONS} x {TURNS} {kind}: {got[0]:.1f} s,"
                        f" peak RSS {got[1] / 1024:,.0f} MiB, PSS {got[2] / 1024:,.0f} MiB",
                        flush=True,
                    )
    finally:
        await standin.stop()
        for path in (homes, *roots):
            shutil.rmtree(path, ignore_errors=True)
    _report(report, rounds.samples, concurrency, supervisor_rss, sdk_rss)


def _report(
    report: Report,
    s: Samples,
    concurrency: dict[str, list[tuple[float, int, int]]],
    supervisor_rss: int,
    sdk_rss: int,
) -> None:
    print(
        "  peer: p90 "
        + ", ".join(f"{name} {s.p90(name):.0f}" for name in sorted(s.values))
        + " ms",
        flush=True,
    )
    lines = [
        (
            "warm turn: first text",
            "warm first sage",
            "warm first sdk",
            "warm first bare",
            "<= 1.2x",
        ),
        ("warm turn: end of turn", "warm end sage", "warm end sdk", "warm end bare", "<= 1.2x"),
        ("warm turn via astrid: first text", "warm first astrid", "warm first sdk", "", ""),
        ("warm turn via astrid: end of turn", "warm end astrid", "warm end sdk", "", ""),
        ("tool call, tool_use to tool_result", "tool call sage", "tool call sdk", "", "<= 1.2x"),
        ("whole tool turn", "tool turn sage", "tool turn sdk", "", ""),
        ("cold: start to first text, no spare", "cold sage", "cold sdk", "cold bare", "<= 1.1x"),
        ("cold: start to first text, a spare", "cold sage spare", "cold sdk", "", "<= 0.7x"),
    ]
    table = [
        "| workload | sage | Agent SDK | bare `claude -p` | sage / SDK | goal |",
        "|---|---|---|---|---|---|",
    ]
    for title, ours, sdk, bare, goal in lines:
        report.add(
            "peer",
            f"{title} (p50 of {ROUNDS})",
            s.p50(ours),
            "ms",
            reference=s.p50(sdk),
            reference_name="Agent SDK",
            goal=goal,
            higher_is_better=False,
        )
        bare_ms = f"{s.p50(bare):.0f} ms" if bare else "-"
        table.append(
            f"| {title} | {s.p50(ours):.0f} ms | {s.p50(sdk):.0f} ms | {bare_ms}"
            f" | {s.p50(ours) / s.p50(sdk):.2f}x | {goal} |"
        )
    med = {
        kind: [statistics.median(run[i] for run in runs) for i in range(3)]
        for kind, runs in concurrency.items()
    }
    for i, (title, unit, scale, goal) in enumerate(
        (
            (f"{SESSIONS} sessions x {TURNS} turns at once: wall", "s", 1.0, "<= 1.05x"),
            ("same: peak RSS of all processes", "MiB", 1 / 1024, ""),
            ("same: peak PSS of all processes", "MiB", 1 / 1024, ""),
        )
    ):
        ours_v, sdk_v, bare_v = (med[k][i] * scale for k in ("sage", "sdk", "bare"))
        report.add(
            "peer",
            f"{title} (p50 of {CONCURRENCY_ROUNDS})",
            ours_v,
            unit,
            reference=sdk_v,
            reference_name="Agent SDK",
            goal=goal,
            higher_is_better=False,
        )
        fmt = "{:.1f} s" if unit == "s" else "{:,.0f} MiB"
        table.append(
            f"| {title} | {fmt.format(ours_v)} | {fmt.format(sdk_v)} | {fmt.format(bare_v)}"
            f" | {ours_v / sdk_v:.2f}x | {goal} |"
        )
    report.add(
        "peer",
        "controller RSS, one idle session",
        supervisor_rss / 1024,
        "MiB",
        reference=sdk_rss / 1024,
        reference_name="the SDK's Python process",
        goal="<= 1.2x",
        higher_is_better=False,
    )
    table.append(
        f"| controller RSS, one idle session | {supervisor_rss / 1024:.0f} MiB"
        f" | {sdk_rss / 1024:.0f} MiB | - | {supervisor_rss / sdk_rss:.2f}x | <= 1.2x |"
    )
    print("\n".join(table), flush=True)


def run(report: Report) -> None:
    anyio.run(_bench, report)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
