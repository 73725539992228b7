"""astrid mcp serve as Claude Code would run it: a subprocess speaking JSON-RPC on stdio."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio

ASTRID = Path(sys.executable).parent / "astrid"
FAKE = FAKE_CLAUDE


async def _session(
    lines: list[dict[str, Any] | bytes], env: dict[str, str]
) -> list[dict[str, Any]]:
    data = b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )
    result = await anyio.run_process(
        [str(ASTRID), "mcp", "serve", "--principal", "alice"],
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
