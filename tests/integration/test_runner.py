"""The session runner against the CLI test double: spawn rules and faults on cue.

The real CLI proves the protocol (tests/e2e/test_sessions.py); the double
(tests/support/fake_claude.py) misbehaves when told to: an 80 MB line, a
10 MB stderr flood, garbage, a child that ignores SIGTERM, a grandchild that
holds the pipes, no answer to ``initialize``, a crash, endless 401 retries.
Every case must end in a defined outcome, one ``exited`` event, and a
session table that is clean afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import FrameError
from bus.client import BusClient
from sage.claude.binary import FLOOR, NEWEST_TESTED
from tests.support import FAKE_CLAUDE
from tests.support.as_uid import Say, fork_as
from tests.support.sage_harness import Events, Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

FAKE = FAKE_CLAUDE
ENV = {"ANTHROPIC_API_KEY": "sk-double"}


def _config(mode: str = "", extra: str = "", principal_extra: str = "", **env: str) -> str:
    child_env = {"FAKE_CLAUDE_MODE": mode, **env}
    limits = "[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\nmax_line_bytes = 1048576\n"
    return sage_config(FAKE, child_env, extra=limits + extra, principal_extra=principal_extra)


@pytest.fixture
async def sage() -> AsyncIterator[Sage]:
    async with running_sage(_config(), env=ENV) as running:
        yield running


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


async def _listing(sage: Sage) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = (await sage.request("sage.v1.request.sessions", {}))["sessions"]
    return rows


async def _exited(events: Events, within: float = 15.0) -> dict[str, Any]:
    seen = await events.until("exited", within)
    assert [n for n, _ in seen].count("exited") == 1
    return seen[-1][1]


# -- spawn rules -----------------------------------------------------------------


async def test_a_turn_with_the_double(sage: Sage) -> None:
    events = await sage.ready("plain")
    await sage.send("plain", "hello")
    text, done = await events.text_until_done()
    assert text == "echo: hello"
    assert done["is_error"] is False


async def test_send_prints_its_own_turn_not_the_tail_of_an_earlier_one(sage: Sage) -> None:
    """A send while an earlier turn still runs waits for its own turn's done (issue 16:
    it used to return at the first done, whatever its turn, and print the old tail)."""
    events = await sage.ready("tail")
    await sage.send("tail", "/fault hang")
    await events.until("text")  # the first turn streams, then hangs
    result: list[tuple[int, str, str]] = []

    async def second() -> None:
        result.append(await sage.astrid("sage", "send", "tail", "second"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.sleep(1.5)  # the CLI subscribes and sends turn 2 behind the hung one
        assert (await sage.request("sage.v1.request.interrupt.tail", {}))["ok"]
    ((code, out, err),) = result
    assert (code, out) == (0, "echo: second\n"), err


async def _send_process(sage: Sage, sid: str, text: str) -> tuple[Any, bytearray]:
    """A real `astrid sage send` process, once its turn streams its first text."""
    from tests.support.daemon import ASTRID

    proc = await anyio.open_process(
        [*ASTRID, "sage", "send", sid, text, "--config", str(sage.daemon.config)],
        env=sage.daemon.env,
    )
    seen = bytearray()
    assert proc.stdout is not None
    with anyio.fail_after(15):
        while b"partial" not in seen:
            seen += await proc.stdout.receive()
    return proc, seen


async def test_ctrl_c_interrupts_the_turn_and_the_session_stays(sage: Sage) -> None:
    await sage.ready("ctrlc")
    proc, _ = await _send_process(sage, "ctrlc", "/fault hang")
    proc.send_signal(signal.SIGINT)
    with anyio.fail_after(15):
        code = await proc.wait()
    assert proc.stderr is not None
    err = (await proc.stderr.receive(65536)).decode()
    assert code == 130
    assert "interrupting the turn (Ctrl-C again to detach)" in err
    assert "turn 1 interrupted" in err
    await proc.aclose()
    code_, out, err = await sage.astrid("sage", "send", "ctrlc", "after")
    assert (code_, out) == (0, "echo: after\n"), err  # ready, and no old tail printed


async def test_a_second_ctrl_c_detaches(sage: Sage) -> None:
    await sage.ready("detach")
    proc, _ = await _send_process(sage, "detach", "/fault hang")
    (row,) = await _listing(sage)
    os.kill(row["pid"], signal.SIGSTOP)  # the CLI cannot answer the interrupt: the turn waits
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.stderr is not None
        err = bytearray()
        with anyio.fail_after(10):
            while b"Ctrl-C again to detach" not in err:
                err += await proc.stderr.receive()
        proc.send_signal(signal.SIGINT)
        with anyio.fail_after(10):
            assert await proc.wait() == 130
        err += await proc.stderr.receive()
        assert b"detached; session detach goes on" in err
    finally:
        os.kill(row["pid"], signal.SIGCONT)
    await proc.aclose()
    (row,) = await _listing(sage)
    assert row["session_id"] == "detach"


async def test_send_shows_tool_calls_on_stderr(sage: Sage) -> None:
    """A tool call and its end are one stderr line each; the reply stays on stdout."""
    await sage.ready("tools")
    code, out, err = await sage.astrid("sage", "send", "tools", '/fault tool greet {"name":"Ada"}')
    assert code == 0, err
    lines = err.splitlines()
    assert '[tool] mcp__sage__greet {"name":"Ada"}' in lines
    (end,) = [line for line in lines if line.startswith("[tool] mcp__sage__greet error (")]
    assert end.endswith(" ms)")
    assert "[tool]" not in out


def test_retry_lines_say_attempt_reason_and_delay() -> None:
    from sage.cli.turn import retry_line as _retry

    line = _retry(
        {"attempt": 3, "max_retries": 10, "status": 529, "error": "overloaded", "delay_ms": 2150}
    )
    assert line == "[api] retrying (3/10): overloaded (HTTP 529), next try in 2.1 s"


async def test_ended_sessions_have_a_history() -> None:
    """Ended sessions stay listed (--all) with how they ended; a send to one says how and
    when; a watch of an id that never existed fails at once; only [sessions] history
    ended records per principal are kept."""
    config = _config().replace("[limits]", "[sessions]\nhistory = 2\n[limits]")
    async with running_sage(config, env=ENV) as sage:
        for sid in ("h1", "h2", "h3"):
            events = await sage.ready(sid)
            await sage.send(sid, "hi")
            await events.text_until_done()
            assert (await sage.request(f"sage.v1.request.stop.{sid}", {}))["ok"]
        live = await sage.request("sage.v1.request.sessions", {})
        assert live["sessions"] == []
        listing = await sage.request("sage.v1.request.sessions", {"all": True})
        rows = listing["sessions"]
        assert [r["session_id"] for r in rows] == ["h3", "h2"]  # newest first, h1 pruned
        assert rows[0]["state"] == "ended"
        assert rows[0]["reason"] == "stopped"
        assert rows[0]["turns"] == 1
        assert rows[0]["exit_code"] == 0
        assert rows[0]["ended_at"] >= rows[0]["started_at"] > 0
        reply = await sage.send("h3", "again")
        assert reply["error"] == "session_ended"
        assert "ended at " in reply["message"]
        assert "(stopped, exit code 0)" in reply["message"]
        code, out, err = await sage.astrid("sage", "sessions", "--all")
        assert code == 0, err
        assert "ended " in out
        assert ": stopped (exit 0)" in out
        t0 = time.monotonic()
        code, _, err = await sage.astrid("sage", "watch", "never-was")
        assert code == 1
        assert "unknown_session: no session 'never-was'" in err
        assert time.monotonic() - t0 < 10
        code, out, err = await sage.astrid("sage", "watch", "h3", "--replay", "2")
        assert code == 0, err
        assert [json.loads(x)["event"] for x in out.splitlines()] == ["done", "exited"]
        assert "session h3 ended " in err
        assert ": stopped (exit 0)" in err


async def test_watch_replay_then_live_without_a_gap_or_a_repeat(sage: Sage) -> None:
    events = await sage.ready("replay")
    await sage.send("replay", "one")
    await events.text_until_done()
    from tests.support.daemon import ASTRID

    proc = await anyio.open_process(
        [*ASTRID, "sage", "watch", "replay", "--replay", "256", "--config",
         str(sage.daemon.config)],
        env=sage.daemon.env,
    )  # fmt: skip
    assert proc.stdout is not None
    out = bytearray()
    with anyio.fail_after(15):
        while b'"event":"done"' not in out:  # the replay: spawned, init, turn 1
            out += await proc.stdout.receive()
    await sage.send("replay", "two")
    await events.text_until_done()
    assert (await sage.request("sage.v1.request.stop.replay", {}))["ok"]
    with anyio.fail_after(15):
        assert await proc.wait() == 0
        async for chunk in proc.stdout:
            out += chunk
    await proc.aclose()
    lines = [json.loads(line) for line in out.splitlines()]
    names = [line["event"] for line in lines if line["event"] != "usage"]  # the ledger's
    collapsed = [n for i, n in enumerate(names) if i == 0 or n != names[i - 1]]
    # the replay (turn 1) keeps no assistant event; live (turn 2) shows it
    assert collapsed == [
        "spawned", "init", "text", "done", "text", "assistant", "done", "exited"
    ]  # fmt: skip
    texts = "".join(x["data"]["delta"] for x in lines if x["event"] == "text")
    assert texts == "echo: oneecho: two"  # each piece once: no gap, no repeat


async def test_send_json_and_watch_print_the_same_event_shape(sage: Sage) -> None:
    await sage.ready("shape")
    code, out, err = await sage.astrid("sage", "send", "shape", "hello", "--json")
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["event"] for line in lines][-1] == "done"
    assert all(set(line) == {"event", "ts", "data"} for line in lines), lines
    assert "".join(x["data"]["delta"] for x in lines if x["event"] == "text") == "echo: hello"
    watched: list[str] = []
    done = anyio.Event()

    async def watch() -> None:
        _, out, _ = await sage.astrid("sage", "watch", "shape", "-n", "1")
        watched.extend(out.splitlines())
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        while not done.is_set():  # turns until the watcher, once subscribed, sees one
            await sage.send("shape", "again")
            with anyio.move_on_after(0.5):
                await done.wait()
    (line,) = [json.loads(x) for x in watched]
    assert set(line) == {"event", "ts", "data"}


@pytest.mark.parametrize("bad", ["../etc", "a b", "x" * 65, "", "-rf", "a.b"])
async def test_bad_session_ids_are_refused(sage: Sage, bad: str) -> None:
    rejected = await sage.client.subscribe("sage.v1.event.session_rejected")
    reply = await sage.request(
        "sage.v1.request.spawn", {"principal_id": "alice", "session_id": bad}
    )
    if bad == "-rf":  # matches the id pattern; it is never read as a flag
        assert reply["ok"], reply
        await sage.request("sage.v1.request.stop.-rf", {})
        return
    assert reply == {
        "ok": False,
        "error": "invalid_session_id",
        "message": "session ids are 1-64 of [A-Za-z0-9_-]",
    }
    event = msgspec.json.decode((await rejected.get()).payload)
    assert event["reason"] == "invalid_session_id"
    assert await _listing(sage) == []


async def test_bad_requests_get_clear_errors(sage: Sage) -> None:
    reply = await sage.request("sage.v1.request.spawn", {"principal_id": "nobody"})
    assert reply["error"] == "unknown_principal"
    reply = await sage.request("sage.v1.request.spawn", {"principal": "alice"})
    assert reply["error"] == "bad_request"
    with pytest.raises(FrameError, match="not valid JSON"):  # refused before it is sent
        await sage.client.request_raw("sage.v1.request.spawn", b"[1, 2", deadline=5)
    raw = await sage.client.request_raw("sage.v1.request.spawn", b"[1, 2]", deadline=5)
    assert msgspec.json.decode(raw.payload)["error"] == "bad_request"
    reply = await sage.request("sage.v1.request.send.nope", {"text": "hi"})
    assert reply["error"] == "unknown_session"
    await sage.ready("s1")
    reply = await sage.request("sage.v1.request.send.s1", {"txt": "hi"})
    assert reply["error"] == "bad_request"


async def test_the_cap_holds_against_concurrent_spawns(sage: Sage) -> None:
    replies: list[dict[str, Any]] = []

    async def spawn(i: int) -> None:
        replies.append(
            await sage.request(
                "sage.v1.request.spawn", {"principal_id": "alice", "session_id": f"c{i}"}
            )
        )

    async with anyio.create_task_group() as tg:
        for i in range(7):
            tg.start_soon(spawn, i)
    ok = [r for r in replies if r["ok"]]
    refused = [r for r in replies if not r["ok"]]
    assert len(ok) == 4
    assert {r["error"] for r in refused} == {"principal_limit"}
    assert len(await _listing(sage)) == 4
    # a duplicate id is refused while the session lives
    reply = await sage.request(
        "sage.v1.request.spawn", {"principal_id": "alice", "session_id": ok[0]["session_id"]}
    )
    assert reply["error"] in ("duplicate_session", "principal_limit")
    for r in ok:
        assert (await sage.request(f"sage.v1.request.stop.{r['session_id']}", {}))["ok"]
    assert await _listing(sage) == []
    again = await sage.request(
        "sage.v1.request.spawn", {"principal_id": "alice", "session_id": "c0"}
    )
    assert again["ok"], again  # an ended id may be used again


async def test_who_may_act_repl_and_missing_key() -> None:
    extra_principals = (
        '[[principals]]\nname = "bob"\nuids = []\ninteraction_mode = "repl"\n'
        '[[principals]]\nname = "carol"\nuids = []\nauth_mode = "subscription"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "ANTHROPIC_API_KEY"}
    async with running_sage(_config() + extra_principals, env=env) as sage:
        sage.daemon.env = env
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "bob"})
        assert reply["error"] == "interaction_mode_is_repl"
        assert "astrid sage repl bob" in reply["message"]  # what to run instead
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["error"] == "api_key_missing"
        assert "ANTHROPIC_API_KEY" in reply["message"]
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "carol"})
        assert reply["ok"], reply  # subscription mode needs no key
        environ = (await anyio.Path(f"/proc/{reply['pid']}/environ").read_bytes()).split(b"\0")
        assert not [e for e in environ if e.startswith(b"ANTHROPIC_API_KEY=")]
        # a connection acting for bob may not spawn for carol, nor see or stop her session
        from bus import BusClient

        async with BusClient.connect(
            sage.daemon.socket, role="cli", name="bob", principal="bob"
        ) as bob:
            answer = await bob.request(
                "sage.v1.request.spawn", {"principal_id": "carol"}, deadline=5
            )
            assert msgspec.json.decode(answer.payload)["error"] == "not_authorized"
            listing = msgspec.json.decode(
                (await bob.request("sage.v1.request.sessions", {}, deadline=5)).payload
            )
            assert listing["sessions"] == []
            sid = reply["session_id"]
            answer = await bob.request(f"sage.v1.request.stop.{sid}", {}, deadline=5)
            assert msgspec.json.decode(answer.payload)["error"] == "unknown_session"
        assert len(await _listing(sage)) == 1


# -- faults ------------------------------------------------------------------------


async def test_an_80_mb_line_ends_the_session_cleanly(sage: Sage) -> None:
    events = await sage.ready("huge")
    await sage.send("huge", "/fault huge_line 80000000")
    seen = await events.until("exited", within=30)
    assert ("error", "line_too_long") in [(n, d.get("reason")) for n, d in seen]
    assert seen[-1][1]["reason"] == "line_too_long"
    assert len(seen[-1][1]["stdout_tail"]) <= 4096
    assert await _listing(sage) == []


async def test_stderr_flood_garbage_and_unknown_types_do_not_stop_a_session(sage: Sage) -> None:
    events = await sage.ready("noisy")
    for fault in ("stderr_flood 10000000", "garbage", "unknown"):
        await sage.send("noisy", f"/fault {fault}")
        text, done = await events.text_until_done(within=30)
        assert done["is_error"] is False, fault
    await sage.send("noisy", "still there?")
    text, _ = await events.text_until_done()
    assert text == "echo: still there?"
    await sage.request("sage.v1.request.stop.noisy", {})
    exited = await _exited(events)
    assert exited["reason"] == "stopped"
    assert 0 < len(exited["stderr_tail"].encode()) <= 4096 * 4


async def test_stopping_a_busy_session_interrupts_its_turn_first(sage: Sage) -> None:
    events = await sage.ready("busy")
    await sage.send("busy", "/fault hang")
    await events.until("text")
    assert (await sage.request("sage.v1.request.stop.busy", {}))["ok"]
    seen = await events.until("exited")
    done = [d for n, d in seen if n == "done"]
    assert len(done) == 1
    assert done[0]["subtype"] == "error_during_execution"
    assert seen[-1][1]["reason"] == "stopped"
    assert seen[-1][1]["exit_code"] == 0  # ended by its input, no signal needed


async def test_a_child_that_ignores_sigterm_is_killed() -> None:
    async with running_sage(_config("ignore_sigterm"), env=ENV) as sage:
        events, reply = await sage.spawn("stubborn")
        await events.until("init")
        await sage.send("stubborn", "/fault hang")
        await events.until("text")
        t0 = time.monotonic()
        assert (await sage.request("sage.v1.request.stop.stubborn", {}))["ok"]
        exited = await _exited(events)
        assert time.monotonic() - t0 < 5
        assert exited["reason"] == "stopped"
        assert not _alive(reply["pid"])


async def test_a_grandchild_holding_the_pipes_does_not_hide_the_exit() -> None:
    async with running_sage(_config("grandchild"), env=ENV) as sage:
        events, _reply = await sage.spawn("gc")
        await events.until("init")
        await sage.send("gc", "/fault crash 3")
        exited = await _exited(events)
        assert exited["exit_code"] == 3
        assert exited["reason"] == "crashed"
        line = next(ln for ln in exited["stderr_tail"].splitlines() if "grandchild pid" in ln)
        grandchild = int(line.rsplit(" ", 1)[1])
        for _ in range(100):
            if not _alive(grandchild):
                break
            await anyio.sleep(0.05)
        assert not _alive(grandchild), "the group was not killed"


async def test_no_answer_to_initialize_is_an_init_timeout() -> None:
    async with running_sage(
        _config("no_init").replace("init_timeout = 5.0", "init_timeout = 0.5"), env=ENV
    ) as sage:
        events, reply = await sage.spawn("mute")
        assert reply["ok"]
        seen = await events.until("exited")
        assert ("error", "init_timeout") in [(n, d.get("reason")) for n, d in seen]
        assert seen[-1][1]["reason"] == "init_timeout"
        assert "init" not in [n for n, _ in seen]
        assert not _alive(reply["pid"])
        # a send after the end is answered at once, saying how it ended
        assert (await sage.send("mute", "hi"))["error"] == "session_ended"  # and how


async def test_a_stop_before_initialize_is_answered_is_just_a_stop() -> None:
    async with running_sage(_config("no_init"), env=ENV) as sage:
        events, reply = await sage.spawn("early")
        assert reply["ok"]
        assert (await sage.request("sage.v1.request.stop.early", {}))["ok"]
        seen = await events.until("exited")
        assert [n for n, _ in seen] == ["spawned", "exited"]
        assert seen[-1][1]["reason"] == "stopped"


async def test_endless_401_retries_end_as_auth_failed(sage: Sage) -> None:
    events = await sage.ready("auth")
    t0 = time.monotonic()
    await sage.send("auth", "/fault api_retry_401 0.1")
    exited = await _exited(events)
    assert exited["reason"] == "auth_failed"
    assert time.monotonic() - t0 < 5


def _audit(root: Path) -> list[tuple[str, dict[str, Any]]]:
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    rows = db.execute("SELECT kind, payload FROM entries ORDER BY seq").fetchall()
    db.close()
    return [(kind, msgspec.json.decode(payload)["payload"]) for kind, payload in rows]


async def test_a_cli_in_another_permission_mode_never_gets_a_turn() -> None:
    """A CLI that ignores --permission-mode (answers initialize with "auto") ends at
    once as permission_mode_mismatch, audited; the turn queued at spawn never reaches it."""
    from tests.support.daemon import short_dir

    async with running_sage(_config("permission_mode=auto"), env=ENV, root=short_dir()) as sage:
        events, reply = await sage.spawn("auto", initial_message="hello")
        assert reply["ok"], reply
        seen = await events.until("exited")
        names = [n for n, _ in seen]
        assert "text" not in names
        assert "done" not in names
        errors = [d for n, d in seen if n == "error"]
        assert [(e["reason"], e["expected"], e["got"]) for e in errors] == [
            ("permission_mode_mismatch", "default", "auto")
        ]
        assert seen[-1][1]["reason"] == "permission_mode_mismatch"
        assert (await sage.send("auto", "again"))["error"] == "session_ended"
        root = sage.daemon.root
    audited = [p for k, p in _audit(root) if k == "sage.v1.audit.permission_mode_mismatch"]
    assert len(audited) == 1
    assert audited[0]["session_id"] == "auto"
    assert (audited[0]["expected"], audited[0]["got"]) == ("default", "auto")
    assert audited[0]["where"] == "initialize"


async def test_a_mode_that_changes_after_the_handshake_ends_the_session() -> None:
    """system/init is the second gate: a mode other than sage's ends the session there."""
    async with running_sage(_config("init_permission_mode=bypassPermissions"), env=ENV) as sage:
        events = await sage.ready("late")
        await sage.send("late", "hello")
        seen = await events.until("exited")
        errors = [d for n, d in seen if n == "error"]
        assert [(e["reason"], e["got"], e["where"]) for e in errors] == [
            ("permission_mode_mismatch", "bypassPermissions", "system/init")
        ]
        assert seen[-1][1]["reason"] == "permission_mode_mismatch"


