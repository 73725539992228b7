"""Sans-IO codec for Claude Code's stream-json output and control protocol.

Bytes in, typed msgspec messages out (:class:`StreamDecoder`), one encoded
line per host message out (the ``encode_*`` functions), and the request
bookkeeping of the control protocol (:class:`ControlChannel`).  Nothing here
does I/O; the session runner moves the bytes.

The names below are imported when first used (PEP 562): a program that needs
one encoder (``astrid sage send`` sizing a turn) does not load the decoder and
every message type.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from sage.claude.protocol.control import (
        ChannelState,
        ControlChannel,
        ControlOutcome,
        IncomingState,
        OutgoingState,
    )
    from sage.claude.protocol.decoder import (
        DEFAULT_MAX_LINE_BYTES,
        DecoderCounters,
        DecoderState,
        Event,
        InvalidLine,
        LineTooLong,
        StreamDecoder,
    )
    from sage.claude.protocol.encoder import (
        HookMatcher,
        encode_control_error,
        encode_control_request,
        encode_control_success,
        encode_hook_response,
        encode_initialize,
        encode_interrupt,
        encode_mcp_notification,
        encode_mcp_response,
        encode_permission_allow,
        encode_permission_deny,
        encode_user_turn,
    )
    from sage.claude.protocol.messages import (
        AssistantBody,
        AssistantMessage,
        CanUseToolRequest,
        ContentBlock,
        ControlCancelRequest,
        ControlRequest,
        ControlRequestBody,
        ControlResponse,
        ControlResponseBody,
        HookCallbackRequest,
        InitializeRequest,
        InterruptRequest,
        McpMessageRequest,
        McpServerStatus,
        Message,
        PermissionDenial,
        RedactedThinkingBlock,
        ResultMessage,
        StreamEvent,
        SystemApiRetry,
        SystemInformational,
        SystemInit,
        SystemPermissionDenied,
        SystemStatus,
        TextBlock,
        ThinkingBlock,
        ToolResultBlock,
        ToolUseBlock,
        UnknownBlock,
        UnknownMessage,
        UnknownRequest,
        Usage,
        UserBody,
        UserMessage,
    )

__all__ = (
    "DEFAULT_MAX_LINE_BYTES",
    "AssistantBody",
    "AssistantMessage",
    "CanUseToolRequest",
    "ChannelState",
    "ContentBlock",
    "ControlCancelRequest",
    "ControlChannel",
    "ControlOutcome",
    "ControlRequest",
    "ControlRequestBody",
    "ControlResponse",
    "ControlResponseBody",
    "DecoderCounters",
    "DecoderState",
    "Event",
    "HookCallbackRequest",
    "HookMatcher",
    "IncomingState",
    "InitializeRequest",
    "InterruptRequest",
    "InvalidLine",
    "LineTooLong",
    "McpMessageRequest",
    "McpServerStatus",
    "Message",
    "OutgoingState",
    "PermissionDenial",
    "RedactedThinkingBlock",
    "ResultMessage",
    "StreamDecoder",
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

_EXPORTS = {
    "ChannelState": "sage.claude.protocol.control",
    "ControlChannel": "sage.claude.protocol.control",
    "ControlOutcome": "sage.claude.protocol.control",
    "IncomingState": "sage.claude.protocol.control",
    "OutgoingState": "sage.claude.protocol.control",
    "DEFAULT_MAX_LINE_BYTES": "sage.claude.protocol.decoder",
    "DecoderCounters": "sage.claude.protocol.decoder",
    "DecoderState": "sage.claude.protocol.decoder",
    "Event": "sage.claude.protocol.decoder",
    "InvalidLine": "sage.claude.protocol.decoder",
    "LineTooLong": "sage.claude.protocol.decoder",
    "StreamDecoder": "sage.claude.protocol.decoder",
    "HookMatcher": "sage.claude.protocol.encoder",
    "encode_control_error": "sage.claude.protocol.encoder",
    "encode_control_request": "sage.claude.protocol.encoder",
    "encode_control_success": "sage.claude.protocol.encoder",
    "encode_hook_response": "sage.claude.protocol.encoder",
    "encode_initialize": "sage.claude.protocol.encoder",
    "encode_interrupt": "sage.claude.protocol.encoder",
    "encode_mcp_notification": "sage.claude.protocol.encoder",
    "encode_mcp_response": "sage.claude.protocol.encoder",
    "encode_permission_allow": "sage.claude.protocol.encoder",
    "encode_permission_deny": "sage.claude.protocol.encoder",
    "encode_user_turn": "sage.claude.protocol.encoder",
    "AssistantBody": "sage.claude.protocol.messages",
    "AssistantMessage": "sage.claude.protocol.messages",
    "CanUseToolRequest": "sage.claude.protocol.messages",
    "ContentBlock": "sage.claude.protocol.messages",
    "ControlCancelRequest": "sage.claude.protocol.messages",
    "ControlRequest": "sage.claude.protocol.messages",
    "ControlRequestBody": "sage.claude.protocol.messages",
    "ControlResponse": "sage.claude.protocol.messages",
    "ControlResponseBody": "sage.claude.protocol.messages",
    "HookCallbackRequest": "sage.claude.protocol.messages",
    "InitializeRequest": "sage.claude.protocol.messages",
    "InterruptRequest": "sage.claude.protocol.messages",
    "McpMessageRequest": "sage.claude.protocol.messages",
    "McpServerStatus": "sage.claude.protocol.messages",
    "Message": "sage.claude.protocol.messages",
    "PermissionDenial": "sage.claude.protocol.messages",
    "RedactedThinkingBlock": "sage.claude.protocol.messages",
    "ResultMessage": "sage.claude.protocol.messages",
    "StreamEvent": "sage.claude.protocol.messages",
    "SystemApiRetry": "sage.claude.protocol.messages",
    "SystemInformational": "sage.claude.protocol.messages",
    "SystemInit": "sage.claude.protocol.messages",
    "SystemPermissionDenied": "sage.claude.protocol.messages",
    "SystemStatus": "sage.claude.protocol.messages",
    "TextBlock": "sage.claude.protocol.messages",
    "ThinkingBlock": "sage.claude.protocol.messages",
    "ToolResultBlock": "sage.claude.protocol.messages",
    "ToolUseBlock": "sage.claude.protocol.messages",
    "UnknownBlock": "sage.claude.protocol.messages",
    "UnknownMessage": "sage.claude.protocol.messages",
    "UnknownRequest": "sage.claude.protocol.messages",
    "Usage": "sage.claude.protocol.messages",
    "UserBody": "sage.claude.protocol.messages",
    "UserMessage": "sage.claude.protocol.messages",
}


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sage.claude.protocol' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
