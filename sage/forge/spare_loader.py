"""Inside a spare sandbox: say ready, take one tool over stdin, become it.

This file is not imported by sage: :mod:`sage.forge.spares` mounts its
bytes at ``/forge/spare.py`` in a spare sandbox, where the interpreter runs
it as ``python3 /forge/spare.py`` with nothing but the standard library.

It writes one byte, ``R``, to stdout once the interpreter is up, then
blocks on stdin for the hand-over (and writes ``T`` once it holds it, so
the pool knows the tool, not a dead spare, owns what follows), read with ``os.read`` so that nothing
past it is buffered::

    12 bytes  big-endian: length of the environment block, length of the
              tool, RLIMIT_NPROC counted at the hand-over
    env       NAME=VALUE pairs, each ended by a NUL byte
    tool      the tool's source

Everything after that on stdin is the tool's own input.  The loader lowers
RLIMIT_NPROC to the count given (a limit set when the spare started would
count what ran before the call; lowering is always allowed), sets the
environment, writes the tool to ``/forge/tool.py`` (read-only, and
``/forge`` then read-only too) and runs it as ``python3 /forge/tool.py``
would: ``sys.argv``, ``__main__``, ``__file__``, ``sys.path[0]`` are the
same, ``__loader__`` is a ``SourceFileLoader``, a traceback starts at the
tool's frame, not the loader's, and an uncaught KeyboardInterrupt ends the
process by SIGINT.  Its exit status is the tool's.  When stdin ends before the hand-over is
complete, it exits 125 without running anything.
"""

from __future__ import annotations

import builtins
import os
import resource
import signal
import sys
import types
from importlib.machinery import SourceFileLoader

TOOL_PATH = "/forge/tool.py"
READY = b"R"
TAKEN = b"T"
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
    head = _read_exact(12)
    env_size = int.from_bytes(head[0:4], "big")
    tool_size = int.from_bytes(head[4:8], "big")
    nproc = int.from_bytes(head[8:12], "big")
    _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if hard != resource.RLIM_INFINITY:
        nproc = min(nproc, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
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
    os.write(1, TAKEN)
    sys.argv[:] = [TOOL_PATH]
    module = types.ModuleType("__main__")
    module.__file__ = TOOL_PATH
    module.__loader__ = SourceFileLoader("__main__", TOOL_PATH)
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
        if isinstance(exc, KeyboardInterrupt):
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        sys.exit(1)


if __name__ == "__main__":
    main()
