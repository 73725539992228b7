"""`astrid sage send` on a real pseudo-terminal, for the inline approval tests."""

from __future__ import annotations

import os
import pty
import subprocess

import anyio

from tests.support.daemon import ASTRID
from tests.support.sage_harness import Sage

__all__ = ("Terminal",)


class Terminal:
    """`astrid sage send` with its stdin and stderr on a pseudo-terminal."""

    def __init__(self, sage: Sage, sid: str, text: str) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            [*ASTRID, "sage", "send", sid, text, "--config", str(sage.daemon.config)],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=sage.daemon.env,
        )
        os.close(slave)
        self.screen = b""

    async def expect(self, text: bytes, within: float = 15.0) -> None:
        with anyio.fail_after(within):
            while text not in self.screen:
                try:
                    chunk = await anyio.to_thread.run_sync(os.read, self.master, 4096)
                except OSError:  # EIO: the process closed the terminal
                    chunk = b""
                if not chunk:
                    raise AssertionError(
                        f"{text!r} never came; the terminal showed:\n{self.screen!r}"
                    )
                self.screen += chunk

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\n")

    async def finish(self, within: float = 15.0) -> tuple[int, str]:
        with anyio.fail_after(within):
            code = await anyio.to_thread.run_sync(self.proc.wait)
        assert self.proc.stdout is not None
        with self.proc.stdout:
            out = self.proc.stdout.read().decode()
        os.close(self.master)
        return code, out