async def test_an_oversized_turn_is_refused_and_the_session_goes_on(sage: Sage) -> None:
    """A turn over ``[limits] stdin_quota`` is refused ``payload_too_large`` naming the
    size and the limit; the session takes the next one."""
    events = await sage.ready("quota")
    # the payload fits the bus (1 MiB), the encoded stdin line does not
    reply = await sage.send("quota", "x" * (1024 * 1024 - 40))
    assert reply["ok"] is False
    assert reply["error"] == "payload_too_large"
    assert "over the limit of 1048576 ([limits] stdin_quota)" in reply["message"]
    name, data = await events.next()
    assert (name, data["reason"]) == ("error", "payload_too_large")
    await sage.send("quota", "small")
    text, _ = await events.text_until_done()
    assert text == "echo: small"
    assert "session.send_refused" in sage.daemon.log()


async def test_oversized_sends_are_refused_at_once_and_wake_nothing() -> None:
    """Over the stdin quota: the runner refuses before it wakes a hibernated session;
    over the bus's payload limit: astrid refuses before it sends (it used to wait
    minutes for an answer that never came), naming the limit either way."""
    config = _config(extra="stdin_quota = 4096\n[sessions]\nhibernate_after = 0.3\n")
    async with running_sage(config, env=ENV) as sage:
        events = await sage.ready("big")
        await events.until("hibernated")
        reply = await sage.send("big", "x" * 5000)
        assert reply["error"] == "payload_too_large", reply
        assert (await _listing(sage))[0]["state"] == "hibernated"  # not woken for it
        for size in (5000, 3 * 1024 * 1024):
            t0 = time.monotonic()
            code, out, err = await sage.astrid("sage", "send", "big", "-", stdin=b"y" * size)
            assert time.monotonic() - t0 < 10
            assert code == 1, (out, err)
            assert "payload_too_large" in err
            assert "[limits] stdin_quota" in err
        assert (await _listing(sage))[0]["state"] == "hibernated"


