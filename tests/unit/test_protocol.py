"""The stream-json / control protocol codec, against the golden CLI transcripts."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sage.claude.protocol as protocol
from sage.claude.protocol import (
    AssistantMessage,
    CanUseToolRequest,
    ChannelState,
    ControlCancelRequest,
    ControlChannel,
    ControlRequest,
    ControlResponse,
    ControlResponseBody,
    DecoderState,
    Event,
    HookCallbackRequest,
    HookMatcher,
    IncomingState,
    InvalidLine,
    LineTooLong,
    McpMessageRequest,
    OutgoingState,
    ResultMessage,
    StreamDecoder,
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
    UserMessage,
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
from sage.errors import ProtocolError
from tests.support.transcripts import EXPECTED_KINDS, FIXTURES, REFERENCE

TRANSCRIPTS = sorted(p.name for p in REFERENCE.glob("*.jsonl"))
MB = 1 << 20
CHUNK = 64 * 1024


def golden(name: str) -> bytes:
    return (REFERENCE / name).read_bytes()


def decode(data: bytes, cuts: list[int] | None = None, limit: int = MB) -> list[Event]:
    """Feed ``data`` split at ``cuts`` (one feed if None), then eof."""
    decoder = StreamDecoder(limit)
    events: list[Event] = []
    prev = 0
    for cut in sorted(cuts or []):
        events += decoder.feed(data[prev:cut])
        prev = cut
    events += decoder.feed(data[prev:])
    events += decoder.eof()
    return events


def kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def of(events: list[Event], cls: type[Any]) -> list[Any]:
    return [e for e in events if isinstance(e, cls)]


def mcp_methods(events: list[Event]) -> list[str]:
    out = []
    for e in of(events, ControlRequest):
        if isinstance(e.request, McpMessageRequest):
            out.append(json.loads(bytes(e.request.message))["method"])
    return out


def test_reference_transcripts_present() -> None:
    """The golden transcripts are in the repository, recorded by tests/e2e/record.py."""
    assert set(TRANSCRIPTS) == set(EXPECTED_KINDS)


# -- golden transcripts ---------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_golden_kinds_and_counters(name: str) -> None:
    """Every transcript line decodes to the expected typed message, none unknown or invalid."""
    decoder = StreamDecoder()
    events = decoder.feed(golden(name)) + decoder.eof()
    assert kinds(events) == EXPECTED_KINDS[name]
    c = decoder.counters
    assert (c.messages, c.unknown, c.invalid, c.too_long) == (len(events), 0, 0, 0)


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_golden_setup_and_init(name: str) -> None:
    """Init carries model, tools, MCP servers and capabilities; setup is the MCP handshake."""
    events = decode(golden(name))
    init = of(events, SystemInit)[0]
    assert init.model == "claude-opus-5-5"
    assert init.claude_code_version == "2.1.328"
    assert init.cwd == "/home/svc/work"
    assert init.permission_mode == "default"
    assert "sdk_mcp_tools_list_changed" in init.capabilities
    if name == "print_text_only.jsonl":
        assert "Bash" in init.tools
        assert init.mcp_servers == []
        return
    assert init.tools == ["mcp__sage__greet"]
    assert [(s.name, s.status, s.source) for s in init.mcp_servers] == [
        ("sage", "connected", "sdk")
    ]
    assert mcp_methods(events)[:3] == ["initialize", "notifications/initialized", "tools/list"]
    response = of(events, ControlResponse)[0].response
    assert (response.subtype, response.request_id) == ("success", "req_init")
    assert "commands" in json.loads(bytes(response.response))


def test_golden_api_retry_401() -> None:
    """The 401 transcript is api_retry lines with growing delays and no result."""
    events = decode(golden("api_retry_401_truncated.jsonl"))
    retries = of(events, SystemApiRetry)
    assert [r.attempt for r in retries] == [1, 2, 3, 4]
    delays = [r.retry_delay_ms for r in retries]
    assert delays == sorted(delays), delays
    assert delays[0] > 0
    assert {(r.error_status, r.error, r.max_retries) for r in retries} == {
        (401, "authentication_failed", 10)
    }
    assert of(events, ResultMessage) == []
    ids = [e.request_id for e in of(events, ControlRequest)]
    assert len(ids) == 3
    assert len(set(ids)) == 3
    assert all(ids)


def test_golden_permission_prompt() -> None:
    """permission_prompt has a can_use_tool request, then tools/call, then a success result."""
    events = decode(golden("permission_prompt.jsonl"))
    requests = of(events, ControlRequest)
    assert [type(r.request).__name__ for r in requests] == [
        "McpMessageRequest",
        "McpMessageRequest",
        "McpMessageRequest",
        "CanUseToolRequest",
        "McpMessageRequest",
    ]
    ask = requests[3]
    assert ask.request_id
    assert ask.request_id not in {r.request_id for r in requests[:3]}
    assert isinstance(ask.request, CanUseToolRequest)
    assert ask.request.tool_name == "mcp__sage__greet"
    assert ask.request.input == {"name": "Ada"}
    assert ask.request.tool_use_id is not None
    assert ask.request.tool_use_id.startswith("toolu_")
    assert ask.request.permission_suggestions is not None
    assert ask.request.permission_suggestions[0]["behavior"] == "allow"
    assert mcp_methods(events)[3] == "tools/call"
    tool_use = of(events, AssistantMessage)[0].message.content[0]
    assert tool_use == ToolUseBlock(
        id=ask.request.tool_use_id, name="mcp__sage__greet", input={"name": "Ada"}
    )
    result_block = of(events, UserMessage)[0].message.content[0]
    assert isinstance(result_block, ToolResultBlock)
    assert result_block.tool_use_id == ask.request.tool_use_id
    assert result_block.content == [{"type": "text", "text": "Hello, Ada!"}]
    result = of(events, ResultMessage)[0]
    assert (result.subtype, result.is_error, result.num_turns) == ("success", False, 2)
    assert result.total_cost_usd > 0
    assert result.terminal_reason == "completed"
    assert result.permission_denials == []
    assert result.result == "hello from fake api after tool"
    assert result.usage is not None
    # the stand-in reports 12 input and 5 output tokens per message; two messages
    assert (result.usage.input_tokens, result.usage.output_tokens) == (24, 10)
    assert result.session_id == of(events, SystemInit)[0].session_id


def test_golden_hook_callback() -> None:
    """tool_loop_with_hook_callback has one PreToolUse hook_callback for hook_0."""
    events = decode(golden("tool_loop_with_hook_callback.jsonl"))
    hooks = [e for e in of(events, ControlRequest) if isinstance(e.request, HookCallbackRequest)]
    assert len(hooks) == 1
    hook = hooks[0]
    assert hook.request_id
    assert isinstance(hook.request, HookCallbackRequest)
    tool_use = of(events, AssistantMessage)[0].message.content[0]
    assert isinstance(tool_use, ToolUseBlock)
    assert (hook.request.callback_id, hook.request.tool_use_id) == ("hook_0", tool_use.id)
    assert hook.request.input["hook_event_name"] == "PreToolUse"
    assert hook.request.input["tool_input"] == {"name": "Ada"}
    result = of(events, ResultMessage)[0]
    assert (result.subtype, result.num_turns) == ("success", 2)


def test_golden_print_text_only() -> None:
    """A plain text turn: one text block and a one-turn result."""
    events = decode(golden("print_text_only.jsonl"))
    assert of(events, AssistantMessage)[0].message.content == [
        TextBlock(text="hello from fake api")
    ]
    result = of(events, ResultMessage)[0]
    assert (result.subtype, result.num_turns) == ("success", 1)
    assert result.total_cost_usd == pytest.approx(0.000148)


def test_golden_partial_messages() -> None:
    """tool_loop_partial: stream events in order, two turns, two results, status lines."""
    events = decode(golden("tool_loop_partial.jsonl"))
    stream = [e.event_dict()["type"] for e in of(events, StreamEvent)]
    turn = [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    # the stand-in streams a tool call's input in two input_json_delta events
    tool_turn = [*turn[:3], "content_block_delta", *turn[3:]]
    assert stream == tool_turn + turn * 2
    assert {s.status for s in of(events, SystemStatus)} == {"requesting"}
    results = of(events, ResultMessage)
    assert [(r.subtype, r.num_turns) for r in results] == [("success", 2), ("success", 1)]
    assert results[1].total_cost_usd == pytest.approx(0.000444)
    assert [type(r.request).__name__ for r in of(events, ControlRequest)][3] == "CanUseToolRequest"
    tool_uses = [
        b.name
        for a in of(events, AssistantMessage)
        for b in a.message.content
        if isinstance(b, ToolUseBlock)
    ]
    assert tool_uses == ["mcp__sage__greet"]


AUTO_MODE = FIXTURES / "claude-code-2.1.300" / "permission_mode_auto.jsonl"


def test_golden_auto_mode_classifier_denial() -> None:
    """2.1.300 without --permission-mode: init says auto, no can_use_tool is sent, the
    CLI's classifier denies the tool itself, and both system lines are typed."""
    decoder = StreamDecoder()
    events = decoder.feed(AUTO_MODE.read_bytes()) + decoder.eof()
    assert (decoder.counters.unknown, decoder.counters.invalid) == (0, 0)
    assert of(events, SystemInit)[0].permission_mode == "auto"
    assert not [e for e in of(events, ControlRequest) if isinstance(e.request, CanUseToolRequest)]
    (denied,) = of(events, SystemPermissionDenied)
    assert denied.kind == "system/permission_denied"
    assert (denied.tool_name, denied.decision_reason_type) == ("mcp__sage__greet", "classifier")
    tool_use = of(events, AssistantMessage)[0].message.content[0]
    assert isinstance(tool_use, ToolUseBlock)
    assert denied.tool_use_id == tool_use.id
    assert denied.message
    (note,) = of(events, SystemInformational)
    assert note.kind == "system/informational"
    assert "auto mode" in note.content


