"""The completion provider's pure parts: request mapping and the stream mapper."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import anthropic
import httpx2
import pytest
from anthropic.types import RawMessageStreamEvent

from capsules.llm.errors import error_event, scrub
from capsules.llm.events import (
    Done,
    Error,
    IncompleteStream,
    StreamMapper,
    TextDelta,
    ToolCallDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
    stream_payload,
)
from capsules.llm.mapping import (
    BadRequest,
    GenerateRequest,
    UnknownModel,
    api_arguments,
    offered_models,
    parse_request,
)
from sage.config import LlmConfig
from sage.usage.pricing import cost_usd

CONFIG = LlmConfig(model="claude-sonnet-4-5", max_tokens=777)
USER = {"role": "user", "content": "hi"}


def _parse(**fields: Any) -> GenerateRequest:
    parsed = parse_request(json.dumps({"request_id": "r1", "messages": [USER], **fields}).encode())
    assert isinstance(parsed, GenerateRequest), parsed
    return parsed


def _bad(payload: Any) -> BadRequest:
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    parsed = parse_request(raw)
    assert isinstance(parsed, BadRequest), parsed
    return parsed


# -- mapping ------------------------------------------------------------------------


def test_defaults_come_from_config() -> None:
    args = api_arguments(_parse(), CONFIG)
    assert args == {
        "model": "claude-sonnet-4-5",
        "max_tokens": 777,
        "messages": [{"role": "user", "content": "hi"}],
    }


def test_request_overrides_model_and_max_tokens() -> None:
    args = api_arguments(_parse(model="claude-haiku-4-5", max_tokens=5), CONFIG)
    assert (args["model"], args["max_tokens"]) == ("claude-haiku-4-5", 5)


def test_unknown_model_is_refused() -> None:
    with pytest.raises(UnknownModel, match="claude-nope"):
        api_arguments(_parse(model="claude-nope"), CONFIG)


def test_offered_models_include_the_default() -> None:
    config = LlmConfig(model="m-default", models=["a", "b", "a"])
    assert offered_models(config) == ["a", "b", "m-default"]
    assert api_arguments(_parse(model="m-default"), config)["model"] == "m-default"


@pytest.mark.parametrize(
    ("payload", "where"),
    [
        ({"request_id": "r1", "messages": []}, "messages"),
        ({"request_id": "r1", "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"request_id": "r1", "messages": [{"role": "user", "content": []}]}, "content"),
        (
            {"request_id": "r1", "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "content",
        ),
        ({"request_id": "r1", "messages": [USER], "colour": "red"}, "colour"),
        ({"request_id": "r1", "messages": [USER], "max_tokens": 0}, "max_tokens"),
        (
            {
                "request_id": "r1",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "file:///x"}}
                        ],
                    }
                ],
            },
            "url",
        ),
    ],
)
def test_malformed_requests_name_the_place_and_keep_the_id(
    payload: dict[str, Any], where: str
) -> None:
    bad = _bad(payload)
    assert bad.message.startswith("malformed request")
    assert where in bad.message
    assert bad.request_id == "r1"


def test_a_bad_id_or_no_json_has_no_id() -> None:
    assert _bad({"request_id": "../x", "messages": [USER]}).request_id is None
    assert _bad({"messages": [USER]}).request_id is None
    bad = _bad(b"{not json")
    assert "not JSON" in bad.message
    assert bad.request_id is None
    assert _bad([1, 2]).request_id is None


def test_system_and_last_tool_are_cache_breakpoints() -> None:
    tools = [
        {"name": "a", "input_schema": {"type": "object"}},
        {"name": "b", "input_schema": {"type": "object"}, "description": "B"},
    ]
    args = api_arguments(_parse(system="be brief", tools=tools), CONFIG)
    assert args["system"] == [
        {"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}
    ]
    assert args["tools"] == [
        {"name": "a", "input_schema": {"type": "object"}},
        {
            "name": "b",
            "input_schema": {"type": "object"},
            "description": "B",
            "cache_control": {"type": "ephemeral"},
        },
    ]


def test_system_blocks_mark_only_the_last() -> None:
    system = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    args = api_arguments(_parse(system=system), CONFIG)
    assert args["system"] == [
        {"type": "text", "text": "one"},
        {"type": "text", "text": "two", "cache_control": {"type": "ephemeral"}},
    ]
    assert "tools" not in api_arguments(_parse(tools=[]), CONFIG)


def test_images_tool_use_and_tool_result_pass_through() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "what is this?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                },
                {"type": "image", "source": {"type": "url", "url": "https://x.test/a.png"}},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {"q": 1}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "42"},
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "x"}],
                    "is_error": True,
                },
            ],
        },
    ]
    args = api_arguments(_parse(messages=messages), CONFIG)
    # tool_result's defaults are omitted; everything else is as it came
    assert args["messages"] == messages


def test_a_request_with_an_unknown_image_type_is_refused() -> None:
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/bmp", "data": ""}}
    _bad({"request_id": "r1", "messages": [{"role": "user", "content": [block]}]})


# -- events -----------------------------------------------------------------------


def _raw(event: dict[str, Any]) -> RawMessageStreamEvent:
    from anthropic._models import construct_type

    return cast(RawMessageStreamEvent, construct_type(type_=RawMessageStreamEvent, value=event))


def _start(**usage: int) -> dict[str, Any]:
    return {
        "type": "message_start",
        "message": {
            "id": "m",
            "type": "message",
            "role": "assistant",
            "model": "claude-sonnet-4-5",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 10, "output_tokens": 1, **usage},
        },
    }


def _feed(mapper: StreamMapper, events: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for event in events:
        out += mapper.feed(_raw(event))
    return out


def test_text_deltas_and_usage_once_at_the_end() -> None:
    mapper = StreamMapper()
    emitted = _feed(
        mapper,
        [
            _start(cache_read_input_tokens=3),
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "Hel"},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": ""},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "lo"},
            },
            {"type": "content_block_stop", "index": 0},
            {
                "type": "message_delta",
                "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                "usage": {"output_tokens": 4},
            },
            {
                "type": "message_delta",
                "delta": {"stop_reason": None, "stop_sequence": None},
                "usage": {"output_tokens": 6, "input_tokens": 11},
            },
            {"type": "message_stop"},
        ],
    )
    assert emitted == [TextDelta("Hel"), TextDelta("lo")]  # no Usage mid-stream
    usage, done = mapper.finish()
    assert usage == Usage(11, 6, 3, 0)
    assert done == Done("end_turn")


def test_tool_use_deltas_are_passed_on_untouched() -> None:
    pieces = ['{"ci', 'ty": "Pa', "ris", '", "n": [1,', " 2]}"]
    events: list[dict[str, Any]] = [
        _start(),
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}},
        },
    ]
    events += [
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": p},
        }
        for p in pieces
    ]
    events += [
        {"type": "content_block_stop", "index": 1},
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {"output_tokens": 9},
        },
        {"type": "message_stop"},
    ]
    mapper = StreamMapper()
    emitted = _feed(mapper, events)
    assert emitted == [
        TextDelta("ok"),
        ToolCallStart("toolu_1", "weather"),
        *[ToolCallDelta("toolu_1", p) for p in pieces],
        ToolCallEnd("toolu_1"),
    ]
    joined = "".join(e.args_delta for e in emitted if isinstance(e, ToolCallDelta))
    assert json.loads(joined) == {"city": "Paris", "n": [1, 2]}
    assert mapper.finish()[1] == Done("tool_use")
    assert mapper.tools == {}


def test_an_incomplete_stream_is_an_error() -> None:
    mapper = StreamMapper()
    _feed(
        mapper,
        [
            _start(),
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "text", "text": ""},
            },
            {
                "type": "content_block_delta",
                "index": 0,
                "delta": {"type": "text_delta", "text": "x"},
            },
        ],
    )
    with pytest.raises(IncompleteStream, match="before the message was complete"):
        mapper.finish()
    assert mapper.usage() == Usage(10, 1)
    with pytest.raises(IncompleteStream, match="no message_start"):
        StreamMapper().finish()


def test_stream_payload_shape() -> None:
    assert stream_payload("r1", TextDelta("a")) == {
        "request_id": "r1",
        "event": {"type": "TextDelta", "text": "a"},
    }
    assert stream_payload("r1", Error("boom", "cancelled"))["event"] == {
        "type": "Error",
        "message": "boom",
        "code": "cancelled",
    }
    assert stream_payload("r1", Usage(1, 2))["event"] == {
        "type": "Usage",
        "input_tokens": 1,
        "output_tokens": 2,
    }
    assert stream_payload("r1", Done())["event"] == {"type": "Done"}


def test_scrub_and_cost() -> None:
    assert scrub("key sk-1 leaked sk-1", "sk-1") == "key <redacted> leaked <redacted>"
    assert scrub("fine", None) == "fine"
    assert cost_usd("claude-sonnet-4-5", Usage(1_000_000, 0)) == 3.0
    assert cost_usd("claude-opus-4-5-x", Usage(0, 1_000_000)) == 25.0
    assert cost_usd("gpt", Usage(1, 1)) is None


# -- errors -------------------------------------------------------------------------


def _status(status: int, type_: str, message: str) -> anthropic.APIStatusError:
    request = httpx2.Request("POST", "http://127.0.0.1:1/v1/messages")
    body = {"type": "error", "error": {"type": type_, "message": message}}
    response = httpx2.Response(status, json=body, request=request)
    client = anthropic.Anthropic(api_key="sk-x", base_url="http://127.0.0.1:1")
    try:
        return client._make_status_error(message, body=body, response=response)
    finally:
        client.close()


@pytest.mark.parametrize(
    ("status", "type_", "code", "retried"),
    [
        (401, "authentication_error", "authentication", False),
        (400, "invalid_request_error", "invalid_request", False),
        (429, "rate_limit_error", "rate_limited", True),
        (529, "overloaded_error", "overloaded", True),
        (500, "api_error", "server_error", True),
        (503, "weird_error", "server_error", True),
        (418, "weird_error", "api_error", False),
    ],
)
def test_status_errors_have_stable_codes(status: int, type_: str, code: str, retried: bool) -> None:
    error = error_event(_status(status, type_, "the detail"), max_retries=2, timeout=5)
    assert error.code == code
    assert f"HTTP {status}" in error.message
    assert "the detail" in error.message
    assert ("gave up after 2 retries" in error.message) is retried
    none = error_event(_status(status, type_, "x"), max_retries=0, timeout=5)
    assert "gave up" not in none.message


def test_transport_errors() -> None:
    request = httpx2.Request("POST", "http://127.0.0.1:1/v1/messages")
    timeout = error_event(anthropic.APITimeoutError(request), max_retries=1, timeout=3)
    assert timeout.code == "timeout"
    assert "3 s" in timeout.message
    assert "2 times" in timeout.message
    connection = error_event(
        anthropic.APIConnectionError(request=request), max_retries=0, timeout=3
    )
    assert connection.code == "connection"
    assert "127.0.0.1" in connection.message
    assert "1 time)" in connection.message
    stalled = error_event(httpx2.ReadTimeout("slow", request=request), max_retries=0, timeout=3)
    assert stalled.code == "timeout"
    broken = error_event(httpx2.RemoteProtocolError("cut"), max_retries=0, timeout=3)
    assert broken.code == "stream_incomplete"
    assert error_event(IncompleteStream("x"), max_retries=0, timeout=3).code == "stream_incomplete"
    # once the response began, a wrapped transport error is a cut stream and a timeout a
    # stalled one, whichever way the SDK release wraps them
    wrapped = anthropic.APIConnectionError(request=request)
    wrapped.__cause__ = httpx2.RemoteProtocolError("incomplete chunked read")
    cut = error_event(wrapped, max_retries=2, timeout=3, mid_stream=True)
    assert cut.code == "stream_incomplete"
    assert "incomplete chunked read" in cut.message
    assert error_event(wrapped, max_retries=2, timeout=3).code == "connection"
    late = error_event(
        anthropic.APITimeoutError(request), max_retries=1, timeout=3, mid_stream=True
    )
    assert (late.code, "stalled" in late.message) == ("timeout", True)
    assert error_event(ValueError("?"), max_retries=0, timeout=3).code == "error"


def test_the_operators_key_serves_a_principal_only_when_configured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Completions follow the sessions' rule: no silent sharing of the operator's key."""
    from capsules.llm.capsule import lookup_api_key
    from sage.config import decode_config

    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-operator")
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    config = decode_config(
        '[supervisor]\nstate_dir = "st"\n'
        '[[principals]]\nname = "alice"\n'
        '[[principals]]\nname = "bob"\noperator_key = true\n',
        base_dir=str(tmp_path),
    )
    assert lookup_api_key(config, None) == "sk-operator"  # the operator's own requests
    assert lookup_api_key(config, "bob") == "sk-operator"
    assert lookup_api_key(config, "alice") is None
    assert lookup_api_key(config, "nobody") is None
