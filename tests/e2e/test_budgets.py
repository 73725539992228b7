"""Budgets end to end: the real Claude Code CLI, a real supervisor, the Messages API stand-in.

The stand-in reports ``usage`` on every reply (12 input and 5 output tokens a model
call), the CLI streams it, the runner reports each model call once and the usage
ledger (sage/usage) counts it against alice's ``budget_tokens_per_day``.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.daemon import short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.standin import Standin, Text, ToolUse

pytestmark = [pytest.mark.anyio, pytest.mark.e2e]

CALL_TOKENS = 12 + 5
"""What one stand-in reply uses: 12 input tokens, 5 output (its message_delta)."""
ENV = {"ANTHROPIC_API_KEY": "sk-test"}


def _config(claude_bin: Path, standin: Standin, budget: int, extra: str = "") -> str:
    return sage_config(
        claude_bin,
        standin.offline_env(),
        extra="[limits]\nstop_grace = 2.0\ninit_timeout = 30.0\n" + extra,
        principal_extra=f"budget_tokens_per_day = {budget}\n",
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _usage(sage: Sage, *args: str) -> dict[str, Any]:
    code, out, err = await sage.astrid("sage", "usage", "--json", *args)
    assert code == 0, err
    data: dict[str, Any] = msgspec.json.decode(out)
    return data


async def test_the_fourth_turn_is_refused_and_the_ledger_survives_a_restart(
    claude_bin: Path, standin: Standin
) -> None:
    """Three turns fit a budget of 40 tokens (the third crosses it); the fourth send is
    refused budget_exceeded naming spend, budget and reset; the figures outlive a restart."""
    root = short_dir()
    config = _config(claude_bin, standin, budget=40)
    try:
        async with running_sage(config, env=ENV, root=root) as sage:
            events = await sage.ready("b1")
            warnings = await sage.client.subscribe("sage.v1.event.budget_warning")
            for n in range(3):
                standin.push(Text(f"answer {n}"))
                assert (await sage.send("b1", f"turn {n}"))["ok"]
                _, done = await events.text_until_done()
                assert done["is_error"] is False
            warning = msgspec.json.decode((await warnings.get()).payload)
            assert (warning["budget"], warning["limit"]) == ("tokens_per_day", 40)
            assert 32 <= warning["spent"] < 40  # the second turn took it past 80 %
            refused = await sage.send("b1", "turn 3")
            assert refused["ok"] is False
            assert refused["error"] == "budget_exceeded"
            message = refused["message"]
            assert f"{3 * CALL_TOKENS:,} tokens" in message
            assert "40 tokens" in message
            assert "resets at" in message
            code, _, err = await sage.astrid("sage", "send", "b1", "turn 3")
            assert code == 1
            assert "budget_exceeded" in err
            report = await _usage(sage, "--by", "session")
            (row,) = report["rows"]
            assert (row["key"], row["principal"]) == ("b1", "alice")
            assert row["calls"] == 3
            assert row["tokens"] == 3 * CALL_TOKENS
            assert row["cli_usd"] > 0  # the CLI's own total_cost_usd, kept beside
            code, out, err = await sage.astrid("sage", "usage", "--by", "model")
            assert code == 0, err
            assert "budget alice tokens_per_day: spent 51 of 40" in out
        async with running_sage(config, env=ENV, root=root) as sage:
            report = await _usage(sage, "--by", "session")
            assert [r["tokens"] for r in report["rows"]] == [3 * CALL_TOKENS]
            events, reply = await sage.spawn("b2")
            assert reply["ok"] is False
            assert reply["error"] == "budget_exceeded"  # a spawn too, after the restart
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_long_turn_is_interrupted_at_the_next_model_call(
    claude_bin: Path, standin: Standin
) -> None:
    """A turn that loops on tool calls is interrupted once a model call starts over the
    budget; its done says budget_exceeded; an admin raises the budget and the same
    session takes the next turn.  /metrics shows the figures."""
    port = _free_port()
    extra = f'[metrics]\nlisten = "127.0.0.1:{port}"\n'
    async with running_sage(_config(claude_bin, standin, 50, extra), env=ENV) as sage:
        events = await sage.ready("long")
        standin.push(*[ToolUse("mcp__nowhere__loop", {"n": n}) for n in range(12)])
        code, _, err = await sage.astrid("sage", "send", "long", "keep going")
        assert code == 3, err  # the turn failed, and the CLI says why
        assert "budget_exceeded" in err
        assert "resets at" in err
        _, done = await events.text_until_done()
        assert done["reason"] == "budget_exceeded"
        assert "50 tokens" in done["message"]
        calls = sum(1 for n, _ in events.seen if n == "tool_use")
        assert 3 <= calls < 12  # stopped mid-way, not at the end of the turn
        interrupted = [d for n, d in events.seen if n == "budget_exceeded"]
        assert len(interrupted) == 1
        code, out, err = await sage.astrid(
            "sage", "settings", "alice", "--budget-tokens-per-day", "100000"
        )
        assert code == 0, err
        assert "tokens_per_day" in out
        standin.script.clear()
        standin.push(Text("back again"))
        again = await sage.send("long", "and now?")
        assert again["ok"], again
        text, done = await events.text_until_done()
        assert (text, done["is_error"]) == ("back again", False)
        body = await _scrape(port)
    families = {f.name: f for f in text_string_to_metric_families(body)}
    tokens = families["sage_tokens"]
    assert tokens.type == "counter"
    by_kind = {s.labels["kind"]: s.value for s in tokens.samples if s.name == "sage_tokens_total"}
    assert by_kind["input"] >= 12 * 4
    assert families["sage_budget_interrupts"].samples[0].value == 1
    remaining = families["sage_budget_remaining"]
    (left,) = [s for s in remaining.samples if s.labels["budget"] == "tokens_per_day"]
    assert left.labels["principal"] == "alice"
    assert 0 < left.value < 100000
    turns = {s.labels["reason"]: s.value for s in families["sage_turns"].samples}
    assert turns["budget_exceeded"] == 1


async def _scrape(port: int) -> str:
    import anyio

    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body.decode()
