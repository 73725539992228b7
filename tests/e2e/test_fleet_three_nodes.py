"""Three nodes, one session, the real CLI: driven, watched and approved from other nodes.

A real 3-server NATS cluster and three supervisors.  Node a runs the session (the
pinned ``claude`` against the Messages API stand-in) and the ``greeter`` tool;
nobody types on a:

- b's socket spawns it on a (``spawn --node a``);
- c's socket watches it and sends it a message with ``--approve ask`` (c is the
  approver), and the model's ``tool_use`` of ``mcp__sage__greet`` waits for an
  approval on a;
- b's socket lists that approval, with its node, and allows it;
- the reply streams to c, the watcher on c sees the tool call, and the model's
  next request carries greeter's answer.

Every command acts for alice (``--principal alice``): another node's admins are
not admins on a (docs/fleet.md, "Who may act for whom").
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import NatsCluster
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

GREET = "mcp__sage__greet"
ASTRID = [sys.executable, "-m", "sage.cli"]


def node_config(
    cluster: NatsCluster, node: str, capsules: str, binary: Path, env: dict[str, str]
) -> str:
    env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in env.items())
    return (
        f"capsules = {capsules}\n"
        f"[claude]\nbinary = {json.dumps(str(binary))}\nenv = {{ {env_toml} }}\n"
        "[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n"
        + cluster.fleet_section(node, heartbeat=0.4)
        + f'[[principals]]\nname = "alice"\nuids = [{os.getuid()}]\noperator_key = true\n'
    )


def alice(daemon: Daemon) -> list[str]:
    return ["--principal", "alice", "--config", str(daemon.config)]


def run(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*ASTRID, *args, *alice(daemon)],
        capture_output=True,
        text=True,
        env=daemon.env,
        timeout=60,
    )


def start(daemon: Daemon, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*ASTRID, *args, *alice(daemon)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemon.env,
    )


async def test_spawned_from_b_sent_and_watched_from_c_approved_from_b(
    claude_bin: Path, standin: Standin
) -> None:
    with NatsCluster(["a", "b", "c"]) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-test"}
        config = functools.partial(node_config, cluster, binary=claude_bin)
        nodes = {
            "a": Daemon(
                short_dir(),
                config("a", '["runner", "tools", "greeter"]', env=standin.offline_env()),
                env=env,
            ),
            "b": Daemon(short_dir(), config("b", '["runner"]', env={}), env=env),
            "c": Daemon(short_dir(), config("c", '["runner"]', env={}), env=env),
        }
        for daemon in nodes.values():
            daemon.launch()
        watch: subprocess.Popen[str] | None = None
        send: subprocess.Popen[str] | None = None
        try:
            for daemon in nodes.values():
                await anyio.to_thread.run_sync(daemon.wait_ready)
            a, b, c = nodes["a"], nodes["b"], nodes["c"]

            spawned = await anyio.to_thread.run_sync(
                run, b, "sage", "spawn", "alice", "--node", "a", "--session", "t3", "--json"
            )
            assert spawned.returncode == 0, spawned.stderr
            assert json.loads(spawned.stdout)["node"] == "a"
            listed = await anyio.to_thread.run_sync(run, a, "sage", "sessions", "--json")
            assert [(r["session_id"], r["node"]) for r in json.loads(listed.stdout)] == [
                ("t3", "a")
            ]  # a's runner has it: the child is a's

            # --replay: what the session did before c's relay of its events was up is
            # printed first (the watch starts beside the send, not before it)
            watch = start(c, "sage", "watch", "t3", "--replay", "256")
            standin.push(ToolUse(GREET, {"name": "Ada"}), Text("greeted Ada", chunks=2))
            send = start(c, "sage", "send", "t3", "greet Ada", "--approve", "ask")

            pending: list[Any] = []
            with anyio.fail_after(30):
                while not pending:
                    listed = await anyio.to_thread.run_sync(run, b, "sage", "approvals", "--json")
                    assert listed.returncode == 0, listed.stderr
                    pending = json.loads(listed.stdout)
                    await anyio.sleep(0.2)
            (row,) = pending
            assert (row["node"], row["session_id"], row["tool_name"]) == ("a", "t3", GREET)
            approved = await anyio.to_thread.run_sync(run, b, "sage", "approve", row["approval_id"])
            assert approved.returncode == 0, approved.stderr
            assert approved.stdout == f"allowed: {GREET} in session t3\n"

            out, err = await anyio.to_thread.run_sync(
                functools.partial(send.communicate, timeout=60)
            )
            assert (send.returncode, out) == (0, "greeted Ada\n"), err
            # the model's next request carries the answer of a's greeter
            (result,) = standin.messages[-1].tool_results()
            assert "Hello, Ada!" in json.dumps(result["content"])
            assert not result.get("is_error")

            stopped = await anyio.to_thread.run_sync(run, c, "sage", "stop", "t3")
            assert stopped.returncode == 0, stopped.stderr
            seen, err = await anyio.to_thread.run_sync(
                functools.partial(watch.communicate, timeout=30)
            )
            assert watch.returncode == 0, err
            events = [json.loads(line) for line in seen.splitlines()]
            names = [e["event"] for e in events]
            assert names.count("tool_use") == 1, names  # replayed or live, never both
            turn = names[names.index("tool_use") :]
            # the watcher on c saw the turn on a: the tool call, its approval, the reply, the
            # end (between them the model's messages and their usage, as the model wrote them)
            assert [n for n in turn if n not in ("text", "assistant", "usage")] == [
                "tool_use",
                "approval_request",
                "approval",
                "tool_result",
                "done",
                "exited",
            ], names
            assert "".join(e["data"]["delta"] for e in events if e["event"] == "text") == (
                "greeted Ada"
            )
            (use,) = [e["data"] for e in events if e["event"] == "tool_use"]
            assert (use["name"], use["input"]) == (GREET, {"name": "Ada"})
        finally:
            for proc in (watch, send):
                if proc is not None and proc.poll() is None:
                    proc.kill()
                    proc.communicate()
            for daemon in nodes.values():
                await anyio.to_thread.run_sync(functools.partial(daemon.stop, 15.0))
