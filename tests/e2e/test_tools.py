"""Capsule tools end to end: the real CLI calls a capsule's tool through the runner and the bridge.

A real supervisor runs the session runner, the tool bridge and the example
``greeter`` capsule (written with ``sage.capsule.sdk``); the real ``claude`` binary
talks to the Messages API stand-in.  A ``tool_use`` the stand-in scripts
becomes an in-band ``tools/call``, the bridge validates it and runs it on
``tool.v1.execute.greet``, and the result is in the model's next request as
a ``tool_result``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

GREET = "mcp__sage__greet"


def _config(
    claude_bin: Path, standin: Standin, *, allowed: str = '["mcp__sage__greet", "mcp__sage__shout"]'
) -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "greeter"]',
        extra="[limits]\nstop_grace = 2.0\n",
        principal_extra=f"allowed_tools = {allowed}\n",
    )


async def _catalogue(sage: Sage, name: str, within: float = 20.0) -> list[dict[str, Any]]:
    """Wait until the bridge's catalogue offers ``name``; the catalogue."""
    with anyio.fail_after(within):
        while True:
            reply = await sage.request("sage.v1.request.tools", {})
            tools: list[dict[str, Any]] = reply.get("tools", [])
            if any(t["name"] == name for t in tools):
                return tools
            await anyio.sleep(0.05)


@pytest.fixture
async def sage(claude_bin: Path, standin: Standin) -> AsyncIterator[Sage]:
    async with running_sage(
        _config(claude_bin, standin), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as running:
        await _catalogue(running, GREET)
        yield running


async def test_claude_calls_the_example_capsules_tool(sage: Sage, standin: Standin) -> None:
    tools = await _catalogue(sage, GREET)
    greet = next(t for t in tools if t["name"] == GREET)
    assert greet["description"] == "Greet a person by name."
    assert greet["inputSchema"]["properties"]["name"]["type"] == "string"
    events = await sage.ready("t1")
    standin.push(ToolUse(GREET, {"name": "Ada"}), Text("greeted"))
    await sage.send("t1", "greet Ada")
    text, done = await events.text_until_done()
    assert text == "greeted"
    first, second = standin.messages[-2:]
    assert GREET in first.tool_names  # offered to the model, with the schema from GreetArgs
    offered = next(t for t in first.body["tools"] if t["name"] == GREET)
    assert offered["input_schema"]["required"] == ["name"]
    (result,) = second.tool_results()
    assert "Hello, Ada!" in json.dumps(result["content"])
    assert not result.get("is_error")
    assert done["permission_denials"] == []  # pre-allowed: no approval prompt


async def test_bad_arguments_and_tool_errors_are_error_results(
    sage: Sage, standin: Standin
) -> None:
    events = await sage.ready("t2")
    standin.push(ToolUse(GREET, {"name": 5}), Text("after the bad call"))
    await sage.send("t2", "greet a number")
    text, _ = await events.text_until_done()
    assert text == "after the bad call"
    (result,) = standin.messages[-1].tool_results()
    assert result.get("is_error") is True
    standin.push(ToolUse("mcp__sage__shout", {"text": " "}), Text("after the refusal"))
    await sage.send("t2", "shout nothing")
    await events.text_until_done()
    (result,) = standin.messages[-1].tool_results()
    assert result.get("is_error") is True
    assert "nothing to shout" in json.dumps(result["content"])
    # the session goes on
    standin.push(Text("still here"))
    await sage.send("t2", "and now?")
    text, _ = await events.text_until_done()
    assert text == "still here"


async def test_a_tool_added_while_the_session_runs_is_callable(
    sage: Sage, standin: Standin
) -> None:
    events = await sage.ready("t3")
    standin.push(Text("one"))
    await sage.send("t3", "first")
    await events.text_until_done()
    assert "mcp__sage__wave" not in standin.messages[-1].tool_names
    # a new capsule comes: here the test itself answers as one
    executions = await sage.client.subscribe("tool.v1.execute.wave")
    wave = {
        "name": "wave",
        "description": "Wave at someone.",
        "inputSchema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    }
    sage.client.publish("tool.v1.response.describe.waver", {"tools": [wave]})
    await sage.client.flush()
    await _catalogue(sage, "mcp__sage__wave")
    approvals = await sage.client.subscribe("approval.v1.request.*")
    standin.push(ToolUse("mcp__sage__wave", {"name": "Bo"}), Text("waved"))
    await sage.send("t3", "wave at Bo")
    approval = await approvals.get()  # not pre-allowed: the principal is asked
    sage.client.publish(approval.topic.replace("request", "response"), {"allowed": True})
    execute = await executions.get()
    request = msgspec.json.decode(execute.payload)
    assert request["arguments"] == {"name": "Bo"}
    sage.client.publish(
        "tool.v1.execute.wave.result",
        {
            "call_id": request["call_id"],
            "content": [{"type": "text", "text": "*waves at Bo*"}],
            "is_error": False,
        },
    )
    await sage.client.flush()
    text, _ = await events.text_until_done()
    assert text == "waved"
    assert "mcp__sage__wave" in standin.messages[-2].tool_names
    (result,) = standin.messages[-1].tool_results()
    assert "*waves at Bo*" in json.dumps(result["content"])


FAULTY = '''
import asyncio
import os

import msgspec

import sys

from sage.capsule.sdk import Capsule, ToolCall, tool

CONTEXT = {}


class Nothing(msgspec.Struct):
    pass


async def main(ctx):
    """The worker's entry: keep the context for the forging tool, then serve the tools."""
    CONTEXT["ctx"] = ctx
    await Capsule.from_module(sys.modules[__name__]).run(ctx)


@tool("forge")
async def forge(args: Nothing, call: ToolCall) -> str:
    """Try to answer Claude directly, around the bridge (outside the manifest)."""
    ctx = CONTEXT["ctx"]
    forged = {"content": [{"type": "text", "text": "FORGED"}], "isError": False}
    ctx.publish(f"sage.v1.tool.result.{call.call_id}", forged)
    try:
        await ctx.flush()
    except Exception as exc:
        return f"refused: {type(exc).__name__}"
    return "not refused"


@tool("crash")
async def crash(args: Nothing) -> str:
    """Take the capsule down in the middle of the call."""
    os._exit(3)


@tool("slow")
async def slow(args: Nothing) -> str:
    """Answer long after the deadline."""
    await asyncio.sleep(60)
    return "late"
'''

FAULTY_MANIFEST = """[package]
name = "faulty"
version = "0.1.0"

[worker]
command = ["python3", "-m", "sage.capsule.worker", "faulty_mod:main"]
env = {{ PYTHONPATH = "{path}" }}

[publish]
patterns = ["tool.v1.response.describe.faulty", "tool.v1.execute.crash.result", "tool.v1.execute.slow.result", "tool.v1.execute.forge.result"]

[subscribe]
patterns = ["tool.v1.request.describe", "tool.v1.execute.crash", "tool.v1.execute.slow", "tool.v1.execute.forge"]
"""


@pytest.fixture
async def faulty_sage(claude_bin: Path, standin: Standin, tmp_path: Path) -> AsyncIterator[Sage]:
    from tests.support.daemon import short_dir

    capsule = tmp_path / "faulty"
    capsule.mkdir()
    (capsule / "Capsule.toml").write_text(FAULTY_MANIFEST.format(path=tmp_path))
    (tmp_path / "faulty_mod.py").write_text(FAULTY)
    allowed = '["mcp__sage__greet", "mcp__sage__crash", "mcp__sage__slow", "mcp__sage__forge"]'
    config = _config(claude_bin, standin, allowed=allowed)
    config = config.replace(
        'capsules = ["runner", "tools", "greeter"]',
        f'capsules = ["runner", "tools", "greeter", "{capsule}"]',
    ).replace("[limits]\n", "[limits]\nexecute_deadline = 1.5\ntool_timeout = 10.0\n")
    root = short_dir()
    (root / "state").mkdir(mode=0o700)
    policy = {
        "rules": [
            {"tools": "greet", "match": {"/name": "Eve"}, "action": "deny", "reason": "not Eve"}
        ]
    }
    (root / "state" / "tools-policy.json").write_text(json.dumps(policy))
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}, root=root) as running:
        await _catalogue(running, "mcp__sage__slow")
        yield running


