"""The session runner end to end: a real supervisor, the real Claude Code CLI, a stand-in API.

Each test starts a supervisor process whose runner spawns the pinned
``claude`` binary against the Messages API stand-in on 127.0.0.1, and
drives it over the supervisor's socket the way ``astrid sage`` does.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.standin import Error, Slow, Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

GREET = {
    "name": "mcp__sage__greet",
    "description": "Greet someone by name.",
    "inputSchema": {
        "type": "object",
        "properties": {"name": {"type": "string"}},
        "required": ["name"],
    },
}


def _config(claude_bin: Path, standin: Standin, extra: str = "") -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        extra="[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n" + extra,
    )


@pytest.fixture
async def sage(claude_bin: Path, standin: Standin) -> AsyncIterator[Sage]:
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as running:
        yield running


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


async def test_spawn_two_turns_list_stop(sage: Sage, standin: Standin) -> None:
    events, reply = await sage.spawn("one")
    assert reply["ok"]
    assert reply["session_id"] == "one"
    assert reply["pid"] > 0
    name, spawned = await events.next()
    assert (name, spawned) == (
        "spawned",
        {"principal_id": "alice", "session_id": "one", "pid": reply["pid"]},
    )
    name, init = await events.next()
    assert name == "init"
    assert init["session_id"] == "one"
    assert Path(init["cwd"]).name == "alice"

    standin.push(Text("hello there", chunks=3))
    assert (await sage.send("one", "hi"))["turn"] == 1
    text, done = await events.text_until_done()
    assert text == "hello there"
    assert done["is_error"] is False
    assert done["subtype"] == "success"
    assert done["total_cost_usd"] > 0
    assert len([n for n, _ in events.seen if n == "text"]) == 3  # streamed, not whole

    standin.push(Text("second answer"))
    await sage.send("one", "again")
    text, done2 = await events.text_until_done()
    assert text == "second answer"
    # the second request carries the first turn: one conversation
    body = standin.messages[-1].body
    roles = [m["role"] for m in body["messages"] if m["role"] != "system"]
    assert roles == ["user", "assistant", "user"]

    listing = await sage.request("sage.v1.request.sessions", {})
    (row,) = listing["sessions"]
    assert row["session_id"] == "one"
    assert row["principal_id"] == "alice"
    assert row["turns"] == 2
    assert row["state"] == "ready"
    assert row["pid"] == reply["pid"]
    assert row["cost_usd"] >= done2["total_cost_usd"] > 0

    # the child got a clean environment and the headless command line
    environ = (await anyio.Path(f"/proc/{reply['pid']}/environ").read_bytes()).split(b"\0")
    names = {e.split(b"=", 1)[0].decode() for e in environ if e}
    assert {
        "HOME",
        "PATH",
        "ASTRID_PRINCIPAL_ID",
        "ASTRID_SESSION_ID",
        "ASTRID_HOOK_TOKEN",
    } <= names
    assert "PYTEST_CURRENT_TEST" not in names
    argv = (await anyio.Path(f"/proc/{reply['pid']}/cmdline").read_bytes()).split(b"\0")
    assert b"--tools" in argv
    assert argv[argv.index(b"--tools") + 1] == b""
    assert b"sk-test" not in b" ".join(argv)

    assert (await sage.request("sage.v1.request.stop.one", {}))["ok"]
    exited = (await events.until("exited"))[-1][1]
    assert exited["reason"] == "stopped"
    assert exited["exit_code"] == 0
    assert not _alive(reply["pid"])
    assert (await sage.request("sage.v1.request.sessions", {}))["sessions"] == []
    assert [n for n, _ in events.seen].count("exited") == 1


async def test_astrid_sage_commands(sage: Sage, standin: Standin) -> None:
    code, out, err = await sage.astrid("sage", "spawn", "alice", "--session", "cli1")
    assert code == 0, err
    assert out.strip() == "cli1"
    standin.push(Text("streamed reply", chunks=4))
    code, out, err = await sage.astrid("sage", "send", "cli1", "-", stdin=b"hello from stdin")
    assert code == 0, err
    assert out == "streamed reply\n"
    assert standin.messages[-1].last_user_message is not None
    assert "hello from stdin" in str(standin.messages[-1].last_user_message)
    code, out, err = await sage.astrid("sage", "sessions")
    assert code == 0, err
    assert "cli1" in out
    assert "alice" in out
    code, out, err = await sage.astrid("sage", "sessions", "--json")
    assert msgspec.json.decode(out)[0]["turns"] == 1
    code, out, err = await sage.astrid("sage", "send", "nope", "hi")
    assert code == 1
    assert "unknown_session" in err
    code, out, err = await sage.astrid("sage", "spawn", "alice", "--session", "cli1")
    assert code == 1
    assert "duplicate_session" in err
    code, out, err = await sage.astrid("sage", "stop", "cli1")
    assert code == 0, err


async def test_interrupt_mid_turn_then_next_turn(sage: Sage, standin: Standin) -> None:
    events = await sage.ready("int")
    standin.push(Slow("first part and a very slow rest", delay=20, chunks=2))
    await sage.send("int", "go")
    await events.until("text")  # the first text (after the call's usage event)
    reply = await sage.request("sage.v1.request.interrupt.int", {})
    assert reply["ok"]
    assert reply["interrupted"] is True
    _, done = await events.text_until_done(within=15)
    assert done["is_error"] is True
    assert done["subtype"] == "error_during_execution"
    standin.push(Text("after the interrupt"))
    await sage.send("int", "next")
    text, done = await events.text_until_done()
    assert text == "after the interrupt"
    assert done["is_error"] is False


async def test_ctrl_c_in_astrid_sage_send_interrupts_the_real_turn(
    sage: Sage, standin: Standin
) -> None:
    """SIGINT to a real `astrid sage send` interrupts the CLI's turn; the next send
    shows its own reply, not the interrupted one's tail."""
    from tests.support.daemon import ASTRID

    await sage.ready("ctrlc")
    standin.push(Slow("first part and a very slow rest", delay=20, chunks=2))
    proc = await anyio.open_process(
        [*ASTRID, "sage", "send", "ctrlc", "go", "--config", str(sage.daemon.config)],
        env=sage.daemon.env,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    seen = bytearray()
    with anyio.fail_after(20):
        while b"first" not in seen:
            seen += await proc.stdout.receive()
    proc.send_signal(signal.SIGINT)
    with anyio.fail_after(20):
        assert await proc.wait() == 130
    err = (await proc.stderr.receive(65536)).decode()
    await proc.aclose()
    assert "turn 1 interrupted" in err
    standin.push(Text("after the interrupt"))
    code, out, err = await sage.astrid("sage", "send", "ctrlc", "next")
    assert (code, out) == (0, "after the interrupt\n"), err


async def _tool_bridge(sage: Sage) -> Any:
    """Publish a catalogue with greet and answer its calls like a tool bridge would."""
    calls = await sage.client.subscribe("sage.v1.tool.call.*")
    sage.client.publish("sage.v1.tools.list", {"tools": [GREET]})
    await sage.client.flush()
    return calls


@pytest.mark.parametrize("allowed", [True, False])
async def test_can_use_tool_goes_to_the_approval_topics(
    sage: Sage, standin: Standin, allowed: bool
) -> None:
    calls = await _tool_bridge(sage)
    approvals = await sage.client.subscribe("approval.v1.request.*")
    hooks = await sage.client.subscribe("hook.v1.event.>")
    events = await sage.ready("ask")
    standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("finished"))
    await sage.send("ask", "greet Ada")

    request = await approvals.get()
    data = msgspec.json.decode(request.payload)
    assert data["tool_name"] == "mcp__sage__greet"
    assert data["arguments"] == {"name": "Ada"}
    assert data["principal_id"] == "alice"
    assert data["session_id"] == "ask"
    cid = request.topic.rsplit(".", 1)[1]
    sage.client.publish(
        f"approval.v1.response.{cid}", {"allowed": allowed, "reason": "test says no"}
    )
    await sage.client.flush()
    seen_hooks = [(await hooks.get()).topic for _ in range(2)]
    # UserPromptSubmit, then PreToolUse, as in-band hook callbacks
    assert seen_hooks == ["hook.v1.event.message_received", "hook.v1.event.before_tool_call"]
    if allowed:
        call = await calls.get()
        body = msgspec.json.decode(call.payload)
        assert body["tool_name"] == "greet"
        assert body["arguments"] == {"name": "Ada"}
        sage.client.publish(
            f"sage.v1.tool.result.{call.topic.rsplit('.', 1)[1]}",
            {"content": [{"type": "text", "text": "Hello, Ada!"}], "isError": False},
        )
        await sage.client.flush()
    text, done = await events.text_until_done()
    assert text == "finished"
    (use,) = [d for n, d in events.seen if n == "tool_use"]
    assert (use["name"], use["input"], use["turn"]) == ("mcp__sage__greet", {"name": "Ada"}, 1)
    (result,) = [d for n, d in events.seen if n == "tool_result"]
    assert result["tool_use_id"] == use["tool_use_id"]
    assert result["name"] == "mcp__sage__greet"
    assert result["is_error"] is (not allowed)
    assert result["duration_ms"] >= 0
    results = standin.messages[-1].tool_results()
    assert len(results) == 1
    if allowed:
        assert "Hello, Ada!" in str(results[0]["content"])
        assert done["permission_denials"] == []
    else:
        assert results[0].get("is_error") is True
        assert "test says no" in str(results[0]["content"])
        assert [d["tool_name"] for d in done["permission_denials"]] == ["mcp__sage__greet"]


