"""``astrid sage repl`` with the real CLI on a pseudo-terminal: it starts as its principal's
own user, with nothing to answer (onboarding, trusting the folder, using the API key: the
installer and the REPL answered them in the home's Claude Code config), and writes nothing
into the repository above the home (the checkout a state folder may sit in)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import ASTRID, short_dir
from tests.support.sage_harness import running_sage, sage_config
from tests.support.standin import Standin, Text

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="alice's own user is another uid (nobody)"),
]

KEY = "sk-ant-api03-" + "k" * 80 + "AAAAQ"
_ESCAPES = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]")


class Screen:
    """A process on a pseudo-terminal of 120x40; what it showed, escapes taken out."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env)
        os.close(slave)
        self.raw = b""

    @property
    def text(self) -> str:
        """What it showed, without escapes or blanks (the CLI moves the cursor instead of
        writing spaces, so words run together)."""
        return re.sub(r"\s+", "", _ESCAPES.sub(b"", self.raw).decode(errors="replace"))

    async def expect(self, pattern: str, within: float = 20.0) -> None:
        with anyio.fail_after(within):
            while not re.search(pattern, self.text):
                try:
                    chunk = await anyio.to_thread.run_sync(
                        os.read, self.master, 65536, abandon_on_cancel=True
                    )
                except OSError:
                    chunk = b""
                if not chunk:
                    raise AssertionError(f"{pattern!r} never came; the screen:\n{self.text}")
                self.raw += chunk

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())


async def test_a_repl_starts_with_nothing_to_answer_and_keeps_out_of_the_checkout(
    claude_bin: Path, standin: Standin
) -> None:
    """As alice's own user (run_as): no onboarding, no "trust this folder?", no "use this
    API key?"; a turn answers; no .claude/ appears at the repository's root."""
    root = short_dir()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    await anyio.run_process(["git", "init", "-q", str(root)])  # a checkout around it
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "hooks", "installer"]',
        principal_extra='run_as = "nobody"\n',
    ).replace(f"uids = [{os.getuid()}]", "uids = [65534]")
    async with running_sage(config, root=root) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        standin.push(Text("Hello from the stand-in."))
        env = {
            "PATH": os.environ["PATH"],
            "TERM": "xterm-256color",
            "LANG": "C.UTF-8",
            "ANTHROPIC_API_KEY": KEY,  # the caller's: not in the store it cannot open
        }
        user = ["setpriv", "--reuid", "65534", "--regid", "65534", "--groups", "91000", "--"]
        argv = [*user, *ASTRID, "sage", "repl", "alice", "--config", str(sage.daemon.config)]
        screen = Screen(argv, env)
        try:
            await screen.expect(r"forshortcuts|\?for")  # the prompt, nothing asked first
            screen.type("hi")
            await anyio.sleep(0.5)
            screen.type("\r")
            await screen.expect(r"Hellofromthestand-in")
            screen.type("/exit")
            await anyio.sleep(0.5)
            screen.type("\r")
            with anyio.fail_after(30):
                code = await anyio.to_thread.run_sync(screen.proc.wait)
        finally:
            if screen.proc.poll() is None:
                screen.proc.kill()
            os.close(screen.master)
        shown = screen.text.lower()
        for question in ("trustthisfolder", "usethisapikey", "choosethetextstyle", "newmcpservers"):
            assert question not in shown, (question, screen.text)
        assert code == 0, screen.text
        assert standin.messages[-1].headers.get("x-api-key") == KEY
        assert not (root / ".claude").exists()  # nothing in the checkout's root
        assert _owners(Path(installed["home_path"])) == {65534}  # nothing of root's in it


def _owners(home: Path) -> set[int]:
    """The uids that own the home and what is in it."""
    return {home.stat().st_uid} | {p.stat().st_uid for p in home.rglob("*") if not p.is_symlink()}
