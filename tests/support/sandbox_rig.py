"""What the real-bwrap sandbox tests share: the interpreter, small limits, a call in a spare."""

from __future__ import annotations

from sage.forge.sandbox import Limits, SandboxResult, SandboxSpec, run_sandboxed
from sage.forge.spares import SparePool

PY = "/usr/bin/python3"
LIMITS = Limits(
    wall_clock=5.0,
    cpu_seconds=5,
    memory_bytes=512 * 1024 * 1024,
    file_bytes=16 * 1024 * 1024,
    open_files=64,
    max_processes=16,
    output_cap=1024 * 1024,
)


async def in_spare(pool: SparePool, spec: SandboxSpec) -> SandboxResult:
    """Run ``spec`` in a spare of ``pool`` primed for it; fail if the call did not take it."""
    assert await pool.prime(spec), "no spare sandbox could be started"
    taken = pool.taken
    result = await run_sandboxed(spec, pool)
    assert pool.taken == taken + 1, "the call did not run in the spare"
    return result
