"""Encoders for what the host writes to Claude Code's stdin.

This module owns the exact bytes of every line sage sends: user turns,
control requests (``initialize``, ``interrupt``, ``mcp_message``
notifications) and control responses (success, error, and the
``mcp_response``, hook and permission wrappers).  Each function returns one
compact JSON line ending in ``b"\\n"``; the shapes follow NOTES.md of the
pinned CLI.  Payloads that another layer already encoded may be passed as
:class:`msgspec.Raw` and are written through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

__all__ = (
    "HookMatcher",
    "encode_control_error",
    "encode_control_request",
    "encode_control_success",
    "encode_hook_response",
    "encode_initialize",
    "encode_interrupt",
    "encode_mcp_notification",
    "encode_mcp_response",
    "encode_permission_allow",
    "encode_permission_deny",
    "encode_user_turn",
)

_ENCODER = msgspec.json.Encoder()


class HookMatcher(msgspec.Struct, frozen=True):
    """One entry of an ``initialize`` hooks list: a matcher and its callback ids."""

    matcher: str | None
    hook_callback_ids: list[str] = msgspec.field(name="hookCallbackIds")


class _UserBody(msgspec.Struct):
    role: str
    content: str | Sequence[Any]


class _UserTurn(msgspec.Struct, tag_field="type", tag="user"):
    message: _UserBody
    parent_tool_use_id: str | None
    session_id: str


class _ControlRequestOut(msgspec.Struct, tag_field="type", tag="control_request"):
    request_id: str
    request: Mapping[str, Any]


class _Success(msgspec.Struct, tag_field="subtype", tag="success", omit_defaults=True):
    request_id: str
    response: Any = None


class _Error(msgspec.Struct, tag_field="subtype", tag="error"):
    request_id: str
    error: str


class _ControlResponseOut(msgspec.Struct, tag_field="type", tag="control_response"):
    response: _Success | _Error


def _line(obj: object) -> bytes:
    buf = bytearray()
    _ENCODER.encode_into(obj, buf)
    buf += b"\n"
    return bytes(buf)


def encode_user_turn(
    content: str | Sequence[Any],
    *,
    session_id: str = "default",
    parent_tool_use_id: str | None = None,
) -> bytes:
    """A user turn; ``content`` is text or a list of content blocks."""
    return _line(_UserTurn(_UserBody("user", content), parent_tool_use_id, session_id))


def encode_control_request(request_id: str, request: Mapping[str, Any]) -> bytes:
    """Any control request; ``request`` holds ``subtype`` first."""
    return _line(_ControlRequestOut(request_id, request))


def encode_initialize(
    request_id: str,
    hooks: Mapping[str, Sequence[HookMatcher]] | None = None,
    **fields: Any,
) -> bytes:
    """The first line of a session: register hook callbacks (and more ``fields``)."""
    request: dict[str, Any] = {"subtype": "initialize"}
    if hooks is not None:
        request["hooks"] = {event: list(matchers) for event, matchers in hooks.items()}
    request.update(fields)
    return encode_control_request(request_id, request)


def encode_interrupt(request_id: str) -> bytes:
    """Stop the current turn; the CLI answers and ends the turn with a result."""
    return encode_control_request(request_id, {"subtype": "interrupt"})


def encode_mcp_notification(
    request_id: str,
    server_name: str,
    method: str,
    params: Mapping[str, Any] | None = None,
) -> bytes:
    """A JSON-RPC notification to the CLI for an sdk MCP server, e.g. tools/list_changed."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    return encode_control_request(
        request_id,
        {"subtype": "mcp_message", "server_name": server_name, "message": message},
    )


def encode_control_success(request_id: str, response: Any = None) -> bytes:
    """Answer a control request; ``response`` None leaves the key out."""
    return _line(_ControlResponseOut(_Success(request_id, response)))


def encode_control_error(request_id: str, error: str) -> bytes:
    """Refuse a control request with a message."""
    return _line(_ControlResponseOut(_Error(request_id, error)))


def encode_mcp_response(request_id: str, jsonrpc_response: Any) -> bytes:
    """Answer an ``mcp_message`` with the server's JSON-RPC response (dict or Raw)."""
    return encode_control_success(request_id, {"mcp_response": jsonrpc_response})


def encode_hook_response(request_id: str, output: Mapping[str, Any] | None = None) -> bytes:
    """Answer a ``hook_callback``; no output means ``{"continue": true}``."""
    return encode_control_success(request_id, {"continue": True} if output is None else output)


def encode_permission_allow(request_id: str, updated_input: Mapping[str, Any]) -> bytes:
    """Let a ``can_use_tool`` request run with ``updated_input``."""
    return encode_control_success(request_id, {"behavior": "allow", "updatedInput": updated_input})


def encode_permission_deny(request_id: str, message: str) -> bytes:
    """Refuse a ``can_use_tool`` request; the model sees ``message``."""
    return encode_control_success(request_id, {"behavior": "deny", "message": message})
