"""The runner's table of pending approvals, with no process: who may decide, until when."""

from __future__ import annotations

import pytest

from capsules.runner.approvals import (
    Approvals,
    Decision,
    UnknownApproval,
    matches,
    rule_reach,
    self_rule_refusal,
    valid_rule,
)
from sage.errors import SageError

YES = Decision(True, "", "approver")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _table() -> tuple[Approvals, Clock]:
    clock = Clock()
    table = Approvals(clock)
    for cid, principal in (("a1", "alice"), ("b1", "bob")):
        table.open(
            cid,
            session_id=f"s-{principal}",
            principal_id=principal,
            tool_name="mcp__sage__greet",
            arguments={"name": "Ada"},
            tool_use_id="toolu_1",
            timeout=60,
        )
        clock.now += 1
    return table, clock


def test_a_principal_sees_and_decides_its_own_only() -> None:
    table, _ = _table()
    assert [r["approval_id"] for r in table.listing("alice")] == ["a1"]
    assert [r["approval_id"] for r in table.listing(None)] == ["a1", "b1"]  # an admin
    with pytest.raises(UnknownApproval):
        table.decide("b1", "alice", YES)
    pending = table.decide("a1", "alice", YES)
    assert pending.done.is_set()
    assert pending.decision == YES
    with pytest.raises(UnknownApproval):  # decided already
        table.decide("a1", None, Decision(False, "late", "approver"))
    assert table.listing("alice") == []
    table.decide("b1", None, YES)  # an admin decides anyone's


def test_past_its_deadline_nobody_decides_it() -> None:
    table, clock = _table()
    row = table.listing("alice")[0]
    assert (row["age_s"], row["expires_in_s"]) == (2.0, 58.0)
    clock.now += 60
    assert table.listing(None) == []  # both past their deadline
    with pytest.raises(UnknownApproval, match="unknown, decided or expired") as info:
        table.decide("a1", "alice", YES)
    assert isinstance(info.value, SageError)
    assert info.value.code == "unknown_approval"
    table.close("a1")
    table.close("a1")  # closing twice is fine
    assert len(table) == 1


@pytest.mark.parametrize(
    ("rules", "tool", "hit"),
    [
        (["mcp__sage__*"], "mcp__sage__greet", "mcp__sage__*"),
        (["mcp__sage__greet"], "mcp__sage__greet", "mcp__sage__greet"),
        (["mcp__sage__greet"], "mcp__sage__greetx", None),
        (["mcp__forge__*", "mcp__sage__g*"], "mcp__sage__greet", "mcp__sage__g*"),
        ([], "mcp__sage__greet", None),
    ],
)
def test_allow_rules_match_tool_names(rules: list[str], tool: str, hit: str | None) -> None:
    assert matches(rules, tool) == hit


def test_rules_are_plain_patterns() -> None:
    assert valid_rule("mcp__sage__*")
    assert not valid_rule("mcp__sage__[ab]")
    assert not valid_rule("")
    assert not valid_rule("x" * 129)


@pytest.mark.parametrize(
    ("rule", "reach"),
    [
        ("mcp__sage__greet", "exact"),
        ("Bash", "exact"),
        ("mcp__sage__*", "prefix"),
        ("mcp__forge__*", "prefix"),
        ("mcp__*", "any"),
        ("*", "any"),
        ("mcp__sage__g*", "any"),
        ("mcp__sage__*__*", "any"),
    ],
)
def test_a_rules_reach_is_one_tool_one_servers_tools_or_any(rule: str, reach: str) -> None:
    """What an allow rule reaches decides whether a principal may give it to itself."""
    assert rule_reach(rule) == reach
    allowed = {"exact": ("exact", "prefix", "any"), "prefix": ("prefix", "any"), "any": ("any",)}
    for ceiling in ("exact", "prefix", "any"):
        refused = self_rule_refusal("alice", [rule], ceiling)
        assert (refused is None) == (ceiling in allowed[reach]), (rule, ceiling)