def test_known_system_subtype_with_a_wrong_field_type_is_unknown_not_fatal() -> None:
    """A permission_denied whose tool_name is not a string is reported, not raised."""
    line = b'{"type":"system","subtype":"permission_denied","tool_name":7}\n'
    decoder = StreamDecoder()
    (event,) = decoder.feed(line)
    assert isinstance(event, UnknownMessage)
    assert (event.type, event.subtype) == ("system", "permission_denied")
    assert event.error is not None


# -- chunking, CRLF, blank lines -------------------------------------------


def _chunked_equal(data: bytes, cuts: list[int]) -> None:
    assert decode(data, cuts) == decode(data)


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_chunkings_decode_the_same(name: str, data: st.DataObject) -> None:
    """Any split of a transcript into feeds yields the same messages as one feed."""
    blob = golden(name)
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=40))
    _chunked_equal(blob, cuts)


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_crlf_and_blank_lines_decode_the_same(name: str, data: st.DataObject) -> None:
    """CRLF endings and inserted blank lines change nothing, however the bytes are split."""
    lines = golden(name).split(b"\n")
    fillers = st.sampled_from([b"", b"\r", b"   ", b" \t\r"])
    out: list[bytes] = []
    for line in lines:
        out.extend(data.draw(st.lists(fillers, max_size=2)))
        out.append(line)
    blob = b"\r\n".join(out)
    cuts = data.draw(st.lists(st.integers(0, len(blob)), max_size=30))
    assert decode(blob, cuts) == decode(golden(name))


