"""sage.client end to end: a real supervisor, the real Claude Code CLI, the stand-in API.

A program spawns a session, streams typed messages, decides tool calls with
``can_use_tool`` (allowed with a changed input, and denied), interrupts a turn,
sees a session that ends mid-turn raise, and stops a session: the way a port from
the Claude Agent SDK would.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sage.client import (
    Allow,
    ApprovalDecision,
    ApprovalRequest,
    AssistantMessage,
    Deny,
    Message,
    ResultMessage,
    Sage,
    SageError,
    Session,
    SessionEnded,
    TextBlock,
    TextDelta,
    ToolPermissionContext,
    ToolResultBlock,
    UserMessage,
    connect,
)
from tests.support.sage_harness import Sage as Harness
from tests.support.sage_harness import running_sage, sage_config
from tests.support.standin import Slow, Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

GREET = "mcp__sage__greet"
DEADLINE = 60.0
DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


@pytest.fixture
async def harness(claude_bin: Path, standin: Standin) -> AsyncIterator[Harness]:
    config = sage_config(
        claude_bin,
        standin.offline_env(),
        capsules='["runner", "tools", "greeter"]',
        extra="[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n",
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as running:
        with anyio.fail_after(20):
            while True:  # the bridge's catalogue offers greet
                tools = (await running.request("sage.v1.request.tools", {})).get("tools", [])
                if any(t["name"] == GREET for t in tools):
                    break
                await anyio.sleep(0.05)
        yield running


async def _turn(sage: Sage, sid: str, prompt: str, **options: Any) -> list[Message]:
    session = await sage.session(sid)
    with anyio.fail_after(DEADLINE):
        return [m async for m in session.send(prompt, **options)]


async def _kill_mid_turn(session: Session, pid: int) -> None:
    """Follow a turn and kill the session's CLI at its first text."""
    async for message in session.send("go on", include_partial_messages=True):
        if isinstance(message, TextDelta):
            os.kill(pid, signal.SIGKILL)


def _of(messages: list[Message], kind: type[Any]) -> list[Any]:
    return [m for m in messages if isinstance(m, kind)]


async def test_spawn_stream_decide_interrupt_stop(harness: Harness, standin: Standin) -> None:
    """The whole life of a session through sage.client against the real CLI."""
    asked: list[tuple[str, dict[str, Any], ToolPermissionContext]] = []

    async def allow_as_bo(tool: str, input: dict[str, Any], ctx: ToolPermissionContext) -> Allow:
        asked.append((tool, input, ctx))
        return Allow(updated_input={"name": "Bo"})

    async def deny(tool: str, input: dict[str, Any], ctx: ToolPermissionContext) -> Deny:
        return Deny("not today")

    async with connect(harness.daemon.config) as sage:
        session = await sage.spawn("alice", session_id="c1")
        assert session.session_id == "c1"

        standin.push(Text("hello there", chunks=3))
        messages = await _turn(sage, "c1", "hi")
        (assistant,) = _of(messages, AssistantMessage)
        assert assistant.content == [TextBlock(text="hello there")]
        assert assistant.message_id.startswith("msg_")
        assert assistant.model
        assert _of(messages, TextDelta) == []  # not asked for
        result = messages[-1]
        assert isinstance(result, ResultMessage)
        assert (result.reason, result.is_error, result.result) == (
            "completed",
            False,
            "hello there",
        )
        assert result.total_cost_usd > 0
        assert result.usage["output_tokens"] > 0

        # a tool call allowed with a changed input: the tool runs with it
        standin.push(ToolUse(GREET, {"name": "Ada"}), Text("greeted"))
        messages = await _turn(sage, "c1", "greet Ada", can_use_tool=allow_as_bo)
        ((tool, input, ctx),) = asked
        assert (tool, input, ctx.session_id) == (GREET, {"name": "Ada"}, "c1")
        assert ctx.tool_use_id
        (request,) = _of(messages, ApprovalRequest)
        assert request.approval_id == ctx.approval_id
        (decision,) = _of(messages, ApprovalDecision)
        assert (decision.allowed, decision.source, decision.input_updated) == (
            True,
            "approver",
            True,
        )
        (tool_result,) = _of(messages, UserMessage)
        (block,) = tool_result.content
        assert isinstance(block, ToolResultBlock)
        assert "Hello, Bo!" in json.dumps(block.content)
        assert not block.is_error
        (sent_back,) = standin.messages[-1].tool_results()
        assert "Hello, Bo!" in json.dumps(sent_back["content"])  # what the model saw
        assert messages[-1].reason == "completed"  # type: ignore[union-attr]

        # denied: Claude reads the reason
        standin.push(ToolUse(GREET, {"name": "Cy"}), Text("ok then"))
        messages = await _turn(sage, "c1", "greet Cy", can_use_tool=deny)
        (decision,) = _of(messages, ApprovalDecision)
        assert (decision.allowed, decision.reason) == (False, "not today")
        (sent_back,) = standin.messages[-1].tool_results()
        assert sent_back.get("is_error") is True
        assert "not today" in json.dumps(sent_back["content"])

        # an interrupt ends the running turn, the session goes on
        standin.push(Slow("first part and a very slow rest", delay=20, chunks=2))
        got: list[Message] = []
        with anyio.fail_after(DEADLINE):
            async for message in session.send("go", include_partial_messages=True):
                got.append(message)
                if isinstance(message, TextDelta) and len(_of(got, TextDelta)) == 1:
                    assert await session.interrupt() is True
        assert isinstance(got[-1], ResultMessage)
        assert got[-1].reason == "interrupted"

        # a session that ends mid-turn raises with its end reason
        standin.push(Slow("a turn that never ends", delay=30, chunks=2))
        (row,) = [s async for s in sage.sessions() if s.session_id == "c1"]
        assert row.pid
        with anyio.fail_after(DEADLINE), pytest.raises(SessionEnded) as ended:
            await _kill_mid_turn(session, row.pid)
        assert ended.value.reason == "crashed"
        assert ended.value.code == "session_ended"

        # stop, and an ended session is refused with its code
        other = await sage.spawn("alice", session_id="c2")
        await other.stop()
        ended_rows = [s async for s in sage.sessions(all=True) if s.session_id == "c2"]
        assert [(r.state, r.reason) for r in ended_rows] == [("ended", "stopped")]
        with pytest.raises(SageError) as refused:
            await _turn(sage, "c2", "anyone?")
        assert refused.value.code in ("session_ended", "unknown_session")


async def test_the_example_of_docs_client_md_runs(harness: Harness, standin: Standin) -> None:
    """docs/client.md's example, run as a program against the real CLI, does what it says."""
    doc = await anyio.Path(DOC).read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    script = anyio.Path(harness.daemon.root) / "example.py"
    await script.write_text(example.replace('"my.toml"', repr(str(harness.daemon.config))))
    standin.push(ToolUse(GREET, {"name": "ada"}), Text("Greeted her."))
    result = await anyio.run_process(
        [sys.executable, str(script)], check=False, env=harness.daemon.env
    )
    out = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "tool result: [{'type': 'text', 'text': 'Hello, Ada!'}]" in out  # title-cased input
    assert "Greeted her." in out
    assert "completed $" in out