async def test_pending_approvals_fail_at_once_when_the_child_dies(sage: Sage) -> None:
    approvals = await sage.client.subscribe("approval.v1.request.*")  # never answered
    events, reply = await sage.spawn("ask")
    await events.until("init")
    await sage.send("ask", '/fault ask mcp__sage__greet {"name": "Ada"}')
    await approvals.get()
    t0 = time.monotonic()
    os.kill(reply["pid"], signal.SIGKILL)
    exited = await _exited(events)
    assert exited["signal"] == signal.SIGKILL
    assert time.monotonic() - t0 < 5  # not after approval_timeout (60 s)


async def test_no_approver_means_deny_at_once(sage: Sage) -> None:
    events = await sage.ready("deny")
    await sage.send("deny", '/fault ask mcp__sage__greet {"name": "Ada"}')
    text, done = await events.text_until_done(within=10)
    assert text.startswith("denied: no approver")
    assert [d["tool_name"] for d in done["permission_denials"]] == ["mcp__sage__greet"]


async def test_tool_calls_go_to_the_bus_and_hooks_are_republished(sage: Sage) -> None:
    hooks = await sage.client.subscribe("hook.v1.event.>")
    approvals = await sage.client.subscribe("approval.v1.request.*")
    events = await sage.ready("tools")

    async def approve() -> None:
        approval = await approvals.get()
        assert msgspec.json.decode(approval.payload)["tool_name"] == "mcp__sage__greet"
        sage.client.publish(approval.topic.replace("request", "response"), {"allowed": True})
        await sage.client.flush()

    # no tool bridge: Claude gets an isError result, not a hang
    await sage.send("tools", '/fault tool greet {"name": "Ada"}')
    await approve()
    text, _ = await events.text_until_done()
    assert text.startswith("tool error:")
    assert "no tool bridge" in text
    hook = await hooks.get()
    assert hook.topic == "hook.v1.event.before_tool_call"
    payload = msgspec.json.decode(hook.payload)
    assert payload["principal_id"] == "alice"
    assert payload["session_id"] == "tools"
    # a bridge that answers
    calls = await sage.client.subscribe("sage.v1.tool.call.*")
    await sage.send("tools", '/fault tool greet {"name": "Bo"}')
    await approve()
    call = await calls.get()
    assert msgspec.json.decode(call.payload)["arguments"] == {"name": "Bo"}
    sage.client.publish(
        call.topic.replace("call", "result"),
        {"content": [{"type": "text", "text": "Hello, Bo!"}], "isError": False},
    )
    await sage.client.flush()
    text, _ = await events.text_until_done()
    assert text == "tool: Hello, Bo!"
    # without an approver listening, the prompt is denied at once
    await approvals.close()
    await sage.send("tools", '/fault tool greet {"name": "Cy"}')
    text, _ = await events.text_until_done(within=10)
    assert text == "tool denied: no approver is listening"


