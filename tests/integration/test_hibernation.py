"""Hibernation with the CLI double: idle sessions stop their child and wake on the next send.

``[sessions] hibernate_after`` hibernates a session idle that long; ``max_live``
bounds the live children, the least recently used idle session making room;
a wake resumes the conversation with ``--resume`` and the same ids.  The real
CLI's side (the earlier turns reach the model after a wake) is tests/e2e.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import BusClient
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.procs import marked
from tests.support.sage_harness import Events, Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

ENV = {"ANTHROPIC_API_KEY": "sk-double"}


def _config(sessions: str = "", limits: str = "", mode: str = "") -> str:
    return sage_config(
        FAKE_CLAUDE,
        {"FAKE_CLAUDE_MODE": mode},
        extra=(
            f"[limits]\nstop_grace = 1.0\ninit_timeout = 5.0\n{limits}\n[sessions]\n{sessions}\n"
        ),
    )


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _argv(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")


async def _rows(sage: Sage) -> dict[str, dict[str, Any]]:
    listing = await sage.request("sage.v1.request.sessions", {})
    return {row["session_id"]: row for row in listing["sessions"]}


def _stored(sage: Sage, sid: str) -> dict[str, Any]:
    db = sqlite3.connect(sage.daemon.root / "state" / "state.db")
    try:
        (value,) = db.execute(
            "SELECT value FROM kv WHERE namespace = 'sessions' AND key = ?", (sid,)
        ).fetchone()
    finally:
        db.close()
    record: dict[str, Any] = msgspec.json.decode(value)
    return record


async def _turn(sage: Sage, events: Events, sid: str, text: str) -> str:
    reply = await sage.send(sid, text)
    assert reply["ok"], reply
    got, _ = await events.text_until_done()
    return got


async def test_an_idle_session_hibernates_and_the_next_send_wakes_it() -> None:
    async with running_sage(_config("hibernate_after = 0.5\n"), env=ENV) as sage:
        events = await sage.ready("nap")
        assert await _turn(sage, events, "nap", "one") == "echo: one"
        pid = (await _rows(sage))["nap"]["pid"]
        seen = await events.until("hibernated", within=10)
        names = [n for n, _ in seen]
        assert names.index("hibernating") < names.index("hibernated")
        assert "exited" not in names  # the session did not end
        assert not _alive(pid)
        row = (await _rows(sage))["nap"]
        assert (row["state"], row["pid"], row["turns"]) == ("hibernated", None, 1)
        record = _stored(sage, "nap")
        assert record["state"] == "hibernated"
        assert record["pid"] is None
        claude_session = record["claude_session"]

        audits = await sage.client.subscribe("sage.v1.audit.spawn")
        asleep = len(events.seen)
        assert await _turn(sage, events, "nap", "two") == "echo: two"
        woke = [n for n, _ in events.seen[asleep:]]
        assert woke[:4] == ["waking", "spawned", "resumed", "init"], woke
        resumed = dict(events.seen[asleep:])["resumed"]
        assert resumed["reason"] == "wake"
        with anyio.fail_after(5):
            audit = msgspec.json.decode((await audits.get()).payload)
        assert audit["resume"] is True
        row = (await _rows(sage))["nap"]
        assert row["state"] in ("ready", "busy")
        assert row["pid"] not in (None, pid)
        assert row["turns"] == 2  # the session's, across its children
        assert _stored(sage, "nap")["claude_session"] == claude_session
        argv = _argv(row["pid"])
        assert f"--resume={claude_session}".encode() in argv or (
            b"--resume" in argv and claude_session.encode() in argv
        )


async def test_a_busy_session_does_not_hibernate() -> None:
    async with running_sage(_config("hibernate_after = 0.3\n"), env=ENV) as sage:
        events = await sage.ready("busy")
        assert (await sage.send("busy", "/fault hang"))["ok"]
        await anyio.sleep(1.5)
        assert "hibernating" not in [n for n, _ in events.seen]
        assert (await _rows(sage))["busy"]["state"] == "busy"


async def test_max_live_hibernates_the_least_recently_used() -> None:
    """Three sessions, two live slots: the oldest idle one makes room, and a send to it
    wakes it while the next least recently used goes to sleep; never three children."""
    async with running_sage(_config("max_live = 2\n"), env=ENV) as sage:
        marker = f"ASTRID_SOCKET={sage.daemon.socket}".encode()
        most = 0

        async def count() -> None:  # the supervisor's claude children, all along
            nonlocal most
            while True:
                most = max(most, len(await anyio.to_thread.run_sync(marked, marker)))
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(count)
            first = await sage.ready("a")
            second = await sage.ready("b")
            await _turn(sage, second, "b", "b is used after a")
            await sage.ready("c")
            await first.until("hibernated", within=10)
            rows = await _rows(sage)
            assert {sid: row["state"] for sid, row in rows.items()}["a"] == "hibernated"
            assert sum(1 for row in rows.values() if row["pid"]) == 2
            assert await _turn(sage, first, "a", "back") == "echo: back"
            await second.until("hibernated", within=10)  # b was used before c
            rows = await _rows(sage)
            assert rows["b"]["state"] == "hibernated"
            live = [row["pid"] for row in rows.values() if row["pid"]]
            assert len(live) == 2
            assert all(_alive(pid) for pid in live)
            tg.cancel_scope.cancel()
        assert most == 2


async def test_a_full_host_with_no_idle_session_says_host_full() -> None:
    async with running_sage(
        _config("max_live = 1\nwake_wait = 0.5\nwake_queue = 1\n"), env=ENV
    ) as sage:
        events = await sage.ready("hog")
        assert (await sage.send("hog", "/fault hang"))["ok"]
        started = time.monotonic()
        _, reply = await sage.spawn("late")
        assert reply["ok"] is False
        assert reply["error"] == "host_full", reply
        assert "max_live" in reply["message"]
        assert time.monotonic() - started >= 0.4  # it waited for a slot first
        assert "late" not in await _rows(sage)
        assert "hibernating" not in [n for n, _ in events.seen]


async def test_a_waiting_spawn_gets_the_slot_once_a_session_turns_idle() -> None:
    async with running_sage(_config("max_live = 1\nwake_wait = 10\n"), env=ENV) as sage:
        events = await sage.ready("hog")
        assert (await sage.send("hog", "/fault hang"))["ok"]
        async with anyio.create_task_group() as tg:
            replies: list[dict[str, Any]] = []

            async def spawn() -> None:
                replies.append((await sage.spawn("next"))[1])

            tg.start_soon(spawn)
            await anyio.sleep(0.5)
            assert replies == []  # it waits: the only live session is busy
            await sage.request("sage.v1.request.interrupt.hog", {})
        assert replies[0]["ok"], replies
        await events.until("hibernated", within=10)


async def test_stopping_a_hibernated_session_ends_it() -> None:
    async with running_sage(_config("hibernate_after = 0.3\n"), env=ENV) as sage:
        events = await sage.ready("bye")
        await events.until("hibernated", within=10)
        assert (await sage.request("sage.v1.request.stop.bye", {}))["ok"]
        _, exited = (await events.until("exited"))[-1]
        assert exited["reason"] == "stopped"
        assert "bye" not in await _rows(sage)
        assert _stored(sage, "bye")["state"] == "ended"
        reply = await sage.send("bye", "hello?")
        assert reply["error"] == "session_ended", reply


async def test_a_failed_resume_ends_the_session_with_a_clear_reason() -> None:
    """A session that spoke and whose transcript is gone (``resume_fails``: the double
    fails every ``--resume`` as the real CLI fails one with no transcript) ends
    ``resume_failed`` with the CLI's words, instead of forgetting its conversation."""
    async with running_sage(
        _config("hibernate_after = 0.3\n", mode="resume_fails"), env=ENV
    ) as sage:
        events = await sage.ready("lost")
        assert await _turn(sage, events, "lost", "remember") == "echo: remember"
        await events.until("hibernated", within=10)
        audits = await sage.client.subscribe("sage.v1.audit.resume_failed")
        reply = await sage.send("lost", "still there?")
        assert reply["ok"] is False
        assert reply["error"] == "session_ended", reply
        _, exited = (await events.until("exited"))[-1]
        assert exited["reason"].startswith("resume_failed: crashed"), exited
        assert "No conversation found" in exited["reason"]
        with anyio.fail_after(5):
            audit = msgspec.json.decode((await audits.get()).payload)
        assert audit["session_id"] == "lost"
        assert _stored(sage, "lost")["state"] == "ended"


