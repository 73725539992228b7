"""The JSON-RPC 2.0 / MCP core of ``astrid mcp serve``: bytes in, decisions out, no I/O.

One line of stdin (newline-delimited JSON-RPC, as MCP's stdio transport
frames it) goes to :func:`handle_line`, which answers at once
(:class:`Reply`: ``initialize``, ``ping``, errors), asks the shell to fetch
the tool list (:class:`NeedList`) or to run a call (:class:`NeedCall`), or
says nothing is to be sent (:class:`Silent`: notifications).  The shell
builds the answers to the last two with :func:`list_reply` and
:func:`call_reply`.  Errors follow JSON-RPC: -32700 for a line that is not
JSON (id null), -32600 for one that is not a request, -32601 for an unknown
method, -32602 for bad params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = (
    "MAX_LINE",
    "SUPPORTED_VERSIONS",
    "NeedCall",
    "NeedList",
    "Reply",
    "Silent",
    "call_reply",
    "handle_line",
    "list_reply",
)

SUPPORTED_VERSIONS: Final = ("2025-06-18", "2025-03-26", "2024-11-05")
MAX_LINE: Final = 16 * 1024 * 1024
SERVER_INFO: Final = {"name": "sage", "version": "0.1.0"}
PREFIX: Final = "mcp__sage__"

RequestId = int | str | None


@dataclass(frozen=True)
class Reply:
    message: dict[str, Any]


@dataclass(frozen=True)
class NeedList:
    id: RequestId


@dataclass(frozen=True)
class NeedCall:
    id: RequestId
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Silent:
    pass


Outcome = Reply | NeedList | NeedCall | Silent


def _error(id_: RequestId, code: int, message: str) -> Reply:
    return Reply({"jsonrpc": "2.0", "id": id_, "error": {"code": code, "message": message}})


def _result(id_: RequestId, result: dict[str, Any]) -> Reply:
    return Reply({"jsonrpc": "2.0", "id": id_, "result": result})


def handle_line(line: bytes) -> Outcome:
    if len(line) > MAX_LINE:
        return _error(None, -32600, f"message longer than {MAX_LINE} bytes")
    try:
        message = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        return _error(None, -32700, f"parse error: {exc}")
    if not isinstance(message, dict) or not isinstance(message.get("method"), str):
        if isinstance(message, dict) and ("result" in message or "error" in message):
            return Silent()  # a response to nothing we asked: ignore
        return _error(None, -32600, "not a JSON-RPC request")
    method: str = message["method"]
    if "id" not in message:
        return Silent()  # a notification (notifications/initialized, cancelled, ...)
    id_ = message["id"]
    if not isinstance(id_, int | str) or isinstance(id_, bool):
        return _error(None, -32600, "the id must be a string or a number")
    params = message.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        return _error(id_, -32602, "params must be an object")
    if method == "initialize":
        asked = params.get("protocolVersion")
        version = asked if asked in SUPPORTED_VERSIONS else SUPPORTED_VERSIONS[0]
        return _result(
            id_,
            {
                "protocolVersion": version,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": SERVER_INFO,
            },
        )
    if method == "ping":
        return _result(id_, {})
    if method == "tools/list":
        return NeedList(id_)
    if method == "tools/call":
        name = params.get("name")
        arguments = params.get("arguments")
        arguments = {} if arguments is None else arguments
        if not isinstance(name, str) or not name:
            return _error(id_, -32602, "tools/call needs a tool name")
        if not isinstance(arguments, dict):
            return _error(id_, -32602, "tools/call arguments must be an object")
        return NeedCall(id_, name.removeprefix(PREFIX), arguments)
    return _error(id_, -32601, f"method not found: {method}")


def list_reply(id_: RequestId, catalogue: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer to ``tools/list`` from the bridge's listing (``sage.v1.request.tools``)."""
    tools = [
        {
            "name": str(tool.get("name", "")).removeprefix(PREFIX),
            "description": tool.get("description", ""),
            "inputSchema": tool.get("inputSchema") or {"type": "object"},
        }
        for tool in catalogue
        if isinstance(tool, dict)
    ]
    return _result(id_, {"tools": tools}).message


def call_reply(id_: RequestId, content: Any, is_error: bool) -> dict[str, Any]:
    blocks = content if isinstance(content, list) else [{"type": "text", "text": str(content)}]
    return _result(id_, {"content": blocks, "isError": bool(is_error)}).message
