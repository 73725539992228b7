"""Approvals where the user is: astrid sage send asks inline on a terminal (through a
real pseudo-terminal), astrid sage approvals / approve / deny, allow rules."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.abc
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.daemon import ASTRID, short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.terminal import Terminal

pytestmark = pytest.mark.anyio

FAKE = FAKE_CLAUDE
ENV = {"ANTHROPIC_API_KEY": "sk-double"}
ASK = '/fault ask mcp__sage__greet {"name":"Ada"}'


def _config(approval_timeout: float = 20.0) -> str:
    limits = (
        f"[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\napproval_timeout = {approval_timeout}\n"
    )
    return sage_config(FAKE, {"FAKE_CLAUDE_MODE": ""}, extra=limits)


@pytest.fixture
async def sage() -> AsyncIterator[Sage]:
    async with running_sage(_config(), env=ENV, root=short_dir()) as running:
        yield running


async def test_yes_at_the_terminal_allows_the_call(sage: Sage) -> None:
    await sage.ready("t1")
    term = Terminal(sage, "t1", ASK)
    await term.expect(b'Claude wants to run mcp__sage__greet {"name":"Ada"}')
    await term.expect(b"allow? [y/a/n]")
    term.type("y")
    await term.expect(b"[approval] mcp__sage__greet allowed")
    code, out = await term.finish()
    assert (code, out) == (0, "allowed\n")


async def test_always_allows_this_call_and_every_later_one(sage: Sage) -> None:
    await sage.ready("t2")
    term = Terminal(sage, "t2", ASK)
    await term.expect(b"allow? [y/a/n]")
    term.type("a")
    code, out = await term.finish()
    assert (code, out) == (0, "allowed\n")
    # the next call is allowed by the rule, with nobody asked and nobody listening
    code, out, err = await sage.astrid("sage", "send", "t2", ASK)
    assert (code, out) == (0, "allowed\n"), err
    assert "[approval] mcp__sage__greet allowed by the rule mcp__sage__greet" in err
    code, out, err = await sage.astrid("sage", "settings", "alice")
    assert code == 0, err
    assert "allow_rules       mcp__sage__greet\n" in out  # a list, not Python's repr
    code, out, err = await sage.astrid(
        "sage", "settings", "alice", "--disallow", "mcp__sage__greet"
    )
    assert code == 0, err
    code, out, err = await sage.astrid("sage", "send", "t2", ASK)  # off a terminal: deny
    assert out.startswith("denied"), (out, err)


async def test_no_with_a_reason_denies_and_claude_is_told_why(sage: Sage) -> None:
    await sage.ready("t3")
    term = Terminal(sage, "t3", ASK)
    await term.expect(b"allow? [y/a/n]")
    term.type("n")
    await term.expect(b"reason (optional")
    term.type("not on Fridays")
    await term.expect(b"[approval] mcp__sage__greet denied: not on Fridays")
    code, out = await term.finish()
    assert (code, out) == (0, "denied: not on Fridays\n")


async def test_an_unanswered_prompt_times_out_as_a_denial() -> None:
    async with running_sage(_config(approval_timeout=1.5), env=ENV) as sage:
        await sage.ready("t4")
        term = Terminal(sage, "t4", ASK)
        await term.expect(b"allow? [y/a/n]")
        await term.expect(b"[approval] mcp__sage__greet timed out: denied")
        code, out = await term.finish()  # the turn goes on without waiting for the prompt
        assert (code, out) == (0, "denied: no approver answered\n")


async def test_off_a_terminal_the_default_is_deny_and_said(sage: Sage) -> None:
    await sage.ready("t5")
    code, out, err = await sage.astrid("sage", "send", "t5", ASK)
    assert (code, out) == (0, "denied: no approver is listening\n"), err
    assert "[approval] mcp__sage__greet denied: no approver is listening" in err
    assert "--approve prompt|ask waits for an answer" in err


async def _waiting_approval(sage: Sage, sid: str) -> tuple[anyio.abc.Process, list[dict[str, Any]]]:
    """A send off a terminal (`--approve ask`) whose tool call waits; the pending rows."""
    sender = await anyio.open_process(
        [*ASTRID, "sage", "send", sid, ASK, "--approve", "ask", "--config",
         str(sage.daemon.config)],
        env=sage.daemon.env,
    )  # fmt: skip
    rows: list[dict[str, Any]] = []
    with anyio.fail_after(15):
        while not rows:
            code, out, err = await sage.astrid("sage", "approvals", "--json")
            assert code == 0, err
            rows = json.loads(out)
    return sender, rows


async def test_approvals_lists_and_approve_answers_from_another_terminal(sage: Sage) -> None:
    await sage.ready("t6")
    sender, rows = await _waiting_approval(sage, "t6")
    (row,) = rows
    assert (row["session_id"], row["tool_name"]) == ("t6", "mcp__sage__greet")
    assert row["arguments"] == {"name": "Ada"}
    assert 0 < row["expires_in_s"] <= 20
    code, out, err = await sage.astrid("sage", "approvals")
    assert row["approval_id"] in out
    code, out, err = await sage.astrid("sage", "approve", "nosuchid")
    assert code == 1
    assert "unknown_approval" in err
    code, out, err = await sage.astrid("sage", "approve", row["approval_id"])
    assert (code, out) == (0, "allowed: mcp__sage__greet in session t6\n"), err
    code, out, err = await sage.astrid("sage", "deny", row["approval_id"])  # decided already
    assert code == 1
    assert "unknown_approval" in err
    with anyio.fail_after(15):
        assert await sender.wait() == 0
    assert sender.stdout is not None
    assert (await sender.stdout.receive()).decode() == "allowed\n"
    await sender.aclose()


async def test_a_misspelt_published_answer_is_audited_not_taken() -> None:
    root = short_dir()
    async with running_sage(_config(approval_timeout=3), env=ENV, root=root) as sage:
        await sage.ready("t7")
        requests = await sage.client.subscribe("approval.v1.request.*")
        await sage.send("t7", ASK)
        request = await requests.get()
        cid = request.topic.rsplit(".", 1)[1]
        sage.client.publish(f"approval.v1.response.{cid}", {"allowd": True})
        await sage.client.flush()
        events = await sage.events("t7")
        text, _ = await events.text_until_done()
        assert text == "denied: no approver answered"  # the typo was no decision
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    kinds = [k for (k,) in db.execute("SELECT kind FROM entries")]
    db.close()
    assert "sage.v1.audit.approval_malformed" in kinds


async def test_a_principal_gives_itself_exact_rules_only_unless_the_config_says(
    sage: Sage,
) -> None:
    """`settings --allow '*'` and `approve --always --rule` for one's own principal are
    refused under the default [limits] self_allow_rules; exact names pass; an admin's any."""
    own = ("--principal", "alice")
    for wide in ("*", "mcp__*", "mcp__sage__*"):
        code, out, err = await sage.astrid("sage", "settings", "alice", "--allow", wide, *own)
        assert code == 1, (wide, out)
        assert "rule_not_allowed" in err
        assert "self_allow_rules = 'exact'" in err
    code, out, err = await sage.astrid("sage", "settings", "alice", "--json", *own)
    assert json.loads(out)["allow_rules"] == [], err
    code, out, err = await sage.astrid(
        "sage", "settings", "alice", "--allow", "mcp__sage__shout", *own
    )
    assert code == 0, err
    await sage.ready("t9")
    sender, rows = await _waiting_approval(sage, "t9")
    cid = rows[0]["approval_id"]
    code, out, err = await sage.astrid("sage", "approve", cid, "--always", "--rule", "*", *own)
    assert code == 1
    assert "rule_not_allowed" in err
    code, out, err = await sage.astrid("sage", "approve", cid, "--always", *own)  # still pending
    assert code == 0, err
    with anyio.fail_after(15):
        assert await sender.wait() == 0
    await sender.aclose()
    code, out, err = await sage.astrid("sage", "settings", "alice", "--allow", "*")  # an admin
    assert code == 0, err
    code, out, err = await sage.astrid("sage", "settings", "alice", "--json")
    assert json.loads(out)["allow_rules"] == ["mcp__sage__shout", "mcp__sage__greet", "*"]


