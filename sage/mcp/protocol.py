"""The one JSON-RPC 2.0 / MCP core of sage's MCP servers: bytes in, decisions out, no I/O.

Three servers share it: ``astrid mcp serve`` (:mod:`sage.mcp.serve`, newline-
delimited JSON-RPC on stdio) and the runner's two in-band ``sdk`` servers,
``sage`` and ``forge`` (:mod:`capsules.runner.mcp`, JSON-RPC carried in the
CLI's ``mcp_message`` control requests).  A :class:`Server` says what each
announces in ``initialize`` and how it reads tool names.

One message goes to :func:`handle_line`, which answers at once
(:class:`Reply`: ``initialize``, ``ping``, errors), asks the shell to fetch
the tool list (:class:`NeedList`) or to run a call (:class:`NeedCall`), or
says nothing is to be sent (:class:`Silent`: notifications, and responses to
nothing we asked).  The shell builds the answers to the last two with
:func:`result` (or :func:`list_reply` and :func:`call_reply`, which shape the
tool bridge's answers for stdio).  Errors follow JSON-RPC: -32700 for a
message that is not JSON, -32600 for one that is not a request (both
:class:`Unreadable`, id null), -32601 for an unknown method, -32602 for bad
params.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

__all__ = (
    "MAX_LINE",
    "STDIO",
    "SUPPORTED_VERSIONS",
    "NeedCall",
    "NeedList",
    "Outcome",
    "Reply",
    "RequestId",
    "Server",
    "Silent",
    "Unreadable",
    "call_reply",
    "handle_line",
    "list_reply",
    "result",
)

SUPPORTED_VERSIONS: Final = ("2025-06-18", "2025-03-26", "2024-11-05")
MAX_LINE: Final = 16 * 1024 * 1024
PREFIX: Final = "mcp__sage__"

RequestId = int | str | None


@dataclass(frozen=True)
class Server:
    """What one MCP server announces in ``initialize``, and how it reads tool names."""

    name: str
    version: str = "0.1.0"
    list_changed: bool = False
    """Whether it may send ``notifications/tools/list_changed``."""
    negotiate: bool = True
    """True: answer the client's protocol version if supported, else the newest
    supported.  False: echo the client's (the in-band servers, whose client is
    the CLI that carries them), the newest supported when it names none."""
    prefix: str = ""
    """Taken off the front of a called tool's name."""


STDIO: Final = Server("sage", prefix=PREFIX)
"""``astrid mcp serve``: tools named as the bridge lists them, versions negotiated.
(The runner's in-band servers are described in :mod:`capsules.runner.mcp`.)"""


@dataclass(frozen=True)
class Reply:
    message: dict[str, Any]


@dataclass(frozen=True)
class Unreadable(Reply):
    """An error answer to a message that is no request at all (its id is null):
    stdio sends it, the in-band servers fail the control request instead."""

    @property
    def text(self) -> str:
        text: str = self.message["error"]["message"]
        return text


@dataclass(frozen=True)
class NeedList:
    id: RequestId


@dataclass(frozen=True)
class NeedCall:
    id: RequestId
    name: str
    arguments: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)
    """The request's ``_meta`` (the CLI puts ``claudecode/toolUseId`` there)."""


@dataclass(frozen=True)
class Silent:
    pass


Outcome = Reply | NeedList | NeedCall | Silent


def _error(id_: RequestId, code: int, message: str) -> Reply:
    return Reply({"jsonrpc": "2.0", "id": id_, "error": {"code": code, "message": message}})


def _unreadable(code: int, message: str) -> Unreadable:
    return Unreadable({"jsonrpc": "2.0", "id": None, "error": {"code": code, "message": message}})


def result(id_: RequestId, body: dict[str, Any]) -> dict[str, Any]:
    """The JSON-RPC success response carrying ``body``."""
    return {"jsonrpc": "2.0", "id": id_, "result": body}


def handle_line(line: bytes, server: Server = STDIO) -> Outcome:
    """What to do with one JSON-RPC message addressed to ``server``."""
    if len(line) > MAX_LINE:
        return _unreadable(-32600, f"message longer than {MAX_LINE} bytes")
    try:
        message = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        return _unreadable(-32700, f"parse error: {exc}")
    if not isinstance(message, dict) or not isinstance(message.get("method"), str):
        if isinstance(message, dict) and ("result" in message or "error" in message):
            return Silent()  # a response to nothing we asked: ignore
        return _unreadable(-32600, "not a JSON-RPC request")
    method: str = message["method"]
    if "id" not in message:
        return Silent()  # a notification (notifications/initialized, cancelled, ...)
    id_ = message["id"]
    if not isinstance(id_, int | str) or isinstance(id_, bool):
        return _unreadable(-32600, "the id must be a string or a number")
    params = message.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        return _error(id_, -32602, "params must be an object")
    if method == "initialize":
        return Reply(result(id_, _initialize(server, params)))
    if method == "ping":
        return Reply(result(id_, {}))
    if method == "tools/list":
        return NeedList(id_)
    if method == "tools/call":
        name = params.get("name")
        arguments = params.get("arguments")
        arguments = {} if arguments is None else arguments
        meta = params.get("_meta")
        if not isinstance(name, str) or not name:
            return _error(id_, -32602, "tools/call needs a tool name")
        if not isinstance(arguments, dict):
            return _error(id_, -32602, "tools/call arguments must be an object")
        meta = meta if isinstance(meta, dict) else {}
        return NeedCall(id_, name.removeprefix(server.prefix), arguments, meta)
    return _error(id_, -32601, f"method not found: {method}")


def _initialize(server: Server, params: dict[str, Any]) -> dict[str, Any]:
    asked = params.get("protocolVersion")
    if server.negotiate:
        version = asked if asked in SUPPORTED_VERSIONS else SUPPORTED_VERSIONS[0]
    else:
        version = params.get("protocolVersion", SUPPORTED_VERSIONS[0])
    return {
        "protocolVersion": version,
        "capabilities": {"tools": {"listChanged": server.list_changed}},
        "serverInfo": {"name": server.name, "version": server.version},
    }


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
    return result(id_, {"tools": tools})


def call_reply(id_: RequestId, content: Any, is_error: bool) -> dict[str, Any]:
    blocks = content if isinstance(content, list) else [{"type": "text", "text": str(content)}]
    return result(id_, {"content": blocks, "isError": bool(is_error)})
