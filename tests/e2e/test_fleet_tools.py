"""Tools anywhere end to end: the real CLI on node a calls a tool only node b serves.

A real 3-server NATS cluster and two real supervisors: node a runs the session
runner and the bridge with the real ``claude`` binary against the Messages API
stand-in; node b runs the bridge and the ``greeter`` capsule.  The stand-in's
``tool_use`` of ``mcp__sage__greet`` goes a's bridge -> NATS -> b's bridge ->
greeter, and b's answer is in the model's next request as the ``tool_result``.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest

from bus.client import BusClient
from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import NatsCluster
from tests.support.sage_harness import Sage
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

GREET = "mcp__sage__greet"


def node_config(
    cluster: NatsCluster, node: str, capsules: str, binary: Path, env: dict[str, str]
) -> str:
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    return (
        f"capsules = {capsules}\n"
        f"[claude]\nbinary = {json.dumps(str(binary))}\nenv = {{ {env_toml} }}\n"
        + cluster.fleet_section(node, heartbeat=0.4)
        + f'[[principals]]\nname = "alice"\nuids = [{os.getuid()}]\noperator_key = true\n'
        f'allowed_tools = ["{GREET}"]\n'
    )


async def test_the_real_cli_on_a_calls_a_tool_served_by_b(
    claude_bin: Path, standin: Standin
) -> None:
    """The model's tool_use on a is answered by b's greeter: "Hello, Ada!" in the tool_result."""
    with NatsCluster(["a", "b"]) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-test"}
        config = functools.partial(node_config, cluster, binary=claude_bin)
        a = Daemon(
            short_dir(), config("a", '["runner", "tools"]', env=standin.offline_env()), env=env
        )
        b = Daemon(short_dir(), config("b", '["tools", "greeter"]', env={}), env=env)
        for daemon in (a, b):
            daemon.launch()
        try:
            for daemon in (a, b):
                await anyio.to_thread.run_sync(daemon.wait_ready)
            async with BusClient.connect(a.socket, role="cli", name="test") as client:
                sage = Sage(a, client)
                with anyio.fail_after(15):
                    while True:
                        reply: dict[str, Any] = await sage.request("sage.v1.request.tools", {})
                        if any(t["name"] == GREET and t["node"] == "b" for t in reply["tools"]):
                            break
                        await anyio.sleep(0.1)
                events = await sage.ready("x1")
                standin.push(ToolUse(GREET, {"name": "Ada"}), Text("greeted"))
                await sage.send("x1", "greet Ada")
                text, _ = await events.text_until_done()
                assert text == "greeted"
                (result,) = standin.messages[-1].tool_results()
                assert "Hello, Ada!" in json.dumps(result["content"])
                assert not result.get("is_error")
        finally:
            for daemon in (a, b):
                await anyio.to_thread.run_sync(functools.partial(daemon.stop, 15.0))
