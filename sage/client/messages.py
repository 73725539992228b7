"""The typed messages of :mod:`sage.client`, and their decoding from session events.

Named and shaped after the Claude Agent SDK's where the meaning is the same
(:class:`AssistantMessage` with :class:`TextBlock`, :class:`ThinkingBlock` and
:class:`ToolUseBlock`; :class:`UserMessage` with :class:`ToolResultBlock`;
:class:`ResultMessage` at a turn's end), so a port is mostly renames; what only
sage has (approvals, retries, text deltas) has its own types.  docs/client.md
lists the differences.

Sans-IO: :func:`decode_event` turns one ``sage.v1.event.<sid>.<name>`` payload into
a message (None for an event a program does not read as one), nothing here touches
the bus.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

from sage.errors import ProtocolError

__all__ = (
    "ApprovalDecision",
    "ApprovalInfo",
    "ApprovalRequest",
    "AssistantMessage",
    "ContentBlock",
    "Message",
    "RedactedThinkingBlock",
    "ResultMessage",
    "Retry",
    "SessionInfo",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ToolResultBlock",
    "ToolUseBlock",
    "UserMessage",
    "decode_event",
)


class TextBlock(msgspec.Struct, tag_field="type", tag="text", frozen=True):
    text: str
    truncated: bool = False
    """The runner cut a text over 64 KiB (docs/topics.md, ``assistant``)."""


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", frozen=True):
    thinking: str
    truncated: bool = False


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking", frozen=True):
    pass


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", frozen=True):
    id: str
    name: str
    input: dict[str, Any] = {}
    input_preview: str | None = None
    """An input over 64 KiB: its first 64 KiB (then ``input`` is empty)."""
    input_bytes: int | None = None


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", frozen=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool = False
    name: str = ""
    duration_ms: int | None = None
    content_preview: str | None = None
    content_bytes: int | None = None


ContentBlock: TypeAlias = TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock


class AssistantMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One message of Claude's (the SDK's ``AssistantMessage``)."""

    content: list[ContentBlock]
    model: str = ""
    message_id: str = ""
    parent_tool_use_id: str | None = None
    stop_reason: str | None = None
    usage: dict[str, Any] | None = None
    turn: int = 0


class UserMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A tool's result, as the CLI echoed it (the SDK's ``UserMessage`` of tool results)."""

    content: list[ToolResultBlock]
    turn: int = 0


class TextDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of text as it streams (``include_partial_messages=True`` only)."""

    text: str
    turn: int = 0


class ApprovalRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call waits for a decision (``can_use_tool`` answers it)."""

    approval_id: str
    tool_name: str
    input: dict[str, Any] = msgspec.field(default_factory=dict, name="arguments")
    tool_use_id: str | None = None
    expires_at: float = 0.0
    session_id: str = ""
    principal_id: str = ""
    turn: int = 0


class ApprovalDecision(msgspec.Struct, frozen=True, kw_only=True):
    """How a tool call was decided: ``source`` ``approver``, ``allow_rule``,
    ``no_approver`` or ``timeout``."""

    approval_id: str
    tool_name: str
    allowed: bool
    source: str
    reason: str = ""
    tool_use_id: str | None = None
    rule: str | None = None
    input_updated: bool = False
    turn: int = 0


class Retry(msgspec.Struct, frozen=True, kw_only=True):
    """The CLI retries a failed Messages API request."""

    attempt: int
    max_retries: int = 0
    status: int | None = None
    error: str | None = None
    delay_ms: int = 0
    turn: int = 0


class ResultMessage(msgspec.Struct, frozen=True, kw_only=True):
    """The end of a turn (the SDK's ``ResultMessage``); ``reason`` says how it ended
    (``completed``, ``interrupted``, ``rate_limited``, ...: ``TurnEnd``)."""

    subtype: str
    is_error: bool
    reason: str
    result: str | None = None
    message: str | None = None
    """A failed turn's result text (at most 1,000 characters)."""
    usage: dict[str, Any] = {}
    total_cost_usd: float = 0.0
    num_turns: int = 0
    duration_ms: int = 0
    permission_denials: list[dict[str, Any]] = []
    turn: int = 0


class SessionInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A row of ``sage.sessions()``: live or ended, on this node or another."""

    session_id: str
    principal_id: str = ""
    pid: int | None = None
    state: str = ""
    node: str | None = None
    started_at: float | None = None
    turns: int = 0
    cost_usd: float = 0.0
    model: str | None = None
    reason: str | None = None
    """An ended session's end reason."""


class ApprovalInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A row of ``sage.approvals()``: a tool call waiting for the caller's decision."""

    approval_id: str
    session_id: str
    principal_id: str
    tool_name: str
    arguments: dict[str, Any] = {}
    tool_use_id: str | None = None
    age_s: float = 0.0
    expires_in_s: float = 0.0
    node: str | None = None


Message: TypeAlias = (
    AssistantMessage
    | UserMessage
    | TextDelta
    | ApprovalRequest
    | ApprovalDecision
    | Retry
    | ResultMessage
)

_BLOCKS = msgspec.json.Decoder(AssistantMessage)
_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "assistant": _BLOCKS,
    "approval_request": msgspec.json.Decoder(ApprovalRequest),
    "approval": msgspec.json.Decoder(ApprovalDecision),
    "retry": msgspec.json.Decoder(Retry),
    "done": msgspec.json.Decoder(ResultMessage),
}
_RESULT = msgspec.json.Decoder(ToolResultBlock)


class _Delta(msgspec.Struct, frozen=True):
    delta: str
    turn: int = 0


_DELTA = msgspec.json.Decoder(_Delta)


def decode_event(name: str, payload: bytes) -> Message | None:
    """The message of session event ``name`` (its JSON payload); None for an event that is
    none (``spawned``, ``init``, ``tool_use``: its call comes in the ``assistant``
    message); a :class:`~sage.errors.ProtocolError` for a payload of the wrong shape."""
    try:
        if name == "text":
            delta = _DELTA.decode(payload)
            return TextDelta(text=delta.delta, turn=delta.turn)
        if name == "tool_result":
            block = _RESULT.decode(payload)
            turn = msgspec.json.decode(payload, type=_Turn).turn
            return UserMessage(content=[block], turn=turn)
        decoder = _DECODERS.get(name)
        return None if decoder is None else decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"session event {name!r}: {exc}") from None


class _Turn(msgspec.Struct, frozen=True):
    turn: int = 0
