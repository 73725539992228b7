"""`astrid` on a real pseudo-terminal: `sage send`'s inline approvals, and any command
whose behaviour depends on a terminal (a hidden prompt, a question)."""

from __future__ import annotations

import os
import pty
import subprocess

import anyio

from tests.support.daemon import ASTRID
from tests.support.sage_harness import Sage

__all__ = ("Terminal",)


class Terminal:
    """`astrid sage send SID TEXT` (or ``astrid *command``) with its stdin and stderr on a
    pseudo-terminal."""

    def __init__(self, sage: Sage, sid: str, text: str, *, command: tuple[str, ...] = ()) -> None:
        self.master, slave = pty.openpty()
        argv = command or ("sage", "send", sid, text)
        self.proc = subprocess.Popen(
            [*ASTRID, *argv, "--config", str(sage.daemon.config)],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=slave,
            env=sage.daemon.env,
        )
        os.close(slave)
        self.screen = b""

    @classmethod
    def astrid(cls, sage: Sage, *command: str) -> Terminal:
        """Any ``astrid`` command on the terminal."""
        return cls(sage, "", "", command=command)

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
        while True:  # what it wrote to the terminal last (EIO once it is all read)
            try:
                chunk = os.read(self.master, 4096)
            except OSError:
                break
            if not chunk:
                break
            self.screen += chunk
        os.close(self.master)
        return code, out
