"""End-to-end: the real Claude Code CLI against the Messages API stand-in."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sage.claude.binary import read_claude_version
from sage.claude.protocol import (
    AssistantMessage,
    Message,
    OutgoingState,
    ResultMessage,
    SystemApiRetry,
    SystemInit,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
    encode_interrupt,
    encode_mcp_notification,
    encode_user_turn,
)
from tests.support.host import Host
from tests.support.standin import Error, Slow, Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

DEADLINE = 45.0
GREET = "mcp__sage__greet"
WAVE = "mcp__sage__wave"

Claude = Callable[..., AbstractAsyncContextManager[Host]]


def _of(msgs: list[Message], cls: type[Any]) -> list[Any]:
    return [m for m in msgs if isinstance(m, cls)]


def _texts(msgs: list[Message]) -> list[str]:
    return [
        b.text
        for m in _of(msgs, AssistantMessage)
        for b in m.message.content
        if isinstance(b, TextBlock)
    ]


def _result_text(block: dict[str, Any]) -> str:
    content = block.get("content")
    if isinstance(content, str):
        return content
    return "".join(c.get("text", "") for c in content or [])


@pytest.mark.parametrize("standin", [False, True], ids=["keepalive", "close"], indirect=True)
async def test_text_turns_and_clean_exit(
    claude: Claude, standin: Standin, claude_bin: Path
) -> None:
    """Two text turns in one process, then closing stdin exits 0."""
    version = await read_claude_version(claude_bin)
    standin.push(Text("hello from the stand-in", chunks=3), Text("second answer"))
    with anyio.fail_after(DEADLINE):
        async with claude() as host:
            first = await host.turn("hi")
            inits = _of(first, SystemInit)
            assert len(inits) == 1
            init = inits[0]
            assert init.model
            assert init.claude_code_version == version  # what --version says
            assert GREET in init.tools
            assert all(t.startswith("mcp__") for t in init.tools), init.tools
            assert [(s.name, s.status) for s in init.mcp_servers] == [("sage", "connected")]
            assert _texts(first) == ["hello from the stand-in"]
            result = first[-1]
            assert isinstance(result, ResultMessage)
            assert result.subtype == "success"
            assert not result.is_error
            assert result.session_id == init.session_id

            second = await host.turn("again")
            assert _texts(second) == ["second answer"]
            assert isinstance(second[-1], ResultMessage)
            assert second[-1].subtype == "success"

            await host.close_stdin()
            assert await host.wait() == 0
    assert [r.live_tool_names for r in standin.messages] == [[GREET], [GREET]]
    assert set(standin.messages[0].tool_names) <= {GREET, "DeferredToolPlaceholder"}
    assert standin.messages[0].body["stream"] is True
    assert standin.unscripted == 0


async def test_tool_loop(claude: Claude, standin: Standin) -> None:
    """A tool_use reply makes the CLI call greet via the host and send back its tool_result."""
    standin.push(ToolUse(GREET, {"name": "Ada"}, id="toolu_ada"), Text("greeted"))
    with anyio.fail_after(DEADLINE):
        async with claude() as host:
            msgs = await host.turn("greet Ada")
    assert host.tool_calls == [
        {"name": "greet", "arguments": {"name": "Ada"}, "_meta": host.tool_calls[0]["_meta"]}
    ]
    assert host.tool_calls[0]["_meta"]["claudecode/toolUseId"] == "toolu_ada"
    uses = [
        b
        for m in _of(msgs, AssistantMessage)
        for b in m.message.content
        if isinstance(b, ToolUseBlock)
    ]
    assert [(u.id, u.name, u.input) for u in uses] == [("toolu_ada", GREET, {"name": "Ada"})]
    echoed = [
        b
        for m in _of(msgs, UserMessage)
        if isinstance(m.message.content, list)
        for b in m.message.content
        if isinstance(b, ToolResultBlock)
    ]
    assert [e.tool_use_id for e in echoed] == ["toolu_ada"]
    assert _texts(msgs) == ["greeted"]
    result = msgs[-1]
    assert isinstance(result, ResultMessage)
    assert result.subtype == "success"
    assert result.num_turns == 2
    assert len(standin.messages) == 2
    results = standin.messages[1].tool_results()
    assert [r["tool_use_id"] for r in results] == ["toolu_ada"]
    assert "Hello, Ada!" in _result_text(results[0])
    assert not results[0].get("is_error")


async def test_pre_tool_use_hook_callback(claude: Claude, standin: Standin) -> None:
    """The PreToolUse hook registered in initialize is called back before the tool runs."""
    standin.push(ToolUse(GREET, {"name": "Ada"}, id="toolu_hook"), Text("done"))
    with anyio.fail_after(DEADLINE):
        async with claude() as host:
            msgs = await host.turn("greet Ada")
    assert isinstance(msgs[-1], ResultMessage)
    assert msgs[-1].subtype == "success"
    assert len(host.hook_callbacks) == 1
    hook = host.hook_callbacks[0]
    assert hook.callback_id == "hook_0"
    assert hook.tool_use_id == "toolu_hook"
    assert hook.input["hook_event_name"] == "PreToolUse"
    assert hook.input["tool_name"] == GREET
    assert hook.input["tool_input"] == {"name": "Ada"}
    order = [e for e in host.log if e.startswith(("<- hook_callback", "<- mcp tools/call"))]
    assert order == ["<- hook_callback hook_0", "<- mcp tools/call"]


@pytest.mark.parametrize("allow", [True, False], ids=["allow", "deny"])
async def test_can_use_tool(claude: Claude, standin: Standin, allow: bool) -> None:
    """Without pre-allowing greet, --permission-prompt-tool stdio asks the host; allow runs it, deny does not."""
    standin.push(ToolUse(GREET, {"name": "Ada"}, id="toolu_perm"), Text("after"))
    with anyio.fail_after(DEADLINE):
        async with claude(allowed_tools=(), permission_prompt=True) as host:
            host.permission = "allow" if allow else "deny"
            msgs = await host.turn("greet Ada")
    assert [(p.tool_name, p.input, p.tool_use_id) for p in host.permission_requests] == [
        (GREET, {"name": "Ada"}, "toolu_perm")
    ]
    order = [e for e in host.log if e.startswith(("<- hook_callback", "<- can_use_tool"))]
    assert order == ["<- hook_callback hook_0", f"<- can_use_tool {GREET} {host.permission}"]
    result = msgs[-1]
    assert isinstance(result, ResultMessage)
    assert result.subtype == "success"
    sent = standin.messages[1].tool_results()
    assert [r["tool_use_id"] for r in sent] == ["toolu_perm"]
    if allow:
        assert len(host.tool_calls) == 1
        assert result.permission_denials == []
        assert "Hello, Ada!" in _result_text(sent[0])
    else:
        assert host.tool_calls == []
        assert [(d.tool_name, d.tool_use_id, d.tool_input) for d in result.permission_denials] == [
            (GREET, "toolu_perm", {"name": "Ada"})
        ]
        assert sent[0].get("is_error") is True
        assert "denied by the test host" in _result_text(sent[0])


async def test_auth_error_surfaces_fast(claude: Claude, standin: Standin) -> None:
    """A 401 shows up as system/api_retry with error_status 401 within seconds (sage can fail fast)."""
    standin.default = Error(401, "authentication_error", "invalid x-api-key")
    with anyio.fail_after(DEADLINE):
        async with claude() as host:
            start = time.monotonic()
            await host.write(encode_user_turn("hi"))
            with anyio.fail_after(10):
                msgs = await host.until(SystemApiRetry)
            elapsed = time.monotonic() - start
            retry = msgs[-1]
            assert isinstance(retry, SystemApiRetry)
            assert retry.error_status == 401
            assert retry.error == "authentication_failed"
            assert retry.attempt == 1
            assert retry.max_retries >= 1
            assert elapsed < 5.0, elapsed
            assert not _of(msgs, ResultMessage)
    assert standin.messages
    assert standin.messages[0].headers["x-api-key"] == "sk-test"


@pytest.mark.parametrize(
    ("status", "kind"),
    [(429, "rate_limit_error"), (500, "api_error"), (529, "overloaded_error")],
)
async def test_transient_error_retried(
    claude: Claude, standin: Standin, status: int, kind: str
) -> None:
    """A transient API error is retried (system/api_retry) and the turn then succeeds."""
    standin.push(Error(status, kind), Text("recovered"))
    with anyio.fail_after(DEADLINE):
        async with claude() as host:
            msgs = await host.turn("hi")
    retries = _of(msgs, SystemApiRetry)
    assert [r.error_status for r in retries] == [status]
    assert _texts(msgs) == ["recovered"]
    assert isinstance(msgs[-1], ResultMessage)
    assert msgs[-1].subtype == "success"
    assert len(standin.messages) == 2


async def test_interrupt_mid_stream(claude: Claude, standin: Standin) -> None:
    """An interrupt during a slow stream is acknowledged and ends the turn with an error result."""
    standin.push(Slow("partial answer and the rest much later", delay=30.0), Text("next turn"))
    with anyio.fail_after(DEADLINE):
        async with claude() as host:
            await host.write(encode_user_turn("talk slowly"))
            await standin.stream_started.wait()
            # the first delta left the stand-in; give the CLI a moment to take it in
            # (on a loaded machine the interrupt could otherwise overtake it)
            await anyio.sleep(0.3)
            outcome = await host.request("interrupt", encode_interrupt)
            assert outcome.state is OutgoingState.COMPLETED
            assert msgspec.json.decode(outcome.response) == {"still_queued": []}
            msgs = await host.until(ResultMessage)
            assert _texts(msgs) == ["partial answer and "]
            interrupted = [m.message.content for m in _of(msgs, UserMessage)]
            assert interrupted == [[TextBlock("[Request interrupted by user]")]]
            result = msgs[-1]
            assert isinstance(result, ResultMessage)
            assert result.is_error
            assert result.subtype == "error_during_execution"
            assert result.terminal_reason == "aborted_streaming"
            after = await host.turn("and now?")
            assert _texts(after) == ["next turn"]
            assert isinstance(after[-1], ResultMessage)
            assert after[-1].subtype == "success"


async def test_tools_list_changed_between_turns(claude: Claude, standin: Standin) -> None:
    """notifications/tools/list_changed makes the CLI re-list tools; the next request offers wave."""
    standin.push(
        Text("one"), Text("two"), ToolUse(WAVE, {"name": "Ada"}, id="toolu_wave"), Text("waved")
    )
    with anyio.fail_after(DEADLINE):
        async with claude(allowed_tools=(GREET, WAVE)) as host:
            await host.turn("first")
            assert host.mcp_methods.count("tools/list") == 1
            host.tools.append("wave")
            outcome = await host.request(
                "mcp_message",
                lambda rid: encode_mcp_notification(
                    rid, "sage", "notifications/tools/list_changed"
                ),
            )
            assert outcome.state is OutgoingState.COMPLETED
            await host.wait_until(lambda: host.mcp_methods.count("tools/list") == 2)
            second = await host.turn("second")
            third = await host.turn("wave at Ada")
    for msgs in (second, third):
        assert isinstance(msgs[-1], ResultMessage)
        assert msgs[-1].subtype == "success"
    first_req, second_req = standin.messages[0], standin.messages[1]
    assert first_req.live_tool_names == [GREET]
    assert WAVE in second_req.tool_names
    (wave,) = [t for t in second_req.body["tools"] if t["name"] == WAVE]
    if wave.get("defer_loading"):
        # 2.1.328 offers a tool added mid-conversation as deferred and announces it
        # in a trailing system-role message with a tool_addition block
        announce = second_req.body["messages"][-1]
        assert announce["role"] == "system"
        assert {"type": "tool_reference", "name": WAVE} in [
            b.get("tool") for b in announce["content"] if b.get("type") == "tool_addition"
        ]
    else:  # earlier releases (2.1.275) offer it as a live tool at once
        assert WAVE in second_req.live_tool_names
    # ...and the deferred tool is callable on the next turn.
    assert [c["name"] for c in host.tool_calls] == ["wave"]
    results = standin.messages[3].tool_results()
    assert [r["tool_use_id"] for r in results] == ["toolu_wave"]
    assert "*waves at Ada*" in _result_text(results[0])
