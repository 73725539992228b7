"""The runner's in-band MCP servers (sage, forge) over the one MCP core, on an in-process bus."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest

from bus import Bus, Identity
from capsules.runner.claude_process import SessionError
from capsules.runner.mcp import McpServer
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import CapsuleManifest
from sage.claude.protocol import McpMessageRequest

pytestmark = pytest.mark.anyio

PROC: Any = SimpleNamespace(session_id="s1", principal_id="alice")
BRIDGE = Identity("capsule:tool-bridge")


def _server(bus: Bus) -> McpServer:
    manifest = msgspec.convert({"package": {"name": "runner", "entry": "x"}}, CapsuleManifest)
    return McpServer(CapsuleContext(bus, Identity("capsule:runner"), manifest))


def _request(server_name: str, message: Any) -> McpMessageRequest:
    raw = message if isinstance(message, bytes) else msgspec.json.encode(message)
    return McpMessageRequest(server_name=server_name, message=msgspec.Raw(raw))


def _rpc(method: str, params: dict[str, Any] | None = None, id_: int = 1) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": params or {}}


@pytest.mark.parametrize("name", ["sage", "forge"])
async def test_each_server_announces_itself_and_echoes_the_cli_version(name: str) -> None:
    """initialize: the server's own name, tools with listChanged, the CLI's version."""
    answer = await _server(Bus()).handle(
        PROC, _request(name, _rpc("initialize", {"protocolVersion": "2099-01-01"}))
    )
    assert answer == {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {
            "protocolVersion": "2099-01-01",
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": name, "version": "0.1.0"},
        },
    }


async def test_notifications_pings_and_unknown_methods() -> None:
    """A notification is acknowledged (None), ping answered, an unknown method is -32601."""
    server = _server(Bus())
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert await server.handle(PROC, _request("sage", note)) is None
    assert await server.handle(PROC, _request("forge", _rpc("ping", id_=7))) == {
        "jsonrpc": "2.0",
        "id": 7,
        "result": {},
    }
    unknown = await server.handle(PROC, _request("sage", _rpc("resources/list")))
    assert unknown["error"]["code"] == -32601


@pytest.mark.parametrize(
    ("server_name", "message", "code"),
    [
        ("github", _rpc("ping"), "unknown_server"),
        ("sage", b"{not json", "bad_message"),
        ("forge", b'{"jsonrpc":"2.0","id":1}', "bad_message"),
    ],
)
async def test_what_is_no_mcp_request_fails_the_control_request(
    server_name: str, message: Any, code: str
) -> None:
    """An unknown server or a message that is no request is a SessionError, not a reply."""
    with pytest.raises(SessionError) as caught:
        await _server(Bus()).handle(PROC, _request(server_name, message))
    assert caught.value.code == code


async def test_sage_lists_the_catalogue_the_bridge_published() -> None:
    """tools/list serves the last good catalogue, names without mcp__sage__, fields kept."""
    server = _server(Bus())

    async def published() -> AsyncIterator[Any]:
        tool = {"name": "mcp__sage__greet", "description": "d", "capsule": "greeter"}
        yield SimpleNamespace(payload=msgspec.json.encode({"tools": [tool]}))
        yield SimpleNamespace(payload=b"not json")

    await server.follow(published())
    answer = await server.handle(PROC, _request("sage", _rpc("tools/list")))
    assert answer["result"] == {
        "tools": [{"name": "greet", "description": "d", "capsule": "greeter"}]
    }


async def test_sage_calls_go_through_the_tool_bridge() -> None:
    """tools/call publishes the call for the principal and answers the bridge's result;
    with no bridge it is an isError result."""
    bus = Bus()
    server = _server(bus)
    params = {"name": "greet", "arguments": {"who": "Ada"}, "_meta": {"claudecode/toolUseId": "t"}}
    alone = await server.handle(PROC, _request("sage", _rpc("tools/call", params)))
    assert alone["result"]["isError"] is True
    assert "no tool bridge is running" in alone["result"]["content"][0]["text"]

    seen: list[tuple[str | None, Any]] = []
    with bus.subscribe("sage.v1.tool.call.*", BRIDGE) as calls:

        async def bridge() -> None:
            async for env in calls:
                seen.append((env.principal, env.data()))
                cid = env.topic.rsplit(".", 1)[1]
                content = [{"type": "text", "text": "hi Ada"}]
                bus.publish(BRIDGE, f"sage.v1.tool.result.{cid}", {"content": content})

        async with anyio.create_task_group() as tg:
            tg.start_soon(bridge)
            with anyio.fail_after(5):
                answer = await server.handle(PROC, _request("sage", _rpc("tools/call", params, 2)))
            tg.cancel_scope.cancel()
    assert answer == {
        "jsonrpc": "2.0",
        "id": 2,
        "result": {"content": [{"type": "text", "text": "hi Ada"}], "isError": False},
    }
    assert seen == [
        (
            "alice",
            {
                "session_id": "s1",
                "principal_id": "alice",
                "tool_name": "greet",
                "arguments": {"who": "Ada"},
                "tool_use_id": "t",
            },
        )
    ]
