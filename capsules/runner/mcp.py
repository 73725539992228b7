"""The in-band MCP servers: JSON-RPC over the CLI's ``mcp_message`` requests.

The CLI reaches a ``{"type": "sdk"}`` MCP server through control requests,
so the runner is the server and no extra process exists.  Two such servers
run here, both thin shells over the one MCP core (:mod:`sage.mcp.protocol`):
``sage`` (below) and ``forge`` (:mod:`capsules.runner.forge_mcp`).  Each
supplies only what its ``tools/list`` and ``tools/call`` become; the core
answers ``initialize`` (tools with ``listChanged``, the CLI's protocol
version echoed), ``ping``, notifications and errors.

For ``sage``: ``tools/list`` serves the catalogue last published on
``sage.v1.tools.list`` (empty until a tool bridge publishes one);
``tools/call`` becomes ``sage.v1.tool.call.<cid>`` and waits for
``sage.v1.tool.result.<cid>``.  Every failure of a call is an ``isError``
result, so Claude always gets an answer.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Final, Protocol

import msgspec

from bus import BusError, Envelope
from capsules.runner.claude_process import ClaudeProcess, SessionError
from capsules.runner.forge_mcp import ForgeMcpServer
from capsules.runner.messages import ToolResult, ToolsList
from sage.capsule.context import CapsuleContext
from sage.claude.protocol import McpMessageRequest
from sage.mcp.protocol import (
    NeedCall,
    NeedList,
    Reply,
    Server,
    Silent,
    Unreadable,
    handle_line,
    result,
)

__all__ = ("SAGE", "McpServer", "Tools", "answer")

SAGE: Final = Server("sage", list_changed=True, negotiate=False)
"""What the ``sage`` sdk server announces: the tool bridge's catalogue, which changes."""
PREFIX: Final = "mcp__sage__"


class Tools(Protocol):
    """One in-band server: what its ``tools/list`` and ``tools/call`` become."""

    @property
    def server(self) -> Server: ...

    async def list(self, proc: ClaudeProcess) -> list[dict[str, Any]]: ...

    async def call(self, proc: ClaudeProcess, call: NeedCall) -> dict[str, Any]: ...


async def answer(
    tools: Tools, proc: ClaudeProcess, message: bytes, refusal: str | None = None
) -> dict[str, Any] | None:
    """The JSON-RPC response to one message for ``tools`` (None: a notification,
    which the session acknowledges); SessionError for a message that is no request.
    ``refusal``: why no tool may run now (an isError result for every ``tools/call``)."""
    outcome = handle_line(message, tools.server)
    if isinstance(outcome, Unreadable):
        raise SessionError("bad_message", f"not a JSON-RPC message: {outcome.text}")
    if isinstance(outcome, Reply):
        return outcome.message
    if isinstance(outcome, Silent):
        return None
    if isinstance(outcome, NeedList):
        return result(outcome.id, {"tools": await tools.list(proc)})
    if refusal is not None:
        return result(outcome.id, _text_error(refusal))
    return result(outcome.id, await tools.call(proc, outcome))


def _text_error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class McpServer:
    """Answers the CLI's MCP messages: the ``sage`` server here, ``forge`` in
    :mod:`capsules.runner.forge_mcp`."""

    server: Final = SAGE

    def __init__(self, ctx: CapsuleContext) -> None:
        self.ctx = ctx
        self.tools: list[dict[str, Any]] = []
        self.forge = ForgeMcpServer(ctx)
        self.refusal: Callable[[], str | None] = lambda: None
        """Why no tool call may run now (the fleet lease: capsules/runner/fleet_lease.py)."""

    async def follow(self, envelopes: Any) -> None:
        """Keep the catalogue the tool bridge publishes."""
        async for envelope in envelopes:
            try:
                catalogue = msgspec.json.decode(envelope.payload, type=ToolsList)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            self.tools = [
                {**tool, "name": str(tool.get("name", "")).removeprefix(PREFIX)}
                for tool in catalogue.tools
            ]

    async def handle(self, proc: ClaudeProcess, request: McpMessageRequest) -> Any:
        tools: Tools
        if request.server_name == self.server.name:
            tools = self
        elif request.server_name == self.forge.server.name:
            tools = self.forge
        else:
            raise SessionError("unknown_server", f"no sdk MCP server {request.server_name!r}")
        return await answer(tools, proc, bytes(request.message), self.refusal())

    async def list(self, proc: ClaudeProcess) -> list[dict[str, Any]]:
        """The catalogue the tool bridge last published (bare names)."""
        return self.tools

    async def call(self, proc: ClaudeProcess, call: NeedCall) -> dict[str, Any]:
        """Run one tool through the tool bridge; its result, or an isError result."""
        ctx = self.ctx
        name = call.name
        cid = uuid.uuid4().hex
        topic = f"sage.v1.tool.call.{cid}"
        if not ctx.bus.has_subscribers(topic):
            return _text_error(f"tool {name!r} is not available: no tool bridge is running")
        message = {
            "session_id": proc.session_id,
            "principal_id": proc.principal_id,
            "tool_name": name,
            "arguments": call.arguments,
            "tool_use_id": call.meta.get("claudecode/toolUseId"),
        }

        def result(envelope: Envelope) -> dict[str, Any]:
            try:
                sent = msgspec.json.decode(envelope.payload, type=ToolResult)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                return _text_error(f"the tool bridge sent a bad result: {exc}")
            return {"content": sent.content, "isError": sent.is_error}

        try:
            answer = await ctx.ask(
                f"sage.v1.tool.result.{cid}",
                lambda: ctx.publish(topic, message, on_behalf_of=proc.principal_id),
                result,
                deadline=ctx.config.limits.tool_timeout,
            )
        except BusError as exc:  # e.g. arguments over the payload limit
            return _text_error(f"tool {name!r} could not be called: {exc}")
        if answer is not None:
            return answer
        return _text_error(f"tool {name!r} did not answer in time")
