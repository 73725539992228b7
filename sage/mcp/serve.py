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

A supervisor that is down never hangs Claude: ``tools/list`` answers an
empty list, ``tools/call`` an ``isError`` result saying so; each request
connects anew, so a restarted supervisor is found again.  Requests are served concurrently; each
answer is one line, written whole.  Diagnostics go to stderr.
"""

from __future__ import annotations

import os
import sys
from typing import Any, BinaryIO

import anyio
import msgspec

from bus import BusClient, BusError
from sage.config import Config
from sage.mcp.protocol import (
    STDIO,
    NeedCall,
    NeedList,
    Reply,
    Silent,
    call_reply,
    handle_line,
    list_reply,
)

__all__ = ("serve",)

LIST_DEADLINE = 10.0


class _Upstream:
    """The supervisor, reached with one short connection per request: an MCP
    client's requests are few, and a supervisor restarted in between is found
    again without any reconnect logic."""

    def __init__(self, config: Config, principal: str) -> None:
        self.principal = principal
        self.socket = os.environ.get("ASTRID_SOCKET") or str(config.socket_path)

    async def request(self, topic: str, payload: Any, deadline: float) -> dict[str, Any]:
        with anyio.fail_after(deadline + 5):
            async with BusClient.connect(
                self.socket, role="cli", name="astrid-mcp", principal=self.principal
            ) as client:
                reply = await client.request(topic, payload, deadline=deadline)
        data: dict[str, Any] = msgspec.json.decode(reply.payload)
        return data


async def _answer(
    outcome: NeedList | NeedCall, upstream: _Upstream, config: Config
) -> dict[str, Any]:
    try:
        if isinstance(outcome, NeedList):
            data = await upstream.request("sage.v1.request.tools", {}, LIST_DEADLINE)
            return list_reply(outcome.id, data.get("tools") or [])
        payload: dict[str, Any] = {"tool_name": outcome.name, "arguments": outcome.arguments}
        if os.environ.get("ASTRID_SESSION_ID"):
            payload["session_id"] = os.environ["ASTRID_SESSION_ID"]
        data = await upstream.request(
            "sage.v1.request.tool.call", payload, config.limits.tool_timeout
        )
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
) -> None:
    """Serve until stdin ends."""
    reader = stdin or sys.stdin.buffer
    writer = stdout or sys.stdout.buffer
    upstream = _Upstream(config, principal)
    write_lock = anyio.Lock()

    async def send(message: dict[str, Any]) -> None:
        line = msgspec.json.encode(message) + b"\n"
        async with write_lock:
            await anyio.to_thread.run_sync(_write, writer, line)

    async def answer(outcome: NeedList | NeedCall) -> None:
        await send(await _answer(outcome, upstream, config))

    async with anyio.create_task_group() as tg:
        while True:
            line = await anyio.to_thread.run_sync(reader.readline)
            if not line:
                break
            if not line.strip():
                continue
            outcome = handle_line(line.rstrip(b"\r\n"), STDIO)
            if isinstance(outcome, Reply):
                await send(outcome.message)
            elif isinstance(outcome, NeedList | NeedCall):
                tg.start_soon(answer, outcome)
            else:
                assert isinstance(outcome, Silent)


def _write(writer: BinaryIO, line: bytes) -> None:
    writer.write(line)
    writer.flush()