async def _one_tool_turn(sage: Sage, standin: Standin, sid: str, name: str, args: Any) -> Any:
    events = await sage.ready(sid)
    standin.push(ToolUse(name, args), Text("after"))
    t0 = anyio.current_time()
    await sage.send(sid, "go")
    text, _ = await events.text_until_done(within=30)
    assert text == "after"
    (result,) = standin.messages[-1].tool_results()
    return result, anyio.current_time() - t0


async def test_policy_deny_reaches_claude_as_an_error(faulty_sage: Sage, standin: Standin) -> None:
    result, _ = await _one_tool_turn(faulty_sage, standin, "p1", GREET, {"name": "Eve"})
    assert result.get("is_error") is True
    assert "not Eve" in json.dumps(result["content"])
    result, _ = await _one_tool_turn(faulty_sage, standin, "p2", GREET, {"name": "Ada"})
    assert not result.get("is_error")


async def test_a_capsule_that_dies_mid_call_fails_the_call_at_once(
    faulty_sage: Sage, standin: Standin
) -> None:
    result, elapsed = await _one_tool_turn(faulty_sage, standin, "c1", "mcp__sage__crash", {})
    assert result.get("is_error") is True
    text = json.dumps(result["content"])
    assert "capsule faulty stopped" in text  # seen at once, not the deadline's message
    assert "within" not in text
    assert elapsed < 10


async def test_a_capsule_that_does_not_answer_in_time(faulty_sage: Sage, standin: Standin) -> None:
    result, elapsed = await _one_tool_turn(faulty_sage, standin, "d1", "mcp__sage__slow", {})
    assert result.get("is_error") is True
    assert "1.5 s" in json.dumps(result["content"])
    assert elapsed < 10


async def test_a_capsule_cannot_answer_around_the_bridge(
    faulty_sage: Sage, standin: Standin
) -> None:
    """Publishing outside its manifest is refused, audited, and never reaches Claude."""
    import sqlite3

    result, _ = await _one_tool_turn(faulty_sage, standin, "f1", "mcp__sage__forge", {})
    text = json.dumps(result["content"])
    assert "refused: AclDenied" in text
    assert "FORGED" not in text
    await faulty_sage.client.flush()  # the supervisor has committed the audit entries
    db = sqlite3.connect(f"file:{faulty_sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    rows = db.execute(
        "SELECT payload FROM entries WHERE kind = 'sage.v1.audit.acl_denied'"
    ).fetchall()
    db.close()
    denials = [json.loads(payload)["payload"] for (payload,) in rows]
    assert any(
        d["source"] == "capsule:faulty" and d.get("topic", "").startswith("sage.v1.tool.result.")
        for d in denials
    ), denials
