"""Forge: a trivial python tool through the forge's call path vs the same code as a bare process.

Measured in one run, interleaved round by round so machine noise hits all
alike (medians and p90 of :data:`ROUNDS` calls each):

- ``bare python``: ``python3 tool.py`` with the input on stdin, as a plain
  subprocess: what the tool costs without any sandbox;
- ``run_sandboxed``: the same through ``sage.forge.sandbox.run_sandboxed``
  alone (bwrap as the sandbox uid, rlimits, memfd args): the sandbox floor;
- ``forge call, spare ready``: :meth:`sage.forge.service.Forge.dispatch` of
  the forged tool, no cache (``meta.deterministic`` false): registry
  lookup, policy snapshot, ACL, forbidden names, breakers, schema
  validation, the sandbox, output parsing, redaction, the run manifest on
  disk and the audit record, with the default spare sandbox
  (sage.forge.spares) ready, as it is for calls spaced more than one
  sandbox start apart.  Its successor's start is left to finish outside
  the timed part (``SparePool.settle``), so it does not slow the next
  measurement;
- ``forge call, fresh sandbox``: the same with ``spare_sandboxes = 0``;
- ``forge call, back to back``: calls with nothing between them, so each
  finds the spare its predecessor started still starting: the figure for a
  steady stream.

The bus hop to the capsule is in none of them (its cost is the ``tools``
benchmark's ``ping``/``greet`` difference, well under 1 ms).

Goal: ``forge call, spare ready`` <= 1.3x ``bare python``.  Then the cache: a
deterministic tool called again with the same input is answered from the
cache without a sandbox (goal < 1 ms, p50 and p99 of 200 hits), and forge
-> callable: ``forge_tool`` (static check, atomic registry write) and the
first successful call of the new tool.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from sage.config import Config, ForgeConfig, PrincipalConfig, SupervisorConfig
from sage.forge.sandbox import Limits, SandboxSpec, run_sandboxed
from sage.forge.service import Caller, Forge, SandboxExecutor
from tests.bench.report import Report

ROUNDS = 30
HITS = 200
TOOL = (
    "import sys, json\n"
    "args = json.loads(sys.stdin.read())\n"
    "print(json.dumps({'ok': True, 'data': {'echo': args['x']}}))\n"
)
SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def _forge_args(name: str, *, deterministic: bool) -> dict[str, Any]:
    return {
        "name": name,
        "description": "Echo x back.",
        "input_schema": SCHEMA,
        "impl": TOOL,
        "runtime": "python",
        "meta": {"deterministic": deterministic},
    }


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _config(root: Path, spares: int) -> Config:
    config = Config(
        supervisor=SupervisorConfig(state_dir=str(root / f"state-{spares}")),
        principals=[PrincipalConfig(name="alice")],
        forge=ForgeConfig(spare_sandboxes=spares),
    )
    # the bench calls one tool far more often than the default breakers allow
    config.forge_dir.mkdir(parents=True)
    (config.forge_dir / "policy.json").write_text(
        json.dumps({"breakers": {"per_tool_rpm": 100_000, "per_session_forge_count": 1000}})
    )
    return config


async def _bench(report: Report, root: Path) -> None:
    config = _config(root, spares=ForgeConfig().spare_sandboxes)
    forge = Forge(config, lambda event, payload: None)
    fresh_forge = Forge(_config(root, spares=0), lambda event, payload: None)
    try:
        await _calls(report, root, config, forge, fresh_forge)
    finally:
        await forge.aclose()
        await fresh_forge.aclose()


async def _calls(
    report: Report, root: Path, config: Config, forge: Forge, fresh_forge: Forge
) -> None:
    caller = Caller("alice", "bench")
    script = root / "tool.py"
    script.write_text(TOOL)
    python = config.forge.python
    limits = Limits.from_config(config.forge)
    stdin = json.dumps({"x": 7}).encode()
    executor = forge.executor
    assert isinstance(executor, SandboxExecutor)
    spares = executor.spares

    async def bare() -> None:
        result = await anyio.run_process([python, str(script)], input=stdin)
        assert json.loads(result.stdout)["data"] == {"echo": 7}

    async def sandboxed() -> None:
        spec = SandboxSpec(
            argv=[python, "/forge/tool.py"], impl=TOOL.encode(), stdin=stdin, limits=limits
        )
        result = await run_sandboxed(spec)
        assert json.loads(result.stdout)["data"] == {"echo": 7}, result

    async def forged() -> None:
        out = await forge.dispatch(caller, "echo_x", {"x": 7})
        assert out.get("ok"), out
        assert out["data"] == {"echo": 7}, out

    async def forged_fresh() -> None:
        out = await fresh_forge.dispatch(caller, "echo_x", {"x": 7})
        assert out.get("ok"), out

    await forge.forge(caller, _forge_args("echo_x", deterministic=False))
    await fresh_forge.forge(caller, _forge_args("echo_x", deterministic=False))
    kinds = {
        "bare python": bare,
        "run_sandboxed": sandboxed,
        "forge call, spare ready": forged,
        "forge call, fresh sandbox": forged_fresh,
    }
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for fn in kinds.values():  # warm-up
        await fn()
    taken = spares.taken
    for _ in range(ROUNDS):
        for name, fn in kinds.items():
            await spares.settle()  # no spare still starting while anything is timed
            t0 = time.perf_counter()
            await fn()
            times[name].append((time.perf_counter() - t0) * 1000)
    assert spares.taken - taken == ROUNDS, "a spare-ready call did not take its spare"
    back_to_back: list[float] = []
    await spares.settle()
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        t1 = time.perf_counter()
        await forged()
        back_to_back.append((time.perf_counter() - t1) * 1000)
    stream = (time.perf_counter() - t0) * 1000 / ROUNDS
    times["forge call, back to back"] = back_to_back
    base = statistics.median(times["bare python"])
    for name in times:
        median = statistics.median(times[name])
        report.add(
            "forge",
            f"{name} median",
            median,
            "ms",
            reference=None if name == "bare python" else base,
            reference_name="bare python",
            goal="<= 1.3x" if name == "forge call, spare ready" else "",
            higher_is_better=False,
        )
        print(f"    {name}: p90 {_p(times[name], 0.9):.2f} ms", flush=True)
    report.add("forge", "back to back, mean per call", stream, "ms", higher_is_better=False)
    floor = statistics.median(times["run_sandboxed"])
    report.add(
        "forge",
        "fresh forge call over run_sandboxed",
        statistics.median(times["forge call, fresh sandbox"]) - floor,
        "ms",
        higher_is_better=False,
    )

    await forge.forge(caller, _forge_args("echo_d", deterministic=True))
    seed = await forge.dispatch(caller, "echo_d", {"x": 7})
    assert seed.get("ok"), seed
    hits: list[float] = []
    for _ in range(HITS):
        t0 = time.perf_counter()
        out = await forge.dispatch(caller, "echo_d", {"x": 7})
        hits.append((time.perf_counter() - t0) * 1000)
        assert out.get("ok"), out
    report.add("forge", "cache hit p50", _p(hits, 0.5), "ms", goal="< 1 ms", higher_is_better=False)
    report.add(
        "forge", "cache hit p99", _p(hits, 0.99), "ms", goal="< 1 ms", higher_is_better=False
    )

    forged_ms: list[float] = []
    callable_ms: list[float] = []
    for i in range(10):
        await spares.settle()
        t0 = time.perf_counter()
        await forge.forge(caller, _forge_args(f"fresh_{i}", deterministic=False))
        t1 = time.perf_counter()
        out = await forge.dispatch(caller, f"fresh_{i}", {"x": i})
        t2 = time.perf_counter()
        assert out.get("ok"), out
        forged_ms.append((t1 - t0) * 1000)
        callable_ms.append((t2 - t0) * 1000)
    report.add(
        "forge",
        "forge_tool (check + write)",
        statistics.median(forged_ms),
        "ms",
        higher_is_better=False,
    )
    report.add(
        "forge",
        "forge -> first call done",
        statistics.median(callable_ms),
        "ms",
        higher_is_better=False,
    )


def run(report: Report) -> None:
    root = Path(tempfile.mkdtemp(prefix="sage-bench-forge-"))
    try:
        anyio.run(_bench, report, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
    sys.exit(0)
