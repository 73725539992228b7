"""Spare sandboxes (sage.forge.spares) with real bwrap: what a tool sees, what it cannot keep.

The escape suite (test_forge_sandbox.py) runs its ``both`` tests in spares
too; this file covers what is particular to them: the loader's parity with
``python3 /forge/tool.py``, one use per spare, which calls take one, and
what happens when a spare is dead, stale or never handed a tool.
"""

from __future__ import annotations

import json
import os
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sage.forge import spares as spares_mod
from sage.forge.mounts import Bind
from sage.forge.sandbox import IMPL_PATH, Limits, SandboxSpec, ensure_sandbox, run_sandboxed
from sage.forge.spares import SparePool, kind_of
from tests.support.sandbox_rig import LIMITS, PY, in_spare

pytestmark = pytest.mark.anyio


def _spec(code: str, stdin: Any = None, **kwargs: Any) -> SandboxSpec:
    return SandboxSpec(
        argv=kwargs.pop("argv", [PY, IMPL_PATH]),
        impl=textwrap.dedent(code).encode(),
        stdin=json.dumps(stdin if stdin is not None else {}).encode(),
        limits=kwargs.pop("limits", LIMITS),
        **kwargs,
    )


@pytest.fixture
async def pool() -> AsyncIterator[SparePool]:
    spares = SparePool(2)
    try:
        yield spares
    finally:
        await spares.aclose()


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process under it, as the host sees them."""
    found, todo = [], [pid]
    while todo:
        here = todo.pop()
        found.append(here)
        try:
            for task in os.listdir(f"/proc/{here}/task"):
                todo += map(int, Path(f"/proc/{here}/task/{task}/children").read_text().split())
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie is dead: it can read and write nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _alive_with(token: str) -> list[int]:
    alive = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if token.encode() in Path(f"/proc/{name}/cmdline").read_bytes():
                    alive.append(int(name))
            except OSError:
                continue
    return alive


PARITY = """
import json, os, sys
here = {
    "argv": sys.argv,
    "file": __file__,
    "name": __name__,
    "path0": sys.path[0],
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
    "source": open(__file__).read().splitlines()[1],
    "input": json.load(sys.stdin),
    "secret": os.environ.get("FORGE_TOKEN"),
    "uid": os.getuid(),
    "loader": type(__loader__).__name__,
}
print(json.dumps(here))
"""


async def test_a_spare_runs_a_tool_as_python3_forge_tool_py_would(pool: SparePool) -> None:
    """Same argv, __file__, __main__, sys.path[0], input and environment as a fresh sandbox."""
    spec = _spec(PARITY, {"n": 5}, env={"FORGE_TOKEN": "tok-123456789"})
    fresh = await run_sandboxed(spec)
    spare = await in_spare(pool, spec)
    assert fresh.exit_code == spare.exit_code == 0, spare.stderr_tail
    assert json.loads(spare.stdout) == json.loads(fresh.stdout)
    assert json.loads(spare.stdout)["secret"] == "tok-123456789"
    assert spare.label == fresh.label == "bwrap"


async def test_errors_and_exit_codes_are_the_tools_own(pool: SparePool) -> None:
    """A traceback starts at the tool's frame; sys.exit(N) and syntax errors exit as usual."""
    crash = await in_spare(pool, _spec("def f():\n    raise ValueError('boom')\nf()\n"))
    text = crash.stderr_tail.decode()
    assert crash.exit_code == 1
    assert 'File "/forge/tool.py", line 2, in f' in text
    assert "ValueError: boom" in text
    assert "spare.py" not in text
    exited = await in_spare(pool, _spec("import sys\nsys.exit(3)\n"))
    assert exited.exit_code == 3
    broken = await in_spare(pool, _spec("def f(:\n"))
    assert broken.exit_code == 1
    assert "SyntaxError" in broken.stderr_tail.decode()
    assert "spare.py" not in broken.stderr_tail.decode()
    interrupted = _spec("raise KeyboardInterrupt\n")
    fresh = await run_sandboxed(interrupted)
    spared = await in_spare(pool, interrupted)
    assert fresh.signal == spared.signal == 2  # SIGINT, as the interpreter ends itself
    future = await in_spare(pool, _spec("def f(x: undefined_name) -> None: pass\nprint('{}')\n"))
    assert future.exit_code == 1  # annotations are evaluated: no __future__ leaks from the loader
    assert "NameError" in future.stderr_tail.decode()