async def test_a_new_identity_from_settings_reaches_the_live_sessions(tmp_path: Path) -> None:
    """astrid sage settings --identity FILE: kept, audited by digest, and the principal's
    live session respawns with it (the path existed, but nothing wrote identities)."""
    import hashlib

    text = "You are Ada's careful assistant."
    identity = tmp_path / "identity.md"
    identity.write_text(text)
    async with running_sage(_config(), env=ENV) as sage:
        audits = await sage.client.subscribe("sage.v1.audit.identity_changed")
        events = await sage.ready("idt")
        code, _, err = await sage.astrid("sage", "settings", "alice", "--identity", str(identity))
        assert code == 0, err
        _name, data = (await events.until("respawned"))[-1]
        assert data["reason"] == "identity_refresh"
        await events.until("init")
        (row,) = await _listing(sage)
        argv = (await anyio.Path(f"/proc/{row['pid']}/cmdline").read_bytes()).split(b"\0")
        path = argv[argv.index(b"--append-system-prompt-file") + 1].decode()
        assert await anyio.Path(path).read_text() == text
        changed = msgspec.json.decode((await audits.get()).payload)
        assert changed["after_sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert changed["before_sha256"] is None
        assert text not in str(changed)  # the audit keeps a digest, not the prompt
        await sage.send("idt", "still here")
        reply, _ = await events.text_until_done()
        assert reply == "echo: still here"
        code, _, err = await sage.astrid("sage", "settings", "alice", "--identity", "/nonexistent")
        assert code == 1
        assert "cannot read it" in err


async def test_an_identity_refresh_waits_for_the_running_turn_and_keeps_every_send() -> None:
    """A refresh during a turn lets it finish (it is not interrupted), then respawns; a
    send while the session is respawning goes to the new child instead of being refused
    as the old one ends (found by the lifecycle model test)."""
    async with running_sage(_config(), env=ENV) as sage:
        events = await sage.ready("busy")
        assert (await sage.send("busy", "/fault hang"))["ok"]
        await events.until("text")  # the turn runs
        reply = await sage.request(
            "sage.v1.request.settings.set", {"principal_id": "alice", "identity": "You are v2."}
        )
        assert reply["ok"], reply
        await anyio.sleep(0.5)
        assert "respawned" not in [name for name, _ in events.seen]  # not while it runs
        assert (await _listing(sage))[0]["state"] == "busy"
        assert (await sage.request("sage.v1.request.interrupt.busy", {}))["ok"]
        _, done = (await events.until("done"))[-1]
        assert done["is_error"] is True  # the interrupt we sent, nothing else
        async with anyio.create_task_group() as tg:

            async def send_meanwhile() -> None:
                await events.until("respawned")
                answer = await sage.send("busy", "during the respawn")
                assert answer["ok"], answer

            tg.start_soon(send_meanwhile)
        text, done = await events.text_until_done()
        assert (text, done["is_error"]) == ("echo: during the respawn", False)


async def test_identity_refresh_respawns_then_gives_up(tmp_path: Path) -> None:
    from bus import BusClient

    broken = tmp_path / "broken"
    wrapper = tmp_path / "claude"
    wrapper.write_text(f'#!/bin/sh\n[ -e {broken} ] && exit 7\nexec {FAKE} "$@"\n')
    wrapper.chmod(0o755)
    config = _config(extra="[sessions]\nmax_respawns = 2\n").replace(str(FAKE), str(wrapper))
    async with running_sage(config, env=ENV) as sage:
        audits = await sage.client.subscribe("sage.v1.audit.>")
        events, reply = await sage.spawn("who")
        await events.until("init")
        async with BusClient.connect(
            sage.daemon.socket, role="cli", name="alice", principal="alice"
        ) as alice:
            for attempt in range(3):  # refreshes that work do not use up the attempts
                # the payload names someone else: the verified publisher decides
                alice.publish(
                    "tool.v1.execute.save_identity.result",
                    {"success": True, "principal_id": "bob"},
                )
                await alice.flush()
                _name, data = (await events.until("respawned"))[-1]
                assert data["principal_id"] == "alice"
                assert data["reason"] == "identity_refresh"
                assert data["flags_hash"].startswith("sha256:")
                await events.until("init")
                await sage.send("who", f"after {attempt}")
                text, _ = await events.text_until_done()
                assert text == f"echo: after {attempt}"
            listing = await _listing(sage)
            assert listing[0]["pid"] != reply["pid"]
            # the session's turns, every child's: a respawn (or a wake) does not reset them
            assert listing[0]["turns"] == 3
            broken.touch()  # from now on the binary fails before initialize
            alice.publish("tool.v1.execute.save_identity.result", {"success": True})
            await alice.flush()
            exited = await _exited(events)
            assert exited["reason"] == "respawn_abandoned"
        kinds = []
        with anyio.move_on_after(2):
            async for envelope in audits:
                kinds.append(envelope.topic)
                if envelope.topic == "sage.v1.audit.respawn_abandoned":
                    break
        assert "sage.v1.audit.respawn_abandoned" in kinds
        assert kinds.count("sage.v1.audit.spawn") >= 4


def _config_claiming(version: str, folder: Path) -> str:
    """The runner config with the double saying it is Claude Code ``version``."""
    script = folder / "claude"
    script.write_text(f'#!/bin/sh\nFAKE_CLAUDE_VERSION={version} exec {FAKE} "$@"\n')
    script.chmod(0o755)
    return _config().replace(str(FAKE), str(script))


async def test_version_drift_and_identity_fallback_are_audited(tmp_path: Path) -> None:
    from tests.support.daemon import short_dir

    config = _config_claiming("9.9.9", tmp_path)
    async with running_sage(config, env=ENV, root=short_dir()) as sage:
        await sage.ready("drift")
        await sage.request("sage.v1.request.stop.drift", {})
        root = sage.daemon.root
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    rows = db.execute("SELECT kind, payload FROM entries").fetchall()
    db.close()
    kinds = {kind: msgspec.json.decode(payload)["payload"] for kind, payload in rows}
    drift = kinds["sage.v1.audit.claude_version_drift"]
    assert drift["version"] == "9.9.9"
    assert "newer than any release sage was tested with" in drift["message"]
    assert kinds["sage.v1.audit.identity_fallback"]["principal_id"] == "alice"
    spawn = kinds["sage.v1.audit.spawn"]
    assert spawn["flags_hash"].startswith("sha256:")
    assert len(spawn["flags_hash"]) == 71
    assert "sk-double" not in str(rows)  # the key never reaches the audit log


async def test_an_unsupported_claude_is_refused_and_audited(tmp_path: Path) -> None:
    """Below the floor the runner spawns nothing: claude_unsupported, with the range."""
    from tests.support.daemon import short_dir

    config = _config_claiming("2.1.0", tmp_path)
    async with running_sage(config, env=ENV, root=short_dir()) as sage:
        reply = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "session_id": "old"}
        )
        assert reply["ok"] is False
        assert reply["error"] == "claude_unsupported"
        assert "2.1.0 is older than the floor" in reply["message"]
        assert f"{FLOOR} to {NEWEST_TESTED}" in reply["message"]
        assert await _listing(sage) == []
        root = sage.daemon.root
    refused = [p for k, p in _audit(root) if k == "sage.v1.audit.claude_unsupported"]
    assert len(refused) == 1
    assert (refused[0]["version"], refused[0]["support"]) == ("2.1.0", "too_old")
    assert refused[0]["session_id"] == "old"
    assert "sage.v1.audit.spawn" not in [k for k, _ in _audit(root)]


