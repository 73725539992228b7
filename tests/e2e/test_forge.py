"""Forge end to end: the real CLI forges ``fib`` and calls it in the same session.

A real supervisor runs the session runner and the forge capsule; the real
``claude`` binary talks to the Messages API stand-in, which scripts the
model: first ``mcp__forge__forge_tool`` with the tool's source, then
``mcp__forge__fib``.  Between the two the forge announces the new tool
(``sage.v1.tools.changed`` -> ``notifications/tools/list_changed``), the CLI
lists the forge server's tools again, and the call runs in the bwrap
sandbox.  The value comes back as the ``tool_result`` of the model's next
request, and the audit log, which holds the forge events next to the
session's, verifies.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import anyio
import msgspec
import pytest

from tests.support.host import claude_env
from tests.support.sage_harness import running_sage, sage_config
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

FIB = (
    "import sys, json\n"
    "n = json.loads(sys.stdin.read())['n']\n"
    "a, b = 0, 1\n"
    "for _ in range(n):\n"
    "    a, b = b, a + b\n"
    "print(json.dumps({'ok': True, 'data': {'value': a}, 'meta': {'deterministic': True}}))\n"
)
FORGE_FIB = {
    "name": "fib",
    "description": "Compute the nth Fibonacci number, deterministically.",
    "input_schema": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["n"],
    },
    "impl": FIB,
    "runtime": "python",
    "meta": {"deterministic": True},
}


def _config(claude_bin: Path, standin: Standin) -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "forge"]',
        extra="[limits]\nstop_grace = 2.0\n",
        principal_extra='allowed_tools = ["mcp__forge__forge_tool", "mcp__forge__fib"]\n',
    )


async def test_claude_forges_fib_and_calls_it_in_the_same_session(
    claude_bin: Path, standin: Standin
) -> None:
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        events = await sage.ready("f1")
        standin.push(
            ToolUse("mcp__forge__forge_tool", FORGE_FIB),
            ToolUse("mcp__forge__fib", {"n": 30}),
            Text("fib(30) is 832040"),
        )
        await sage.send("f1", "forge fib, then compute fib(30)")
        text, done = await events.text_until_done(within=60.0)
        assert text == "fib(30) is 832040"
        assert done["permission_denials"] == []
        first, second, third = standin.messages[-3:]
        assert "mcp__forge__forge_tool" in first.tool_names
        assert "mcp__forge__fib" not in first.tool_names
        (forged,) = second.tool_results()
        assert not forged.get("is_error"), forged
        assert "mcp__forge__fib" in second.tool_names  # listed again after list_changed
        (called,) = third.tool_results()
        assert not called.get("is_error"), called
        content = called["content"]  # the CLI sends a lone text block as a plain string
        envelope = json.loads(content if isinstance(content, str) else content[0]["text"])
        assert envelope["ok"] is True
        assert envelope["data"] == {"value": 832040}
        code, out, err = await sage.astrid("audit", "verify")
        assert code == 0, out + err
        db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
        kinds = [row[0] for row in db.execute("SELECT kind FROM entries ORDER BY seq")]
        rows = db.execute(
            "SELECT payload FROM entries WHERE kind = 'forge.v1.audit.called'"
        ).fetchall()
        db.close()
        assert "forge.v1.audit.created" in kinds
        assert "sage.v1.audit.spawn" in kinds  # sessions and tools in one chain
        called_audit = msgspec.json.decode(rows[-1][0])["payload"]
        assert called_audit["ok"] is True
        assert FIB not in json.dumps(called_audit)  # the source never goes into the audit


BIG = {
    "name": "big",
    "description": "Print a long report.",
    "input_schema": {"type": "object"},
    "impl": ("import sys\nsys.stdout.write(''.join(f'ligne {i} ✓\\n' for i in range(2000)))\n"),
    "runtime": "python",
}
BIG_OUT = "".join(f"ligne {i} ✓\n" for i in range(2000))


def _envelope(result: dict[str, object]) -> dict[str, object]:
    content = result["content"]  # the CLI sends a lone text block as a plain string
    text = content if isinstance(content, str) else content[0]["text"]  # type: ignore[index]
    envelope: dict[str, object] = json.loads(str(text))
    return envelope


async def test_claude_pages_back_the_output_a_tool_spilled(
    claude_bin: Path, standin: Standin
) -> None:
    """Over the output cap the result names the run; read_artifact pages it back."""
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "forge"]',
        extra="[limits]\nstop_grace = 2.0\n[forge]\noutput_cap = 4096\n",
        principal_extra=(
            'allowed_tools = ["mcp__forge__forge_tool", "mcp__forge__big",'
            ' "mcp__forge__read_artifact"]\n'
        ),
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as sage:
        events = await sage.ready("a1")
        standin.push(
            ToolUse("mcp__forge__forge_tool", BIG),
            ToolUse("mcp__forge__big", {}),
            Text("too long; I will page it"),
        )
        await sage.send("a1", "forge big and run it")
        text, done = await events.text_until_done(within=60.0)
        assert text == "too long; I will page it"
        (over,) = standin.messages[-1].tool_results()
        assert over.get("is_error") is True
        envelope = _envelope(over)
        assert envelope["error"] == "output_truncated"
        message = envelope["message"]
        assert isinstance(message, str)
        meta = envelope["meta"]
        assert isinstance(meta, dict)
        run_id = meta["run_id"]
        assert run_id in message
        assert "read_artifact" in message
        # the next turn: the model pages the run back, then tries another path
        assert "mcp__forge__read_artifact" in standin.messages[-1].tool_names
        standin.push(
            ToolUse("mcp__forge__read_artifact", {"run_id": run_id, "limit": 32768}),
            ToolUse("mcp__forge__read_artifact", {"run_id": f"../{run_id}"}),
            Text("read it"),
        )
        await sage.send("a1", "read the report")
        text, done = await events.text_until_done(within=60.0)
        assert text == "read it"
        assert done["permission_denials"] == []
        (page,) = standin.messages[-2].tool_results()
        assert not page.get("is_error"), page
        data = _envelope(page)["data"]
        assert isinstance(data, dict)
        assert (data["encoding"], data["eof"], data["text"]) == ("utf-8", True, BIG_OUT)
        (tricked,) = standin.messages[-1].tool_results()
        assert tricked.get("is_error") is True
        assert _envelope(tricked)["error"] == "bad_arguments"


async def test_a_repl_session_forges_and_calls_through_astrid_mcp_serve(
    claude_bin: Path, standin: Standin
) -> None:
    """A session sage does not run (REPL): the real CLI, started on the installed
    ``.mcp.json``, forges ``fib`` through ``astrid mcp serve --server forge``, hears of the
    new tool (``notifications/tools/list_changed``), lists again and calls it."""
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "installer", "hooks", "forge"]',
        extra="[limits]\nstop_grace = 2.0\n",
    )
    async with running_sage(config) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        home = Path(installed["home_path"])
        standin.push(
            ToolUse("mcp__forge__forge_tool", FORGE_FIB),
            ToolUse("mcp__forge__fib", {"n": 30}),
            Text("fib(30) is 832040"),
        )
        env = {**claude_env(home, standin.url), "ASTRID_SESSION_ID": opened["session_id"]}
        argv = [
            str(claude_bin),
            "-p",
            "--output-format",
            "stream-json",
            "--verbose",
            "--mcp-config",
            str(home / ".mcp.json"),
            "--strict-mcp-config",
            "--allowedTools=mcp__forge__forge_tool,mcp__forge__fib",
            "forge fib, then compute fib(30)",
        ]
        with anyio.fail_after(120):
            done = await anyio.run_process(argv, env=env, cwd=home, check=False)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        inits = [m for m in lines if m.get("subtype") == "init"]
        assert inits, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
        servers = {m["name"]: m["status"] for m in inits[0]["mcp_servers"]}
        assert servers == {"sage": "connected", "forge": "connected"}, inits[0]
        assert lines[-1]["result"] == "fib(30) is 832040", lines[-1]
        # a REPL keeps its built-in tools, so the CLI defers MCP tools (ToolSearch): the
        # model request names none of them, and a tool only counts once it is listed
        assert {"mcp__forge__forge_tool", "mcp__forge__forge_list"} <= set(inits[0]["tools"])
        assert "mcp__forge__fib" not in inits[0]["tools"]
        forge_call, fib_call = standin.messages[-2:]
        (forged,) = forge_call.tool_results()
        assert not forged.get("is_error"), forged
        # fib was unknown at the start; the call reaching it shows the CLI listed again
        (called,) = fib_call.tool_results()
        assert not called.get("is_error"), called
        content = called["content"]
        envelope = json.loads(content if isinstance(content, str) else content[0]["text"])
        assert envelope["data"] == {"value": 832040}
        # the forge audited it as the principal's, in the REPL session
        code, out, err = await sage.astrid("audit", "verify")
        assert code == 0, out + err
        db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
        rows = db.execute(
            "SELECT payload FROM entries WHERE kind = 'forge.v1.audit.created'"
        ).fetchall()
        db.close()
        created = msgspec.json.decode(rows[-1][0])["payload"]
        assert (created["principal"], created["session_id"]) == ("alice", opened["session_id"])
