"""Where two lifecycle features meet, with the real Claude Code CLI.

A session that never spoke has no transcript (the CLI writes none before the
first user turn), so a wake, a restart or an adoption must start it afresh
under the same ``--session-id`` instead of ``--resume``, which the CLI refuses
("No conversation found").  A changed identity must reach a session that did
speak: the CLI keeps the system prompt its conversation recorded first unless
it runs with ``--system-prompt-snapshot off``.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import anyio
import pytest

from tests.support.daemon import short_dir
from tests.support.nats_cluster import NatsCluster
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.standin import Error, Standin, Text

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

ENV = {"ANTHROPIC_API_KEY": "sk-test"}
LIMITS = "[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n"


def _config(claude_bin: Path, standin: Standin, sessions: str, extra: str = "") -> str:
    return sage_config(
        claude_bin, standin.offline_env(), extra=f"{LIMITS}[sessions]\n{sessions}\n{extra}"
    )


async def _answers(sage: Sage, sid: str, standin: Standin, reply: str) -> None:
    """``sid`` takes a turn (a woken or restarted session may still be starting)."""
    events = await sage.events(sid)
    standin.push(Text(reply))
    deadline = time.monotonic() + 30
    while True:
        answer = await sage.send(sid, "are you there?")
        if answer.get("ok") or answer.get("error") != "session_busy":
            break
        assert time.monotonic() < deadline, answer
        await anyio.sleep(0.1)
    assert answer["ok"], answer
    text, done = await events.text_until_done(within=60)
    assert (text, done["is_error"]) == (reply, False)


async def test_a_session_that_hibernates_before_its_first_turn_wakes(
    claude_bin: Path, standin: Standin
) -> None:
    """Spawned, never spoken, hibernated: the send that wakes it is answered."""
    async with running_sage(_config(claude_bin, standin, "hibernate_after = 1.0"), env=ENV) as sage:
        events = await sage.ready("quiet")
        await events.until("hibernated", within=30)
        await _answers(sage, "quiet", standin, "here")
        names = [name for name, _ in events.seen]
        assert "exited" not in names, events.seen


async def test_a_never_spoken_session_survives_a_restart(
    claude_bin: Path, standin: Standin
) -> None:
    """``[sessions] resume = true``: a session with no turn is started again after a
    graceful restart and after a SIGKILL of the supervisor, and answers."""
    root = short_dir()
    config = _config(claude_bin, standin, "resume = true")
    async with running_sage(config, env=ENV, root=root) as sage:
        await sage.ready("quiet")
    async with running_sage(config, env=ENV, root=root) as sage:
        await _answers(sage, "quiet", standin, "after a restart")
        await sage.ready("mute")
        sage.daemon.signal(signal.SIGKILL)
    async with running_sage(config, env=ENV, root=root) as sage:
        await _answers(sage, "mute", standin, "after a kill")


async def test_a_never_spoken_session_adopted_after_failover_wakes(
    claude_bin: Path, standin: Standin
) -> None:
    """A node dies with a session that never spoke; the node that adopts it lets it
    hibernate, and the next send wakes it with a fresh conversation."""
    lost_after = 2.0
    with NatsCluster(["a", "b"]) as cluster:

        def config(node: str, sessions: str) -> str:
            fleet = cluster.fleet_section(node, lost_after=lost_after, replicas=1)
            return _config(claude_bin, standin, f"resume = true\n{sessions}", fleet)

        async with (
            running_sage(config("a", ""), env=ENV) as a,
            running_sage(config("b", "hibernate_after = 1.0"), env=ENV) as b,
        ):
            await a.ready("far")
            on_b = await b.events("far")
            a.daemon.signal(signal.SIGKILL)
            with anyio.fail_after(lost_after + 40):
                await on_b.until("resumed")
                await on_b.until("hibernated")
            await _answers(b, "far", standin, "adopted and awake")


async def test_a_changed_identity_reaches_a_session_that_spoke(
    claude_bin: Path, standin: Standin
) -> None:
    """The next model request of a live session after ``settings --identity`` carries
    the new text and still the earlier turns; so does a hibernated one's after its wake."""
    sessions = "max_live = 1"
    async with running_sage(_config(claude_bin, standin, sessions), env=ENV) as sage:
        standin.push(Text("noted"))
        sleepy = await sage.ready("sleepy")
        assert (await sage.send("sleepy", "remember plum"))["ok"]
        await sleepy.text_until_done(within=60)
        standin.push(Text("noted"))
        live = await sage.ready("live")  # sleepy hibernates: one live slot
        await sleepy.until("hibernated", within=30)
        assert (await sage.send("live", "remember fig"))["ok"]
        await live.text_until_done(within=60)
        assert "run by the sage supervisor" in str(standin.messages[-1].body["system"])

        reply = await sage.request(
            "sage.v1.request.settings.set",
            {"principal_id": "alice", "identity": "You are NEW-IDENTITY-7."},
        )
        assert reply["ok"], reply
        await live.until("respawned", within=30)
        await _answers(sage, "live", standin, "as the new one")
        request = standin.messages[-1].body
        assert "NEW-IDENTITY-7" in str(request["system"])
        assert "run by the sage supervisor" not in str(request["system"])
        assert "remember fig" in str(request["messages"])

        await _answers(sage, "sleepy", standin, "woken as the new one")
        request = standin.messages[-1].body
        assert "NEW-IDENTITY-7" in str(request["system"])
        assert "remember plum" in str(request["messages"])


@pytest.mark.parametrize(
    ("status", "kind", "reason"),
    [(529, "overloaded_error", "overloaded"), (403, "permission_error", "auth_failed")],
)
async def test_a_failed_turn_says_why_and_exits_non_zero(
    claude_bin: Path, standin: Standin, status: int, kind: str, reason: str
) -> None:
    """`astrid sage send` names how the turn failed (the CLI calls it 'success' with
    is_error) and exits 3, the code --help gives for a turn that ran and failed."""
    env = {**standin.offline_env(), "CLAUDE_CODE_MAX_RETRIES": "1"}  # not minutes of retries
    config = sage_config(claude_bin, env, extra=f"{LIMITS}[sessions]\n")
    async with running_sage(config, env=ENV) as sage:
        await sage.ready("fails")
        standin.push(*[Error(status, kind)] * 3)
        code, out, err = await sage.astrid("sage", "send", "fails", "hello")
        assert code == 3, (out, err)
        assert f"astrid: the turn failed: {reason}: " in err, err
        assert f"API Error: {status}" in err, err
        assert "success" not in err
