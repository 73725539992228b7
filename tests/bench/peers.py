"""The contenders of bench_peer: one Claude Code session each way a program can run one.

- :class:`BareSession`: the CLI alone, ``claude -p`` in stream-json with no hook,
  no MCP server, no settings (an empty home), driven by the e2e host
  (tests/support/host.py): the floor.
- :class:`SdkSession`: the Claude Agent SDK's ``ClaudeSDKClient`` with the same
  binary (``cli_path``) and an in-process MCP server ``sage`` whose tool ``greet``
  answers as sage's greeter does, pre-allowed (``allowed_tools``) as alice's is.
- :class:`SageSession`: a session of sage's runner, through its bus client.

Each takes turns the same way: :meth:`turn` returns when the turn's first text
arrived and when it ended (seconds from the call).  All three run the CLI with
``--include-partial-messages`` and ``--tools ""``, against the Messages API
stand-in, whose :func:`responder` answers every request the same way for all
of them (so many sessions at once get their own answers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from sage.claude.protocol import (
    OutgoingState,
    ResultMessage,
    StreamEvent,
    encode_initialize,
    encode_user_turn,
)
from tests.support.host import Host
from tests.support.sage_harness import Events
from tests.support.standin import Recorded, Reply, Text, ToolUse, offline_env

__all__ = (
    "GREET",
    "TOOL_PROMPT",
    "BareSession",
    "SageSession",
    "SdkSession",
    "Timing",
    "responder",
    "tree_memory",
)

TOOL_PROMPT = "greet Ada"
GREET = "mcp__sage__greet"
API_KEY = "sk-bench-peer"


def responder(request: Recorded) -> Reply:
    """The stand-in's answer: ``greet Ada`` gets a call of ``mcp__sage__greet``, a tool
    result gets "greeted", anything else "hello"."""
    last = request.last_user_message or {}
    content = last.get("content")
    if isinstance(content, list) and any(b.get("type") == "tool_result" for b in content):
        return Text("greeted")
    text = content if isinstance(content, str) else ""
    if isinstance(content, list):
        text = " ".join(str(b.get("text", "")) for b in content if isinstance(b, dict))
    if TOOL_PROMPT in text:
        return ToolUse(GREET, {"name": "Ada"})
    return Text("hello")


@dataclass(frozen=True)
class Timing:
    """Seconds from the start of a turn (or of a cold start) to its first text and end."""

    first: float
    end: float


def _is_text_delta(event: dict[str, Any]) -> bool:
    delta = event.get("delta")
    return (
        event.get("type") == "content_block_delta"
        and isinstance(delta, dict)
        and delta.get("type") == "text_delta"
    )


# -- the bare CLI ----------------------------------------------------------------------


def bare_argv(binary: Path) -> list[str]:
    return [
        str(binary),
        "-p",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "--include-partial-messages",
        "--tools",
        "",
    ]


def cli_env(home: Path, url: str) -> dict[str, str]:
    return {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "ANTHROPIC_API_KEY": API_KEY,
        **offline_env(url),
    }


class BareSession:
    """``claude -p`` and the e2e host: no hook registered, no MCP server."""

    def __init__(self, host: Host, proc: anyio.abc.Process) -> None:
        self.host = host
        self.proc = proc

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, binary: Path, url: str, home: Path) -> AsyncIterator[BareSession]:
        """Start it and initialize it (no hooks)."""
        proc = await anyio.open_process(
            bare_argv(binary), env=cli_env(home, url), cwd=home, start_new_session=True
        )
        host = Host(proc)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(host.read_stdout)
                tg.start_soon(host.drain_stderr)
                outcome = await host.request("initialize", lambda rid: encode_initialize(rid))
                if outcome.state is not OutgoingState.COMPLETED:
                    raise RuntimeError(f"bare claude: initialize failed: {outcome}")
                yield cls(host, proc)
                await host.close_stdin()
                with anyio.move_on_after(5):
                    await proc.wait()
                tg.cancel_scope.cancel()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with anyio.CancelScope(shield=True):
                await proc.aclose()

    async def turn(self, text: str, t0: float | None = None) -> Timing:
        start = time.perf_counter() if t0 is None else t0
        await self.host.write(encode_user_turn(text))
        first = 0.0
        while True:
            msg = await self.host.next()
            if not first and isinstance(msg, StreamEvent) and _is_text_delta(msg.event_dict()):
                first = time.perf_counter() - start
            if isinstance(msg, ResultMessage):
                return Timing(first, time.perf_counter() - start)


# -- the Agent SDK ----------------------------------------------------------------------


class SdkSession:
    """A ``ClaudeSDKClient`` with an in-process MCP server ``sage`` (tool ``greet``)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @staticmethod
    def options(binary: Path, url: str, home: Path) -> Any:
        from claude_agent_sdk import ClaudeAgentOptions, create_sdk_mcp_server, tool

        @tool("greet", "Greet someone by name.", {"name": str})
        async def greet(args: dict[str, Any]) -> dict[str, Any]:
            return {"content": [{"type": "text", "text": f"Hello, {args['name']}!"}]}

        return ClaudeAgentOptions(
            cli_path=binary,
            cwd=home,
            tools=[],
            allowed_tools=[GREET],
            mcp_servers={"sage": create_sdk_mcp_server("sage", tools=[greet])},
            include_partial_messages=True,
            env=cli_env(home, url),
        )

    @classmethod
    @contextlib.asynccontextmanager
    async def open(cls, binary: Path, url: str, home: Path) -> AsyncIterator[SdkSession]:
        from claude_agent_sdk import ClaudeSDKClient

        async with ClaudeSDKClient(cls.options(binary, url, home)) as client:
            yield cls(client)

    async def turn(self, text: str, t0: float | None = None) -> Timing:
        from claude_agent_sdk import ResultMessage as SdkResult
        from claude_agent_sdk import StreamEvent as SdkStreamEvent

        start = time.perf_counter() if t0 is None else t0
        await self.client.query(text)
        first = 0.0
        async for msg in self.client.receive_response():
            if not first and isinstance(msg, SdkStreamEvent) and _is_text_delta(msg.event):
                first = time.perf_counter() - start
            if isinstance(msg, SdkResult):
                break
        return Timing(first, time.perf_counter() - start)


