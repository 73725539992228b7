"""Inside a spare sandbox: say ready, take one tool over stdin, become it.

This file is not imported by sage: :mod:`sage.forge.spares` mounts its
bytes at ``/forge/spare.py`` in a spare sandbox, where the interpreter runs
it as ``python3 /forge/spare.py`` with nothing but the standard library.

It writes one byte, ``R``, to stdout once the interpreter is up, then
blocks on stdin for the hand-over, read with ``os.read`` so that nothing
past it is buffered::

    8 bytes   big-endian lengths: the environment block, then the tool
    env       NAME=VALUE pairs, each ended by a NUL byte
    tool      the tool's source

Everything after that on stdin is the tool's own input.  The loader sets
the environment, writes the tool to ``/forge/tool.py`` (read-only, and
``/forge`` then read-only too) and runs it as ``python3 /forge/tool.py``
would: ``sys.argv``, ``__main__``, ``__file__``, ``sys.path[0]`` are the
same, and a traceback starts at the tool's frame, not the loader's.  Its
exit status is the tool's.  When stdin ends before the hand-over is
complete, it exits 125 without running anything.
"""

from __future__ import annotations

import builtins
import os
import sys
import types

TOOL_PATH = "/forge/tool.py"
READY = b"R"
INCOMPLETE = 125


def _read_exact(size: int) -> bytes:
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = os.read(0, min(left, 1 << 20))
        if not chunk:
            os._exit(INCOMPLETE)
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _take() -> bytes:
    head = _read_exact(8)
    env_size = int.from_bytes(head[:4], "big")
    tool_size = int.from_bytes(head[4:], "big")
    for item in _read_exact(env_size).split(b"\0"):
        if item:
            name, _, value = item.partition(b"=")
            os.environb[name] = value
    return _read_exact(tool_size)


def _write_tool(source: bytes) -> None:
    fd = os.open(TOOL_PATH, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
    try:
        view = memoryview(source)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.chmod(os.path.dirname(TOOL_PATH), 0o555)


def main() -> None:
    os.write(1, READY)
    source = _take()
    _write_tool(source)
    sys.argv[:] = [TOOL_PATH]
    module = types.ModuleType("__main__")
    module.__file__ = TOOL_PATH
    module.__dict__["__builtins__"] = builtins
    module.__dict__["__cached__"] = None
    sys.modules["__main__"] = module
    try:
        code = compile(source, TOOL_PATH, "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:  # as the interpreter would report it, minus this frame
        tb = exc.__traceback__
        exc = exc.with_traceback(tb.tb_next if tb is not None else None)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)


if __name__ == "__main__":
    main()
