"""Typed messages of Claude Code's stream-json output and control protocol.

This module owns the shapes: msgspec Structs for every stdout line sage acts
on (``system/init``, ``system/api_retry``, ``system/status``, ``assistant``,
``user``, ``result``, ``stream_event``, ``control_request``,
``control_response``, ``control_cancel_request``) with only the fields sage
needs.  Fields the CLI adds between releases are ignored by msgspec; types
and subtypes it does not know come out as :class:`UnknownMessage`,
:class:`UnknownBlock` or :class:`UnknownRequest` holding the raw bytes.  JSON
that is payload for another layer (the JSON-RPC body of ``mcp_message``, the
``initialize`` answer) is kept as :class:`msgspec.Raw` so that layer decodes
it with its own schema; an empty ``Raw()`` means the key was absent.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeAlias

import msgspec

__all__ = (
    "AssistantBody",
    "AssistantMessage",
    "CanUseToolRequest",
    "ContentBlock",
    "ControlCancelRequest",
    "ControlRequest",
    "ControlRequestBody",
    "ControlResponse",
    "ControlResponseBody",
    "HookCallbackRequest",
    "InitializeRequest",
    "InterruptRequest",
    "McpMessageRequest",
    "McpServerStatus",
    "Message",
    "PermissionDenial",
    "RedactedThinkingBlock",
    "ResultMessage",
    "StreamEvent",
    "SystemApiRetry",
    "SystemInformational",
    "SystemInit",
    "SystemPermissionDenied",
    "SystemStatus",
    "TextBlock",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
    "UnknownBlock",
    "UnknownMessage",
    "UnknownRequest",
    "Usage",
    "UserBody",
    "UserMessage",
)

_EMPTY = msgspec.Raw()
_EVENT: msgspec.json.Decoder[Any] = msgspec.json.Decoder()


class _Base(msgspec.Struct, frozen=True, gc=False):
    """Decoded data never holds reference cycles, so the GC need not track it."""


# -- content blocks ---------------------------------------------------------


class TextBlock(_Base, tag_field="type", tag="text", frozen=True):
    text: str


class ToolUseBlock(_Base, tag_field="type", tag="tool_use", frozen=True):
    id: str
    name: str
    input: dict[str, Any] = {}


class ToolResultBlock(_Base, tag_field="type", tag="tool_result", frozen=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False


class ThinkingBlock(_Base, tag_field="type", tag="thinking", frozen=True):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(_Base, tag_field="type", tag="redacted_thinking", frozen=True):
    data: str = ""


class UnknownBlock(_Base, tag_field="type", tag="__unknown__", frozen=True):
    """A content block of a type this release of sage does not know."""

    block_type: str = ""
    raw: msgspec.Raw = _EMPTY


ContentBlock: TypeAlias = (
    TextBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
    | UnknownBlock
)


class Usage(_Base, frozen=True):
    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


# -- conversation messages --------------------------------------------------


class AssistantBody(_Base, frozen=True):
    content: list[ContentBlock] = []
    id: str = ""
    model: str = ""
    stop_reason: str | None = None
    usage: Usage | None = None


class AssistantMessage(_Base, tag_field="type", tag="assistant", frozen=True):
    kind: ClassVar[str] = "assistant"
    message: AssistantBody
    session_id: str = ""
    parent_tool_use_id: str | None = None
    uuid: str = ""
    error: str | None = None


class UserBody(_Base, frozen=True):
    content: str | list[ContentBlock] = ""
    role: str = "user"


class UserMessage(_Base, tag_field="type", tag="user", frozen=True):
    kind: ClassVar[str] = "user"
    message: UserBody
    session_id: str = ""
    parent_tool_use_id: str | None = None
    uuid: str = ""


class PermissionDenial(_Base, frozen=True):
    tool_name: str
    tool_use_id: str = ""
    tool_input: dict[str, Any] = {}


class ResultMessage(_Base, tag_field="type", tag="result", frozen=True):
    """The end of one turn: ``subtype`` is ``success`` or an error subtype."""

    kind: ClassVar[str] = "result"
    subtype: str
    is_error: bool = False
    session_id: str = ""
    num_turns: int = 0
    duration_ms: int = 0
    total_cost_usd: float = 0.0
    usage: Usage | None = None
    permission_denials: list[PermissionDenial] = []
    result: str | None = None
    stop_reason: str | None = None
    terminal_reason: str | None = None
    api_error_status: int | None = None


class StreamEvent(_Base, tag_field="type", tag="stream_event", frozen=True):
    """A raw Messages API streaming event (``--include-partial-messages``)."""

    kind: ClassVar[str] = "stream_event"
    event: msgspec.Raw
    session_id: str = ""
    parent_tool_use_id: str | None = None
    uuid: str = ""
    api_message_id: str = ""
    """The Messages API message the event belongs to (2.1.328 names it on each event)."""

    def event_dict(self) -> dict[str, Any]:
        """The event decoded (left raw on the hot path: most are only forwarded)."""
        obj = _EVENT.decode(self.event)
        return obj if isinstance(obj, dict) else {}


# -- system messages (second decoding step on ``subtype``) ------------------


class McpServerStatus(_Base, frozen=True):
    name: str
    status: str = ""
    source: str | None = None


class SystemInit(_Base, frozen=True):
    kind: ClassVar[str] = "system/init"
    session_id: str
    tools: list[str] = []
    mcp_servers: list[McpServerStatus] = []
    model: str = ""
    cwd: str = ""
    claude_code_version: str = ""
    capabilities: list[str] = []
    permission_mode: str | None = msgspec.field(default=None, name="permissionMode")
    api_key_source: str | None = msgspec.field(default=None, name="apiKeySource")
    uuid: str = ""


class SystemApiRetry(_Base, frozen=True):
    kind: ClassVar[str] = "system/api_retry"
    attempt: int
    max_retries: int = 0
    retry_delay_ms: int = 0
    error_status: int | None = None
    error: str | None = None
    session_id: str = ""
    uuid: str = ""


class SystemStatus(_Base, frozen=True):
    kind: ClassVar[str] = "system/status"
    status: str | None = None
    session_id: str = ""
    uuid: str = ""


class SystemPermissionDenied(_Base, frozen=True):
    """The CLI refused a tool call by itself (seen: ``decision_reason_type``
    ``classifier`` in the ``auto`` permission mode of 2.1.296 to 2.1.301)."""

    kind: ClassVar[str] = "system/permission_denied"
    tool_name: str = ""
    tool_use_id: str = ""
    decision_reason_type: str | None = None
    decision_reason: str | None = None
    message: str | None = None
    session_id: str = ""
    uuid: str = ""


class SystemInformational(_Base, frozen=True):
    """A notice the CLI prints for its user (``content`` is prose, not protocol)."""

    kind: ClassVar[str] = "system/informational"
    content: str = ""
    session_id: str = ""
    uuid: str = ""


# -- control protocol -------------------------------------------------------


class McpMessageRequest(_Base, tag_field="subtype", tag="mcp_message", frozen=True):
    """JSON-RPC for an ``sdk`` MCP server; ``message`` is left undecoded."""

    server_name: str
    message: msgspec.Raw


class HookCallbackRequest(_Base, tag_field="subtype", tag="hook_callback", frozen=True):
    callback_id: str
    input: dict[str, Any] = {}
    tool_use_id: str | None = None


class CanUseToolRequest(_Base, tag_field="subtype", tag="can_use_tool", frozen=True):
    tool_name: str
    input: dict[str, Any] = {}
    tool_use_id: str | None = None
    permission_suggestions: list[dict[str, Any]] | None = None
    blocked_path: str | None = None


class InitializeRequest(_Base, tag_field="subtype", tag="initialize", frozen=True):
    hooks: dict[str, Any] | None = None


class InterruptRequest(_Base, tag_field="subtype", tag="interrupt", frozen=True):
    pass


class UnknownRequest(_Base, tag_field="subtype", tag="__unknown__", frozen=True):
    """A control request subtype sage does not know; answer it with an error."""

    name: str = ""
    raw: msgspec.Raw = _EMPTY


ControlRequestBody: TypeAlias = (
    McpMessageRequest
    | HookCallbackRequest
    | CanUseToolRequest
    | InitializeRequest
    | InterruptRequest
    | UnknownRequest
)


class ControlRequest(_Base, tag_field="type", tag="control_request", frozen=True):
    kind: ClassVar[str] = "control_request"
    request_id: str
    request: ControlRequestBody


class ControlResponseBody(_Base, frozen=True):
    """``subtype`` is ``success`` (with ``response``) or ``error`` (with ``error``)."""

    subtype: str
    request_id: str
    response: msgspec.Raw = _EMPTY
    error: str | None = None


class ControlResponse(_Base, tag_field="type", tag="control_response", frozen=True):
    kind: ClassVar[str] = "control_response"
    response: ControlResponseBody


class ControlCancelRequest(_Base, tag_field="type", tag="control_cancel_request", frozen=True):
    kind: ClassVar[str] = "control_cancel_request"
    request_id: str


class UnknownMessage(_Base, frozen=True):
    """A JSON object line sage could not type.

    ``error`` is None when the type (or system subtype) is simply unknown, and
    holds msgspec's message when a known type did not match its schema.
    """

    kind: ClassVar[str] = "unknown"
    type: str | None
    subtype: str | None
    raw: bytes
    error: str | None = None


Message: TypeAlias = (
    SystemInit
    | SystemApiRetry
    | SystemStatus
    | SystemPermissionDenied
    | SystemInformational
    | AssistantMessage
    | UserMessage
    | ResultMessage
    | StreamEvent
    | ControlRequest
    | ControlResponse
    | ControlCancelRequest
    | UnknownMessage
)
