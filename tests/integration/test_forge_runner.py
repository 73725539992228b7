"""The runner's ``forge`` sdk MCP server against a fake forge capsule on a real bus."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest

from bus.acl import Acl, Identity
from bus.broker import Bus
from capsules.runner.forge_mcp import ForgeMcpServer

pytestmark = pytest.mark.anyio

RUNNER = Identity("capsule:runner", acl=Acl(publish=["forge.v1.request.*"], subscribe=[]))
FORGE = Identity("capsule:forge")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _Ctx:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def request(self, topic: str, payload: Any, **kw: Any) -> Any:
        return await self.bus.request(RUNNER, topic, payload, **kw)


def _server(bus: Bus) -> ForgeMcpServer:
    runner = SimpleNamespace(
        ctx=_Ctx(bus), config=SimpleNamespace(limits=SimpleNamespace(tool_timeout=2.0))
    )
    return ForgeMcpServer(runner)  # type: ignore[arg-type]


PROC: Any = SimpleNamespace(session_id="s1", principal_id="alice")


async def test_list_and_call_go_to_the_forge_on_behalf_of_the_principal() -> None:
    bus = Bus()
    seen: list[tuple[str, str | None, Any]] = []
    sub = bus.subscribe("forge.v1.request.>", FORGE)

    async def forge() -> None:
        async for env in sub:
            data = env.data()
            seen.append((env.topic, env.principal, data))
            assert env.reply_to is not None
            if env.topic.endswith(".list"):
                reply: Any = {"tools": [{"name": "fib", "description": "f", "inputSchema": {}}]}
            else:
                envelope = {"ok": True, "data": {"value": 832040}}
                reply = {
                    "content": [{"type": "text", "text": msgspec.json.encode(envelope).decode()}],
                    "isError": False,
                    "structuredContent": envelope,
                }
            bus.reply(FORGE, env.reply_to, reply)

    server = _server(bus)
    async with anyio.create_task_group() as tg:
        tg.start_soon(forge)
        listed = await server.answer(PROC, 1, "tools/list", {})
        called = await server.answer(
            PROC,
            2,
            "tools/call",
            {"name": "fib", "arguments": {"n": 30}, "_meta": {"claudecode/toolUseId": "tu1"}},
        )
        init = await server.answer(PROC, 0, "initialize", {})
        unknown = await server.answer(PROC, 3, "nope", {})
        tg.cancel_scope.cancel()
    assert listed["result"]["tools"][0]["name"] == "fib"
    assert called["result"]["structuredContent"]["data"]["value"] == 832040
    assert called["result"]["isError"] is False
    assert init["result"]["capabilities"]["tools"]["listChanged"] is True
    assert unknown["error"]["code"] == -32601
    assert [(t, p) for t, p, _ in seen] == [
        ("forge.v1.request.list", "alice"),
        ("forge.v1.request.call", "alice"),
    ]
    assert seen[1][2] == {
        "session_id": "s1",
        "tool_name": "fib",
        "arguments": {"n": 30},
        "tool_use_id": "tu1",
    }


async def test_no_forge_means_an_empty_list_and_an_error_result() -> None:
    server = _server(Bus())
    listed = await server.answer(PROC, 1, "tools/list", {})
    called = await server.answer(PROC, 2, "tools/call", {"name": "fib", "arguments": {}})
    assert listed["result"] == {"tools": []}
    assert called["result"]["isError"] is True
    assert "no forge is running" in called["result"]["content"][0]["text"]