async def test_hibernated_sessions_survive_a_supervisor_restart() -> None:
    """Without ``[sessions] resume``, too: a hibernated session has no child to lose."""
    root = short_dir()
    config = _config("hibernate_after = 0.3\n")
    async with running_sage(config, env=ENV, root=root) as sage:
        events = await sage.ready("keep")
        await _turn(sage, events, "keep", "before")
        await events.until("hibernated", within=10)
    async with running_sage(config, env=ENV, root=root) as sage:
        rows = await _rows(sage)
        assert rows["keep"]["state"] == "hibernated"
        events = await sage.events("keep")
        assert await _turn(sage, events, "keep", "after") == "echo: after"
        assert (await _rows(sage))["keep"]["turns"] == 2


async def test_a_hibernation_cut_by_a_supervisor_crash_resumes_after_restart() -> None:
    root = short_dir()
    config = _config("hibernate_after = 0.3\n")
    async with running_sage(config, env=ENV, root=root) as sage:
        events = await sage.ready("cut")
        _, hibernating = (await events.until("hibernating", within=10))[-1]
        assert hibernating["why"] == "idle"
        daemon = sage.daemon.proc
        assert daemon is not None
        os.kill(daemon.pid, signal.SIGKILL)  # before or as the child goes
        await anyio.to_thread.run_sync(daemon.wait)
    async with running_sage(config, env=ENV, root=root) as sage:
        assert (await _rows(sage))["cut"]["state"] == "hibernated"
        events = await sage.events("cut")
        assert await _turn(sage, events, "cut", "again") == "echo: again"


