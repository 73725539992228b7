"""Failover with the real Claude Code CLI: node a SIGKILLed mid-conversation, its session
resumes on node b, and the next model request carries the earlier turns.

Both nodes have ``[sessions] resume = true``; the CLI writes its transcript under
alice's home on a, a replicates it to the ``sage_transcripts`` object store after
the turn, and b restores it under alice's home there before ``claude --resume``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest

from tests.support.nats_cluster import NatsCluster, stored_transcript
from tests.support.sage_harness import running_sage, sage_config
from tests.support.standin import Standin, Text

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

LOST_AFTER = 2.0


def _config(claude_bin: Path, standin: Standin, cluster: NatsCluster, node: str) -> str:
    fleet = cluster.fleet_section(node, lost_after=LOST_AFTER, replicas=1)
    return sage_config(
        claude_bin,
        standin.offline_env(),
        extra="[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n[sessions]\nresume = true\n"
        + fleet,
    )


async def test_a_killed_nodes_session_resumes_on_b_with_its_turns(
    claude_bin: Path, standin: Standin
) -> None:
    env = {"ANTHROPIC_API_KEY": "sk-test"}
    with NatsCluster(["a", "b"]) as cluster:
        async with (
            running_sage(_config(claude_bin, standin, cluster, "a"), env=env) as a,
            running_sage(_config(claude_bin, standin, cluster, "b"), env=env) as b,
        ):
            on_a = await a.ready("far")
            standin.push(Text("noted: tangerine"))
            assert (await a.send("far", "remember the word tangerine"))["ok"]
            await on_a.text_until_done(within=60)

            async def replicated() -> bytes:
                while True:
                    found = await stored_transcript(cluster, "a", "far")
                    if found is not None and b"tangerine" in found[0]:
                        return found[0]
                    await anyio.sleep(0.1)

            with anyio.fail_after(15):
                await replicated()

            on_b = await b.events("far")
            a.daemon.signal(signal.SIGKILL)
            killed = time.monotonic()
            with anyio.fail_after(LOST_AFTER + 30):
                resumed = await on_b.until("init")
            names = [name for name, _ in resumed]
            assert "resumed" in names, names
            (payload,) = [data for name, data in resumed if name == "resumed"]
            assert (payload["reason"], payload["from_node"]) == ("failover", "a")
            print(f"failover: init on b {time.monotonic() - killed:.1f} s after the SIGKILL")

            standin.push(Text("it was tangerine"))
            reply = await b.send("far", "which word?")
            assert reply["ok"], reply
            text, done = await on_b.text_until_done(within=60)
            assert text == "it was tangerine"
            assert done["is_error"] is False
            earlier = str(standin.messages[-1].body["messages"])
            assert "remember the word tangerine" in earlier  # the conversation came along
            assert "noted: tangerine" in earlier
            listing = await b.request("sage.v1.request.sessions", {})
            (row,) = listing["sessions"]
            assert (row["session_id"], row["turns"]) == ("far", 2)
