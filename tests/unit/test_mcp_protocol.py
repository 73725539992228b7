"""The sans-IO core of astrid mcp serve: every line gets the right answer or none."""

from __future__ import annotations

import pytest

from sage.mcp.protocol import (
    MAX_LINE,
    NeedCall,
    NeedList,
    Reply,
    Silent,
    call_reply,
    handle_line,
    list_reply,
)


def _error(outcome: object) -> tuple[object, int]:
    assert isinstance(outcome, Reply)
    return outcome.message["id"], outcome.message["error"]["code"]


def test_initialize_negotiates_the_version() -> None:
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
    assert _error(handle_line(line)) == expected


def test_replies_from_the_bridge() -> None:
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
