"""A real supervisor for the session-lifecycle model test, driven step by step from sync code.

:class:`Rig` runs a supervisor (:class:`~tests.support.daemon.Daemon`) with the
runner and the CLI double, a bus client on an event loop in a thread of its own
(an anyio blocking portal: hypothesis's rules are plain functions), and a
:class:`Sampler` that looks at the double's processes every few milliseconds,
so a moment with two children on one conversation, more children than
``max_live`` or a child outliving its supervisor is seen even between two
steps.  Every child carries a marker in its environment (``[claude] env``),
which is how the sampler finds them, descendants of the supervisor or not.

Each step the test takes is also written down as the ``astrid`` command (or
shell line) that does the same by hand (:attr:`Rig.commands`), so a shrunk
counterexample can be replayed at a terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import msgspec

from bus import BusClient
from bus.client import RemoteSubscription
from tests.support import FAKE_CLAUDE
from tests.support.daemon import Daemon, descendants, short_dir
from tests.support.procs import marked

__all__ = ("Observation", "Rig", "Sampler", "Turn")

MAX_LIVE = 2
SPARES = 1
"""Warm spares per principal (alice and bob each)."""
HIBERNATE_AFTER = 1.5
STEP_DEADLINE = 30.0
"""Seconds any one step may take before the test calls it a hang."""


def config(marker: str, work: Path) -> str:
    """Two principals (alice with a work root), a warm spare each, a small ``max_live``,
    a short ``hibernate_after`` and ``resume = true``: every lifecycle path is near."""
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\n'
        f'env = {{ FAKE_CLAUDE_MODE = "", LIFECYCLE_RUN = "{marker}" }}\n'
        "[limits]\nstop_grace = 1.0\ninit_timeout = 10.0\n"
        f"[sessions]\nresume = true\nmax_live = {MAX_LIVE}\n"
        f"hibernate_after = {HIBERNATE_AFTER}\nwake_wait = 20.0\nspares = {SPARES}\n"
        f'[[principals]]\nname = "alice"\nuids = [{os.getuid()}]\noperator_key = true\n'
        f'work_roots = ["{work}"]\n'
        f'[[principals]]\nname = "bob"\noperator_key = true\n'
    )


@dataclass(frozen=True)
class Observation:
    """What the sampler saw at one moment."""

    at: float
    children: int
    conversations: dict[str, int]
    """Conversation (the CLI's session uuid) -> live processes on it."""
    orphans: tuple[int, ...]
    """Marked processes that are not the running supervisor's descendants."""
    unlabelled: tuple[str, ...] = ()
    """The command lines of marked processes on no conversation (what else runs?)."""


@dataclass
class Sampler:
    """Samples the marked processes in a thread until stopped; keeps the worst moments."""

    marker: bytes
    supervisor: Daemon
    interval: float = 0.02
    most_children: Observation | None = None
    doubled: list[Observation] = field(default_factory=list)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def observe(self) -> Observation:
        pids = marked(self.marker)
        proc = self.supervisor.proc
        running = proc is not None and proc.poll() is None
        family = set(descendants(proc.pid)) if running and proc is not None else set()
        conversations: dict[str, int] = {}
        unlabelled: list[str] = []
        for pid in pids:
            argv = _argv(pid)
            convs = [
                arg.split("=", 1)[1]
                for arg in argv
                if arg.startswith(("--session-id=", "--resume="))
            ]
            for conv in convs:
                conversations[conv] = conversations.get(conv, 0) + 1
            if not convs:
                unlabelled.append(f"{pid}: {' '.join(argv)[:200]}")
        orphans = tuple(pid for pid in pids if pid not in family)
        return Observation(time.monotonic(), len(pids), conversations, orphans, tuple(unlabelled))

    def take(self) -> tuple[Observation | None, list[Observation]]:
        """The worst moments since the last take (most children, two children on one
        conversation), so each is laid at the step that made it; then reset.  (A child
        the supervisor's death left behind is looked for after each step: for a moment
        after a SIGKILL every child is an orphan.)"""
        found = (self.most_children, self.doubled)
        self.most_children, self.doubled = None, []
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            seen = self.observe()
            self.samples += 1
            if self.most_children is None or seen.children > self.most_children.children:
                self.most_children = seen
            if any(n > 1 for n in seen.conversations.values()):
                self.doubled.append(seen)


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return [part.decode(errors="replace") for part in file.read().split(b"\0") if part]
    except OSError:
        return []


@dataclass(frozen=True)
class Turn:
    """A send and what came of it."""

    reply: dict[str, Any]
    text: str = ""
    done: dict[str, Any] | None = None
    exited: dict[str, Any] | None = None


class Rig:
    """A supervisor, a client and a sampler; see the module docstring."""

    def __init__(self) -> None:
        self.root = short_dir()
        self.work = self.root / "work"
        (self.work / "project").mkdir(parents=True)
        self.marker = secrets.token_hex(8)
        self.daemon = Daemon(
            self.root, config(self.marker, self.work), env={"ANTHROPIC_API_KEY": "sk-double"}
        )
        self.commands: list[str] = []
        self._portal = anyio.from_thread.start_blocking_portal()
        self.portal = self._portal.__enter__()
        self._connection: contextlib.AbstractContextManager[BusClient] | None = None
        self.client: BusClient | None = None
        self.sampler = Sampler(f"LIFECYCLE_RUN={self.marker}".encode(), self.daemon)

    # -- the supervisor ------------------------------------------------------------------

    def start(self) -> None:
        self.daemon.start(30.0)
        self._connection = self.portal.wrap_async_context_manager(
            BusClient.connect(self.daemon.socket, role="cli", name="lifecycle")
        )
        self.client = self._connection.__enter__()
        if not self.sampler.samples:
            self.sampler.start()

    def restart(self, *, kill: bool) -> None:
        """Stop the supervisor (SIGTERM, or SIGKILL: no goodbye) and start it again."""
        self.note(
            "kill -9 <supervisor pid>" if kill else "kill -TERM <supervisor pid>",
            f"astrid supervisor run --config {self.daemon.config}",
        )
        self._disconnect()
        if kill:
            self.daemon.signal(signal.SIGKILL)
            assert self.daemon.proc is not None
            self.daemon.proc.wait(STEP_DEADLINE)
        else:
            code = self.daemon.stop(STEP_DEADLINE)
            assert code == 0, f"the supervisor stopped with {code}:\n{self.daemon.log()[-3000:]}"
        self.start()

    def close(self) -> None:
        self.sampler.stop()
        self._disconnect()
        self.daemon.stop(STEP_DEADLINE)
        self._portal.__exit__(None, None, None)
        shutil.rmtree(self.root, ignore_errors=True)

    def _disconnect(self) -> None:
        """Leave the client's connection (before its supervisor goes)."""
        connection, self._connection, self.client = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):  # the supervisor may be gone already
                connection.__exit__(None, None, None)

    # -- requests -------------------------------------------------------------------------

    def note(self, *commands: str) -> None:
        self.commands.extend(commands)

    def request(self, topic: str, payload: Any) -> dict[str, Any]:
        client = self.client
        assert client is not None

        async def ask() -> dict[str, Any]:
            reply = await client.request(topic, payload, deadline=STEP_DEADLINE)
            data: dict[str, Any] = msgspec.json.decode(reply.payload)
            return data

        return self.portal.call(ask)

    def turn(self, sid: str, text: str, *, interrupt: bool = False) -> Turn:
        """Send ``text`` and read the session's events to the turn's ``done`` (or the
        session's ``exited``); ``interrupt``: interrupt it once its first text came."""
        client = self.client
        assert client is not None

        async def go() -> Turn:
            events = await client.subscribe(f"sage.v1.event.{sid}.>")
            try:
                reply = await _request(client, f"sage.v1.request.send.{sid}", {"text": text})
                if not reply.get("ok"):
                    return Turn(reply)
                return await _until_done(client, events, sid, interrupt)
            finally:
                await events.close()

        return self.portal.call(go)

    def listing(self) -> dict[str, dict[str, Any]]:
        """Every session the runner knows, ended ones included, by id."""
        rows: dict[str, dict[str, Any]] = {}
        offset: int | None = 0
        while offset is not None:
            page = self.request("sage.v1.request.sessions", {"all": True, "offset": offset})
            assert page.get("ok"), page
            for row in page["sessions"]:
                rows.setdefault(row["session_id"], row)
            offset = page.get("next_offset")
        return rows

    def wait_for(self, what: str, check: Any, within: float = STEP_DEADLINE) -> Any:
        deadline = time.monotonic() + within
        while True:
            found = check()
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {within} s: {what}")
            time.sleep(0.05)

    def audit_verify(self) -> str:
        result = self.daemon.astrid("audit", "verify", timeout=STEP_DEADLINE)
        assert result.returncode == 0, (result.stdout, result.stderr)
        return result.stdout


async def _request(client: BusClient, topic: str, payload: Any) -> dict[str, Any]:
    reply = await client.request(topic, payload, deadline=STEP_DEADLINE)
    data: dict[str, Any] = msgspec.json.decode(reply.payload)
    return data


async def _until_done(
    client: BusClient, events: RemoteSubscription, sid: str, interrupt: bool
) -> Turn:
    text: list[str] = []
    with anyio.fail_after(STEP_DEADLINE):
        while True:
            envelope = await events.get()
            name = envelope.topic.rsplit(".", 1)[1]
            data: dict[str, Any] = msgspec.json.decode(envelope.payload)
            if name == "text":
                text.append(data.get("delta", ""))
                if interrupt:
                    interrupt = False
                    answer = await _request(client, f"sage.v1.request.interrupt.{sid}", {})
                    assert answer.get("ok"), answer
            elif name == "done":
                return Turn({"ok": True}, "".join(text), done=data)
            elif name == "exited":
                return Turn({"ok": True}, "".join(text), exited=data)


@contextlib.contextmanager
def running_rig() -> Iterator[Rig]:
    rig = Rig()
    try:
        rig.start()
        yield rig
    finally:
        rig.close()


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
