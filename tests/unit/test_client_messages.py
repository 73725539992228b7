"""sage.client's messages decoded from session event payloads, with no process or bus."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import pytest

from capsules.runner.conversation import Conversation, Publish
from sage.claude.protocol import StreamDecoder
from sage.client import (
    ApprovalDecision,
    ApprovalRequest,
    AssistantMessage,
    ResultMessage,
    Retry,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)
from sage.client.messages import decode_event
from sage.errors import ProtocolError


def _published(*lines: Mapping[str, object]) -> list[Publish]:
    """What the runner's conversation core publishes for these CLI lines (turn 1)."""
    conv = Conversation("alice", "s1", "default")
    conv.initialized()
    conv.sent()
    decoder = StreamDecoder(1 << 20)
    data = b"".join(msgspec.json.encode(line) + b"\n" for line in lines)
    out = []
    for event in [*decoder.feed(data), *decoder.eof()]:
        out += [o for o in conv.receive(event, 0.0) if isinstance(o, Publish)]
    return out


def _decoded(*lines: Mapping[str, object]) -> list[object]:
    """The client's messages for the events those lines become, on the wire and back."""
    return [
        m
        for p in _published(*lines)
        if (m := decode_event(p.name, msgspec.json.encode(p.payload))) is not None
    ]


def test_an_assistant_line_becomes_an_sdk_shaped_assistant_message() -> None:
    """Text, thinking and tool use blocks, the message id, model and usage come through."""
    line = {
        "type": "assistant",
        "message": {
            "id": "msg_7",
            "model": "claude-x",
            "content": [
                {"type": "thinking", "thinking": "let me see", "signature": "s"},
                {"type": "text", "text": "Hi"},
                {"type": "tool_use", "id": "tu1", "name": "mcp__sage__greet", "input": {"n": 1}},
            ],
            "usage": {"input_tokens": 3, "output_tokens": 4},
        },
        "parent_tool_use_id": None,
    }
    messages = _decoded(line)
    [assistant] = [m for m in messages if isinstance(m, AssistantMessage)]
    assert assistant.content == [
        ThinkingBlock(thinking="let me see"),
        TextBlock(text="Hi"),
        ToolUseBlock(id="tu1", name="mcp__sage__greet", input={"n": 1}),
    ]
    assert (assistant.message_id, assistant.model, assistant.turn) == ("msg_7", "claude-x", 1)
    assert assistant.usage is not None
    assert assistant.usage["output_tokens"] == 4
    assert TextDelta(text="Hi", turn=1) in messages  # the unstreamed text, whole


def test_a_tool_result_echo_becomes_a_user_message_with_its_content() -> None:
    """The CLI's tool_result echo: content, error flag and the tool's name."""
    use = {"type": "tool_use", "id": "tu1", "name": "mcp__sage__greet", "input": {}}
    assistant = {"type": "assistant", "message": {"content": [use]}, "parent_tool_use_id": None}
    result = {"type": "tool_result", "tool_use_id": "tu1", "content": "Hello", "is_error": True}
    user = {"type": "user", "message": {"role": "user", "content": [result]}}
    [message] = [m for m in _decoded(assistant, user) if isinstance(m, UserMessage)]
    [block] = message.content
    assert isinstance(block, ToolResultBlock)
    assert (block.tool_use_id, block.content, block.is_error, block.name) == (
        "tu1",
        "Hello",
        True,
        "mcp__sage__greet",
    )


def test_a_result_line_becomes_a_result_message_with_reason_text_usage_and_cost() -> None:
    """The end of a turn carries how it ended, its text, usage, cost and duration."""
    line = {
        "type": "result",
        "subtype": "success",
        "is_error": False,
        "result": "all done",
        "total_cost_usd": 0.25,
        "duration_ms": 1200,
        "num_turns": 2,
        "usage": {"input_tokens": 10, "output_tokens": 20},
    }
    [result] = _decoded(line)
    assert isinstance(result, ResultMessage)
    assert (result.reason, result.result, result.total_cost_usd, result.duration_ms) == (
        "completed",
        "all done",
        0.25,
        1200,
    )
    assert result.usage["output_tokens"] == 20


def test_approvals_and_retries_decode_and_other_events_are_no_messages() -> None:
    """approval_request, approval and retry have their types; spawned, init do not."""
    request = decode_event(
        "approval_request",
        b'{"approval_id":"a1","session_id":"s","principal_id":"alice","tool_name":"t",'
        b'"arguments":{"x":1},"tool_use_id":"tu","expires_at":5.0,"turn":2}',
    )
    assert request == ApprovalRequest(
        approval_id="a1",
        tool_name="t",
        input={"x": 1},
        tool_use_id="tu",
        expires_at=5.0,
        session_id="s",
        principal_id="alice",
        turn=2,
    )
    decision = decode_event(
        "approval",
        b'{"approval_id":"a1","tool_name":"t","tool_use_id":"tu","allowed":false,'
        b'"source":"timeout","reason":"no approver answered","turn":2}',
    )
    assert isinstance(decision, ApprovalDecision)
    assert (decision.allowed, decision.source) == (False, "timeout")
    retry = decode_event("retry", b'{"attempt":2,"max_retries":10,"status":529,"turn":1}')
    assert retry == Retry(attempt=2, max_retries=10, status=529, turn=1)
    assert decode_event("spawned", b'{"pid":1}') is None
    assert decode_event("init", b"{}") is None


def test_a_payload_of_the_wrong_shape_is_a_protocol_error() -> None:
    """A malformed event is a ProtocolError with its code, never a half-built message."""
    with pytest.raises(ProtocolError) as bad:
        decode_event("done", b'{"is_error": "yes"}')
    assert bad.value.code == "protocol_error"
