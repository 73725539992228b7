"""A principal's spend across a fleet: the report each heartbeat record carries, what of
another node's report counts here (sage/fleet/spend.py), and the budgets that count it
(sage/usage/service.py, ``UsageService.total``)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from bus import Identity
from sage.config import Config, FleetPeerConfig, decode_config
from sage.contract.usage import MAX_SPEND_PRINCIPALS, ReportedSpend, SpendReport
from sage.fleet.nodes import NodeLoad, NodeRecord, NodeTable, decode_record
from sage.fleet.spend import Reported, counted
from sage.usage.budget import BudgetKind, Spend
from sage.usage.ledger import Entry, Ledger
from sage.usage.service import UsageService

pytestmark = pytest.mark.anyio

NOON: float = 1796558400.0  # 2026-12-06 12:00 UTC
DAY, MONTH = "2026-12-06", "2026-12"


def report(day: str = DAY, **principals: tuple[int, float, float]) -> SpendReport:
    return SpendReport(
        day, day[:7], {name: ReportedSpend(*spent) for name, spent in principals.items()}
    )


def record(node: str = "b", spend: SpendReport | None = None) -> NodeRecord:
    return NodeRecord(
        node=node,
        host="h",
        pid=7,
        started_at=NOON - 60,
        heartbeat_at=NOON,
        heartbeat=2.0,
        load=NodeLoad(live=1, max_live=4),
        principals=["alice", "bob"],
        spend=spend,
    )


# -- the report in the heartbeat record -------------------------------------------------


def test_a_record_carries_its_spend_and_status_never_shows_it() -> None:
    spent = report(alice=(1200, 0.5, 3.0))
    data = record(spend=spent).encode()
    table = NodeTable(lost_after=6.0)
    taken = table.observe("b", data)
    assert taken is not None
    assert taken.spend == spent
    (view,) = table.verdicts(NOON)
    assert view.spend == spent
    assert "spend" not in view.to_builtins()
    assert "alice" in view.to_builtins()["principals"]


@pytest.mark.parametrize(
    ("spend", "why"),
    [
        ({"day": DAY, "month": "2026-11", "principals": {}}, "is not of month"),
        ({"day": "6 Dec", "month": MONTH, "principals": {}}, "day"),
        ({"day": DAY, "month": MONTH, "principals": {"a b": {}}}, "principals"),
        ({"day": DAY, "month": MONTH, "principals": {"alice": {"tokens_day": -1}}}, ">= 0"),
        ({"day": DAY, "month": MONTH, "principals": {"alice": {"usd_month": 1e13}}}, "<= "),
        ({"day": DAY, "month": MONTH, "principals": {"alice": {"usd_day": 2.0}}}, "usd_day"),
        ({"day": DAY, "month": MONTH, "principals": {"alice": {"usd_day": "1"}}}, "float"),
    ],
)
def test_a_spend_out_of_bounds_is_left_out_and_the_rest_of_the_record_kept(
    spend: dict[str, Any], why: str
) -> None:
    raw = msgspec.to_builtins(record())
    raw["spend"] = spend
    data = msgspec.json.encode(raw)
    table = NodeTable(lost_after=6.0)
    taken = table.observe("b", data)
    assert taken is not None
    assert taken.spend is None
    assert taken.load == NodeLoad(live=1, max_live=4)  # placement still reads the load
    assert taken.principals == ["alice", "bob"]
    assert why in table.unknown_load["b"]


def test_too_many_principals_in_a_report_are_refused() -> None:
    many: dict[str, dict[str, int]] = {f"p{i}": {} for i in range(MAX_SPEND_PRINCIPALS + 1)}
    raw = {
        **msgspec.to_builtins(record()),
        "spend": {"day": DAY, "month": MONTH, "principals": many},
    }
    assert decode_record("b", msgspec.json.encode(raw)).spend is None


# -- what of another node's report counts here --------------------------------------------


def test_another_nodes_spend_counts_this_nodes_own_never() -> None:
    found = counted(
        "a",
        [
            Reported("a", ["alice"], NOON, report(alice=(9, 9.0, 9.0))),
            Reported("b", ["alice"], NOON - 3, report(alice=(100, 0.25, 1.0))),
            Reported("c", ["alice"], NOON, None),  # an older node: nothing to count
        ],
        {},
    )
    assert set(found.elsewhere) == {"b"}
    spent = found.elsewhere["b"]
    assert (spent.day, spent.month, spent.at) == (DAY, MONTH, NOON - 3)
    assert spent.principals == {"alice": Spend(100, 0.25, 1.0)}
    assert found.left_out == {}


def test_a_node_cannot_spend_the_budget_of_a_principal_it_does_not_serve() -> None:
    """d declares bob only: its word on alice's spend is left out and named; a pin
    ([fleet.peers.e] principals) bounds what e's own record declares."""
    found = counted(
        "a",
        [
            Reported("d", ["bob"], NOON, report(alice=(10**9, 1e6, 1e6), bob=(5, 0.0, 0.0))),
            Reported("e", ["alice", "bob"], NOON, report(alice=(7, 0.0, 0.0), bob=(3, 0, 0))),
            Reported("f", None, NOON, report(alice=(1, 0.0, 0.0))),  # no declared principals
        ],
        {"e": FleetPeerConfig(principals=["bob"])},
    )
    assert found.elsewhere["d"].principals == {"bob": Spend(5, 0.0, 0.0)}
    assert found.elsewhere["e"].principals == {"bob": Spend(3, 0.0, 0.0)}
    assert found.elsewhere["f"].principals == {}
    assert found.left_out == {
        "d": "reports spend of principals it may not vouch for: alice",
        "e": "reports spend of principals it may not vouch for: alice",
        "f": "reports spend of principals it may not vouch for: alice",
    }


