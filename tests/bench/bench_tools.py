"""Tools: the round trip of a tool call, control request in -> control response out.

What is timed is what the Claude Code CLI sees: from writing a
``control_request`` ``mcp_message`` with JSON-RPC ``tools/call`` on its
stdout to reading the matching ``control_response`` on its stdin.  The
supervisor is a separate process, so the clock runs on the CLI's side: the
``[claude] binary`` of a real supervisor (tests/support/sage_harness.py)
is a small stand-in written to the temp folder (:data:`CHILD`, standard
library only).  It answers ``initialize`` as tests/support/fake_claude.py
does and, on a user turn ``run {spec}``, writes the requests itself, one at
a time, each line encoded before the clock starts and decoded after it
stops: ``perf_counter_ns`` right before the ``os.write`` of the request and
right after the ``os.read`` that brought the answer's last byte.  So each
figure holds the whole path inside the supervisor (the runner's decoder and
control channel, its MCP server, the bus to the tool bridge, the bridge's
schema check, policy and audit, the bus to the capsule, the capsule, and
back, the encoder and the stdin writer) plus the two pipe hops.  The request
is written directly: no ``can_use_tool``, no hook callbacks (the CLI asks
those before a ``tools/call``; they are not part of this round trip).

Three kinds of call, in interleaved rounds (ping, greet, greet_w, ping ...)
so machine noise hits all alike, after a warm-up of each:

- ``greet``: the built-in ``greeter`` capsule, in the supervisor's process;
- ``greet_w``: the very same ``greet`` function (``capsules.greeter.greet``)
  served by an out-of-process capsule ``greeter_w``: a ``[worker]`` capsule
  folder in the temp folder running ``python3 -m sage.capsule.worker
  bench_greeter_w:capsule``, a module on the worker's ``PYTHONPATH`` (via
  ``[worker] env``) that wraps ``greet`` in a :class:`sage.capsule.sdk.Capsule` as
  tool ``greet_w`` (tool names are unique across capsules, so it cannot be
  ``greet`` again);
- reference: JSON-RPC ``ping`` on the same ``mcp_message`` path, which the
  runner's MCP server answers itself without the bus, so ``greet`` minus
  ``ping`` is the share of the bus, the bridge and the capsule.

Every answer is checked (``Hello, Ada!``, no ``isError``; ``{}`` for ping).
Around each timed round the stand-in also reads the CPU time of the
supervisor and of the worker (all threads, ``/proc/<pid>/task/*/schedstat``)
and its own, so the console shows CPU microseconds per call of each kind
in each process: where the wall time goes.  Every process started here is
stopped and the temp folder removed, also on failure; processes carrying
this run's marker in their environment (the stand-in, the worker) are
checked to be gone at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import anyio

from tests.bench.report import Report, percentile
from tests.support.daemon import short_dir
from tests.support.procs import marked
from tests.support.sage_harness import Sage, running_sage, sage_config

CALLS = 2000
"""Timed calls of each kind."""
WARMUP = 200
"""Untimed calls of each kind first."""
ROUNDS = 8
"""The timed calls of each kind come in this many interleaved rounds."""
LIMITS = "[limits]\ninit_timeout = 30.0\nstop_grace = 2.0\n"
ARGS = {"name": "Ada"}
EXPECTED = "Hello, Ada!"
KINDS: dict[str, dict[str, Any]] = {
    "ping": {"method": "ping", "params": {}},
    "greet": {"method": "tools/call", "params": {"name": "greet", "arguments": ARGS}},
    "greet_w": {"method": "tools/call", "params": {"name": "greet_w", "arguments": ARGS}},
}

CHILD = r'''
"""A stand-in for claude: answers initialize, times mcp_message round trips on "run"."""

import json
import os
import sys
import time

if "--version" in sys.argv[1:]:
    sys.stdout.write("2.1.328 (Claude Code)\n")
    sys.exit(0)

OUT = os.environ["BENCH_TOOLS_OUT"]
clock = time.perf_counter_ns
buf = bytearray()
last_read = 0


def write(data):
    view = memoryview(data)
    while view:
        view = view[os.write(1, view):]


def dumps(obj):
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def line():
    """The next stdin line and the clock right after the read that completed it."""
    global last_read
    while True:
        i = buf.find(b"\n")
        if i >= 0:
            out = bytes(buf[:i])
            del buf[: i + 1]
            return out, last_read
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(0)
        last_read = clock()
        buf.extend(chunk)


def answer(rid, response=None):
    body = {"subtype": "success", "request_id": rid}
    if response is not None:
        body["response"] = response
    write(dumps({"type": "control_response", "response": body}))


def other(msg, noted):
    """A line that is not the answer we wait for: requests get a success."""
    if msg.get("type") != "control_request":
        return
    rid = msg.get("request_id")
    sub = (msg.get("request") or {}).get("subtype")
    noted.append(sub)
    if sub == "initialize":
        answer(rid, {"commands": [], "models": [], "pid": os.getpid(),
                     "claude_code_version": "2.1.328",
                     "current_permission_mode": "default"})
    elif sub == "interrupt":
        answer(rid, {"still_queued": []})
    elif sub == "mcp_message":
        answer(rid, {"mcp_response": {"jsonrpc": "2.0", "result": {}}})
    else:
        body = {"subtype": "error", "request_id": rid, "error": f"unsupported {sub}"}
        write(dumps({"type": "control_response", "response": body}))


def call(seq, message, noted):
    rid = f"bench{seq}"
    data = dumps({
        "type": "control_request",
        "request_id": rid,
        "request": {
            "subtype": "mcp_message",
            "server_name": "sage",
            "message": {"jsonrpc": "2.0", "id": seq, **message},
        },
    })
    t0 = clock()
    write(data)
    while True:
        raw, t1 = line()
        msg = json.loads(raw)
        if msg.get("type") == "control_response" and (
            (msg.get("response") or {}).get("request_id") == rid
        ):
            return t1 - t0, msg["response"]
        other(msg, noted)


def good(kind, response, expected):
    if response.get("subtype") != "success":
        return False
    result = ((response.get("response") or {}).get("mcp_response") or {}).get("result")
    if kind == "ping":
        return result == {}
    return (
        isinstance(result, dict)
        and not result.get("isError")
        and result.get("content") == [{"type": "text", "text": expected}]
    )


def cpu_ns(pid):
    """CPU nanoseconds of all threads of ``pid`` (schedstat), 0 if unreadable."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError):
                pass
    except OSError:
        pass
    return total


