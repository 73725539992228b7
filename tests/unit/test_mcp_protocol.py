"""The one sans-IO MCP core (astrid mcp serve, the runner's sage and forge servers):
every message gets the right answer or none."""

from __future__ import annotations

import pytest

from sage.mcp.protocol import (
    MAX_LINE,
    STDIO,
    SUPPORTED_VERSIONS,
    NeedCall,
    NeedList,
    Reply,
    Server,
    Silent,
    Unreadable,
    call_reply,
    handle_line,
    list_reply,
    result,
)

IN_BAND = Server("forge", version="9.9", list_changed=True, negotiate=False)


def _error(outcome: object) -> tuple[object, int]:
    assert isinstance(outcome, Reply)
    return outcome.message["id"], outcome.message["error"]["code"]


def test_initialize_negotiates_the_version() -> None:
    """stdio answers the client's version if supported, else the newest, without listChanged."""
    out = handle_line(
        b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2024-11-05"}}'
    )
    assert isinstance(out, Reply)
    assert out.message["result"]["protocolVersion"] == "2024-11-05"
    assert out.message["result"]["capabilities"] == {"tools": {"listChanged": False}}
    out = handle_line(
        b'{"jsonrpc":"2.0","id":2,"method":"initialize","params":{"protocolVersion":"1999"}}'
    )
    assert isinstance(out, Reply)
    assert out.message["result"]["protocolVersion"] == "2025-06-18"


def test_list_call_ping_and_notifications() -> None:
    """tools/list and tools/call go to the shell, ping is answered, notifications are not."""
    assert handle_line(b'{"jsonrpc":"2.0","id":"a","method":"tools/list"}') == NeedList("a")
    out = handle_line(
        b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"greet","arguments":{"name":"Ada"}}}'
    )
    assert out == NeedCall(3, "greet", {"name": "Ada"})
    assert handle_line(b'{"jsonrpc":"2.0","id":4,"method":"ping"}') == Reply(
        {"jsonrpc": "2.0", "id": 4, "result": {}}
    )
    assert handle_line(b'{"jsonrpc":"2.0","method":"notifications/initialized"}') == Silent()


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b"{not json", (None, -32700)),
        (b"[1, 2]", (None, -32600)),
        (b'{"jsonrpc":"2.0","id":true,"method":"ping"}', (None, -32600)),
        (b'{"jsonrpc":"2.0","id":5,"method":"resources/list"}', (5, -32601)),
        (b'{"jsonrpc":"2.0","id":6,"method":"tools/call","params":{}}', (6, -32602)),
        (
            b'{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"x","arguments":[]}}',
            (7, -32602),
        ),
        (b'{"jsonrpc":"2.0","id":8,"method":"ping","params":[]}', (8, -32602)),
        (b" " * (MAX_LINE + 1), (None, -32600)),
    ],
)
def test_bad_lines_get_json_rpc_errors(line: bytes, expected: tuple[object, int]) -> None:
    """Each malformed message gets its JSON-RPC error code, with its id when it has one;
    only those without one are Unreadable."""
    out = handle_line(line)
    assert _error(out) == expected
    assert isinstance(out, Unreadable) == (expected[0] is None)


def test_replies_from_the_bridge() -> None:
    """The bridge's listing loses its prefix and extra fields; a text becomes one block."""
    listing = list_reply(
        1,
        [
            {
                "name": "mcp__sage__greet",
                "description": "d",
                "inputSchema": {"type": "object"},
                "capsule": "greeter",
            }
        ],
    )
    assert listing["result"]["tools"] == [
        {"name": "greet", "description": "d", "inputSchema": {"type": "object"}}
    ]
    assert call_reply(2, "down", True)["result"] == {
        "content": [{"type": "text", "text": "down"}],
        "isError": True,
    }


def test_an_in_band_server_echoes_the_version_and_announces_itself() -> None:
    """The runner's servers echo the CLI's version (the newest when it names none),
    and announce their own name, version and listChanged."""
    out = handle_line(
        b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2099-01-01"}}',
        IN_BAND,
    )
    assert out == Reply(
        {
            "jsonrpc": "2.0",
            "id": 0,
            "result": {
                "protocolVersion": "2099-01-01",
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "forge", "version": "9.9"},
            },
        }
    )
    out = handle_line(b'{"jsonrpc":"2.0","id":1,"method":"initialize"}', IN_BAND)
    assert isinstance(out, Reply)
    assert out.message["result"]["protocolVersion"] == SUPPORTED_VERSIONS[0]
    out = handle_line(b'{"jsonrpc":"2.0","id":2,"method":"initialize"}', STDIO)
    assert isinstance(out, Reply)
    assert out.message["result"]["serverInfo"] == {"name": "sage", "version": "0.1.0"}


def test_a_call_keeps_its_meta_and_only_the_server_prefix_goes() -> None:
    """tools/call carries _meta (the CLI's tool-use id) to the shell; each server strips
    only its own prefix from the tool name."""
    line = (
        b'{"jsonrpc":"2.0","id":"c","method":"tools/call","params":{"name":"mcp__sage__fib",'
        b'"arguments":null,"_meta":{"claudecode/toolUseId":"tu1"}}}'
    )
    assert handle_line(line, STDIO) == NeedCall("c", "fib", {}, {"claudecode/toolUseId": "tu1"})
    assert handle_line(line, IN_BAND) == NeedCall(
        "c", "mcp__sage__fib", {}, {"claudecode/toolUseId": "tu1"}
    )
    odd_meta = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"x","_meta":3}}'
    assert handle_line(odd_meta, IN_BAND) == NeedCall(1, "x", {}, {})


@pytest.mark.parametrize(
    "line",
    [
        b"{not json",
        b'"a string"',
        b'{"jsonrpc":"2.0","id":1}',
        b'{"jsonrpc":"2.0","id":null,"method":"ping"}',
        b'{"jsonrpc":"2.0","id":1.5,"method":"ping"}',
    ],
)
def test_messages_that_are_no_request_are_unreadable(line: bytes) -> None:
    """A message with no answerable id is Unreadable (the in-band servers fail the control
    request); one with an id gets an ordinary error reply."""
    out = handle_line(line, IN_BAND)
    assert isinstance(out, Unreadable)
    assert out.message["id"] is None
    assert out.text


def test_responses_to_nothing_asked_are_silent() -> None:
    """A JSON-RPC response (a result or an error, no method) needs no answer."""
    assert handle_line(b'{"jsonrpc":"2.0","id":1,"result":{}}', IN_BAND) == Silent()
    assert handle_line(b'{"jsonrpc":"2.0","id":1,"error":{"code":1}}', STDIO) == Silent()


def test_result_wraps_a_body() -> None:
    """The shell's answers to NeedList and NeedCall are JSON-RPC results for the same id."""
    assert result("x", {"tools": []}) == {"jsonrpc": "2.0", "id": "x", "result": {"tools": []}}