async def test_settings_patches_apply_to_new_sessions_and_survive_a_restart() -> None:
    from bus.client import BusClient
    from tests.support.daemon import short_dir

    root = short_dir()
    extra = '[[principals]]\nname = "bob"\nuids = []\n'
    async with running_sage(_config() + extra, env=ENV, root=root) as sage:
        changes = await sage.client.subscribe("sage.v1.settings.changed")
        reply = await sage.request(
            "sage.v1.request.settings.set", {"principal_id": "alice", "model": "claude-x"}
        )
        assert reply["ok"], reply
        assert reply["config"]["model"] == "claude-x"
        changed = msgspec.json.decode((await changes.get()).payload)
        assert changed == {
            "principal_id": "alice",
            "config": reply["config"],
            "schema_version": 1,
        }
        for bad in (
            {"principal_id": "alice", "max_turns": -1},
            {"principal_id": "alice", "auth_mode": "magic"},
            {"principal_id": "alice", "colour": "red"},
            {"principal_id": "alice"},
        ):
            answer = await sage.request("sage.v1.request.settings.set", bad)
            assert answer["error"] == "bad_request", bad
        async with BusClient.connect(
            sage.daemon.socket, role="cli", name="bob", principal="bob"
        ) as bob:
            refused = await bob.request(
                "sage.v1.request.settings.set",
                {"principal_id": "alice", "model": "evil"},
                deadline=5,
            )
            assert msgspec.json.decode(refused.payload)["error"] == "not_authorized"
        code, out, err = await sage.astrid("sage", "settings", "alice", "--max-turns", "7")
        assert code == 0, err
        assert "claude-x" in out
    async with running_sage(_config() + extra, env=ENV, root=root) as sage:
        _, reply = await sage.spawn("patched")
        argv = await _cmdline(reply["pid"])
        assert b"--model" in argv, argv
        assert argv[argv.index(b"--model") + 1] == b"claude-x"
        assert argv[argv.index(b"--max-turns") + 1] == b"7"
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    rows = db.execute(
        "SELECT payload FROM entries WHERE kind = 'sage.v1.audit.settings_changed'"
    ).fetchall()
    db.close()
    first = msgspec.json.decode(rows[0][0])["payload"]
    assert first["previous_config"]["model"] == ""
    assert first["new_config"]["model"] == "claude-x"
    assert len(rows) == 2


