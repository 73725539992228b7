"""Installed principals end to end: the real CLI, its hooks in-band or by command.

``astrid sage install`` has the installer write ``.claude/settings.local.json``
into alice's home; the runner starts the real ``claude -p`` there, which reads
that project-local file by itself.  A headless alice gets no command hook: a
tool call the stand-in scripts fires ``PreToolUse`` in-band (``hook_callback``),
published on ``hook.v1.event.before_tool_call`` with ``decision_source:
"in_band"``, and the whole turn starts no process besides the ``claude`` child.
The session's token still dies with it: replayed through ``astrid-emit``, it is
audited as a spoof.  A REPL alice (no control channel) gets ``astrid-emit``
command hooks, checked against the token ``sage.v1.request.repl.open`` minted.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.support.host import claude_env
from tests.support.procs import ProcessWatch
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.spares import claude_children
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

EMIT = Path(sys.executable).parent / "astrid-emit"
KEY = "sk-ant-e2e-principal-key-5d2c"


def _config(claude_bin: Path, standin: Standin) -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "greeter", "installer", "hooks"]',
        extra="[limits]\nstop_grace = 2.0\n",
        principal_extra='allowed_tools = ["mcp__sage__greet"]\n',
    )


async def _until_tools(sage: Sage) -> None:
    with anyio.fail_after(20):
        while not (await sage.request("sage.v1.request.tools", {}))["tools"]:  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def test_a_headless_turn_with_a_tool_call_starts_no_process_and_hooks_come_in_band(
    claude_bin: Path, standin: Standin
) -> None:
    """No hook process: nothing runs below the claude child during a tool turn, and its
    hooks arrive in-band, never as astrid-emit envelopes, with no spoof alarm."""
    async with running_sage(_config(claude_bin, standin)) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "api_key": KEY}
        )
        assert installed["ok"], installed
        hooks = await sage.client.subscribe("hook.v1.event.>")
        raw = await sage.client.subscribe("sage.v1.hook.>")  # what astrid-emit would send
        await _until_tools(sage)
        events, spawned = await sage.spawn("h1")
        assert spawned["ok"], spawned
        await events.until("init")
        environ = await anyio.Path(f"/proc/{spawned['pid']}/environ").read_bytes()
        token = next(
            v.split(b"=", 1)[1].decode()
            for v in environ.split(b"\0")
            if v.startswith(b"ASTRID_HOOK_TOKEN=")
        )
        assert f"ANTHROPIC_API_KEY={KEY}".encode() in environ.split(b"\0")
        claude = claude_children(sage)["h1"]
        standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("greeted"))
        with ProcessWatch(claude) as watch:
            await sage.send("h1", "greet Ada")
            seen = await events.until("done", 60.0)
        text = "".join(d.get("delta", "") for n, d in seen if n == "text")
        assert text == "greeted", (seen, standin.calls)
        assert [n for n, _ in seen].count("tool_result") == 1
        assert watch.seen == {}, f"the turn started processes: {watch.seen}"
        assert watch.children_cpu == 0
        got: dict[str, dict[str, Any]] = {}
        with anyio.fail_after(20):
            while "after_tool_call" not in got or "session_end" not in got:
                envelope = await hooks.get()
                got[envelope.topic.rsplit(".", 1)[1]] = msgspec.json.decode(envelope.payload)
        event = got["before_tool_call"]
        assert event["decision_source"] == "in_band"
        assert (event["principal_id"], event["session_id"]) == ("alice", "h1")
        assert event["hook"] == "PreToolUse"
        assert event["payload"]["tool_name"] == "mcp__sage__greet"
        assert {"message_received", "post_tool_batch", "after_tool_call"} <= set(got)
        assert {e["decision_source"] for e in got.values()} == {"in_band"}
        await sage.request("sage.v1.request.stop.h1", {})
        await events.until("exited")
        with anyio.move_on_after(0.5):
            stray = await raw.get()
            raise AssertionError(f"a command hook ran: {stray.topic} from {stray.source}")
        # the ended session's token, replayed with the real astrid-emit, and a wrong one
        spoofs = await sage.client.subscribe("sage.v1.audit.hook_spoof_attempt")
        for stolen in (token, "0" * 43):
            env = {
                "PATH": os.environ.get("PATH", ""),
                "ASTRID_SOCKET": str(sage.daemon.socket),
                "ASTRID_PRINCIPAL_ID": "alice",
                "ASTRID_SESSION_ID": "h1",
                "ASTRID_HOOK_TOKEN": stolen,
            }
            payload = json.dumps({"hook_event_name": "PreToolUse", "tool_name": "x"})
            done = await anyio.run_process(
                [str(EMIT), "PreToolUse"], input=payload.encode(), env=env, check=False
            )
            assert done.returncode == 0
            with anyio.fail_after(10):
                report = msgspec.json.decode((await spoofs.get()).payload)
            assert report["reason"] == "unknown_or_ended_session"
            assert stolen not in json.dumps(report)
        code, out, err = await sage.astrid("audit", "verify")
        assert code == 0, out + err
        db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
        kinds = [r[0] for r in db.execute("SELECT kind FROM entries")]
        db.close()
        assert kinds.count("sage.v1.audit.hook_spoof_attempt") == 2  # the replays only


async def test_a_repl_principals_command_hooks_are_checked_by_their_token(
    claude_bin: Path, standin: Standin
) -> None:
    """A REPL alice has no control channel: the real CLI runs the installed astrid-emit
    command hooks, and the hooks capsule republishes them as token-checked."""
    async with running_sage(_config(claude_bin, standin)) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert opened["ok"], opened
        hooks = await sage.client.subscribe("hook.v1.event.>")
        spoofs = await sage.client.subscribe("sage.v1.audit.hook_spoof_attempt")
        home = Path(installed["home_path"])
        env = {
            **claude_env(home, standin.url),
            "ASTRID_SOCKET": str(sage.daemon.socket),
            "ASTRID_PRINCIPAL_ID": "alice",
            "ASTRID_SESSION_ID": opened["session_id"],
            "ASTRID_HOOK_TOKEN": opened["token"],
        }
        argv = [str(claude_bin), "-p", "--output-format", "stream-json", "--verbose", "hi"]
        standin.push(Text("hello"))
        with anyio.fail_after(90):
            done = await anyio.run_process(argv, env=env, cwd=home, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        got: dict[str, dict[str, Any]] = {}
        with anyio.fail_after(20):
            while "session_end" not in got:
                envelope = await hooks.get()
                got[envelope.topic.rsplit(".", 1)[1]] = msgspec.json.decode(envelope.payload)
        assert {"session_start", "message_received", "session_end"} <= set(got)
        for event in got.values():
            assert event["decision_source"] == "token"
            assert (event["principal_id"], event["session_id"]) == ("alice", opened["session_id"])
            assert opened["token"] not in json.dumps(event)
        with anyio.move_on_after(0.5):
            report = await spoofs.get()
            raise AssertionError(f"a spoof alarm: {report.payload!r}")


async def test_a_real_claude_uses_the_installed_mcp_json(
    claude_bin: Path, standin: Standin
) -> None:
    """``claude -p --mcp-config <home>/.mcp.json`` starts ``astrid mcp serve``, which
    lists and calls alice's tools through the tool bridge (the REPL's tool path)."""
    async with running_sage(_config(claude_bin, standin)) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        with anyio.fail_after(20):
            while not (await sage.request("sage.v1.request.tools", {}))["tools"]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        home = Path(installed["home_path"])
        standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("greeted"))
        env = claude_env(home, standin.url)
        argv = [
            str(claude_bin),
            "-p",
            "--output-format",
            "stream-json",
            "--verbose",
            "--mcp-config",
            str(home / ".mcp.json"),
            "--strict-mcp-config",
            "--allowedTools=mcp__sage__greet",  # one token: the flag takes a list
            "greet Ada",
        ]
        with anyio.fail_after(90):
            done = await anyio.run_process(argv, env=env, cwd=home, check=False)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        inits = [m for m in lines if m.get("subtype") == "init"]
        assert inits, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
        init = inits[0]
        servers = {m["name"]: m["status"] for m in init["mcp_servers"]}
        assert servers == {"sage": "connected", "forge": "connected"}, init
        assert "mcp__sage__greet" in init["tools"]
        result = lines[-1]
        assert result["type"] == "result"
        assert result["result"] == "greeted", result
        (tool_result,) = standin.messages[-1].tool_results()
        assert "Hello, Ada!" in json.dumps(tool_result["content"])
        assert not tool_result.get("is_error")


def _status(pid: int) -> dict[str, list[int]]:
    fields: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Uid", "Gid", "Groups"):
            fields[name] = [int(v) for v in value.split()]
    return fields


def _transcript_owners(home: Path) -> set[int]:
    return {p.stat().st_uid for p in home.rglob("*.jsonl") if p.is_file()}


@pytest.mark.skipif(os.geteuid() != 0, reason="children change uid only under root")
async def test_a_real_claude_runs_as_its_principals_uid_under_a_root_supervisor(
    claude_bin: Path, standin: Standin
) -> None:
    """The supervisor is root; alice's real ``claude`` is alice's uid from sage's range,
    never root, and its hooks still reach sage in-band."""
    async with running_sage(_config(claude_bin, standin)) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "api_key": KEY}
        )
        assert installed["ok"], installed
        home = Path(installed["home_path"])
        raw = await sage.client.subscribe("sage.v1.hook.>")  # as astrid-emit would send them
        hooks = await sage.client.subscribe("hook.v1.event.before_tool_call")
        await _until_tools(sage)
        events, spawned = await sage.spawn("u1")
        assert spawned["ok"], spawned
        await events.until("init")
        pid = spawned["pid"]
        creds = await anyio.to_thread.run_sync(_status, pid)
        (uid,) = set(creds["Uid"])
        assert uid != 0
        assert 91000 < uid < 92000
        assert set(creds["Gid"]) == {uid}
        assert creds["Groups"] == [91000]
        ps = await anyio.run_process(["ps", "-o", "uid=,comm=", "-p", str(pid)])
        assert ps.stdout.split()[0].decode() == str(uid), ps.stdout
        # the installer's files and the home are alice's uid's, written for it
        settings = home / ".claude" / "settings.local.json"
        for path in (home, settings):
            assert path.stat().st_uid == uid, path

        standin.push(ToolUse("mcp__sage__greet", {"name": "Ada"}), Text("greeted"))
        await sage.send("u1", "greet Ada")
        seen = await events.until("done", 60.0)
        text = "".join(d.get("delta", "") for n, d in seen if n == "text")
        assert text == "greeted", (seen, standin.calls)
        with anyio.fail_after(20):
            event = msgspec.json.decode((await hooks.get()).payload)
        assert event["decision_source"] == "in_band"
        assert event["principal_id"] == "alice"
        assert event["session_id"] == "u1"
        assert event["payload"]["tool_name"] == "mcp__sage__greet"
        with anyio.move_on_after(0.5):  # a headless home has no command hook to run
            stray = await raw.get()
            raise AssertionError(f"a command hook ran: {stray.topic} from {stray.source}")
        # what the CLI wrote in its home (its transcript) is that uid's too
        assert await anyio.to_thread.run_sync(_transcript_owners, home) == {uid}
        await sage.request("sage.v1.request.stop.u1", {})
        await events.until("exited")
