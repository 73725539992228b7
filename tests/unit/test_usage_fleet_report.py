"""A fleet's usage report without I/O: taking a node's answer (sage/usage/fleet_report.py),
the report's rows and totals, the asking node's scoping (sage/fleet/usage.py with a
stand-in node table and stand-in nodes) and the usage service's ``fleet`` request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import msgspec
import pytest

from bus import Envelope, Identity
from sage.contract.codes import ErrorCode
from sage.contract.usage import (
    MAX_NODE_ROWS,
    REPORT_TOPIC,
    USAGE_VERB,
    BudgetRow,
    NodeRowsRequest,
    ReportRequest,
    ReportRow,
    UsageReport,
)
from sage.errors import SageError, StateError
from sage.fleet.member import FleetMember
from sage.fleet.nodes import NodeState, NodeView
from sage.fleet.routes import request_subject
from sage.fleet.usage import USAGE_DEADLINE, FleetUsage
from sage.usage.fleet_report import fleet_report, taken, warning_of
from sage.usage.service import UsageService

pytestmark = pytest.mark.anyio

SINCE = "2026-12-01"


def row(key: str, principal: str = "alice", tokens: int = 10, usd: float = 0.5) -> ReportRow:
    return ReportRow(
        key=key,
        principal=principal,
        calls=1,
        input_tokens=tokens,
        output_tokens=0,
        cache_read_tokens=0,
        cache_write_tokens=0,
        tokens=tokens,
        est_usd=usd,
        cli_usd=0.0,
        usd=usd,
    )


def answer(*rows: ReportRow) -> dict[str, Any]:
    return {"ok": True, "rows": [msgspec.to_builtins(r) for r in rows]}


# -- the merge ---------------------------------------------------------------------------


def test_rows_are_listed_per_node_and_totals_summed_across_nodes() -> None:
    """Each row keeps the node whose ledger it is (the asker's word, not the answer's);
    the totals add the same day and principal up across the nodes."""
    lying = msgspec.structs.replace(row("2026-12-02", tokens=5), node="a")  # b says "a"
    report = fleet_report(
        "a",
        [row("2026-12-02", tokens=10), row("2026-12-03", "bob", tokens=1)],
        {"b": [lying]},
        {},
        since=SINCE,
        by="day",
        budgets=[],
    )
    assert [(r.key, r.principal, r.node, r.tokens) for r in report.rows] == [
        ("2026-12-02", "alice", "a", 10),
        ("2026-12-02", "alice", "b", 5),
        ("2026-12-03", "bob", "a", 1),
    ]
    assert [(r.key, r.principal, r.node, r.tokens, r.usd) for r in report.totals] == [
        ("2026-12-02", "alice", "", 15, 1.0),
        ("2026-12-03", "bob", "", 1, 0.5),
    ]
    assert report.warning is None
    assert (report.node, report.since, report.by) == ("a", SINCE, "day")


def test_by_principal_each_principal_once_per_node_and_once_in_totals() -> None:
    report = fleet_report(
        "a",
        [row("alice"), row("bob", "bob")],
        {"b": [row("alice", tokens=7)], "c": [row("alice", tokens=3)]},
        {},
        since=SINCE,
        by="principal",
        budgets=[],
    )
    assert [(r.key, r.node) for r in report.rows] == [
        ("alice", "a"),
        ("alice", "b"),
        ("alice", "c"),
        ("bob", "a"),
    ]
    assert [(r.key, r.tokens) for r in report.totals] == [("alice", 20), ("bob", 10)]


def test_the_warning_names_each_missing_node_and_why() -> None:
    assert warning_of({}) is None
    text = warning_of({"c": "is lost: not asked", "b": "did not answer"}, "x")
    assert text == (
        "rows missing from this report: x; node 'b' did not answer; node 'c' is lost: not asked"
    )
    report = fleet_report("a", [], {}, {"b": "gone"}, since=SINCE, by="day", budgets=[])
    assert report.warning == "rows missing from this report: node 'b' gone"
    assert report.rows == []
    assert report.totals == []


# -- taking a node's answer ----------------------------------------------------------------


def take(reply: Any, principal: str | None = "alice", by: str = "day") -> list[ReportRow] | str:
    return taken(reply, principal=principal, since=SINCE, by=by)  # type: ignore[arg-type]


def test_an_honest_answer_is_taken() -> None:
    assert take(answer(row("2026-12-01"), row("2026-12-05"))) == [
        row("2026-12-01"),
        row("2026-12-05"),
    ]
    assert take(answer()) == []


def test_a_principals_caller_takes_no_row_of_another_principal() -> None:
    """A node that answers alice's ask with bob's rows too: none of its rows count, and
    the warning does not repeat bob's name to alice."""
    why = take(answer(row("2026-12-02"), row("2026-12-02", "bob")))
    assert isinstance(why, str)
    assert "principals other than 'alice'" in why
    assert "bob" not in why
    # an admin's ask takes every principal's
    assert len(take(answer(row("2026-12-02"), row("2026-12-02", "bob")), principal=None)) == 2


