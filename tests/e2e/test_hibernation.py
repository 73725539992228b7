"""Hibernation end to end: the real Claude Code CLI stopped while idle and resumed on the next send.

A supervisor with ``[sessions] hibernate_after`` (or ``max_live``) stops an idle
session's ``claude``; the next send starts a new one with ``--resume`` on the
same conversation, so the model request after the wake carries the earlier
turns.  A transcript that is gone ends the session ``resume_failed`` with the
CLI's own words.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.standin import Standin, Text

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

ENV = {"ANTHROPIC_API_KEY": "sk-test"}


def _config(claude_bin: Path, standin: Standin, sessions: str) -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        extra=f"[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n[sessions]\n{sessions}\n",
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


async def _rows(sage: Sage) -> dict[str, dict[str, Any]]:
    listing = await sage.request("sage.v1.request.sessions", {})
    return {row["session_id"]: row for row in listing["sessions"]}


def _transcripts(root: Path, claude_session: str) -> list[Path]:
    return [p for p in root.rglob(f"{claude_session}.jsonl") if p.is_file()]


async def test_a_woken_session_carries_its_earlier_turns(
    claude_bin: Path, standin: Standin
) -> None:
    async with running_sage(
        _config(claude_bin, standin, "hibernate_after = 1.0\n"), env=ENV
    ) as sage:
        events = await sage.ready("nap")
        standin.push(Text("noted: tangerine"))
        assert (await sage.send("nap", "remember the word tangerine"))["ok"]
        await events.text_until_done(within=60)
        pid = (await _rows(sage))["nap"]["pid"]
        await events.until("hibernated", within=30)
        assert not _alive(pid)
        assert (await _rows(sage))["nap"]["state"] == "hibernated"

        standin.push(Text("it was tangerine"))
        reply = await sage.send("nap", "which word?")
        assert reply["ok"], reply
        text, done = await events.text_until_done(within=60)
        assert text == "it was tangerine"
        assert done["is_error"] is False
        earlier = str(standin.messages[-1].body["messages"])
        assert "remember the word tangerine" in earlier  # the conversation was resumed
        assert "noted: tangerine" in earlier
        row = (await _rows(sage))["nap"]
        assert row["pid"] not in (None, pid)
        assert row["turns"] == 2


async def test_max_live_holds_with_the_real_cli(claude_bin: Path, standin: Standin) -> None:
    """One live slot: a second session puts the first to sleep, a send to the first
    wakes it (and puts the second to sleep) with its own conversation."""
    async with running_sage(_config(claude_bin, standin, "max_live = 1\n"), env=ENV) as sage:
        first = await sage.ready("one")
        standin.push(Text("one noted"))
        assert (await sage.send("one", "my colour is green"))["ok"]
        await first.text_until_done(within=60)
        second = await sage.ready("two")
        await first.until("hibernated", within=30)
        rows = await _rows(sage)
        assert [sid for sid, row in rows.items() if row["pid"]] == ["two"]

        standin.push(Text("green"))
        assert (await sage.send("one", "what is my colour?"))["ok"]
        text, _ = await first.text_until_done(within=60)
        assert text == "green"
        assert "my colour is green" in str(standin.messages[-1].body["messages"])
        await second.until("hibernated", within=30)
        rows = await _rows(sage)
        assert [sid for sid, row in rows.items() if row["pid"]] == ["one"]


async def test_a_lost_transcript_ends_the_session_resume_failed(
    claude_bin: Path, standin: Standin
) -> None:
    async with running_sage(
        _config(claude_bin, standin, "hibernate_after = 1.0\n"), env=ENV
    ) as sage:
        events = await sage.ready("gone")
        standin.push(Text("ok"))
        assert (await sage.send("gone", "hello"))["ok"]
        await events.text_until_done(within=60)
        await events.until("hibernated", within=30)
        record = await sage.request("sage.v1.request.session.gone", {})
        assert record["session"]["state"] == "hibernated"
        claude_session = _claude_session(sage, "gone")
        found = _transcripts(sage.daemon.root, claude_session)
        assert found, "the CLI keeps a transcript under the principal's home"
        for path in found:
            os.unlink(path)
        reply = await sage.send("gone", "still there?")
        assert reply["ok"] is False
        assert reply["error"] == "session_ended", reply
        _, exited = (await events.until("exited", within=30))[-1]
        assert exited["reason"].startswith("resume_failed:"), exited
        assert "No conversation found" in exited["reason"]
        assert "gone" not in await _rows(sage)


def _claude_session(sage: Sage, sid: str) -> str:
    import sqlite3

    import msgspec

    db = sqlite3.connect(sage.daemon.root / "state" / "state.db")
    try:
        (value,) = db.execute(
            "SELECT value FROM kv WHERE namespace = 'sessions' AND key = ?", (sid,)
        ).fetchone()
    finally:
        db.close()
    claude_session: str = msgspec.json.decode(value)["claude_session"]
    return claude_session
