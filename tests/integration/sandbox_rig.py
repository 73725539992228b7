"""What the real-bwrap sandbox tests share: the interpreter and small limits."""

from __future__ import annotations

from sage.forge.sandbox import Limits

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