async def test_an_approval_asked_inline_at_a_real_terminal(sage: Sage, standin: Standin) -> None:
    """The real CLI asks can_use_tool; `astrid sage send` on a pseudo-terminal asks the
    user, who says yes; the call runs and Claude finishes the turn."""
    from tests.support.terminal import Terminal

    calls = await _tool_bridge(sage)
    await sage.ready("inline")
    standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("finished"))
    term = Terminal(sage, "inline", "greet Ada")
    await term.expect(b'Claude wants to run mcp__sage__greet {"name":"Ada"}')
    await term.expect(b"allow? [y/a/n]")
    term.type("y")
    call = await calls.get()
    sage.client.publish(
        f"sage.v1.tool.result.{call.topic.rsplit('.', 1)[1]}",
        {"content": [{"type": "text", "text": "Hello, Ada!"}], "isError": False},
    )
    await sage.client.flush()
    await term.expect(b"[approval] mcp__sage__greet allowed")
    code, out = await term.finish()
    assert (code, out) == (0, "finished\n")
    assert "Hello, Ada!" in str(standin.messages[-1].tool_results()[0]["content"])


@pytest.mark.parametrize(
    ("status", "kind"), [(401, "authentication_error"), (403, "permission_error")]
)
async def test_auth_failure_ends_the_session_in_seconds(
    claude_bin: Path, standin: Standin, status: int, kind: str
) -> None:
    """A 401 is retried by the CLI (system/api_retry), a 403 ends the turn at once
    (result is_error, api_error_status 403); both end the session as auth_failed."""
    standin.default = Error(status, kind, "invalid x-api-key")
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-bad"}
    ) as sage:
        events = await sage.ready("auth")
        t0 = time.monotonic()
        await sage.send("auth", "hi")
        seen = await events.until("exited", within=20)
        elapsed = time.monotonic() - t0
    names = [n for n, _ in seen]
    errors = [d for n, d in seen if n == "error"]
    assert [(e["reason"], e["status"]) for e in errors] == [("auth_failed", status)]
    assert seen[-1][1]["reason"] == "auth_failed"
    if status == 403:  # the turn's end reached the client before the session ended
        assert names.index("done") < names.index("error")
    assert names.count("exited") == 1
    assert elapsed < 10, f"auth failure took {elapsed:.1f} s"


