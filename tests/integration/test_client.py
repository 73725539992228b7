"""sage.client against a real supervisor and the CLI double: the edges of can_use_tool and
of refused requests, which the real CLI's e2e run does not reach."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from sage.client import (
    Allow,
    ApprovalDecision,
    Message,
    ResultMessage,
    SageError,
    ToolPermissionContext,
    connect,
)
from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

ASK = '/fault ask mcp__sage__greet {"name": "Ada"}'


@pytest.fixture
async def harness() -> AsyncIterator[Sage]:
    config = sage_config(
        FAKE_CLAUDE, {"FAKE_CLAUDE_MODE": ""}, extra="[limits]\nstop_grace = 0.5\n"
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-double"}) as running:
        yield running


async def _turn(harness: Sage, prompt: str, **options: Any) -> list[Message]:
    async with connect(harness.daemon.config) as sage:
        session = await sage.spawn("alice")
        with anyio.fail_after(30):
            return [m async for m in session.send(prompt, **options)]


async def test_a_callback_that_raises_denies_the_call_with_its_text(harness: Sage) -> None:
    """A bug in the program's can_use_tool denies the call, visibly, never allows it."""

    async def broken(tool: str, input: dict[str, Any], ctx: ToolPermissionContext) -> Allow:
        raise RuntimeError("boom")

    messages = await _turn(harness, ASK, can_use_tool=broken)
    [decision] = [m for m in messages if isinstance(m, ApprovalDecision)]
    assert (decision.allowed, decision.source) == (False, "approver")
    assert decision.reason == "can_use_tool failed: RuntimeError: boom"
    result = messages[-1]
    assert isinstance(result, ResultMessage)
    assert result.result == "denied: can_use_tool failed: RuntimeError: boom"


async def test_a_callback_that_returns_no_decision_denies(harness: Sage) -> None:
    """Anything but Allow or Deny from can_use_tool is a denial that says so."""

    async def sloppy(tool: str, input: dict[str, Any], ctx: ToolPermissionContext) -> Any:
        return True

    messages = await _turn(harness, ASK, can_use_tool=sloppy)
    [decision] = [m for m in messages if isinstance(m, ApprovalDecision)]
    assert decision.allowed is False
    assert decision.reason == "can_use_tool returned bool, not Allow or Deny"


async def test_without_a_callback_nobody_decides_and_the_call_is_denied(harness: Sage) -> None:
    """No can_use_tool and no other approver: denied at once (source no_approver)."""
    messages = await _turn(harness, ASK)
    [decision] = [m for m in messages if isinstance(m, ApprovalDecision)]
    assert (decision.allowed, decision.source) == (False, "no_approver")


async def test_a_refused_request_is_a_sage_error_with_its_code(harness: Sage) -> None:
    """An unknown session, a bad principal: SageErrors carrying the runner's code."""
    async with connect(harness.daemon.config) as sage:
        with pytest.raises(SageError) as unknown:
            await sage.session("nope")
        assert unknown.value.code == "unknown_session"
        with pytest.raises(SageError) as bad:
            await sage.spawn("mallory")
        assert bad.value.code in ("unknown_principal", "not_authorized")
        assert [s async for s in sage.sessions()] == []
        assert await sage.approvals() == []


async def test_usage_reports_the_turns_ledger_rows_typed(harness: Sage) -> None:
    """sage.usage() reads what the ledger counted of a turn, as `astrid sage usage` does;
    a malformed day is a SageError with its code."""
    async with connect(harness.daemon.config) as sage:
        session = await sage.spawn("alice")
        with anyio.fail_after(30):
            messages = [m async for m in session.send("hello")]
        assert isinstance(messages[-1], ResultMessage)
        with anyio.fail_after(10):
            while True:  # the ledger counts the turn's events as they pass
                report = await sage.usage(by="session")
                rows = [r for r in report.rows if r.key == session.session_id]
                if rows and rows[0].calls:
                    break
                await anyio.sleep(0.05)
        (row,) = rows
        assert (row.principal, report.by) == ("alice", "session")
        assert row.tokens == row.input_tokens + row.output_tokens + (
            row.cache_read_tokens + row.cache_write_tokens
        )
        assert [b.principal_id for b in report.budgets] == ["alice"]
        with pytest.raises(SageError) as bad:
            await sage.usage(since="yesterday")
        assert bad.value.code == "bad_request"