async def test_a_spare_is_used_once_and_forge_is_read_only_after_the_hand_over(
    pool: SparePool,
) -> None:
    """Nothing of one call reaches the next: /tmp, pid namespace, files; /forge is not writable."""
    code = """
    import json, os
    seen = os.path.exists("/tmp/left-behind")
    open("/tmp/left-behind", "w").write("x")
    try:
        open("/forge/extra.py", "w")
        forge = "writable"
    except OSError:
        forge = "read-only"
    try:
        open("/forge/tool.py", "w")
        tool = "writable"
    except OSError:
        tool = "read-only"
    print(json.dumps({"seen": seen, "forge": forge, "tool": tool, "pid": os.getpid()}))
    """
    first = json.loads((await in_spare(pool, _spec(code))).stdout)
    second = json.loads((await in_spare(pool, _spec(code))).stdout)
    assert first["seen"] is second["seen"] is False
    assert first["forge"] == first["tool"] == second["forge"] == "read-only"


async def test_calls_that_need_their_own_sandbox_do_not_take_a_spare(
    pool: SparePool, tmp_path: Path
) -> None:
    """x-bind mounts, bash tools, start-up environment names, big tools: a fresh sandbox."""
    plain = _spec("print('{}')")
    assert kind_of(plain) is not None
    folder = Path("/tmp") / f"spare-bind-{os.getpid()}-{time.monotonic_ns()}"
    folder.mkdir(mode=0o755)
    try:
        cases = [
            _spec("print('{}')", binds=(Bind(folder, "ro"),)),
            _spec("echo '{}'", argv=["/bin/bash", "/forge/tool.sh"], impl_path="/forge/tool.sh"),
            _spec("print('{}')", env={"PYTHONPATH": "/tmp"}),
            _spec("print('{}')", env={"LD_PRELOAD": "/tmp/x.so"}),
            _spec("print('{}')\n" + "#" * spares_mod.MAX_TOOL_BYTES),
        ]
        for spec in cases:
            assert kind_of(spec) is None
            assert not await pool.prime(spec)
            taken = pool.taken
            result = await run_sandboxed(spec, pool)
            assert result.exit_code == 0, result.stderr_tail
            assert pool.taken == taken
    finally:
        folder.rmdir()


async def test_kinds_are_kept_apart_and_the_pool_stays_bounded() -> None:
    """Network and limits are part of the kind; a pool of one replaces its spare."""
    pool = SparePool(1)
    try:
        offline = _spec("import socket, json\nprint(json.dumps({'ok': True}))")
        online = _spec("import socket, json\nprint(json.dumps({'ok': True}))", network=True)
        tighter = _spec("print('{}')", limits=Limits(**{**LIMITS.__dict__, "cpu_seconds": 2}))
        assert len({kind_of(offline), kind_of(online), kind_of(tighter)}) == 3
        for spec in (offline, online, tighter):
            result = await in_spare(pool, spec)
            assert result.exit_code == 0, result.stderr_tail
            assert len(pool) <= 1
        assert (await in_spare(pool, online)).label == "bwrap+net-noloop"
    finally:
        await pool.aclose()


async def test_a_dead_or_stale_spare_is_not_used_and_the_call_still_runs(
    pool: SparePool,
) -> None:
    """Killed while waiting, or older than max_idle: discarded; the call gets a fresh sandbox."""
    spec = _spec("print('{\"ok\": true}')")
    assert await pool.prime(spec)
    kind = kind_of(spec)
    assert kind is not None
    os.killpg(pool._spares[kind].sandbox.child.pid, 9)
    await anyio.sleep(0.1)
    missed = pool.missed
    result = await run_sandboxed(spec, pool)
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {"ok": True}
    assert pool.missed == missed + 1
    pool.max_idle = 0.0
    assert await pool.prime(spec)
    await anyio.sleep(0.05)
    taken = pool.taken
    result = await run_sandboxed(spec, pool)
    assert result.exit_code == 0
    assert pool.taken == taken


async def test_the_wall_clock_starts_at_the_hand_over(pool: SparePool) -> None:
    """A spare that waited longer than the wall clock still gives its tool the whole of it."""
    limits = Limits(**{**LIMITS.__dict__, "wall_clock": 1.0})
    spec = _spec("import time\ntime.sleep(0.3)\nprint('{}')", limits=limits)
    assert await pool.prime(spec)
    await anyio.sleep(1.3)
    taken = pool.taken
    result = await run_sandboxed(spec, pool)
    assert pool.taken == taken + 1
    assert not result.timed_out
    assert result.exit_code == 0, result.stderr_tail


async def test_a_process_flood_in_a_spare_is_contained(pool: SparePool) -> None:
    """RLIMIT_NPROC holds in a spare, the wall clock ends it, and nothing of it survives."""
    token = f"spareflood-{os.getpid()}-{time.monotonic_ns()}"
    limits = Limits(**{**LIMITS.__dict__, "wall_clock": 2.0, "max_processes": 12})
    code = f"""
    import os, time
    made = 0
    while True:
        try:
            pid = os.fork()
        except OSError:
            time.sleep(0.01)
            continue
        if pid == 0:
            os.execv("/bin/sh", ["sh", "-c", "while :; do sleep 1; done # {token}"])
        made += 1
    """
    result = await in_spare(pool, _spec(code, limits=limits))
    assert result.timed_out
    await anyio.sleep(0.1)
    assert _alive_with(token) == []