async def _cmdline(pid: int) -> list[bytes]:
    """The argv of ``pid`` from /proc, read again while it is empty (a zombie or a
    process caught mid-exec shows none); a process that never shows one fails."""
    path = anyio.Path(f"/proc/{pid}/cmdline")
    with anyio.fail_after(5):
        while not (raw := await path.read_bytes()):  # noqa: ASYNC110 - /proc has no event
            await anyio.sleep(0.05)
    return raw.split(b"\0")


async def test_a_cancelled_control_request_gets_no_answer(sage: Sage) -> None:
    approvals = await sage.client.subscribe("approval.v1.request.*")
    events = await sage.ready("cancel")
    await sage.send("cancel", "/fault cancel 0.3")
    request = await approvals.get()
    await anyio.sleep(0.6)  # the CLI withdrew the prompt meanwhile; a late answer
    sage.client.publish(request.topic.replace("request", "response"), {"allowed": True})
    await sage.client.flush()
    text, _ = await events.text_until_done()
    assert text == "cancel: no answer"
    await sage.send("cancel", "and on")
    text, _ = await events.text_until_done()
    assert text == "echo: and on"


def _watch_as(uid: int, socket_path: Path, seconds: float) -> tuple[int, int]:
    """Fork a client that runs as ``uid`` (group nogroup), subscribes to every session
    event and reports the topics it got; returns (pid, read end of its pipe)."""

    async def watch(say: Say) -> None:
        async with BusClient.connect(socket_path, role="cli", name="watcher") as client:
            events = await client.subscribe("sage.v1.event.>")
            say("ready")
            topics = []
            with anyio.move_on_after(seconds):
                async for envelope in events:
                    topics.append(envelope.topic)
            say(json.dumps(topics))

    return fork_as(uid, watch)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as two other uids")