def run(spec):
    kinds = spec["kinds"]
    pids = spec["pids"]
    times = {k: [] for k in kinds}
    cpu = {k: [0] * (len(pids) + 1) for k in kinds}
    bad = {k: 0 for k in kinds}
    example = {}
    noted = []
    seq = 0
    for kind, message in kinds.items():
        for _ in range(spec["warmup"]):
            seq += 1
            _, response = call(seq, message, noted)
            if not good(kind, response, spec["expected"]):
                bad[kind] += 1
                example.setdefault(kind, response)
    per_round = spec["calls"] // spec["rounds"]
    for _ in range(spec["rounds"]):
        for kind, message in kinds.items():
            before = [cpu_ns(pid) for pid in pids] + [time.process_time_ns()]
            for _ in range(per_round):
                seq += 1
                ns, response = call(seq, message, noted)
                times[kind].append(ns)
                if not good(kind, response, spec["expected"]):
                    bad[kind] += 1
                    example.setdefault(kind, response)
            after = [cpu_ns(pid) for pid in pids] + [time.process_time_ns()]
            cpu[kind] = [c + a - b for c, a, b in zip(cpu[kind], after, before)]
    result = {"times": times, "cpu": cpu, "bad": bad, "example": example, "noted": noted}
    with open(OUT, "w") as f:  # made writable for us: the folder is not ours
        json.dump(result, f)


def main():
    noted = []
    while True:
        raw, _ = line()
        try:
            msg = json.loads(raw)
        except ValueError:
            continue
        if msg.get("type") != "user":
            other(msg, noted)
            continue
        text = (msg.get("message") or {}).get("content")
        if isinstance(text, str) and text.startswith("run "):
            run(json.loads(text[4:]))
        write(dumps({
            "type": "result", "subtype": "success", "is_error": False,
            "session_id": "bench", "num_turns": 1, "duration_ms": 0,
            "total_cost_usd": 0.0, "result": "bench done",
        }))


