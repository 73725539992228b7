"""Warm spares end to end: the real Claude Code CLI started ahead of the spawn.

A supervisor with ``[sessions] spares = 1`` keeps one initialized ``claude``
for alice.  A spawn without a session id takes it and answers a turn through
the Messages API stand-in; a spare started before a settings change is
discarded and the spawn starts cold.  An installed alice's spare raises no
hook spoof alarm: its hooks are in-band, none is a command hook.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import msgspec
import pytest

from tests.support.sage_harness import running_sage, sage_config
from tests.support.spares import listed, ready_spares
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]


def _config(claude_bin: Path, standin: Standin) -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        extra=(
            "[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n"
            "[sessions]\nspares = 1\nspare_max_age = 600.0\n"
        ),
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_spare_is_taken_and_answers_a_turn(claude_bin: Path, standin: Standin) -> None:
    """The spawn gets the spare's id and pid at once; the turn streams as usual."""
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        (sid, pid), *_ = (await ready_spares(sage, within=60)).items()
        assert standin.messages == []  # a spare asks the API nothing before its turn
        events = await sage.events(sid)
        audits = await sage.client.subscribe("sage.v1.audit.spawn")
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply == {"ok": True, "session_id": sid, "pid": pid}, reply
        assert [n for n, _ in await events.until("init")] == ["spawned", "init"]
        with anyio.fail_after(10):
            audit = msgspec.json.decode((await audits.get()).payload)
        assert audit["spare"] is True
        assert audit["session_id"] == sid

        standin.push(Text("warm hello", chunks=3))
        assert (await sage.send(sid, "hi"))["ok"]
        text, done = await events.text_until_done(within=60)
        assert text == "warm hello"
        assert done["is_error"] is False
        assert [row["session_id"] for row in await listed(sage)] == [sid]
        nxt = await ready_spares(sage, within=60)  # the next spare, in the background
        assert sid not in nxt


async def test_a_stale_spare_is_discarded(claude_bin: Path, standin: Standin) -> None:
    """A settings change after the spare started: it is stopped, the spawn starts cold."""
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        (sid, pid), *_ = (await ready_spares(sage, within=60)).items()
        changed = await sage.request(
            "sage.v1.request.settings.set", {"principal_id": "alice", "max_turns": 3}
        )
        assert changed["ok"], changed
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["ok"], reply
        assert reply["pid"] != pid
        assert reply["session_id"] == sid  # the id was chosen ahead; the child is new
        events = await sage.events(sid)
        for _ in range(200):
            if not _alive(pid):
                break
            await anyio.sleep(0.05)
        assert not _alive(pid), "the stale spare still runs"
        standin.push(Text("cold hello"))
        assert (await sage.send(reply["session_id"], "hi"))["ok"]
        text, _ = await events.text_until_done(within=60)
        assert text == "cold hello"
        argv = (await anyio.Path(f"/proc/{reply['pid']}/cmdline").read_bytes()).split(b"\0")
        assert argv[argv.index(b"--max-turns") + 1] == b"3"


async def test_a_spares_start_and_hand_over_raise_no_spoof_alarm(
    claude_bin: Path, standin: Standin
) -> None:
    """An installed alice's spare starts, is taken, answers a tool turn and stops with its
    hooks in-band: not one ``hook_spoof_attempt`` in the audit log (command hooks of an
    untaken spare were each one), and the taken session's hooks are published."""
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "greeter", "installer", "hooks"]',
        extra=(
            "[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n"
            "[sessions]\nspares = 1\nspare_max_age = 600.0\n"
        ),
        principal_extra='allowed_tools = ["mcp__sage__greet"]\n',
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as sage:
        installed = await sage.request("sage.v1.request.install", {"principal_id": "alice"})
        assert installed["ok"], installed
        hooks = await sage.client.subscribe("hook.v1.event.>")
        (sid, pid), *_ = (await ready_spares(sage, within=60)).items()
        await anyio.sleep(1.0)  # what an untaken spare's start would report, reported
        events = await sage.events(sid)
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply == {"ok": True, "session_id": sid, "pid": pid}, reply
        await events.until("init")
        standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("greeted"))
        assert (await sage.send(sid, "greet Ada"))["ok"]
        text, _ = await events.text_until_done(within=60)
        assert text == "greeted"
        with anyio.fail_after(20):
            event = msgspec.json.decode((await hooks.get()).payload)
        assert (event["session_id"], event["decision_source"]) == (sid, "in_band")
        await ready_spares(sage, within=60)  # the next spare starts too
        await sage.request(f"sage.v1.request.stop.{sid}", {})
        await events.until("exited")
        code, out, err = await sage.astrid("audit", "verify")  # every entry committed
        assert code == 0, out + err
        db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
        kinds = [r[0] for r in db.execute("SELECT kind FROM entries")]
        db.close()
    assert "sage.v1.audit.spawn" in kinds
    assert "sage.v1.audit.hook_spoof_attempt" not in kinds