def test_byte_by_byte_feed() -> None:
    """Feeding one byte at a time decodes a whole transcript the same."""
    blob = golden("permission_prompt.jsonl")
    assert decode(blob, list(range(len(blob)))) == decode(blob)


def test_split_utf8() -> None:
    """A multi-byte character split inside its encoding, at every offset, decodes right."""
    text = "héllo wörld — 日本語 🎉"
    line = msgspec.json.encode(
        {"type": "assistant", "message": {"content": [{"type": "text", "text": text}]}}
    )
    blob = line + b"\n"
    assert "🎉".encode() in blob  # msgspec writes UTF-8, not \\u escapes
    for cut in range(len(blob) + 1):
        (msg,) = decode(blob, [cut])
        assert isinstance(msg, AssistantMessage)
        assert msg.message.content == [TextBlock(text=text)]


def test_eof_decodes_unterminated_line_and_closes() -> None:
    """eof() decodes a last line without newline; feeding afterwards raises."""
    decoder = StreamDecoder()
    assert decoder.feed(b'{"type":"control_cancel_request","request_id":"x"}') == []
    assert decoder.eof() == [ControlCancelRequest(request_id="x")]
    assert decoder.state is DecoderState.CLOSED
    with pytest.raises(ProtocolError):
        decoder.feed(b"\n")
    with pytest.raises(ProtocolError):
        decoder.eof()