async def test_the_per_principal_cap_counts_live_sessions() -> None:
    """One live session per principal: a second spawn hibernates the idle first; the
    logical cap (hibernated included) still refuses a third."""
    async with running_sage(
        _config(
            "max_live = 10\n",
            limits="max_sessions_per_principal = 1\nmax_logical_sessions_per_principal = 2\n",
        ),
        env=ENV,
    ) as sage:
        first = await sage.ready("one")
        await sage.ready("two")
        await first.until("hibernated", within=10)
        _, reply = await sage.spawn("three")
        assert reply["error"] == "principal_limit", reply
        assert "hibernated ones included" in reply["message"]
        # waking the first puts the second to sleep: one live at a time
        assert await _turn(sage, first, "one", "hi") == "echo: hi"
        rows = await _rows(sage)
        assert rows["two"]["state"] in ("hibernating", "hibernated")


async def test_another_principal_cannot_wake_a_session() -> None:
    config = _config("hibernate_after = 0.3\n") + (
        f'[[principals]]\nname = "bob"\nuids = [{os.getuid() + 1}]\noperator_key = true\n'
    )
    async with running_sage(config, env=ENV) as sage:
        events = await sage.ready("mine")
        await events.until("hibernated", within=10)
        async with BusClient.connect(
            sage.daemon.socket, role="cli", name="bob", principal="bob"
        ) as bob:
            for topic, payload in (
                ("sage.v1.request.wake.mine", {}),
                ("sage.v1.request.send.mine", {"text": "x"}),
                ("sage.v1.request.session.mine", {}),
                ("sage.v1.request.interrupt.mine", {}),
                ("sage.v1.request.stop.mine", {}),
            ):
                reply = msgspec.json.decode(
                    (await bob.request(topic, payload, deadline=10)).payload
                )
                assert reply["error"] == "unknown_session", reply
        assert (await _rows(sage))["mine"]["state"] == "hibernated"
        assert (await sage.request("sage.v1.request.wake.mine", {}))["woken"] is True
        await events.until("init")


async def test_the_cli_shows_a_hibernated_session_and_resumes_it() -> None:
    """`astrid sage sessions` lists it asleep; `send` says it resumes, then streams;
    `watch --wake` wakes one without a turn."""
    async with running_sage(_config("hibernate_after = 0.3\n"), env=ENV) as sage:
        for sid in ("cli", "woke"):
            events = await sage.ready(sid)
            await events.until("hibernated", within=10)
        code, out, err = await sage.astrid("sage", "sessions")
        assert code == 0, err
        line = next(row for row in out.splitlines() if row.startswith("cli "))
        assert "hibernated" in line.split()
        code, out, err = await sage.astrid("sage", "send", "cli", "hello again")
        assert code == 0, err
        assert out.strip() == "echo: hello again"
        assert "[session] resuming cli (hibernated " in err

        code, out, err = await sage.astrid("sage", "watch", "woke", "--wake", "-n", "4")
        assert code == 0, err
        names = [msgspec.json.decode(row)["event"] for row in out.splitlines()]
        assert names == ["waking", "spawned", "resumed", "init"], names