async def test_aclose_kills_every_spare_and_an_unfed_spare_runs_nothing() -> None:
    """Closing the pool leaves no process; a spare whose input ends early exits 125."""
    pool = SparePool(2)
    spec = _spec("print('{}')")
    assert await pool.prime(spec)
    kind = kind_of(spec)
    assert kind is not None
    child = pool._spares[kind].sandbox.child
    child.close_stdin()  # the hand-over never comes
    status = await child.wait()
    assert status.exit_code == spares_mod.LOADER_INCOMPLETE
    pool._spares.pop(kind).discard()
    assert await pool.prime(_spec("print('{}')", network=True))
    children = [s.sandbox.child for s in pool._spares.values()]
    assert children
    await pool.aclose()
    assert len(pool) == 0
    for spare in children:
        assert spare.status is not None  # killed and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(spare.pid, 0)


FORKS = """
import json, os, time
made = 0
while True:
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(2)
        os._exit(0)
    made += 1
print(json.dumps({"made": made}))
"""


async def test_the_process_limit_is_counted_at_the_hand_over_not_at_the_spare_start(
    pool: SparePool,
) -> None:
    """A spare started while another sandbox held many processes gets no more than max_processes."""
    limits = Limits(**{**LIMITS.__dict__, "max_processes": 12, "wall_clock": 10.0})
    crowd = _spec(
        "import os, time\nfor _ in range(10):\n    if os.fork() == 0:\n        time.sleep(1.5)\n"
        "        os._exit(0)\ntime.sleep(1.5)\nprint('{}')\n",
        limits=limits,
    )
    forks = _spec(FORKS, limits=limits)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_sandboxed, crowd)
        await anyio.sleep(0.5)  # the crowd is up: a limit counted now would include it
        assert await pool.prime(forks)
    result = await in_spare(pool, forks)  # the crowd is gone
    assert json.loads(result.stdout)["made"] <= limits.max_processes, result.stdout


async def test_a_spare_that_dies_before_the_hand_over_leaves_the_call_to_a_fresh_sandbox(
    pool: SparePool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tool never ran in it, so the call runs fresh; it is not the tool's failure."""
    spec = _spec("print('{\"ok\": true}')")
    assert await pool.prime(spec)
    ready = pool._wait_ready

    async def ready_then_dead(spare: Any) -> bool:
        fine = await ready(spare)
        # all of it dies, as when the OOM killer takes it: bwrap's init (its pid
        # namespace with it), then bwrap
        status = os.read(spare.sandbox.status_r, 4096)
        init = json.loads(status.splitlines()[0])["child-pid"]
        inside = _descendants(init)
        os.kill(init, 9)
        os.killpg(spare.sandbox.child.pid, 9)
        with anyio.fail_after(5):
            await spare.sandbox.child.wait()
            # the kernel kills the rest of the pid namespace as its init exits, not at
            # once: a loader still alive would take the hand-over (and the test would race)
            while True:
                if not any(_alive(pid) for pid in inside):
                    break
                await anyio.sleep(0.01)
        return fine

    monkeypatch.setattr(pool, "_wait_ready", ready_then_dead)
    taken, missed = pool.taken, pool.missed
    result = await run_sandboxed(spec, pool)
    assert result.exit_code == 0, result
    assert json.loads(result.stdout) == {"ok": True}
    assert (pool.taken, pool.missed) == (taken, missed + 1)


async def test_a_call_cancelled_while_its_spare_starts_kills_that_spare(pool: SparePool) -> None:
    spec = _spec("print('{}')")
    kind = kind_of(spec)
    assert kind is not None
    pool._refill(kind, await ensure_sandbox(uid=LIMITS.sandbox_uid))  # starting, not ready
    spare = pool._spares[kind]
    with anyio.move_on_after(0.002) as scope:
        await run_sandboxed(spec, pool)
    assert scope.cancelled_caught
    assert not spare.ready
    with anyio.fail_after(5):
        await spare.sandbox.child.wait()  # killed, not left waiting for a hand-over
    assert pool._spares.get(kind) is not spare


async def test_after_aclose_calls_run_fresh_and_start_no_spare() -> None:
    pool = SparePool(2)
    spec = _spec("print('{\"ok\": true}')")
    assert await pool.prime(spec)
    await pool.aclose()
    assert not await pool.prime(spec)
    result = await run_sandboxed(spec, pool)
    assert json.loads(result.stdout) == {"ok": True}
    assert len(pool) == 0
    assert pool.taken == 0
