"""The in-band ``forge`` MCP server: forged tools as ``mcp__forge__<name>``.

A second ``{"type": "sdk"}`` server next to ``sage``: :mod:`capsules.runner.mcp`
routes the CLI's messages to it and the MCP core (:mod:`sage.mcp.protocol`)
answers all but ``tools/list`` and ``tools/call``.  It keeps no catalogue of
its own: ``tools/list`` asks the forge capsule (``forge.v1.request.list``) and ``tools/call`` becomes ``forge.v1.request.call``,
both on behalf of the session's principal so the forge capsule scopes tools to
that principal and session.  With no forge capsule running the list is empty,
and every failure of a call is an ``isError`` result, so Claude always gets an
answer.  The forge capsule announces changes on ``sage.v1.tools.changed`` with
``server: "forge"``; the runner turns that into ``notifications/tools/list_changed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import structlog

from bus import BusError, NoResponders
from sage.capsule.context import CapsuleContext
from sage.mcp.protocol import NeedCall, Server

if TYPE_CHECKING:
    from capsules.runner.claude_process import ClaudeProcess

__all__ = ("FORGE", "SERVER", "ForgeMcpServer")

log = structlog.get_logger("sage.runner.forge_mcp")

FORGE: Final = Server("forge", list_changed=True, negotiate=False)
"""What the ``forge`` sdk server announces: forged tools, which change."""
SERVER: Final = FORGE.name
CHANGES_TOOLS = frozenset({"forge_tool", "forge_promote"})
"""Meta-tools whose success changes the session's tool list."""
LIST_DEADLINE = 5.0


def _text_error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class ForgeMcpServer:
    """The ``forge`` server's tools, over the bus; :func:`capsules.runner.mcp.answer`
    speaks MCP for it."""

    server: Final = FORGE

    def __init__(self, ctx: CapsuleContext) -> None:
        self.ctx = ctx

    async def list(self, proc: ClaudeProcess) -> list[dict[str, Any]]:
        """The session's forged tools (bare names); [] when the forge does not answer."""
        try:
            reply = await self.ctx.request(
                "forge.v1.request.list",
                {"session_id": proc.session_id},
                deadline=LIST_DEADLINE,
                on_behalf_of=proc.principal_id,
            )
            data = reply.data()
        except NoResponders:
            return []
        except (BusError, ValueError) as exc:
            log.warning("forge.list_failed", session=proc.session_id, error=str(exc))
            return []
        tools = data.get("tools") if isinstance(data, dict) else None
        if not isinstance(tools, list):
            return []
        return [
            tool
            for tool in tools
            if isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool["name"]
        ]

    async def call(self, proc: ClaudeProcess, call: NeedCall) -> dict[str, Any]:
        """Call one forged tool; the forge capsule's MCP result, or an isError result."""
        name = call.name
        payload: dict[str, Any] = {
            "session_id": proc.session_id,
            "tool_name": name,
            "arguments": call.arguments,
        }
        tool_use_id = call.meta.get("claudecode/toolUseId")
        if isinstance(tool_use_id, str):
            payload["tool_use_id"] = tool_use_id
        try:
            reply = await self.ctx.request(
                "forge.v1.request.call",
                payload,
                deadline=self.ctx.config.limits.tool_timeout,
                on_behalf_of=proc.principal_id,
            )
            data = reply.data()
        except NoResponders:
            return _text_error(f"forged tool {name!r} is not available: no forge is running")
        except BusError as exc:  # a timeout, the payload limit, the bus closing
            return _text_error(f"forged tool {name!r} failed: {exc}")
        except ValueError as exc:
            return _text_error(f"the forge sent a bad result: {exc}")
        result = _result(name, data)
        if name in CHANGES_TOOLS and not result["isError"]:
            # announce the new tool before the CLI gets this result, so it lists tools
            # again before its next model request (forge.md: forge, then call at once);
            # the forge capsule's sage.v1.tools.changed comes too, later
            try:
                await proc.tools_changed(SERVER)
            except Exception as exc:  # the result matters more than the announcement
                log.warning("forge_mcp.announce_failed", error=type(exc).__name__)
        return result


def _result(name: str, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        return _text_error("the forge sent a bad result: not an object")
    if data.get("ok") is False:  # the bus's one failure reply (sage.replies)
        code, message = data.get("error") or "error", data.get("message", "")
        return _text_error(f"forged tool {name!r} failed: {code}: {message}")
    content = data.get("content")
    if not isinstance(content, list):
        return _text_error("the forge sent a bad result: no content")
    result: dict[str, Any] = {"content": content, "isError": bool(data.get("isError", False))}
    if isinstance(data.get("structuredContent"), dict):
        result["structuredContent"] = data["structuredContent"]
    return result
