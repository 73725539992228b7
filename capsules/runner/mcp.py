"""The in-band ``sage`` MCP server: JSON-RPC over the CLI's ``mcp_message`` requests.

The CLI reaches a ``{"type": "sdk"}`` MCP server through control requests,
so the runner is the server and no extra process exists.  ``initialize``
advertises tools with ``listChanged``; ``tools/list`` serves the catalogue
last published on ``sage.v1.tools.list`` (empty until a tool bridge
publishes one); ``tools/call`` becomes ``sage.v1.tool.call.<cid>`` and waits
for ``sage.v1.tool.result.<cid>``.  Every failure of a call is an
``isError`` result, so Claude always gets an answer.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from bus import BusError, Envelope
from capsules.runner import forge_mcp
from capsules.runner.messages import ToolResult, ToolsList
from capsules.runner.session import ClaudeProcess, SessionError
from sage.claude.protocol import McpMessageRequest

if TYPE_CHECKING:
    from capsules.runner.runner import Runner

__all__ = ("McpServer",)

log = structlog.get_logger("sage.runner.mcp")

SERVER = "sage"
PREFIX = "mcp__sage__"
VERSION = "0.1.0"


class _JsonRpc(msgspec.Struct, frozen=True):
    method: str = ""
    id: int | str | None = None
    params: dict[str, Any] = {}


def _text_error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class McpServer:
    """Answers the CLI's MCP messages: the ``sage`` server here, ``forge`` in
    :mod:`capsules.runner.forge_mcp`."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.tools: list[dict[str, Any]] = []
        self.forge = forge_mcp.ForgeMcpServer(runner)

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
        if request.server_name not in (SERVER, forge_mcp.SERVER):
            raise SessionError("unknown_server", f"no sdk MCP server {request.server_name!r}")
        try:
            message = msgspec.json.decode(request.message, type=_JsonRpc)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise SessionError("bad_message", f"not a JSON-RPC message: {exc}") from None
        if message.id is None:
            return None  # a notification: acknowledged by the caller
        if request.server_name == forge_mcp.SERVER:
            return await self.forge.answer(proc, message.id, message.method, message.params)
        result: Any = None
        if message.method == "initialize":
            result = {
                "protocolVersion": message.params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": SERVER, "version": VERSION},
            }
        elif message.method == "tools/list":
            result = {"tools": self.tools}
        elif message.method == "tools/call":
            result = await self._call(proc, message.params)
        elif message.method == "ping":
            result = {}
        else:
            return {
                "jsonrpc": "2.0",
                "id": message.id,
                "error": {"code": -32601, "message": f"method not found: {message.method}"},
            }
        return {"jsonrpc": "2.0", "id": message.id, "result": result}

    async def _call(self, proc: ClaudeProcess, params: dict[str, Any]) -> dict[str, Any]:
        runner = self.runner
        name = str(params.get("name", ""))
        arguments = params.get("arguments") or {}
        meta = params.get("_meta") or {}
        cid = uuid.uuid4().hex
        topic = f"sage.v1.tool.call.{cid}"
        if not runner.ctx.bus.has_subscribers(topic):
            return _text_error(f"tool {name!r} is not available: no tool bridge is running")
        call = {
            "session_id": proc.session_id,
            "principal_id": proc.principal_id,
            "tool_name": name,
            "arguments": arguments,
            "tool_use_id": meta.get("claudecode/toolUseId"),
        }

        def result(envelope: Envelope) -> dict[str, Any]:
            try:
                sent = msgspec.json.decode(envelope.payload, type=ToolResult)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                return _text_error(f"the tool bridge sent a bad result: {exc}")
            return {"content": sent.content, "isError": sent.is_error}

        try:
            answer = await runner.ctx.ask(
                f"sage.v1.tool.result.{cid}",
                lambda: runner.ctx.publish(topic, call, on_behalf_of=proc.principal_id),
                result,
                deadline=runner.config.limits.tool_timeout,
            )
        except BusError as exc:  # e.g. arguments over the payload limit
            return _text_error(f"tool {name!r} could not be called: {exc}")
        if answer is not None:
            return answer
        return _text_error(f"tool {name!r} did not answer in time")