async def test_a_wake_refused_before_its_child_runs_leaves_the_session_asleep() -> None:
    """A home made unsafe meanwhile refuses the launch: the send says why, the session
    and its conversation stay; once fixed, the next send wakes it."""
    async with running_sage(_config("hibernate_after = 0.3\n"), env=ENV) as sage:
        events = await sage.ready("safe")
        await _turn(sage, events, "safe", "before")
        await events.until("hibernated", within=10)
        home = sage.daemon.root / "state" / "homes" / "alice"
        mode = home.stat().st_mode & 0o777
        home.chmod(0o777)
        reply = await sage.send("safe", "now?")
        assert reply["error"] == "unsafe_home", reply
        assert (await _rows(sage))["safe"]["state"] == "hibernated"
        assert _stored(sage, "safe")["state"] == "hibernated"
        home.chmod(mode)
        assert await _turn(sage, events, "safe", "after") == "echo: after"
        assert (await _rows(sage))["safe"]["turns"] == 2


async def test_thousands_of_sessions_are_listed_page_by_page() -> None:
    """A listing of every session on a host would pass the bus's 1 MiB payload limit:
    it comes in pages, and `astrid sage sessions` reads them all."""
    root = short_dir()
    config = _config("max_live = 4\n", limits="max_logical_sessions_per_principal = 5000\n")
    async with running_sage(config, env=ENV, root=root):
        pass  # the state store exists now
    db = sqlite3.connect(root / "state" / "state.db")
    try:
        rows = [
            (
                f"h{i:05d}",
                msgspec.json.encode(
                    {
                        "session_id": f"h{i:05d}",
                        "principal_id": "alice",
                        "claude_session": f"00000000-0000-4000-8000-{i:012d}",
                        "state": "hibernated",
                        "started_at": 1.0,
                        "hibernated_at": 2.0,
                        "cwd": "/" + "x" * 200,  # rows of a realistic size
                    }
                ),
            )
            for i in range(4500)
        ]
        db.executemany(
            "INSERT INTO kv (namespace, key, value, updated_ns) VALUES ('sessions', ?, ?, 1)",
            rows,
        )
        db.commit()
    finally:
        db.close()
    async with running_sage(config, env=ENV, root=root) as sage:
        first = await sage.request("sage.v1.request.sessions", {})
        assert first["ok"], first
        assert (len(first["sessions"]), first["total"], first["next_offset"]) == (1000, 4500, 1000)
        last = await sage.request("sage.v1.request.sessions", {"offset": 4000})
        assert (len(last["sessions"]), last["next_offset"]) == (500, None)
        code, out, err = await sage.astrid("sage", "sessions", "--json")
        assert code == 0, err
        listed = msgspec.json.decode(out)
        assert len(listed) == 4500
        assert {row["state"] for row in listed} == {"hibernated"}


async def test_send_past_its_timeout_says_so_and_leaves_the_turn() -> None:
    async with running_sage(_config(), env=ENV) as sage:
        await sage.ready("slow")
        code, _, err = await sage.astrid("sage", "send", "slow", "/fault hang", "--timeout", "1")
        assert code == 124, err
        assert "did not end within 1 s; session slow goes on" in err
        assert "Traceback" not in err
        assert (await _rows(sage))["slow"]["state"] == "busy"


async def test_one_principal_cannot_hold_every_live_slot() -> None:
    """max_live = 3: with alice's session hibernated, bob's busy sessions hold two slots at
    most (one is kept for alice), so her next send wakes it instead of ending host_full."""
    config = _config("max_live = 3\nwake_wait = 2\nhibernate_after = 1.0\n") + (
        '[[principals]]\nname = "bob"\noperator_key = true\n'
    )
    async with running_sage(config, env=ENV) as sage:
        alice = await sage.ready("a1")
        for sid in ("b1", "b2"):
            await sage.ready(sid, principal_id="bob")
            assert (await sage.send(sid, "/fault hang"))["ok"]
        await alice.until("hibernated", within=10)
        code, out, err = await sage.astrid(
            "sage", "spawn", "bob", "--session", "b3", "--message", "/fault hang"
        )
        assert code == 1, out
        assert "principal_limit" in err
        assert "its share of [sessions] max_live = 3" in err
        code, out, err = await sage.astrid("sage", "send", "a1", "back")
        assert code == 0, err
        assert out == "echo: back\n"


