"""The stdio shell of ``astrid mcp serve``: lines in, the bus behind, lines out.

Claude Code starts it from a principal's ``.mcp.json`` (``claude`` in REPL
mode, or ``claude -p --mcp-config``).  It connects to the supervisor's socket
(``$ASTRID_SOCKET``, else the config's) acting for ``--principal``, so the
bus applies that principal's rights, and proxies:

- ``tools/list`` -> ``sage.v1.request.tools`` (the tool bridge's catalogue);
- ``tools/call`` -> ``sage.v1.request.tool.call`` ``{tool_name, arguments,
  session_id}``: the bridge checks, applies the policy, audits and runs it
  exactly as for a headless session (``session_id`` from
  ``$ASTRID_SESSION_ID`` when set).

With ``--server forge`` it is the ``forge`` server instead: the forge's
meta-tools and the principal's forged tools (``sage.v1.request.forge.list``
and ``.call``, the forge capsule checks that the session is the principal's).
It announces ``listChanged``: after a ``forge_tool`` or ``forge_promote`` it
makes succeed, and whenever the forge reports a change to its session
(``sage.v1.event.<sid>.tools_changed``, followed on a connection of its own
that is made again when the supervisor comes back), it sends
``notifications/tools/list_changed`` so Claude lists the tools again.

A supervisor that is down never hangs Claude: ``tools/list`` answers an
empty list, ``tools/call`` an ``isError`` result saying so; each request
connects anew, so a restarted supervisor is found again.  Requests are served concurrently; each
answer is one line, written whole.  Diagnostics go to stderr.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, BinaryIO, Final

import anyio
import msgspec

from bus import BusClient, BusError
from sage.config import Config
from sage.mcp.protocol import (
    STDIO,
    NeedCall,
    NeedList,
    Reply,
    Server,
    Silent,
    call_reply,
    handle_line,
    list_reply,
)

__all__ = ("SERVERS", "Proxied", "serve")

LIST_DEADLINE = 10.0
RECONNECT_EVERY = 1.0
"""Seconds between attempts to follow the forge's changes while the supervisor is away."""
LIST_CHANGED: Final = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
CHANGES_TOOLS = frozenset({"forge_tool", "forge_promote"})
"""Forge meta-tools whose success changes the tool list."""


@dataclass(frozen=True)
class Proxied:
    """One MCP server ``astrid mcp serve`` can be: what it announces, where it asks."""

    server: Server
    list_topic: str
    call_topic: str
    scoped_list: bool = False
    """The list depends on the session (forged tools are session-scoped): send its id."""


SERVERS: Final = {
    "sage": Proxied(STDIO, "sage.v1.request.tools", "sage.v1.request.tool.call"),
    "forge": Proxied(
        Server("forge", list_changed=True, prefix="mcp__forge__"),
        "sage.v1.request.forge.list",
        "sage.v1.request.forge.call",
        scoped_list=True,
    ),
}


class _Upstream:
    """The supervisor, reached with one short connection per request: an MCP
    client's requests are few, and a supervisor restarted in between is found
    again without any reconnect logic."""

    def __init__(self, config: Config, principal: str) -> None:
        self.principal = principal
        self.socket = os.environ.get("ASTRID_SOCKET") or str(config.socket_path)
        self.session_id = os.environ.get("ASTRID_SESSION_ID") or None

    def connect(self) -> Any:
        return BusClient.connect(
            self.socket, role="cli", name="astrid-mcp", principal=self.principal
        )

    async def request(self, topic: str, payload: Any, deadline: float) -> dict[str, Any]:
        with anyio.fail_after(deadline + 5):
            async with self.connect() as client:
                reply = await client.request(topic, payload, deadline=deadline)
        data: dict[str, Any] = msgspec.json.decode(reply.payload)
        return data

    async def follow_changes(self, changed: Any) -> None:
        """Call ``changed()`` for each change the forge reports to this session; keep
        following across supervisor restarts (and say so once on stderr)."""
        topic = f"sage.v1.event.{self.session_id}.tools_changed"
        warned = False
        while True:
            try:
                async with self.connect() as client:
                    changes = await client.subscribe(topic)
                    warned = False
                    async for _ in changes:
                        await changed()
            except (BusError, OSError) as exc:
                if not warned:
                    print(f"astrid mcp serve: not following tool changes: {exc}", file=sys.stderr)
                    warned = True
            await anyio.sleep(RECONNECT_EVERY)


async def _answer(
    outcome: NeedList | NeedCall, upstream: _Upstream, config: Config, proxied: Proxied
) -> dict[str, Any]:
    try:
        if isinstance(outcome, NeedList):
            payload: dict[str, Any] = {}
            if upstream.session_id and proxied.scoped_list:
                payload["session_id"] = upstream.session_id
            data = await upstream.request(proxied.list_topic, payload, LIST_DEADLINE)
            return list_reply(outcome.id, data.get("tools") or [])
        payload = {"tool_name": outcome.name, "arguments": outcome.arguments}
        if upstream.session_id:
            payload["session_id"] = upstream.session_id
        data = await upstream.request(proxied.call_topic, payload, config.limits.tool_timeout)
        return call_reply(outcome.id, data.get("content", []), data.get("isError", True))
    except (BusError, OSError, TimeoutError, msgspec.DecodeError) as exc:
        print(f"astrid mcp serve: {exc}", file=sys.stderr, flush=True)
        if isinstance(outcome, NeedList):
            return list_reply(outcome.id, [])
        return call_reply(outcome.id, f"the sage supervisor is not reachable: {exc}", True)


async def serve(
    config: Config,
    principal: str,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
    server: str = "sage",
) -> None:
    """Serve until stdin ends, as the ``server`` of :data:`SERVERS`."""
    proxied = SERVERS[server]
    reader = stdin or sys.stdin.buffer
    writer = stdout or sys.stdout.buffer
    upstream = _Upstream(config, principal)
    write_lock = anyio.Lock()

    async def send(message: dict[str, Any]) -> None:
        line = msgspec.json.encode(message) + b"\n"
        async with write_lock:
            await anyio.to_thread.run_sync(_write, writer, line)

    async def list_changed() -> None:
        await send(LIST_CHANGED)

    async def answer(outcome: NeedList | NeedCall) -> None:
        reply = await _answer(outcome, upstream, config, proxied)
        changes = isinstance(outcome, NeedCall) and outcome.name in CHANGES_TOOLS
        if proxied.server.list_changed and changes and not reply["result"].get("isError"):
            await list_changed()  # before the result: Claude lists again before its next turn
        await send(reply)

    async with anyio.create_task_group() as tg:
        following = anyio.CancelScope()
        if proxied.server.list_changed and upstream.session_id:
            tg.start_soon(_within, following, upstream.follow_changes, list_changed)
        while True:
            line = await anyio.to_thread.run_sync(reader.readline)
            if not line:
                break
            if not line.strip():
                continue
            outcome = handle_line(line.rstrip(b"\r\n"), proxied.server)
            if isinstance(outcome, Reply):
                await send(outcome.message)
            elif isinstance(outcome, NeedList | NeedCall):
                tg.start_soon(answer, outcome)
            else:
                assert isinstance(outcome, Silent)
        following.cancel()  # answers still owed are sent; changes are no longer followed


async def _within(scope: anyio.CancelScope, func: Any, *args: Any) -> None:
    with scope:
        await func(*args)


def _write(writer: BinaryIO, line: bytes) -> None:
    writer.write(line)
    writer.flush()
