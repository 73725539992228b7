"""The runner's ``forge`` sdk MCP server on a real bus: a fake forge capsule, and the real one."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import anyio
import msgspec
import pytest
import structlog

from bus.acl import Acl, Identity
from bus.broker import Bus
from capsules.forge.capsule import ForgeCapsule
from capsules.runner.mcp import McpServer
from sage.capsule.context import CapsuleContext
from sage.claude.protocol import McpMessageRequest
from sage.config import Config, ForgeConfig, PrincipalConfig, SupervisorConfig
from sage.forge.runs import PAGE_MAX

pytestmark = pytest.mark.anyio

RUNNER = Identity("capsule:runner", acl=Acl(publish=["forge.v1.request.*"], subscribe=[]))
FORGE = Identity("capsule:forge")


class _Ctx:
    """What the runner's MCP servers use of its capsule context."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.config = SimpleNamespace(limits=SimpleNamespace(tool_timeout=2.0))

    async def request(self, topic: str, payload: Any, **kw: Any) -> Any:
        return await self.bus.request(RUNNER, topic, payload, **kw)


class _Forge:
    """The runner's ``forge`` sdk server, reached as the CLI reaches it: mcp_message requests."""

    def __init__(self, bus: Bus) -> None:
        self.mcp = McpServer(cast(CapsuleContext, _Ctx(bus)))

    async def answer(
        self, proc: Any, msg_id: int, method: str, params: dict[str, Any]
    ) -> dict[str, Any]:
        message = {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}
        request = McpMessageRequest(
            server_name="forge", message=msgspec.Raw(msgspec.json.encode(message))
        )
        response = await self.mcp.handle(proc, request)
        assert isinstance(response, dict)
        return response


def _server(bus: Bus) -> _Forge:
    return _Forge(bus)


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


class _CapsuleCtx:
    """What the forge capsule uses of its context when driven by hand (no supervisor)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.log = structlog.get_logger("test.forge")
        self.published: list[tuple[str, Any]] = []

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> None:
        self.published.append((topic, payload))


BIG = (
    "import sys\n"
    "line = 'ligne numéro {} ✓ ' + 'x' * 40 + '\\n'\n"
    "sys.stdout.write(''.join(line.format(i) for i in range(3000)))\n"
)
EXPECTED = "".join(f"ligne numéro {i} ✓ " + "x" * 40 + "\n" for i in range(3000))


async def test_claude_pages_its_own_spilled_output_back_through_the_forge_server(
    tmp_path: Path,
) -> None:
    """Real parts end to end but the CLI: runner MCP server → bus → forge capsule → bwrap."""
    config = Config(
        supervisor=SupervisorConfig(state_dir=str(tmp_path / "state")),
        forge=ForgeConfig(output_cap=4096, spare_sandboxes=0),
        principals=[PrincipalConfig(name="alice"), PrincipalConfig(name="bob")],
    )
    ctx = _CapsuleCtx(config)
    capsule = ForgeCapsule(cast(CapsuleContext, ctx))
    bus = Bus()
    sub = bus.subscribe("forge.v1.request.>", FORGE)

    async def forge() -> None:
        async for env in sub:
            answer = await capsule.handle(env)
            assert env.reply_to is not None
            bus.reply(FORGE, env.reply_to, answer)

    async def announced(server: str) -> None:
        pass

    alice: Any = SimpleNamespace(session_id="s1", principal_id="alice", tools_changed=announced)
    server = _server(bus)
    ids = iter(range(1, 1000))

    async def call(proc: Any, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        answer = await server.answer(
            proc, next(ids), "tools/call", {"name": name, "arguments": arguments}
        )
        result: dict[str, Any] = answer["result"]
        return result

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(forge)
            forged = await call(
                alice,
                "forge_tool",
                {
                    "name": "big",
                    "description": "prints a lot",
                    "input_schema": {"type": "object"},
                    "impl": BIG,
                    "runtime": "python",
                },
            )
            assert forged["isError"] is False, forged
            listed = await server.answer(alice, next(ids), "tools/list", {})
            assert "read_artifact" in [t["name"] for t in listed["result"]["tools"]]
            over = await call(alice, "big", {})
            assert over["isError"] is True
            text = over["content"][0]["text"]
            run_id = over["structuredContent"]["meta"]["run_id"]
            assert run_id in text
            assert "read_artifact" in text
            assert "next_offset" in text
            got, offset = "", 0
            while True:
                page = await call(
                    alice, "read_artifact", {"run_id": run_id, "offset": offset, "limit": 50_000}
                )
                assert page["isError"] is False, page
                data = page["structuredContent"]["data"]
                assert data["encoding"] == "utf-8"
                got += data["text"]
                offset = data["next_offset"]
                if data["eof"]:
                    break
            assert got == EXPECTED
            # another session of alice, bob in the same session id: no such run for them
            for other in (
                SimpleNamespace(session_id="s2", principal_id="alice"),
                SimpleNamespace(session_id="s1", principal_id="bob"),
            ):
                denied = await call(other, "read_artifact", {"run_id": run_id})
                assert denied["structuredContent"]["error"] == "unknown_run", denied
            tricks = await call(alice, "read_artifact", {"run_id": f"../{run_id}"})
            assert tricks["structuredContent"]["error"] == "bad_arguments"
            huge = await call(alice, "read_artifact", {"run_id": run_id, "limit": 2**40})
            assert huge["structuredContent"]["data"]["bytes"] <= PAGE_MAX
            tg.cancel_scope.cancel()
    finally:
        await capsule.forge.aclose()