main()
'''

WORKER_MODULE = '''
"""greeter_w: the greeter's own greet function, served out of process as tool greet_w."""

from capsules.greeter import greet
from sage.capsule.sdk import Capsule, Tool

capsule = Capsule([Tool.of("greet_w", greet)])
'''


# -- helpers --------------------------------------------------------------------


async def _reap(marker: bytes, within: float = 5.0) -> list[int]:
    """Wait for the marked processes to be gone; kill and return any that stay."""
    deadline = time.monotonic() + within
    left = marked(marker)
    while left and time.monotonic() < deadline:
        await anyio.sleep(0.1)
        left = marked(marker)
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return left


def _write_files(root: Path, marker: str) -> tuple[Path, Path, Path]:
    """(the stand-in, the worker capsule's folder, the results file)."""
    # a root supervisor runs the child as the principal's own uid: it must be able to
    # run the script (the system's python3, not a venv under /root) and write its results
    child = root / "bench_claude.py"
    child.write_text(f"#!/usr/bin/env python3\n{CHILD}")
    child.chmod(0o755)
    out = root / "bench_tools_out.json"
    out.write_bytes(b"")
    out.chmod(0o666)
    code = root / "wcode"
    code.mkdir()
    (code / "bench_greeter_w.py").write_text(WORKER_MODULE)
    folder = root / "greeter_w"
    folder.mkdir()
    env = {"PYTHONPATH": str(code), "BENCH_TOOLS_MARK": marker}
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    (folder / "Capsule.toml").write_text(
        '[package]\nname = "greeter_w"\nversion = "0.1.0"\n'
        'description = "The greeter\'s greet as tool greet_w, out of process (bench)."\n'
        "[publish]\npatterns = [\n"
        '  "tool.v1.response.describe.greeter_w",\n'
        '  "tool.v1.execute.greet_w.result",\n]\n'
        "[subscribe]\npatterns = [\n"
        '  "tool.v1.request.describe",\n'
        '  "tool.v1.execute.greet_w",\n]\n'
        "[worker]\n"
        'command = ["python3", "-m", "sage.capsule.worker", "bench_greeter_w:capsule"]\n'
        f"env = {{ {env_toml} }}\n"
    )
    return child, folder, out


async def _catalogue(sage: Sage, wanted: dict[str, str], within: float = 20.0) -> None:
    """Wait until the bridge offers each tool of ``wanted`` from its capsule."""
    with anyio.fail_after(within):
        while True:
            reply = await sage.request("sage.v1.request.tools", {})
            offered = {t["name"]: t["capsule"] for t in reply.get("tools", [])}
            if all(offered.get(name) == capsule for name, capsule in wanted.items()):
                return
            await anyio.sleep(0.05)


async def _worker_pid(sage: Sage, name: str) -> int:
    code, out, err = await sage.astrid("status", "--json")
    if code != 0:
        raise RuntimeError(f"astrid status failed: {err}")
    (found,) = [c for c in json.loads(out)["capsules"] if c["name"] == name]
    if found.get("state") != "running" or not found.get("pid"):
        raise RuntimeError(f"capsule {name} is not a running worker: {found}")
    return int(found["pid"])


# -- the benchmark ------------------------------------------------------------------


async def _measure() -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """By kind: the round trips in ms; CPU µs per call of (supervisor, worker, stand-in)."""
    root = short_dir()
    marker = f"bench-tools-{uuid.uuid4().hex}"
    try:
        child, folder, out = _write_files(root, marker)
        env = {
            "ANTHROPIC_API_KEY": "sk-bench",  # the principal's auth_mode is api_key
            "BENCH_TOOLS_OUT": str(out),
            "BENCH_TOOLS_MARK": marker,
        }
        capsules = json.dumps(["runner", "tools", "greeter", str(folder)])
        config = sage_config(child, env, capsules=capsules, extra=LIMITS)
        async with running_sage(config, root=root) as sage:
            await _catalogue(
                sage, {"mcp__sage__greet": "greeter", "mcp__sage__greet_w": "greeter_w"}
            )
            supervisor = sage.daemon.proc
            assert supervisor is not None
            worker = await _worker_pid(sage, "greeter_w")
            print(
                f"  tools: supervisor pid {supervisor.pid}, greeter_w worker pid {worker}",
                flush=True,
            )
            try:
                events = await sage.ready("bench")
            except TimeoutError:
                raise RuntimeError(f"no init; log:\n{sage.daemon.log()[-3000:]}") from None
            spec = {
                "kinds": KINDS,
                "calls": CALLS,
                "warmup": WARMUP,
                "rounds": ROUNDS,
                "expected": EXPECTED,
                "pids": [supervisor.pid, worker],
            }
            print(
                f"  tools: {WARMUP} warm-up + {CALLS} timed calls each of"
                f" {', '.join(KINDS)} ({ROUNDS} interleaved rounds) ...",
                flush=True,
            )
            t0 = time.perf_counter()
            reply = await sage.send("bench", "run " + json.dumps(spec))
            if not reply.get("ok"):
                raise RuntimeError(f"send failed: {reply}")
            await events.until("done", within=120)
            wall = time.perf_counter() - t0
            data = json.loads(out.read_text())
            await sage.request("sage.v1.request.stop.bench", {}, within=30)
    finally:
        left = await _reap(marker.encode())
        shutil.rmtree(root, ignore_errors=True)
        if root.exists():
            print(f"  tools: WARNING: could not remove {root}", flush=True)
    if left:
        raise RuntimeError(f"processes outlived the supervisor: {left}")
    print("  tools: the supervisor, the stand-in and the worker are gone", flush=True)
    bad = {k: n for k, n in data["bad"].items() if n}
    if bad:
        raise RuntimeError(f"wrong answers {bad}; first of each: {data['example']}")
    if data["noted"]:
        print(f"  tools: other control requests during the run: {data['noted']}", flush=True)
    calls = (CALLS + WARMUP) * len(KINDS)
    print(f"  tools: {calls} calls in {wall:.1f} s", flush=True)
    timed = CALLS // ROUNDS * ROUNDS
    # CPU in microseconds per timed call: (supervisor, worker, stand-in)
    cpu = {k: [ns / timed / 1e3 for ns in v] for k, v in data["cpu"].items()}
    times = {k: [ns / 1e6 for ns in v] for k, v in data["times"].items()}
    return times, cpu


async def _tools(report: Report) -> None:
    times, cpu = await _measure()
    for kind, ms in times.items():
        print(
            f"  tools: {kind:<8} n={len(ms)} min {min(ms):.3f} p50 {percentile(ms, 0.5):.3f}"
            f" p90 {percentile(ms, 0.9):.3f} p99 {percentile(ms, 0.99):.3f} max {max(ms):.3f} ms",
            flush=True,
        )
    ping, greet, greet_w = times["ping"], times["greet"], times["greet_w"]
    p50 = {k: percentile(v, 0.5) for k, v in times.items()}
    print(
        f"  tools: p50 share of bus + bridge + capsule: in-process"
        f" {p50['greet'] - p50['ping']:.3f} ms, out-of-process"
        f" {p50['greet_w'] - p50['ping']:.3f} ms (worker hop"
        f" {p50['greet_w'] - p50['greet']:.3f} ms)",
        flush=True,
    )
    for kind, (sup, wrk, own) in cpu.items():
        print(
            f"  tools: {kind:<8} CPU per call: supervisor {sup:.0f} us, worker {wrk:.0f} us,"
            f" stand-in {own:.0f} us",
            flush=True,
        )
    ref = "mcp ping (runner answers, no bus)"
    for label, values, goal in (
        ("in-process greeter", greet, "< 1 ms p50"),
        ("worker greeter_w", greet_w, "< 3 ms p50"),
    ):
        report.add(
            "tools",
            f"tools/call round trip p50, {label}",
            percentile(values, 0.5),
            "ms",
            reference=percentile(ping, 0.5),
            reference_name=ref,
            goal=goal,
            higher_is_better=False,
        )
        report.add(
            "tools",
            f"tools/call round trip p99, {label}",
            percentile(values, 0.99),
            "ms",
            reference=percentile(ping, 0.99),
            reference_name=ref,
            higher_is_better=False,
        )


def run(report: Report) -> None:
    anyio.run(_tools, report)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