# -- budgets that count it ----------------------------------------------------------------


def config(budget: str) -> Config:
    return decode_config(
        '[fleet]\nurl = "nats://127.0.0.1:4222"\nnode = "a"\ninsecure_no_auth = true\n'
        f'[[principals]]\nname = "alice"\nuids = [1000]\n{budget}\n'
    )


@contextlib.asynccontextmanager
async def service(tmp_path: Path, budget: str) -> AsyncIterator[UsageService]:
    """A usage service over a real ledger file, at noon on 6 December (no bus: nothing
    here crosses 80 % of a budget, so nothing is published)."""
    async with Ledger.open(tmp_path / "usage.db") as ledger:
        usage = UsageService(
            cast(Any, None), Identity("supervisor"), lambda: config(budget), ledger
        )
        usage.clock = lambda: NOON
        await usage.load()
        yield usage


async def test_a_budget_counts_what_the_other_nodes_report(tmp_path: Path) -> None:
    """alice's 1,000 tokens a day: 400 here and 700 on b reach it; b's report of the day
    before counts towards the month only, and one of last month not at all."""
    budgets = "budget_tokens_per_day = 1000\nbudget_usd_per_month = 5"
    async with service(tmp_path, budgets) as usage:
        usage.record(Entry(DAY, "alice", "s1", "a", "m", "call", calls=1, input=400, usd=1.0))
        assert usage.over("alice") is None
        found = counted(
            "a", [Reported("b", ["alice"], NOON - 2, report(alice=(700, 1.0, 2.0)))], {}
        )
        usage.elsewhere = found.elsewhere
        assert usage.total("alice") == Spend(1100, 2.0, 3.0)
        over = usage.over("alice")
        assert over is not None
        assert over.kind is BudgetKind.TOKENS_PER_DAY
        row = usage.budget_row("alice")
        assert row.spend["tokens_day"] == 1100
        assert row.reported_age_s == 2.0

        yesterday = report("2026-12-05", alice=(700, 1.0, 4.5))
        usage.elsewhere = counted("a", [Reported("b", ["alice"], NOON, yesterday)], {}).elsewhere
        assert usage.total("alice") == Spend(400, 1.0, 5.5)
        over = usage.over("alice")
        assert over is not None
        assert over.kind is BudgetKind.USD_PER_MONTH

        november = report("2026-11-30", alice=(700, 1.0, 4.5))
        usage.elsewhere = counted("a", [Reported("b", ["alice"], NOON, november)], {}).elsewhere
        assert usage.total("alice") == Spend(400, 1.0, 1.0)


async def test_this_nodes_report_is_its_own_spend_bounded(tmp_path: Path) -> None:
    async with service(tmp_path, "") as usage:
        usage.record(Entry(DAY, "alice", "s1", "a", "m", "call", calls=1, input=40, usd=0.5))
        assert usage.spend_report() == report(alice=(40, 0.5, 0.5))
        usage.spend = {f"p{i}": Spend(1, 0.0, float(i)) for i in range(MAX_SPEND_PRINCIPALS + 5)}
        bounded = usage.spend_report()
        assert len(bounded.principals) == MAX_SPEND_PRINCIPALS
        assert "p0" not in bounded.principals  # the smallest spenders are left out
        assert f"p{MAX_SPEND_PRINCIPALS + 4}" in bounded.principals
        msgspec.json.decode(msgspec.json.encode(bounded), type=SpendReport)  # others take it