async def test_age_and_cost_are_the_sessions_across_a_wake_and_an_adoption() -> None:
    """AGE is since the spawn (not the current child's), and an adopted session keeps the
    cost, turns and start the lost node had (the fleet's failover asks just this)."""
    async with running_sage(_config("hibernate_after = 0.5\n"), env=ENV) as sage:
        events = await sage.ready("old")
        await events.until("hibernated", within=10)
        await anyio.sleep(1.5)
        assert await _turn(sage, events, "old", "hi") == "echo: hi"  # a new child
        assert (await _rows(sage))["old"]["age_s"] >= 2.0
        events = await sage.events("moved")
        adopted = await sage.request(
            "sage.v1.request.adopt",
            {
                "session_id": "moved",
                "principal_id": "alice",
                "claude_session": "6f1b3f2e-8a0c-4a6b-9d2e-1c3b5a7d9e0f",
                "from_node": "lost",
                "turns": 3,
                "cost_usd": 1.25,
                "started_at": time.time() - 3600,
                "fresh": True,
            },
        )
        assert adopted["ok"], adopted
        await events.until("init")
        code, out, err = await sage.astrid("sage", "sessions")
        assert code == 0, err
        (line,) = [x for x in out.splitlines() if x.startswith("moved ")]
        assert line.split()[-3:] == ["60m", "3", "$1.2500"], line


async def test_a_wake_at_the_principals_cap_waits_for_its_busy_session() -> None:
    """At its cap with its live session busy, a principal's send to a hibernated session
    waits (up to wake_wait) for that session to go idle and sleep, then is answered; it
    used to be refused principal_limit at once (found by the lifecycle model test)."""
    config = _config("max_live = 10\nwake_wait = 20\n", limits="max_sessions_per_principal = 1\n")
    async with running_sage(config, env=ENV) as sage:
        first = await sage.ready("one")
        busy = await sage.ready("two")  # one hibernates for it
        await first.until("hibernated", within=10)
        assert (await sage.send("two", "/fault hang"))["ok"]
        await busy.until("text")
        async with anyio.create_task_group() as tg:
            answers: list[str] = []

            async def send() -> None:
                answers.append(await _turn(sage, first, "one", "back"))

            tg.start_soon(send)
            await anyio.sleep(1.0)
            assert answers == []  # it waits: no refusal
            assert (await sage.request("sage.v1.request.interrupt.two", {}))["ok"]
        assert answers == ["echo: back"]
        rows = await _rows(sage)
        assert rows["two"]["state"] in ("hibernating", "hibernated")


async def test_a_woken_child_killed_before_it_answers_initialize_ends_resume_failed(
    tmp_path: Path,
) -> None:
    """The lifecycle soak's find (seed 1023927600, under load): a wake request returns once
    the child runs, so a SIGKILL may land before that child answers ``initialize``; the
    session then ends ``resume_failed: crashed`` (with the signal), not ``crashed``, and
    says so in the listing and to a send."""
    slow = tmp_path / "claude"  # a --resume child that takes 3 s to start
    slow.write_text(
        f'#!/bin/sh\ncase " $* " in *" --resume "*) sleep 3;; esac\nexec {FAKE_CLAUDE} "$@"\n'
    )
    slow.chmod(0o755)
    config = _config("hibernate_after = 0.3\n").replace(str(FAKE_CLAUDE), str(slow))
    async with running_sage(config, env=ENV) as sage:
        events = await sage.ready("w")
        assert await _turn(sage, events, "w", "hello") == "echo: hello"
        await events.until("hibernated", within=10)
        assert (await sage.request("sage.v1.request.wake.w", {}))["ok"]
        row = (await _rows(sage))["w"]
        assert row["state"] == "waking", row
        os.kill(row["pid"], signal.SIGKILL)
        _, exited = (await events.until("exited", within=10))[-1]
        assert (exited["reason"], exited["signal"]) == ("resume_failed: crashed", 9), exited
        ended = (await sage.request("sage.v1.request.sessions", {"all": True}))["sessions"]
        assert [(r["state"], r["reason"]) for r in ended if r["session_id"] == "w"] == [
            ("ended", "resume_failed: crashed")
        ]
        reply = await sage.send("w", "still there?")
        assert (reply["ok"], reply["error"]) == (False, "session_ended"), reply
