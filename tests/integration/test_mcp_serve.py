"""astrid mcp serve as Claude Code would run it: a subprocess speaking JSON-RPC on stdio."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.streams.text
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.failover_fleet import audit_rows
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio

ASTRID = Path(sys.executable).parent / "astrid"
FAKE = FAKE_CLAUDE


async def _session(
    lines: list[dict[str, Any] | bytes], env: dict[str, str], *server: str
) -> list[dict[str, Any]]:
    data = b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )
    result = await anyio.run_process(
        [str(ASTRID), "mcp", "serve", *server, "--principal", "alice"],
        input=data,
        env={**os.environ, **env},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


async def test_tools_list_and_call_through_the_bridge() -> None:
    config = sage_config(FAKE, {}, capsules='["tools", "greeter", "hooks"]')
    async with running_sage(config) as sage:
        with anyio.fail_after(20):
            while not (await sage.request("sage.v1.request.tools", {}))["tools"]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        # the session must be one of the principal's (the bridge checks), as astrid repl's is
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        env = {"ASTRID_SOCKET": str(sage.daemon.socket), "ASTRID_SESSION_ID": opened["session_id"]}
        answers = await _session(
            [
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "initialize",
                    "params": {"protocolVersion": "2025-06-18"},
                },
                {"jsonrpc": "2.0", "method": "notifications/initialized"},
                {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
                {
                    "jsonrpc": "2.0",
                    "id": 3,
                    "method": "tools/call",
                    "params": {"name": "greet", "arguments": {"name": "Ada"}},
                },
                {
                    "jsonrpc": "2.0",
                    "id": 4,
                    "method": "tools/call",
                    "params": {"name": "greet", "arguments": {"name": 5}},
                },
                b"{broken",
            ],
            env,
        )
        by_id = {a.get("id"): a for a in answers}
        assert by_id[1]["result"]["serverInfo"]["name"] == "sage"
        names = [t["name"] for t in by_id[2]["result"]["tools"]]
        assert "greet" in names
        assert by_id[3]["result"]["isError"] is False
        assert "Hello, Ada!" in json.dumps(by_id[3]["result"]["content"])
        assert by_id[4]["result"]["isError"] is True  # schema check, as for sessions
        assert by_id[None]["error"]["code"] == -32700
        assert len(answers) == 5  # the notification got no answer


async def test_a_supervisor_that_is_down_does_not_hang_claude(tmp_path: Path) -> None:
    env = {"ASTRID_SOCKET": str(tmp_path / "nobody.sock")}
    with anyio.fail_after(20):
        answers = await _session(
            [
                {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "greet"}},
            ],
            env,
        )
    by_id = {a["id"]: a for a in answers}
    assert by_id[1]["result"]["tools"] == []
    assert by_id[2]["result"]["isError"] is True
    assert "not reachable" in json.dumps(by_id[2]["result"])


# -- the forge server (--server forge) ---------------------------------------------------

FIB = (
    "import sys, json\n"
    "n = json.loads(sys.stdin.read())['n']\n"
    "a, b = 0, 1\n"
    "for _ in range(n):\n"
    "    a, b = b, a + b\n"
    "print(json.dumps({'ok': True, 'data': {'value': a}}))\n"
)


def _forge(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "description": "The nth Fibonacci number.",
        "input_schema": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 90}},
            "required": ["n"],
        },
        "impl": FIB,
        "runtime": "python",
    }


def _call(id_: int, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": id_,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }


class _Serve:
    """One long-lived ``astrid mcp serve --server forge``: lines in, messages out."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        assert process.stdout is not None
        self.lines = anyio.streams.text.TextReceiveStream(process.stdout)
        self.buffer = ""
        self.changes = 0

    async def send(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send(json.dumps(message).encode() + b"\n")

    async def next(self, within: float = 30.0) -> dict[str, Any]:
        with anyio.fail_after(within):
            while "\n" not in self.buffer:
                self.buffer += await self.lines.receive()
        line, _, self.buffer = self.buffer.partition("\n")
        message: dict[str, Any] = json.loads(line)
        return message

    async def reply(self, id_: int, within: float = 30.0) -> dict[str, Any]:
        """The answer to request ``id_``; notifications before it are counted."""
        while True:
            message = await self.next(within)
            if message.get("method") == "notifications/tools/list_changed":
                self.changes += 1
                continue
            assert message.get("id") == id_, message
            return message


async def test_the_forge_server_forges_calls_and_forwards_list_changes() -> None:
    """A REPL session's forge: meta-tools, forge then call, and a change made by another
    process of the same session announced as notifications/tools/list_changed."""
    config = sage_config(FAKE, {}, capsules='["tools", "hooks", "forge"]')
    async with running_sage(config) as sage:
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        env = {
            **os.environ,
            "ASTRID_SOCKET": str(sage.daemon.socket),
            "ASTRID_SESSION_ID": opened["session_id"],
        }
        argv = [str(ASTRID), "mcp", "serve", "--server", "forge", "--principal", "alice"]
        async with await anyio.open_process(argv, env=env) as process:
            serve = _Serve(process)
            await serve.send(
                {
                    "jsonrpc": "2.0",
                    "id": 1,
                    "method": "initialize",
                    "params": {"protocolVersion": "2025-06-18"},
                }
            )
            init = (await serve.next())["result"]
            assert init["serverInfo"]["name"] == "forge"
            assert init["capabilities"]["tools"]["listChanged"] is True
            await serve.send({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
            names = {t["name"] for t in (await serve.next())["result"]["tools"]}
            assert {"forge_tool", "forge_list", "forge_promote"} <= names
            assert "fib" not in names
            # forge: the list change is announced before the result (the forge's own event
            # may bring a second announcement, before or after it: Claude lists again)
            await serve.send(_call(3, "forge_tool", _forge("fib")))
            forged = await serve.reply(3)
            assert serve.changes >= 1, "no notifications/tools/list_changed before the result"
            assert forged["result"]["isError"] is False, forged
            await serve.send({"jsonrpc": "2.0", "id": 4, "method": "tools/list"})
            assert "fib" in {t["name"] for t in (await serve.reply(4))["result"]["tools"]}
            await serve.send(_call(5, "mcp__forge__fib", {"n": 10}))
            called = await serve.reply(5, within=60)
            assert called["result"]["isError"] is False, called
            envelope = json.loads(called["result"]["content"][0]["text"])
            assert envelope["data"] == {"value": 55}, called
            # another process of the same session forges: this one hears of it
            other = await _session(
                [_call(1, "forge_tool", _forge("fib2"))],
                {"ASTRID_SOCKET": env["ASTRID_SOCKET"], "ASTRID_SESSION_ID": opened["session_id"]},
                "--server",
                "forge",
            )
            assert other[-1]["result"]["isError"] is False, other
            seen = serve.changes
            await serve.send({"jsonrpc": "2.0", "id": 6, "method": "ping"})
            await serve.reply(6)
            if serve.changes == seen:  # not yet: the forge's event is on its way
                assert (await serve.next()) == {
                    "jsonrpc": "2.0",
                    "method": "notifications/tools/list_changed",
                }
            assert process.stdin is not None
            await process.stdin.aclose()
            with anyio.fail_after(10):
                assert await process.wait() == 0


async def test_the_forge_server_refuses_a_session_that_is_not_the_principals() -> None:
    config = sage_config(FAKE, {}, capsules='["tools", "hooks", "forge"]')
    async with running_sage(config) as sage:
        socket = str(sage.daemon.socket)
        for sid in ("00000000-0000-4000-8000-000000000000", "not a session"):
            answers = await _session(
                [_call(1, "forge_list", {})],
                {"ASTRID_SOCKET": socket, "ASTRID_SESSION_ID": sid},
                "--server",
                "forge",
            )
            (answer,) = answers
            assert answer["result"]["isError"] is True
            assert "unknown_session" in json.dumps(answer["result"]), answer
        # the request behind it: an admin (no principal) is refused too, a user's session
        # must be the user's
        refused = await sage.request("sage.v1.request.forge.list", {})
        assert refused.get("isError") is True
        assert "act for a principal" in json.dumps(refused)


async def test_a_repl_session_outlives_a_restart_of_the_runner() -> None:
    """The runner's start clears its own children's hook tokens, never a REPL's: the
    terminal's session goes on being its principal's after `capsule restart runner`."""
    config = sage_config(FAKE, {}, capsules='["runner", "tools", "hooks", "forge"]')
    async with running_sage(config) as sage:
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        env = {"ASTRID_SOCKET": str(sage.daemon.socket), "ASTRID_SESSION_ID": opened["session_id"]}
        code, _, err = await sage.astrid("capsule", "restart", "runner")
        assert code == 0, err
        # the new runner cleared its own tokens at its start (the restart waits for that)
        assert (await sage.request("sage.v1.request.sessions", {}))["ok"]
        (answer,) = await _session([_call(1, "forge_list", {})], env, "--server", "forge")
        assert answer["result"]["isError"] is False, answer


async def test_a_repl_over_its_budget_opens_no_repl_and_runs_no_tool() -> None:
    """sage never sees a REPL's model calls (its ``claude`` talks to the API), so it holds
    a REPL to its principal's budget where it can: ``repl.open`` and every tool call
    through ``astrid mcp serve``, sage's and the forge's.  Each refusal names the budget
    and is audited; once the budget is raised the same REPL runs tools again."""
    config = sage_config(FAKE, {}, capsules='["tools", "greeter", "hooks", "forge"]')
    async with running_sage(config) as sage:
        with anyio.fail_after(20):
            while not (await sage.request("sage.v1.request.tools", {}))["tools"]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert opened["ok"], opened
        env = {"ASTRID_SOCKET": str(sage.daemon.socket), "ASTRID_SESSION_ID": opened["session_id"]}
        greet = _call(1, "greet", {"name": "Ada"})
        forged = _call(1, "mcp__forge__nothing", {})

        code, _, err = await sage.astrid(
            "sage", "settings", "alice", "--budget-tokens-per-day", "0"
        )
        assert code == 0, err
        (tool,) = await _session([greet], env)
        assert tool["result"]["isError"] is True
        text = tool["result"]["content"][0]["text"]
        assert text.startswith("budget_exceeded: "), text
        assert "0 tokens" in text
        (forge,) = await _session([forged], env, "--server", "forge")
        assert forge["result"]["isError"] is True
        assert "budget_exceeded" in json.dumps(forge["result"]), forge
        refused = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert refused["ok"] is False
        assert refused["error"] == "budget_exceeded", refused

        with anyio.fail_after(10):  # the audit sink writes in batches
            while len(audit_rows(sage.daemon, "sage.v1.audit.budget_refused")) < 3:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        refusals = audit_rows(sage.daemon, "sage.v1.audit.budget_refused")
        verbs = sorted(row["verb"] for row in refusals)
        assert verbs == ["repl.forge_call", "repl.open", "repl.tool_call"], verbs
        (decision,) = [
            row
            for row in audit_rows(sage.daemon, "sage.v1.audit.tool_call")
            if row["decision_source"] == "budget_exceeded"
        ]
        assert (decision["session_id"], decision["allowed"]) == (opened["session_id"], False)

        code, _, err = await sage.astrid("sage", "settings", "alice", "--budget-reset")
        assert code == 0, err
        (tool,) = await _session([greet], env)
        assert tool["result"]["isError"] is False, tool
        (forge,) = await _session([forged], env, "--server", "forge")
        assert "budget_exceeded" not in json.dumps(forge["result"]), forge
