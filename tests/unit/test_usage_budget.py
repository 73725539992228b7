"""The budget policy (sage/usage/budget.py) and the ledger file (sage/usage/ledger.py)."""

from __future__ import annotations

import calendar
from pathlib import Path

import pytest

from sage.usage.budget import BudgetKind, Limits, Period, Spend, crossed, over, remaining
from sage.usage.ledger import Entry, Ledger

pytestmark = pytest.mark.anyio

NOON = float(calendar.timegm((2026, 12, 31, 12, 0, 0)))


def test_periods_are_utc_days_and_months() -> None:
    """The last day of a year ends at midnight UTC, and so does its month."""
    period = Period.at(NOON)
    assert (period.day, period.month) == ("2026-12-31", "2026-12")
    assert period.day_ends_at == calendar.timegm((2027, 1, 1, 0, 0, 0))
    assert period.month_ends_at == period.day_ends_at


def test_over_names_the_first_budget_reached_with_its_reset() -> None:
    """At the limit is over; the message names spend, budget and reset time."""
    limits = Limits(tokens_per_day=100, usd_per_month=5.0)
    period = Period.at(NOON)
    assert over("alice", limits, Spend(99, 0.0, 4.99), period) is None
    reached = over("alice", limits, Spend(100, 0.0, 0.0), period)
    assert reached is not None
    assert reached.kind is BudgetKind.TOKENS_PER_DAY
    message = reached.message(NOON)
    assert "100 tokens of its budget of 100 tokens a day" in message
    assert "resets at 2027-01-01T00:00:00Z (in 12h00m)" in message
    monthly = over("alice", limits, Spend(0, 0.0, 5.0), period)
    assert monthly is not None
    assert monthly.kind is BudgetKind.USD_PER_MONTH


def test_a_warning_at_80_percent_and_at_the_limit_once_each() -> None:
    """Crossing 80 % and 100 % in one step gives both; staying past gives none."""
    limits = Limits(tokens_per_day=100)
    period = Period.at(NOON)
    both = crossed(limits, Spend(10), Spend(120), period)
    assert [c.share for c in both] == [0.8, 1.0]
    assert crossed(limits, Spend(120), Spend(130), period) == []
    assert crossed(Limits(tokens_per_day=0), Spend(0), Spend(5), period) == []


def test_remaining_never_below_zero() -> None:
    """What is left of a budget is 0 once it is spent."""
    left = remaining(Limits(tokens_per_day=10, usd_per_day=1.0), Spend(15, 0.25, 0.25))
    assert left == {BudgetKind.TOKENS_PER_DAY: 0.0, BudgetKind.USD_PER_DAY: 0.75}


def _entry(day: str, tokens: int, usd: float, session: str = "s1") -> Entry:
    return Entry(
        day, "alice", session, "", "claude-sonnet-4-5", "session", 1, tokens, 0, 0, 0, usd, 0.0, usd
    )


async def test_the_ledger_sums_survive_a_reopen(tmp_path: Path) -> None:
    """Entries committed are read back after the file is closed and opened again."""
    path = tmp_path / "usage.db"
    async with Ledger.open(path) as ledger:
        ledger.add(_entry("2026-12-30", 40, 0.5))
        ledger.add(_entry("2026-12-31", 7, 0.25))
        ledger.add(_entry("2026-12-31", 3, 0.25, session="s2"))
        await ledger.set_budget("alice", {"tokens_per_day": 5.0}, at=NOON, by="cli:0")
    assert path.stat().st_mode & 0o777 == 0o600
    async with Ledger.open(path) as ledger:
        spend = await ledger.spend(Period.at(NOON))
        assert spend == {"alice": Spend(10, 0.5, 1.0)}
        rows = await ledger.report(since="2026-12-31", by="session")
        assert [(r.key, r.tokens, r.calls) for r in rows] == [("s1", 7, 1), ("s2", 3, 1)]
        assert await ledger.budgets() == {"alice": {"tokens_per_day": 5.0}}
        assert await ledger.report(principal="bob", since="2026-12-01") == []