def test_bytearray_feed_is_copied() -> None:
    """Raw payloads stay intact when the caller reuses its read buffer."""
    buf = bytearray(
        b'{"type":"control_request","request_id":"r","request":{"subtype":"mcp_message",'
        b'"server_name":"sage","message":{"jsonrpc":"2.0","method":"ping","id":7}}}\n'
    )
    decoder = StreamDecoder()
    (msg,) = decoder.feed(buf)  # type: ignore[arg-type]
    buf[:] = b"x" * len(buf)
    assert isinstance(msg, ControlRequest)
    assert isinstance(msg.request, McpMessageRequest)
    assert json.loads(bytes(msg.request.message)) == {"jsonrpc": "2.0", "method": "ping", "id": 7}


# -- line limit ----------------------------------------------------------------

NEXT = b'{"type":"control_cancel_request","request_id":"after"}\n'


def test_80mb_line_in_64k_chunks() -> None:
    """An 80 MB line fed in 64 KiB chunks: one LineTooLong, bounded buffer, next line decodes."""
    limit = MB
    decoder = StreamDecoder(limit)
    events = decoder.feed(b'{"type":"user","message":{"content":"')
    filler = b"x" * CHUNK
    peak = 0
    for _ in range(80 * MB // CHUNK):
        events += decoder.feed(filler)
        peak = max(peak, decoder.buffered)
    assert peak <= limit + CHUNK
    assert decoder.state is DecoderState.SKIPPING
    events += decoder.feed(b'"}}\n' + NEXT)
    events += decoder.eof()
    too_long = of(events, LineTooLong)
    assert len(too_long) == 1
    assert too_long[0].limit == limit
    assert limit < too_long[0].seen <= limit + CHUNK
    assert events[-1] == ControlCancelRequest(request_id="after")
    assert len(events) == 2
    assert decoder.counters.too_long == 1
    assert decoder.counters.skipped_bytes > 80 * MB


@pytest.mark.parametrize("chunk", [None, CHUNK, 3 * MB])
def test_5mb_line_with_1mb_limit(chunk: int | None) -> None:
    """A 5 MB line over a 1 MB limit is reported once, whatever the feed size."""
    line = b'{"type":"result","subtype":"success","result":"' + b"y" * (5 * MB) + b'"}\n'
    blob = NEXT + line + NEXT
    cuts = list(range(chunk, len(blob), chunk)) if chunk else None
    events = decode(blob, cuts, limit=MB)
    assert kinds(events) == ["control_cancel_request", "too_long", "control_cancel_request"]
    (too_long,) = of(events, LineTooLong)
    assert too_long.limit == MB
    assert too_long.seen > MB


def test_limit_is_inclusive() -> None:
    """A line of exactly max_line_bytes decodes; one byte more is too long."""
    line = NEXT.rstrip(b"\n")
    assert kinds(decode(line + b"\n", limit=len(line))) == ["control_cancel_request"]
    assert kinds(decode(line + b"\n", limit=len(line) - 1)) == ["too_long"]
    # the same, with the line completed across two feeds
    assert kinds(decode(line + b"\n", [5], limit=len(line))) == ["control_cancel_request"]
    assert kinds(decode(line + b"\n", [5], limit=len(line) - 1)) == ["too_long"]


def test_invalid_limit() -> None:
    """A non-positive limit is refused."""
    with pytest.raises(ValueError, match="positive"):
        StreamDecoder(0)


# -- tolerance ----------------------------------------------------------------


def test_non_json_and_non_object_lines() -> None:
    """Non-JSON and non-object lines become InvalidLine with a short preview, never raise."""
    good = golden("print_text_only.jsonl").split(b"\n")
    junk = b"Z" * 5000
    blob = b"\n".join([b"not json {", good[0], b"[1, 2]", b'"text"', b"42", junk, good[1], b"{"])
    decoder = StreamDecoder()
    events = decoder.feed(blob + b"\n") + decoder.eof()
    assert kinds(events) == [
        "invalid",
        "system/init",
        "invalid",
        "invalid",
        "invalid",
        "invalid",
        "assistant",
        "invalid",
    ]
    invalid = of(events, InvalidLine)
    assert invalid[0].reason.startswith("invalid JSON")
    assert invalid[0].preview == b"not json {"
    assert [i.reason for i in invalid[1:4]] == ["not a JSON object"] * 3
    assert invalid[4].preview == b"Z" * 200
    assert decoder.counters.invalid == 6
    assert decoder.counters.messages == 2


def test_unknown_type_passes_through() -> None:
    """rate_limit_event and a type-less object come out as counted UnknownMessage."""
    line = b'{"type":"rate_limit_event","rate_limit_info":{"status":"allowed"},"uuid":"u"}'
    decoder = StreamDecoder()
    events = decoder.feed(line + b"\r\n" + b'{"hello":1}\n' + NEXT)
    assert events[0] == UnknownMessage(type="rate_limit_event", subtype=None, raw=line)
    assert events[1] == UnknownMessage(type=None, subtype=None, raw=b'{"hello":1}')
    assert events[2] == ControlCancelRequest(request_id="after")
    assert (decoder.counters.unknown, decoder.counters.mismatched) == (2, 0)


def test_unknown_system_subtype_passes_through() -> None:
    """An unknown system subtype keeps its raw line; the known ones around it still decode."""
    line = b'{"type":"system","subtype":"compact_boundary","session_id":"s"}'
    retry = b'{"type":"system","subtype":"api_retry","attempt":2,"error_status":529}'
    first = b'{"type":"system","subtype":"api_retry","attempt":1}'
    (unknown, typed) = decode(first + b"\n" + line + b"\n" + retry)[1:]
    assert unknown == UnknownMessage(type="system", subtype="compact_boundary", raw=line)
    assert typed == SystemApiRetry(attempt=2, error_status=529)


def test_unknown_fields_are_ignored() -> None:
    """New fields, even where a merged schema could clash, do not stop a message decoding."""
    init = (
        b'{"type":"system","subtype":"init","session_id":"s","model":"m",'
        b'"status":{"nested":true},"attempt":"x","brand_new":[1,2,3]}'
    )
    result = b'{"type":"result","subtype":"success","num_turns":3,"future":{"a":[]}}'
    events = decode(init + b"\n" + result + b"\n")
    assert events[0] == SystemInit(session_id="s", model="m")
    assert isinstance(events[1], ResultMessage)
    assert events[1].num_turns == 3


def test_schema_mismatch_is_unknown_with_error() -> None:
    """A known type whose fields have the wrong types passes through with msgspec's error."""
    line = b'{"type":"result","subtype":"success","num_turns":"three"}'
    decoder = StreamDecoder()
    (event,) = decoder.feed(line + b"\n")
    assert isinstance(event, UnknownMessage)
    assert (event.type, event.subtype, event.raw) == ("result", "success", line)
    assert event.error is not None
    assert "num_turns" in event.error
    assert (decoder.counters.unknown, decoder.counters.mismatched) == (1, 1)


def test_unknown_content_blocks_are_tolerated() -> None:
    """Unknown block types become UnknownBlock with raw bytes; known blocks stay typed."""
    block = b'{"type":"server_tool_use","id":"s1","name":"web_search","input":{}}'
    line = (
        b'{"type":"assistant","message":{"content":[{"type":"thinking","thinking":"hm",'
        b'"signature":"sig"},' + block + b',{"type":"text","text":"ok"}]},"session_id":"s"}'
    )
    decoder = StreamDecoder()
    (msg,) = decoder.feed(line + b"\n")
    assert isinstance(msg, AssistantMessage)
    thinking, unknown, text = msg.message.content
    assert thinking == ThinkingBlock(thinking="hm", signature="sig")
    assert isinstance(unknown, UnknownBlock)
    assert unknown.block_type == "server_tool_use"
    assert bytes(unknown.raw) == block
    assert text == TextBlock(text="ok")
    assert msg.session_id == "s"
    assert decoder.counters.messages == 1
    user = b'{"type":"user","message":{"role":"user","content":[{"type":"image","source":{}}]}}'
    (umsg,) = decode(user + b"\n")
    assert isinstance(umsg, UserMessage)
    assert isinstance(umsg.message.content, list)
    assert isinstance(umsg.message.content[0], UnknownBlock)


def test_unknown_control_request_subtype_stays_answerable() -> None:
    """An unknown control_request subtype keeps its request_id so the host can answer an error."""
    body = b'{"subtype":"elicitation","mcp_server_name":"x","message":"hi"}'
    line = b'{"type":"control_request","request_id":"q9","request":' + body + b"}"
    (msg,) = decode(line + b"\n")
    assert isinstance(msg, ControlRequest)
    assert msg.request_id == "q9"
    assert isinstance(msg.request, UnknownRequest)
    assert msg.request.name == "elicitation"
    assert bytes(msg.request.raw) == body


def test_mixed_bad_lines_in_one_chunk() -> None:
    """Bad lines in a chunk fall back to line-by-line decoding without losing good ones."""
    blob = golden("tool_loop_with_hook_callback.jsonl")
    lines = blob.split(b"\n")
    lines.insert(3, b"garbage")
    lines.insert(7, b'{"type":"rate_limit_event"}')
    events = decode(b"\n".join(lines))
    assert kinds(events).count("invalid") == 1
    assert kinds(events).count("unknown") == 1
    typed = [e for e in events if not isinstance(e, InvalidLine | UnknownMessage)]
    assert typed == decode(blob)


# -- encoders -------------------------------------------------------------


def test_encode_user_turn_exact_and_round_trip() -> None:
    """A user turn has the exact NOTES.md shape and round-trips through json and the decoder."""
    line = encode_user_turn("hi ☃")
    assert line == (
        b'{"type":"user","message":{"role":"user","content":"hi \xe2\x98\x83"},'
        b'"parent_tool_use_id":null,"session_id":"default"}\n'
    )
    assert json.loads(line) == {
        "type": "user",
        "message": {"role": "user", "content": "hi ☃"},
        "parent_tool_use_id": None,
        "session_id": "default",
    }
    (msg,) = decode(line)
    assert isinstance(msg, UserMessage)
    assert msg.message.content == "hi ☃"


def test_encode_control_responses_exact() -> None:
    """Success (with and without body), error and the mcp_response wrapper are exact."""
    assert encode_control_success("r1", {"continue": True}) == (
        b'{"type":"control_response","response":{"subtype":"success","request_id":"r1",'
        b'"response":{"continue":true}}}\n'
    )
    assert encode_control_success("n1") == (
        b'{"type":"control_response","response":{"subtype":"success","request_id":"n1"}}\n'
    )
    assert encode_control_error("r2", "no such tool") == (
        b'{"type":"control_response","response":{"subtype":"error","request_id":"r2",'
        b'"error":"no such tool"}}\n'
    )
    expected = (
        b'{"type":"control_response","response":{"subtype":"success","request_id":"r3",'
        b'"response":{"mcp_response":{"jsonrpc":"2.0","id":2,"result":{"content":[]}}}}}\n'
    )
    jsonrpc = {"jsonrpc": "2.0", "id": 2, "result": {"content": []}}
    assert encode_mcp_response("r3", jsonrpc) == expected
    assert encode_mcp_response("r3", msgspec.Raw(msgspec.json.encode(jsonrpc))) == expected
    assert encode_hook_response("h") == encode_control_success("h", {"continue": True})
    assert encode_permission_allow("p", {"name": "Ada"}) == (
        b'{"type":"control_response","response":{"subtype":"success","request_id":"p",'
        b'"response":{"behavior":"allow","updatedInput":{"name":"Ada"}}}}\n'
    )
    assert encode_permission_deny("p", "no") == (
        b'{"type":"control_response","response":{"subtype":"success","request_id":"p",'
        b'"response":{"behavior":"deny","message":"no"}}}\n'
    )
    (msg,) = decode(encode_control_error("r2", "x"))
    assert msg == ControlResponse(ControlResponseBody(subtype="error", request_id="r2", error="x"))


def test_encode_control_requests_exact() -> None:
    """initialize, interrupt and the tools/list_changed notification match NOTES.md."""
    hooks = {"PreToolUse": [HookMatcher(matcher=None, hook_callback_ids=["hook_0"])]}
    assert encode_initialize("req_init", hooks) == (
        b'{"type":"control_request","request_id":"req_init","request":{"subtype":"initialize",'
        b'"hooks":{"PreToolUse":[{"matcher":null,"hookCallbackIds":["hook_0"]}]}}}\n'
    )
    assert encode_interrupt("int1") == (
        b'{"type":"control_request","request_id":"int1","request":{"subtype":"interrupt"}}\n'
    )
    assert encode_mcp_notification("n1", "sage", "notifications/tools/list_changed") == (
        b'{"type":"control_request","request_id":"n1","request":{"subtype":"mcp_message",'
        b'"server_name":"sage","message":{"jsonrpc":"2.0",'
        b'"method":"notifications/tools/list_changed"}}}\n'
    )
    assert encode_control_request("x", {"subtype": "set_model", "model": "m"}).endswith(b"}}\n")


# -- control channel ----------------------------------------------------------


def response(request_id: str, subtype: str = "success", **kw: Any) -> ControlResponse:
    return ControlResponse(ControlResponseBody(subtype=subtype, request_id=request_id, **kw))


def request(request_id: str) -> ControlRequest:
    return ControlRequest(request_id=request_id, request=HookCallbackRequest(callback_id="hook_0"))


def test_channel_ids_unique_and_responses_matched() -> None:
    """Allocated ids are unique; a success and an error answer complete and fail their requests."""
    ch = ControlChannel(id_prefix="req")
    ids = [ch.open_request("interrupt") for _ in range(100)]
    assert len(set(ids)) == 100
    assert ch.pending == tuple(ids)
    ok = ch.receive_response(response(ids[0], response=msgspec.Raw(b'{"still_queued":[]}')))
    assert ok is not None
    assert (ok.request_id, ok.subtype, ok.state) == (ids[0], "interrupt", OutgoingState.COMPLETED)
    assert json.loads(bytes(ok.response)) == {"still_queued": []}
    bad = ch.receive_response(response(ids[1], "error", error="busy"))
    assert bad is not None
    assert (bad.state, bad.error) == (OutgoingState.FAILED, "busy")
    assert ch.outgoing_state(ids[0]) is None
    assert ch.outgoing_state(ids[2]) is OutgoingState.PENDING


def test_channel_matches_decoded_response() -> None:
    """A response decoded from CLI bytes completes the request with the given id."""
    ch = ControlChannel()
    rid = ch.open_request("initialize", request_id="req_init")
    (msg,) = [
        e for e in decode(golden("permission_prompt.jsonl")) if isinstance(e, ControlResponse)
    ]
    outcome = ch.receive_response(msg)
    assert outcome is not None
    assert (outcome.request_id, outcome.state) == (rid, OutgoingState.COMPLETED)
    assert ch.pending == ()


def test_channel_unknown_response_counted_and_ignored() -> None:
    """A response nobody waits for (unknown or already answered) is counted, not raised."""
    ch = ControlChannel()
    rid = ch.open_request("interrupt")
    assert ch.receive_response(response("nobody")) is None
    assert ch.receive_response(response(rid)) is not None
    assert ch.receive_response(response(rid)) is None
    assert ch.unmatched_responses == 2


def test_channel_fail_all() -> None:
    """fail_all fails every pending request at once, returns their ids and closes."""
    ch = ControlChannel()
    ids = [ch.open_request(s) for s in ("initialize", "interrupt", "mcp_message")]
    ch.receive_response(response(ids[1]))
    ch.receive_request(request("in1"))
    assert ch.fail_all("child exited with 1") == [ids[0], ids[2]]
    assert ch.state is ChannelState.CLOSED
    assert ch.close_reason == "child exited with 1"
    assert ch.pending == ()
    assert ch.incoming_state("in1") is None


def test_channel_cancel_marks_incoming() -> None:
    """A cancel marks an open incoming request so its late answer is not written."""
    ch = ControlChannel()
    ch.receive_request(request("a"))
    ch.receive_request(request("b"))
    assert ch.receive_cancel(ControlCancelRequest(request_id="a")) is True
    assert ch.incoming_state("a") is IncomingState.CANCELLED
    assert ch.answer("a") is False
    assert ch.answer("b") is True
    assert ch.receive_cancel(ControlCancelRequest(request_id="b")) is False
    assert ch.receive_cancel(ControlCancelRequest(request_id="zzz")) is False
    assert ch.unmatched_cancels == 2


def test_channel_invalid_transitions_raise() -> None:
    """Answering twice or unknown ids, reused ids, and use after close raise ProtocolError."""
    ch = ControlChannel()
    ch.receive_request(request("a"))
    with pytest.raises(ProtocolError, match="reused"):
        ch.receive_request(request("a"))
    assert ch.answer("a") is True
    with pytest.raises(ProtocolError, match="no open"):
        ch.answer("a")
    rid = ch.open_request("interrupt", request_id="x")
    with pytest.raises(ProtocolError, match="already pending"):
        ch.open_request("interrupt", request_id=rid)
    ch.fail_all("gone")
    for action in (
        lambda: ch.open_request("interrupt"),
        lambda: ch.receive_response(response("x")),
        lambda: ch.receive_request(request("b")),
        lambda: ch.receive_cancel(ControlCancelRequest(request_id="b")),
        lambda: ch.answer("b"),
        lambda: ch.fail_all("again"),
    ):
        with pytest.raises(ProtocolError, match="closed"):
            action()


def test_channel_generated_ids_skip_caller_ids() -> None:
    """A generated id never collides with a pending id the caller chose."""
    ch = ControlChannel(id_prefix="req")
    ch.open_request("initialize", request_id="req_1")
    assert ch.open_request("interrupt") == "req_2"


# -- public surface ---------------------------------------------------------


def test_all_matches_submodules() -> None:
    """sage.claude.protocol.__all__ is exactly the union of its modules' __all__, all importable."""
    from sage.claude.protocol import control, decoder, encoder, messages

    names = {n for m in (control, decoder, encoder, messages) for n in m.__all__}
    assert set(protocol.__all__) == names
    assert len(protocol.__all__) == len(set(protocol.__all__))
    for name in protocol.__all__:
        assert getattr(protocol, name) is not None