def test_users_see_only_their_own_principals_session_events() -> None:
    """Real uids over the real socket: alice's session events never reach bob."""
    import json

    from tests.support.daemon import Daemon, short_dir

    config = _config().replace("uids = [0]", "uids = [65533]") + (
        '[[principals]]\nname = "bob"\nuids = [65534]\n[socket]\ngroup = "nogroup"\n'
    )
    root = short_dir()
    root.chmod(0o755)  # the other uids must reach the state folder (0750, group nogroup)
    d = Daemon(root, config, env=ENV).start()
    watchers = {}
    try:
        for name, uid in (("alice", 65533), ("bob", 65534)):
            watchers[name] = _watch_as(uid, d.socket, 4.0)
        files = {name: os.fdopen(fd) for name, (_, fd) in watchers.items()}
        for name, file in files.items():
            assert file.readline() == "ready\n", name
        spawn = d.astrid("sage", "spawn", "alice", "--session", "private")
        assert spawn.returncode == 0, spawn.stderr
        stop = d.astrid("sage", "stop", "private")
        assert stop.returncode == 0, stop.stderr
        seen = {name: json.loads(file.readline()) for name, file in files.items()}
        for file in files.values():
            file.close()
    finally:
        for pid, _ in watchers.values():
            os.waitpid(pid, 0)
        d.stop()
    assert "sage.v1.event.private.spawned" in seen["alice"]
    assert "sage.v1.event.private.exited" in seen["alice"]
    assert seen["bob"] == []