def test_a_refusal_or_an_error_is_named_never_guessed() -> None:
    refused = {
        "ok": False,
        "error": ErrorCode.PRINCIPAL_NOT_AUTHENTICATED,
        "message": "node 'a' may not vouch for principal 'alice' here",
    }
    assert take(refused) == (
        "refused: principal_not_authenticated: node 'a' may not vouch for principal 'alice' here"
    )
    gone = {"ok": False, "error": "fleet_unavailable", "message": "x" * 5000}
    why = take(gone)
    assert isinstance(why, str)
    assert why.startswith("answered fleet_unavailable: x")
    assert len(why) < 400  # a node's own words are cut
    assert isinstance(take(["not", "an", "object"]), str)
    assert isinstance(take({"ok": True}), str)  # no rows at all: the contract is broken


def test_a_huge_answer_is_refused_whole() -> None:
    many = answer(*(row(f"s{i}") for i in range(MAX_NODE_ROWS + 1)))
    assert take(many, by="session") == (
        f"answered {MAX_NODE_ROWS + 1} rows, more than the {MAX_NODE_ROWS} taken from one node"
    )
    enough = answer(*(row(f"s{i}") for i in range(MAX_NODE_ROWS)))
    assert len(take(enough, by="session")) == MAX_NODE_ROWS


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tokens", -5),
        ("calls", 10**16),
        ("usd", 1e300),
        ("usd", -0.01),
        ("cli_usd", "1"),
        ("key", "k" * 300),
        ("principal", "a" * 65),
    ],
)
def test_a_figure_out_of_bounds_breaks_the_contract(field: str, value: Any) -> None:
    bad = answer(row("2026-12-02"))
    bad["rows"][0][field] = value
    why = take(bad)
    assert isinstance(why, str)
    assert why.startswith("broke the usage contract"), why


def test_rows_that_are_not_of_the_report_are_not_taken() -> None:
    assert isinstance(take(answer(row("2026-11-30"))), str)  # before since
    assert isinstance(take(answer(row("not-a-day"))), str)
    assert isinstance(take(answer(row("bob")), by="principal"), str)  # key is not its principal
    assert take(answer(row("alice")), by="principal") == [row("alice")]
    assert isinstance(take(answer(row("2026-12-02"), row("2026-12-02"))), str)  # twice
    assert isinstance(take(answer(row("2026-12-02", "a.b"))), str)  # no principal's name


def test_a_node_cannot_be_asked_for_another_principal_in_the_payload() -> None:
    """The principal is the forwarded request's (vouched), never a field of the ask."""
    with pytest.raises(msgspec.ValidationError, match="principal_id"):
        msgspec.json.decode(b'{"since": "2026-12-01", "principal_id": "bob"}', type=NodeRowsRequest)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"since": "2026-12-01; DROP"}', type=NodeRowsRequest)


def test_the_usage_verb_is_a_node_request_under_the_forwarding_prefix() -> None:
    """No new subject to permit: ``sage.fleet.<node>.request.<origin>.usage``."""
    assert request_subject("b", "a", USAGE_VERB) == "sage.fleet.b.request.a.usage"


# -- the asking node's side, with stand-ins ------------------------------------------------