async def test_the_config_may_let_principals_give_themselves_a_servers_tools() -> None:
    """self_allow_rules = "prefix": mcp__sage__* passes, '*' does not."""
    config = _config().replace("[limits]\n", '[limits]\nself_allow_rules = "prefix"\n')
    async with running_sage(config, env=ENV, root=short_dir()) as sage:
        own = ("--principal", "alice")
        code, _, err = await sage.astrid(
            "sage", "settings", "alice", "--allow", "mcp__sage__*", *own
        )
        assert code == 0, err
        code, _, err = await sage.astrid("sage", "settings", "alice", "--allow", "*", *own)
        assert code == 1
        assert "self_allow_rules = 'prefix'" in err


async def test_the_tool_time_shown_leaves_out_the_time_to_answer(sage: Sage) -> None:
    """`[tool] NAME ok (N ms)` after a slow yes is the tool's time, not the wait for yes."""
    await sage.ready("t10")
    term = Terminal(sage, "t10", ASK)
    await term.expect(b"allow? [y/a/n]")
    await anyio.sleep(1.5)  # a person reading the prompt
    term.type("y")
    await term.expect(b"[tool] mcp__sage__greet ok (")
    code, _ = await term.finish()
    assert code == 0
    took = int(term.screen.split(b"[tool] mcp__sage__greet ok (")[1].split(b" ms)")[0])
    assert took < 1500, term.screen


async def test_approvals_watch_names_the_session_and_says_what_the_answer_did(
    sage: Sage,
) -> None:
    """On a terminal, `approvals --watch` asks naming the session, then prints the outcome."""
    import signal

    await sage.ready("tw")
    watcher = Terminal.astrid(sage, "sage", "approvals", "--watch")
    await watcher.expect(b"waiting for approvals")
    await anyio.sleep(0.5)  # its presence reaches the supervisor
    sender = await anyio.open_process(
        [*ASTRID, "sage", "send", "tw", ASK, "--approve", "ask", "--config",
         str(sage.daemon.config)],
        env=sage.daemon.env,
    )  # fmt: skip
    await watcher.expect(b"in session tw of alice")
    await watcher.expect(b"allow? [y/a/n]")
    watcher.type("y")
    await watcher.expect(b"allowed: mcp__sage__greet in session tw")
    with anyio.fail_after(15):
        assert await sender.wait() == 0
    await sender.aclose()
    watcher.proc.send_signal(signal.SIGINT)
    await watcher.finish()


async def test_approvals_watch_off_a_terminal_is_refused_before_it_stands_as_approver(
    sage: Sage,
) -> None:
    """Off a terminal, `approvals --watch` exits 1 and says so instead of standing as approver."""
    with anyio.fail_after(15):
        code, out, err = await sage.astrid("sage", "approvals", "--watch", stdin=b"")
    assert (code, out) == (1, "")
    assert err.startswith("astrid: approvals --watch asks at a terminal"), err
    assert "astrid sage approve ID" in err
