"""A running supervisor with the session runner, driven over its socket from a test.

:func:`running_sage` starts a real supervisor process (:class:`Daemon`)
whose principal ``alice`` maps to the test's uid, with ``[claude]`` set to
the given binary and environment, and yields a :class:`Sage`: a connected
:class:`bus.client.BusClient` plus helpers to spawn sessions, send turns
and read a session's events in order.  The daemon is started in a thread,
so the event loop stays free for a Messages API stand-in in the same
process.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec

from bus.client import BusClient, RemoteSubscription
from tests.support.daemon import Daemon, short_dir

__all__ = ("Events", "Sage", "running_sage", "sage_config")

STOP_DEADLINE = 8.0  # seconds a supervisor gets to stop before it and its children are killed


def sage_config(
    binary: Path | str,
    env: dict[str, str],
    *,
    principal_extra: str = "",
    extra: str = "",
    capsules: str = '["runner"]',
) -> str:
    """The TOML after ``[supervisor] state_dir`` for a runner test; principal ``alice``
    may run on the operator's key (the supervisor's ``ANTHROPIC_API_KEY``)."""
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    return (
        f"capsules = {capsules}\n"
        f"[claude]\nbinary = {json.dumps(str(binary))}\nenv = {{ {env_toml} }}\n"
        f"{extra}\n"
        f'[[principals]]\nname = "alice"\nuids = [{os.getuid()}]\noperator_key = true\n'
        f"{principal_extra}\n"
    )


class Events:
    """The events of one session, in order, with a cursor."""

    def __init__(self, subscription: RemoteSubscription) -> None:
        self.subscription = subscription
        self.seen: list[tuple[str, dict[str, Any]]] = []

    async def next(self, within: float = 30.0) -> tuple[str, dict[str, Any]]:
        with anyio.fail_after(within):
            envelope = await self.subscription.get()
        name = envelope.topic.rsplit(".", 1)[1]
        data: dict[str, Any] = msgspec.json.decode(envelope.payload)
        self.seen.append((name, data))
        return name, data

    async def until(self, name: str, within: float = 30.0) -> list[tuple[str, dict[str, Any]]]:
        """Events up to and including the first ``name``."""
        out: list[tuple[str, dict[str, Any]]] = []
        with anyio.fail_after(within):
            while True:
                event = await self.next(within)
                out.append(event)
                if event[0] == name:
                    return out

    async def text_until_done(self, within: float = 30.0) -> tuple[str, dict[str, Any]]:
        """The text of a turn and its ``done`` payload."""
        events = await self.until("done", within)
        text = "".join(d["delta"] for n, d in events if n == "text")
        return text, events[-1][1]


class Sage:
    def __init__(self, daemon: Daemon, client: BusClient) -> None:
        self.daemon = daemon
        self.client = client

    async def request(self, topic: str, payload: Any, within: float = 30.0) -> dict[str, Any]:
        reply = await self.client.request(topic, payload, deadline=within)
        data: dict[str, Any] = msgspec.json.decode(reply.payload)
        return data

    async def events(self, sid: str) -> Events:
        return Events(await self.client.subscribe(f"sage.v1.event.{sid}.>"))

    async def spawn(self, sid: str, **fields: Any) -> tuple[Events, dict[str, Any]]:
        """Spawn ``sid`` for alice; its events (from before the spawn) and the reply."""
        events = await self.events(sid)
        reply = await self.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "session_id": sid, **fields}
        )
        return events, reply

    async def ready(self, sid: str, **fields: Any) -> Events:
        """Spawn ``sid`` and wait for its ``init`` event."""
        events, reply = await self.spawn(sid, **fields)
        assert reply["ok"], reply
        await events.until("init")
        return events

    async def send(self, sid: str, text: str) -> dict[str, Any]:
        return await self.request(f"sage.v1.request.send.{sid}", {"text": text})

    async def astrid(self, *args: str, stdin: bytes | None = None) -> tuple[int, str, str]:
        """Run the ``astrid`` CLI against this daemon without blocking the loop."""
        from tests.support.daemon import ASTRID

        result = await anyio.run_process(
            [*ASTRID, *args, "--config", str(self.daemon.config)],
            input=stdin,
            check=False,
            env=self.daemon.env,
        )
        return result.returncode, result.stdout.decode(), result.stderr.decode()


@asynccontextmanager
async def running_sage(
    config: str,
    *,
    env: dict[str, str] | None = None,
    root: Path | None = None,
    prefix: list[str] | None = None,
) -> AsyncIterator[Sage]:
    """Start a supervisor, yield it connected; stop it however the body ends.

    The stop is shielded from the test's cancellation (a test that passed its
    deadline still stops what it started) and bounded: SIGTERM, then after
    ``STOP_DEADLINE`` s SIGKILL to the supervisor and every process it
    started (its process tree, found by pid)."""
    own = root is None
    daemon = Daemon(root or short_dir(), config, env=env)
    daemon.prefix = prefix or []  # e.g. setpriv with a unit's capabilities
    daemon.launch()  # in the loop's thread: the daemon's death signal is tied to it
    try:
        await anyio.to_thread.run_sync(daemon.wait_ready)
        async with BusClient.connect(daemon.socket, role="cli", name="test") as client:
            yield Sage(daemon, client)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(functools.partial(daemon.stop, STOP_DEADLINE))
        if own:
            shutil.rmtree(daemon.root, ignore_errors=True)