def test_a_second_sigterm_during_the_stop_does_not_kill_the_supervisor(tmp_path: Path) -> None:
    """systemd or an impatient operator may signal twice; the stop still completes."""
    from tests.support.daemon import Daemon, short_dir

    # a worker that ignores SIGTERM makes the stop last (SIGKILL after a grace)
    (tmp_path / "stubborn_mod.py").write_text(
        "import signal\nimport time\n\n\nasync def main(ctx):\n"
        "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "    ctx.ready()\n    time.sleep(60)  # deaf to end of input and SIGTERM\n"
    )
    capsule = tmp_path / "stubborn"
    capsule.mkdir()
    (capsule / "Capsule.toml").write_text(
        '[package]\nname = "stubborn"\n[worker]\n'
        'command = ["python3", "-m", "sage.capsule.worker", "stubborn_mod:main"]\n'
        f'env = {{ PYTHONPATH = "{tmp_path}" }}\n'
    )
    d = Daemon(short_dir(), f'capsules = ["{capsule}"]\n').start()
    d.signal(signal.SIGTERM)
    time.sleep(0.3)  # the first stop is under way
    d.signal(signal.SIGTERM)
    assert d.stop() == 0
    assert '"supervisor.already_stopping"' in d.log()


async def test_interrupt_says_whether_a_turn_was_running(sage: Sage) -> None:
    """`astrid sage interrupt` on an idle session says nothing was running, not success."""
    await sage.ready("quiet")
    code, out, err = await sage.astrid("sage", "interrupt", "quiet")
    assert code == 0, err
    assert out == "interrupt: quiet: no turn was running; nothing was interrupted\n"
    assert (await sage.send("quiet", "/fault hang"))["ok"]
    with anyio.fail_after(10):
        while True:
            row = (await sage.request("sage.v1.request.session.quiet", {}))["session"]
            if row["state"] == "busy":
                break
            await anyio.sleep(0.05)
    code, out, err = await sage.astrid("sage", "interrupt", "quiet")
    assert (code, out) == (0, "interrupt: quiet\n"), err


async def test_a_child_that_exits_after_an_interrupted_turn_is_resumed() -> None:
    """As 2.1.275 does, the child exits 1 right after the interrupted turn's result: the
    session stays, a new child resumes the conversation (event `respawned`, reason
    `interrupted_exit`), and the next turn sees the earlier ones.  A crash with no
    interrupt before it still ends the session."""
    async with running_sage(_config("exit_after_interrupt"), env=ENV) as sage:
        events = await sage.ready("floor")
        assert (await sage.send("floor", "first"))["ok"]
        await events.text_until_done()
        assert (await sage.send("floor", "/fault hang"))["ok"]
        with anyio.fail_after(10):
            while True:
                row = (await sage.request("sage.v1.request.session.floor", {}))["session"]
                if row["state"] == "busy":
                    break
                await anyio.sleep(0.05)
        code, out, err = await sage.astrid("sage", "interrupt", "floor")
        assert (code, out) == (0, "interrupt: floor\n"), err
        _, done = await events.text_until_done()
        assert done["reason"] == "interrupted"
        (_, respawned), *_ = [e for e in await events.until("respawned", 15) if e[0] == "respawned"]
        assert respawned["reason"] == "interrupted_exit"
        with anyio.fail_after(15):
            while True:
                row = (await sage.request("sage.v1.request.session.floor", {}))["session"]
                if row["state"] in ("ready", "ended"):
                    break
                await anyio.sleep(0.05)
        assert row["state"] == "ready", row
        code, out, err = await sage.astrid("sage", "send", "floor", "/fault history")
        assert code == 0, err
        assert out == "history: 2: first | /fault hang\n", out  # the earlier turns, resumed
        # no interrupt before it: a crash ends the session as before
        assert (await sage.send("floor", "/fault crash 1"))["ok"]
        with anyio.fail_after(15):
            while True:
                row = (await sage.request("sage.v1.request.session.floor", {}))["session"]
                if row["state"] == "ended":
                    break
                await anyio.sleep(0.05)
        assert row["reason"] == "crashed"