# -- sage -------------------------------------------------------------------------------


class SageSession:
    """A session of sage's runner, through a bus client (``BusClient``)."""

    def __init__(self, client: Any, sid: str, events: Events) -> None:
        self.client = client
        self.sid = sid
        self.events = events

    @classmethod
    @contextlib.asynccontextmanager
    async def open(
        cls, client: Any, sid: str | None = None, *, wait_init: bool = True
    ) -> AsyncIterator[SageSession]:
        """Spawn (``sid`` None: let the runner choose, which takes a spare) and, with a
        ``sid`` and ``wait_init``, wait for ``init`` (a taken spare's is published as
        the spawn answers, before a subscription made then); stopped at the end."""
        payload: dict[str, Any] = {"principal_id": "alice"}
        if sid is not None:
            payload["session_id"] = sid
            events = Events(await client.subscribe(f"sage.v1.event.{sid}.>"))
        reply = msgspec.json.decode(
            (await client.request("sage.v1.request.spawn", payload, deadline=60)).payload
        )
        if not reply.get("ok"):
            raise RuntimeError(f"spawn failed: {reply}")
        if sid is None:
            sid = str(reply["session_id"])
            events = Events(await client.subscribe(f"sage.v1.event.{sid}.>"))
        session = cls(client, sid, events)
        try:
            if wait_init and payload.get("session_id"):
                await events.until("init", within=60)
            yield session
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await client.request(f"sage.v1.request.stop.{sid}", {}, deadline=30)
                await events.subscription.close()

    async def turn(self, text: str, t0: float | None = None) -> Timing:
        start = time.perf_counter() if t0 is None else t0
        reply = msgspec.json.decode(
            (
                await self.client.request(
                    f"sage.v1.request.send.{self.sid}", {"text": text}, deadline=60
                )
            ).payload
        )
        if not reply.get("ok"):
            raise RuntimeError(f"send failed: {reply}")
        turn = reply["turn"]
        first = 0.0
        while True:
            name, data = await self.events.next(within=60)
            if data.get("turn", turn) != turn:
                continue  # a turn someone else sent (astrid sage send)
            if name == "text" and not first:
                first = time.perf_counter() - start
            if name == "done":
                return Timing(first, time.perf_counter() - start)
            if name in ("exited", "error"):
                raise RuntimeError(f"session {self.sid} ended in a turn: {data}")


# -- memory of a process tree -----------------------------------------------------------


def tree_memory(roots: list[int]) -> tuple[int, int]:
    """(RSS, PSS) in KiB, summed over ``roots`` and every process below them."""
    from tests.support.daemon import descendants

    pids = set(roots)
    for root in roots:
        pids.update(descendants(root))
    rss = pss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            continue  # gone meanwhile, or a kernel thread
    return rss, pss