class StandInMember:
    node = "a"
    connected = True

    def __init__(self, states: dict[str, NodeState]) -> None:
        self.states = states

    async def nodes(self) -> list[NodeView]:
        return [
            NodeView(
                node=node,
                state=state,
                host="h",
                pid=1,
                started_at=0.0,
                heartbeat_at=0.0,
                age_s=0.0,
            )
            for node, state in self.states.items()
        ]


class StandInLedger:
    """The usage service's side a fleet report uses: rows scoped by principal."""

    def __init__(self, rows: list[ReportRow]) -> None:
        self.rows = rows
        self.asked: list[ReportRequest] = []
        self.fails = False

    async def local_rows(self, req: ReportRequest) -> list[ReportRow]:
        self.asked.append(req)
        if self.fails:
            raise StateError("usage ledger: disk I/O error")
        return [r for r in self.rows if req.principal_id in (None, r.principal)]

    def budget_rows(self, principal: str | None) -> list[BudgetRow]:
        return []


Asker = Callable[[str, str | None, NodeRowsRequest], dict[str, Any]]


def fleet_usage(
    states: dict[str, NodeState], ledger: StandInLedger, nodes: dict[str, Asker]
) -> tuple[FleetUsage, list[tuple[str, str | None, float | None]]]:
    asked: list[tuple[str, str | None, float | None]] = []

    async def ask(
        node: str,
        verb: str,
        sid: str | None,
        principal: str | None,
        payload: bytes,
        *,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        assert (verb, sid) == (USAGE_VERB, None)
        asked.append((node, principal, deadline))
        return nodes[node](node, principal, msgspec.json.decode(payload, type=NodeRowsRequest))

    member = cast(FleetMember, StandInMember({"a": NodeState.LIVE, **states}))
    return FleetUsage(member, cast(UsageService, ledger), ask), asked


def honest(rows: list[ReportRow]) -> Asker:
    def node(name: str, principal: str | None, req: NodeRowsRequest) -> dict[str, Any]:
        return answer(*(r for r in rows if principal in (None, r.principal)))

    return node


async def test_a_principals_fleet_report_asks_every_live_node_for_its_own_rows() -> None:
    """alice's report: every live node is asked for alice (the vouched principal), with
    the since and grouping asked; a lost node is named, not asked; a node that answers
    bob's rows too is named and none of its rows count."""
    mine = StandInLedger([row("2026-12-02", tokens=1), row("2026-12-02", "bob", tokens=2)])

    def hostile(name: str, principal: str | None, req: NodeRowsRequest) -> dict[str, Any]:
        return answer(row("2026-12-02", tokens=1000), row("2026-12-02", "bob", tokens=1000))

    usage, asked = fleet_usage(
        {"b": NodeState.LIVE, "c": NodeState.LOST, "d": NodeState.LIVE},
        mine,
        {"b": honest([row("2026-12-03", tokens=4), row("2026-12-03", "bob")]), "d": hostile},
    )
    reply = await usage.report(
        ReportRequest(principal_id="alice", since=SINCE, by="day", fleet=True), "alice"
    )
    assert reply["ok"] is True
    report = msgspec.convert(reply, UsageReport)
    assert sorted(asked) == [("b", "alice", USAGE_DEADLINE), ("d", "alice", USAGE_DEADLINE)]
    assert [(r.key, r.principal, r.node, r.tokens) for r in report.rows] == [
        ("2026-12-02", "alice", "a", 1),
        ("2026-12-03", "alice", "b", 4),
    ]
    assert {r.principal for r in report.totals} == {"alice"}
    assert report.warning is not None
    assert "node 'c' is lost: not asked" in report.warning
    assert "node 'd' answered rows of principals other than 'alice'" in report.warning
    assert "bob" not in report.warning
    assert "'b'" not in report.warning


async def test_an_admins_fleet_report_and_a_node_that_refuses_it() -> None:
    mine = StandInLedger([row("alice"), row("bob", "bob")])

    def refuses(name: str, principal: str | None, req: NodeRowsRequest) -> dict[str, Any]:
        assert principal is None
        return {
            "ok": False,
            "error": ErrorCode.PRINCIPAL_NOT_AUTHENTICATED,
            "message": "node 'a' forwarded an admin's request",
        }

    usage, asked = fleet_usage(
        {"b": NodeState.LIVE, "c": NodeState.LIVE},
        mine,
        {"b": honest([row("bob", "bob", tokens=5)]), "c": refuses},
    )
    reply = await usage.report(ReportRequest(since=SINCE, by="principal", fleet=True), None)
    assert sorted(asked) == [("b", None, USAGE_DEADLINE), ("c", None, USAGE_DEADLINE)]
    report = msgspec.convert(reply, UsageReport)
    assert [(r.key, r.node, r.tokens) for r in report.rows] == [
        ("alice", "a", 10),
        ("bob", "a", 10),
        ("bob", "b", 5),
    ]
    assert [(r.key, r.tokens) for r in report.totals] == [("alice", 10), ("bob", 15)]
    assert report.warning == (
        "rows missing from this report: node 'c' refused: principal_not_authenticated:"
        " node 'a' forwarded an admin's request"
    )


async def test_answering_another_node_scopes_to_the_forwarded_principal_and_bounds() -> None:
    ledger = StandInLedger([row("2026-12-02"), row("2026-12-02", "bob")])
    usage, _ = fleet_usage({}, ledger, {})
    reply = await usage.answer(b'{"since": "2026-12-01", "by": "day"}', "alice")
    assert reply == answer(row("2026-12-02"))
    assert ledger.asked[-1] == ReportRequest(principal_id="alice", since=SINCE, by="day")
    refused = await usage.answer(b'{"since": "2026-12-01", "principal_id": "bob"}', "alice")
    assert refused["error"] == ErrorCode.BAD_REQUEST
    ledger.fails = True  # the ledger fails: answered, not raised into the router
    failed = await usage.answer(b'{"since": "2026-12-01"}', None)
    assert failed["error"] == ErrorCode.INTERNAL_ERROR
    ledger.fails = False
    ledger.rows = [row(f"s{i}") for i in range(MAX_NODE_ROWS + 1)]
    big = await usage.answer(b'{"since": "2026-12-01", "by": "session"}', "alice")
    assert big["error"] == ErrorCode.PAYLOAD_TOO_LARGE
    assert f"more than the {MAX_NODE_ROWS}" in big["message"]


# -- the usage service's fleet request -------------------------------------------------------


class NoBus:
    def reply(self, *args: Any) -> None:
        raise AssertionError("not answered through the bus here")


def service() -> tuple[UsageService, list[tuple[ReportRequest, str | None]]]:
    from sage.config import Config

    usage = UsageService(
        cast(Any, NoBus()), Identity("supervisor"), lambda: cast(Config, None), cast(Any, None)
    )
    usage._period = None
    usage.clock = lambda: 1796212800.0  # 2026-12-02
    seen: list[tuple[ReportRequest, str | None]] = []

    async def fleet(req: ReportRequest, principal: str | None) -> dict[str, Any]:
        seen.append((req, principal))
        return {"ok": True}

    usage.fleet_report = fleet
    return usage, seen


def envelope(payload: dict[str, Any], principal: str | None) -> Envelope:
    return Envelope(1, REPORT_TOPIC, msgspec.json.encode(payload), "cli", principal)


async def test_a_fleet_request_is_scoped_to_the_callers_principal() -> None:
    usage, seen = service()
    await usage._report(envelope({"fleet": True, "by": "model"}, "alice"))
    assert seen[-1] == (
        ReportRequest(principal_id="alice", since="2026-12-01", by="model", fleet=True),
        "alice",
    )
    with pytest.raises(SageError) as refused:
        await usage._report(envelope({"fleet": True, "principal_id": "bob"}, "alice"))
    assert refused.value.code == ErrorCode.NOT_AUTHORIZED
    await usage._report(envelope({"fleet": True, "principal_id": "bob"}, None))  # an admin
    req, principal = seen[-1]
    assert (req.principal_id, principal) == ("bob", "bob")
    usage.fleet_report = None
    with pytest.raises(SageError) as alone:
        await usage._report(envelope({"fleet": True}, None))
    assert alone.value.code == ErrorCode.NOT_IN_FLEET
