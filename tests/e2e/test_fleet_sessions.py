"""Sessions anywhere with the real Claude Code CLI: two nodes over a real 3-server NATS cluster.

Node a runs the session (the pinned ``claude`` against the Messages API stand-in);
every command is typed on node b's socket: ``spawn --node a``, ``send`` (its reply
streams through b), ``sessions`` (with the node), ``stop``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.nats_cluster import NatsCluster
from tests.support.sage_harness import running_sage, sage_config
from tests.support.standin import Standin, Text

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


def _config(claude_bin: Path, standin: Standin, cluster: NatsCluster, node: str) -> str:
    fleet = (
        cluster.fleet_section(node, replicas=1)
        # the test's commands are an admin's (no --principal): b's admins are a's
        + '[fleet.peers.b]\nadmins = true\nprincipals = ["alice"]\n'
    )
    return sage_config(
        claude_bin,
        standin.offline_env(),
        extra="[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n" + fleet,
    )


async def test_a_session_on_a_driven_from_b(claude_bin: Path, standin: Standin) -> None:
    env = {"ANTHROPIC_API_KEY": "sk-test"}
    # started in the test's own thread: the servers' death signal is tied to it
    with NatsCluster(["a", "b"]) as cluster:
        async with (
            running_sage(_config(claude_bin, standin, cluster, "a"), env=env) as a,
            running_sage(_config(claude_bin, standin, cluster, "b"), env=env) as b,
        ):
            code, out, err = await b.astrid(
                "sage", "spawn", "alice", "--node", "a", "--session", "far", "--json"
            )
            assert code == 0, err
            spawned = json.loads(out)
            assert (spawned["session_id"], spawned["node"]) == ("far", "a")
            # the child is a's: a's own runner lists it with that pid
            local = await a.request("sage.v1.request.sessions", {})
            assert [r["pid"] for r in local["sessions"]] == [spawned["pid"]]

            standin.push(Text("an answer from node a", chunks=3))
            code, out, err = await b.astrid("sage", "send", "far", "hello across nodes")
            assert code == 0, err
            assert out == "an answer from node a\n"  # streamed through b's socket
            assert "hello across nodes" in str(standin.messages[-1].last_user_message)

            code, out, err = await b.astrid("sage", "sessions", "--json")
            assert code == 0, err
            (row,) = json.loads(out)
            assert (row["session_id"], row["node"], row["turns"]) == ("far", "a", 1)

            code, out, err = await b.astrid("sage", "stop", "far")
            assert code == 0, err
            assert (await a.request("sage.v1.request.sessions", {}))["sessions"] == []