async def test_a_release_whose_default_mode_is_auto_still_asks_sage(
    auto_default_claude_bin: Path, standin: Standin
) -> None:
    """2.1.300 runs -p sessions in "auto" unless told otherwise: its classifier would
    decide tool calls and sage would see none. sage passes --permission-mode default,
    so the call comes to the approval topics, and nothing is decided by the CLI."""
    async with running_sage(
        _config(auto_default_claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        await _tool_bridge(sage)
        approvals = await sage.client.subscribe("approval.v1.request.*")
        events = await sage.ready("auto")
        standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("finished"))
        await sage.send("auto", "greet Ada")
        with anyio.fail_after(20):
            request = await approvals.get()
        assert msgspec.json.decode(request.payload)["tool_name"] == "mcp__sage__greet"
        cid = request.topic.rsplit(".", 1)[1]
        sage.client.publish(f"approval.v1.response.{cid}", {"allowed": False, "reason": "no"})
        await sage.client.flush()
        text, done = await events.text_until_done()
        assert text == "finished"
        assert [d["tool_name"] for d in done["permission_denials"]] == ["mcp__sage__greet"]
        names = [n for n, _ in events.seen]
        assert "permission_denied" not in names  # the CLI's classifier never ran
        assert "error" not in names
        await sage.request("sage.v1.request.stop.auto", {})


async def test_sigkill_of_the_child_mid_turn(sage: Sage, standin: Standin) -> None:
    events, reply = await sage.spawn("kill")
    await events.until("init")
    standin.push(Slow("never finished", delay=30))
    await sage.send("kill", "go")
    await events.until("text")  # mid-turn: the first text (after the call's usage)
    os.kill(reply["pid"], signal.SIGKILL)
    exited = (await events.until("exited", within=15))[-1][1]
    assert exited["signal"] == signal.SIGKILL
    assert exited["exit_code"] is None
    assert exited["reason"] == "crashed"
    listing = await sage.request("sage.v1.request.sessions", {})
    assert listing["sessions"] == []


async def test_sigterm_of_the_supervisor_leaves_no_claude_behind(
    claude_bin: Path, standin: Standin
) -> None:
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        pids = []
        for sid in ("a", "b"):
            _, reply = await sage.spawn(sid)
            pids.append(reply["pid"])
        standin.push(Slow("busy", delay=30))
        await sage.send("a", "keep busy")
        assert all(_alive(pid) for pid in pids)
        sage.daemon.signal(signal.SIGTERM)
        assert sage.daemon.proc is not None
        t0 = time.monotonic()
        while sage.daemon.proc.poll() is None and time.monotonic() - t0 < 15:
            time.sleep(0.05)  # noqa: ASYNC251 - the daemon is another process
        assert sage.daemon.proc.returncode == 0
    assert not [pid for pid in pids if _alive(pid)]


async def test_resume_after_a_supervisor_restart(claude_bin: Path, standin: Standin) -> None:
    from tests.support.daemon import short_dir

    root = short_dir()
    config = _config(claude_bin, standin, "[sessions]\nresume = true\n")
    env = {"ANTHROPIC_API_KEY": "sk-test"}
    async with running_sage(config, env=env, root=root) as sage:
        events = await sage.ready("keep")
        standin.push(Text("remember the word: tangerine"))
        await sage.send("keep", "remember a word")
        await events.text_until_done()
    async with running_sage(config, env=env, root=root) as sage:
        events = await sage.events("keep")
        listing = await sage.request("sage.v1.request.sessions", {})
        assert [s["session_id"] for s in listing["sessions"]] == ["keep"]
        standin.push(Text("it was tangerine"))
        # the resumed session takes turns once its new child is initialized
        for _ in range(100):
            reply = await sage.send("keep", "which word?")
            if reply.get("ok"):
                break
            time.sleep(0.05)  # noqa: ASYNC251
        text, _ = await events.text_until_done()
        assert text == "it was tangerine"
        earlier = standin.messages[-1].body["messages"]
        assert "remember a word" in str(earlier)  # the conversation survived the restart


async def test_without_resume_a_restart_ends_sessions(claude_bin: Path, standin: Standin) -> None:
    from tests.support.daemon import short_dir

    root = short_dir()
    config = _config(claude_bin, standin)
    env = {"ANTHROPIC_API_KEY": "sk-test"}
    async with running_sage(config, env=env, root=root) as sage:
        await sage.ready("gone")
    async with running_sage(config, env=env, root=root) as sage:
        listing = await sage.request("sage.v1.request.sessions", {})
        assert listing["sessions"] == []
    import sqlite3

    db = sqlite3.connect(root / "state" / "state.db")
    rows = dict(db.execute("SELECT key, value FROM kv WHERE namespace = 'sessions'").fetchall())
    tokens = db.execute("SELECT count(*) FROM kv WHERE namespace = 'hook_tokens'").fetchone()
    db.close()
    record = msgspec.json.decode(rows["gone"])
    assert record["state"] == "ended"
    assert record["reason"] == "supervisor_restart"
    assert tokens == (0,)


@pytest.mark.parametrize(
    ("status", "kind"),
    [(429, "rate_limit_error"), (500, "api_error"), (529, "overloaded_error")],
)
async def test_transient_api_errors_are_retried_not_fatal(
    sage: Sage, standin: Standin, status: int, kind: str
) -> None:
    """Only 401/403 end a session early; the CLI's own retries handle the rest."""
    events = await sage.ready(f"r{status}")
    standin.push(Error(status, kind, headers=(("retry-after", "0"),)), Text("recovered"))
    await sage.send(f"r{status}", "hi")
    text, done = await events.text_until_done(within=30)
    assert text == "recovered"
    assert done["is_error"] is False
    assert "error" not in [n for n, _ in events.seen]
    assert len(standin.messages) == 2  # the failed request and its retry
    (retry,) = [d for n, d in events.seen if n == "retry"]  # visible, not silent
    assert (retry["attempt"], retry["status"], retry["turn"]) == (1, status, 1)
    assert retry["max_retries"] > 0


async def test_spawn_with_a_working_folder_and_a_model(
    claude_bin: Path, standin: Standin, tmp_path: Path
) -> None:
    """`--cwd` and `--model` reach the real CLI: its init reports them and the model
    request carries the chosen model."""
    root = tmp_path / "projects"
    (root / "app").mkdir(parents=True)
    for folder in (tmp_path, root, root / "app"):
        os.chmod(folder, 0o755)  # a root supervisor's child runs as alice's own uid
    extra = f'work_roots = ["{root}"]\nmodels = ["claude-haiku-4-5"]\n'
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        extra="[limits]\nstop_grace = 2.0\n",
        principal_extra=extra,
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as sage:
        events = await sage.ready("m1", cwd=str(root / "app"), model="claude-haiku-4-5")
        init = dict(events.seen)["init"]
        assert init["cwd"] == str(root / "app")
        assert init["model"] == "claude-haiku-4-5"
        standin.push(Text("from the app folder"))
        await sage.send("m1", "where are you?")
        text, _ = await events.text_until_done(within=60.0)
        assert text == "from the app folder"
        assert standin.messages[-1].body["model"] == "claude-haiku-4-5"
