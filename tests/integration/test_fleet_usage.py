"""A fleet's usage report: three supervisors over a real 3-server NATS cluster, the CLI
double (which reports a model call's usage and the turn's cost), and a rogue NATS user.

Turns on a and b; ``astrid sage usage --fleet`` on a shows both nodes' rows (a principal
only its own, an admin every principal's where the node takes a's admins), a node that
refuses or is killed is named in the warning, and a node that answers what it was not
asked (another principal's rows, too many rows) is named and none of its rows count.
A budget on one node counts what the principal spent on the others (their heartbeat
records), and a node's report of a principal it does not serve is not counted.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any, cast

import anyio
import msgspec
import pytest

from sage.contract.usage import MAX_NODE_ROWS, USAGE_VERB, ReportedSpend, SpendReport
from sage.fleet.nodes import NodeRecord
from sage.fleet.permissions import BUCKET
from sage.fleet.routes import decode_forwarded
from tests.support import FAKE_CLAUDE
from tests.support.daemon import ASTRID, Daemon, all_running, node_root
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, wait_for

NODES = ["a", "b", "c"]
ALICE_UID, BOB_UID = 65533, 65534
Fleet = tuple[NatsCluster, dict[str, Daemon]]

EXTRA = {"b": "[fleet.peers.a]\nadmins = true\n"}
"""b takes a's admins as its own; c does not (an admin's fleet report on a names c)."""


def node_config(cluster: NatsCluster, node: str) -> str:
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        '[limits]\nstop_grace = 2.0\n[socket]\ngroup = "nogroup"\n'
        + cluster.fleet_section(node, heartbeat=0.5)
        + f'[[principals]]\nname = "alice"\nuids = [{ALICE_UID}]\noperator_key = true\n'
        + f'[[principals]]\nname = "bob"\nuids = [{BOB_UID}]\noperator_key = true\n'
        + EXTRA.get(node, "")
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    # "d" is a NATS user of the cluster with no supervisor: the rogue node
    with NatsCluster([*NODES, "d"]) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-double"}
        with all_running(
            {node: Daemon(node_root(), node_config(cluster, node), env=env) for node in NODES}
        ) as daemons:
            yield cluster, daemons


def run(daemon: Daemon, *args: str, principal: str | None = "alice") -> Any:
    who = ["--principal", principal] if principal is not None else []
    return daemon.astrid(*args, *who, timeout=40.0)


def ok_json(daemon: Daemon, *args: str, principal: str | None = "alice") -> Any:
    result = run(daemon, *args, "--json", principal=principal)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return json.loads(result.stdout)


def turn(daemon: Daemon, sid: str, principal: str) -> None:
    ok_json(daemon, "sage", "spawn", principal, "--session", sid, principal=principal)
    sent = run(daemon, "sage", "send", sid, "hello", principal=principal)
    assert sent.returncode == 0, sent.stderr


def by_node(report: dict[str, Any]) -> dict[tuple[str, str], int]:
    """``(node, principal)`` -> tokens, over the report's rows."""
    out: dict[tuple[str, str], int] = {}
    for row in report["rows"]:
        key = (row["node"], row["principal"])
        out[key] = out.get(key, 0) + row["tokens"]
    return out


def test_a_fleet_report_lists_each_nodes_rows_and_sums_them(fleet: Fleet) -> None:
    """alice's turns on a and b, bob's on b: on a, alice's fleet report has both nodes'
    rows and only hers; bob's on b only his; an admin's on a every principal's of a and b
    (b takes a's admins), and c, which does not, is named as refusing."""
    _, daemons = fleet
    a, b = daemons["a"], daemons["b"]
    turn(a, "u1", "alice")
    turn(b, "u2", "alice")
    turn(b, "u3", "bob")

    alone = ok_json(a, "sage", "usage")  # a's own ledger, as before
    assert {row["principal"] for row in alone["rows"]} == {"alice"}
    assert "totals" not in alone or not alone["totals"]

    mine = ok_json(a, "sage", "usage", "--fleet")
    tokens = by_node(mine)
    assert set(tokens) == {("a", "alice"), ("b", "alice")}, mine
    assert all(n > 0 for n in tokens.values()), tokens
    assert mine["warning"] is None, mine["warning"]
    assert mine["node"] == "a"
    assert [row["principal"] for row in mine["totals"]] == ["alice"] * len(mine["totals"])
    assert sum(r["tokens"] for r in mine["totals"]) == sum(tokens.values())
    assert {row["node"] for row in mine["totals"]} == {""}
    # a's own report of the same rows: the fleet's a-rows are exactly it
    assert sum(r["tokens"] for r in alone["rows"]) == tokens[("a", "alice")]

    his = ok_json(b, "sage", "usage", "--fleet", "--by", "principal", principal="bob")
    assert set(by_node(his)) == {("b", "bob")}, his
    assert [(r["key"], r["node"]) for r in his["rows"]] == [("bob", "b")]
    assert [r["principal_id"] for r in his["budgets"]] == ["bob"]

    admin = ok_json(a, "sage", "usage", "--fleet", "--by", "principal", principal=None)
    assert set(by_node(admin)) == {("a", "alice"), ("b", "alice"), ("b", "bob")}, admin
    totals = {r["key"]: r["tokens"] for r in admin["totals"]}
    assert totals["alice"] == tokens[("a", "alice")] + tokens[("b", "alice")]
    assert admin["warning"].startswith("rows missing from this report: node 'c' refused:")
    assert "principal_not_authenticated" in admin["warning"]

    table = run(a, "sage", "usage", "--fleet", "--by", "principal")
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:3] == ["PRINCIPAL", "PRINCIPAL", "NODE"]
    assert [line.split()[2] for line in lines] == ["a", "b", "(fleet)"], table.stdout


def test_the_client_reads_a_fleet_report_typed(fleet: Fleet) -> None:
    """``sage.client``'s ``usage(fleet=True)``: the same rows and totals, typed."""
    from sage.client import UsageReport, connect

    _, daemons = fleet

    async def main() -> UsageReport:
        async with connect(daemons["a"].config, principal="alice") as sage:
            return await sage.usage(fleet=True, by="principal")

    report = anyio.run(main)
    assert isinstance(report, UsageReport)
    assert [(r.key, r.node) for r in report.rows] == [("alice", "a"), ("alice", "b")]
    (total,) = report.totals
    assert (total.key, total.node) == ("alice", "")
    assert total.tokens == sum(r.tokens for r in report.rows)
    assert report.warning is None


def rogue_answers(cluster: Fleet, answer: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """As the NATS user d: beat as a live node declaring alice and bob, answer every ask
    on d's own request prefix with ``answer``, and ask a for alice's fleet report
    meanwhile; that report, and what d was asked."""
    nats_cluster, daemons = cluster
    asked: list[Any] = []
    argv = ["sage", "usage", "--fleet", "--json", "--principal", "alice"]

    async def main() -> dict[str, Any]:
        async with nats_cluster.client("d") as d:
            kv = await d.jetstream(timeout=JS_TIMEOUT).key_value(BUCKET)

            def record(*, stopped: bool = False) -> bytes:
                return NodeRecord(
                    node="d",
                    host="rogue",
                    pid=4242,
                    started_at=time.time() - 60,
                    heartbeat_at=time.time(),
                    heartbeat=0.5,
                    stopped=stopped,
                    principals=["alice", "bob"],
                ).encode()

            async def beat() -> None:
                while True:
                    await kv.put("d", record())
                    await anyio.sleep(0.3)

            async def take(msg: Any) -> None:
                asked.append((msg.subject, decode_forwarded(msg.data)))
                await msg.respond(msgspec.json.encode(answer))

            await d.subscribe("sage.fleet.d.request.>", cb=take)
            async with anyio.create_task_group() as tg:
                tg.start_soon(beat)
                await anyio.sleep(1.0)  # a sees d live
                result = await anyio.run_process(
                    [*ASTRID, *argv, "--config", str(daemons["a"].config)],
                    check=False,
                    env=daemons["a"].env,
                )
                tg.cancel_scope.cancel()
            # d leaves: its last word, so the next tests do not see it lost
            await kv.put("d", record(stopped=True))
        assert result.returncode == 0, result.stderr
        report: dict[str, Any] = json.loads(result.stdout)
        return report

    return anyio.run(main), asked


def stolen_row(principal: str, key: str) -> dict[str, Any]:
    return {
        "key": key,
        "principal": principal,
        "calls": 1,
        "input_tokens": 1_000_000,
        "output_tokens": 0,
        "cache_read_tokens": 0,
        "cache_write_tokens": 0,
        "tokens": 1_000_000,
        "est_usd": 3.0,
        "cli_usd": 0.0,
        "usd": 3.0,
    }


def test_a_node_answering_another_principals_rows_is_named_and_not_counted(
    fleet: Fleet,
) -> None:
    """d answers alice's ask with her row and bob's: none of d's rows are in alice's
    report, d is named, bob's name is not shown to alice; a and b's rows stay."""
    day = time.strftime("%Y-%m-%d", time.gmtime())
    answer = {"ok": True, "rows": [stolen_row("alice", day), stolen_row("bob", day)]}
    report, asked = rogue_answers(fleet, answer)
    subject, forwarded = asked[0]
    assert subject == f"sage.fleet.d.request.a.{USAGE_VERB}"
    assert forwarded.principal == "alice"  # the caller's, as a's bus established it
    assert {row["node"] for row in report["rows"]} == {"a", "b"}
    assert {row["principal"] for row in report["rows"] + report["totals"]} == {"alice"}
    assert "node 'd' answered rows of principals other than 'alice'" in report["warning"]
    assert "bob" not in report["warning"]


def test_a_node_answering_too_many_rows_is_named_and_not_counted(fleet: Fleet) -> None:
    rows = [stolen_row("alice", f"2099-01-{i % 28 + 1:02d}") for i in range(MAX_NODE_ROWS + 1)]
    report, _ = rogue_answers(fleet, {"ok": True, "rows": rows})
    assert {row["node"] for row in report["rows"]} == {"a", "b"}
    assert f"node 'd' answered {MAX_NODE_ROWS + 1} rows, more than the" in report["warning"]
    assert max(row["tokens"] for row in report["totals"]) < 1_000_000


def budget_row(daemon: Daemon, principal: str) -> dict[str, Any]:
    (row,) = ok_json(daemon, "sage", "usage", principal=principal)["budgets"]
    assert row["principal_id"] == principal
    return cast(dict[str, Any], row)


def fleet_tokens(daemon: Daemon, principal: str) -> int:
    """What ``principal`` spent this month on every node, as its fleet report sums it."""
    report = ok_json(daemon, "sage", "usage", "--fleet", "--by", "principal", principal=principal)
    return sum(row["tokens"] for row in report["totals"])


def plant_spend(cluster: NatsCluster, spend: SpendReport, principals: list[str]) -> None:
    """As the NATS user d (no supervisor): d's last record, stopped, declaring
    ``principals`` and reporting ``spend``."""

    async def main() -> None:
        async with cluster.client("d") as d:
            kv = await d.jetstream(timeout=JS_TIMEOUT).key_value(BUCKET)
            now = time.time()
            record = NodeRecord(
                node="d",
                host="rogue",
                pid=4242,
                started_at=now - 60,
                heartbeat_at=now,
                heartbeat=0.5,
                stopped=True,
                principals=principals,
                spend=spend,
            )
            await kv.put("d", record.encode())

    anyio.run(main)


def test_a_budget_counts_the_spend_of_every_node(fleet: Fleet) -> None:
    """alice spends on a; b counts it against her budget within a few heartbeats, and an
    admin's daily token budget on b above her spend on b but under her spend across the
    fleet refuses her next spawn there budget_exceeded, naming the fleet's figure.  d,
    which declares only bob, reporting a billion tokens of alice's, moves neither: its
    report of bob's spend is counted, of alice's not."""
    cluster, daemons = fleet
    a, b = daemons["a"], daemons["b"]
    turn(a, "budget-a", "alice")
    spent = fleet_tokens(b, "alice")
    row = wait_for(
        lambda: (r := budget_row(b, "alice"))["spend"]["tokens_day"] == spent and r,
        10.0,
        "b counting alice's spend on a",
    )
    assert row["reported_age_s"] is not None
    assert row["reported_age_s"] < 5.0
    own = sum(r["tokens"] for r in ok_json(b, "sage", "usage", "--by", "principal")["rows"])
    assert 0 < own < spent  # b spent some of it, a the rest

    set_budget = run(
        b, "sage", "settings", "alice", "--budget-tokens-per-day", str(own + 1), principal=None
    )
    assert set_budget.returncode == 0, set_budget.stderr
    try:
        refused = run(b, "sage", "spawn", "alice", "--session", "budget-b")
        assert refused.returncode != 0
        assert "budget_exceeded" in refused.stderr, refused.stderr
        assert f"{spent:,} tokens" in refused.stderr, refused.stderr

        bob = budget_row(b, "bob")["spend"]["tokens_day"]
        day = time.strftime("%Y-%m-%d", time.gmtime())
        planted = SpendReport(
            day,
            day[:7],
            {"alice": ReportedSpend(10**9, 0.0, 0.0), "bob": ReportedSpend(1, 0.0, 0.0)},
        )
        plant_spend(cluster, planted, ["bob"])
        wait_for(
            lambda: budget_row(b, "bob")["spend"]["tokens_day"] == bob + 1,
            10.0,
            "b counting d's report of bob's spend",
        )
        assert budget_row(b, "alice")["spend"]["tokens_day"] == spent
    finally:
        reset = run(b, "sage", "settings", "alice", "--budget-reset", principal=None)
        assert reset.returncode == 0, reset.stderr
    sent = run(b, "sage", "spawn", "alice", "--session", "budget-b")
    assert sent.returncode == 0, sent.stderr  # the config's budgets (none) again


def test_a_killed_node_is_named_and_the_others_rows_stay(fleet: Fleet) -> None:
    """SIGKILL c (whose ledger has alice's turn): alice's fleet report on a names c
    (no responders while it still looks live, lost after) and keeps a's and b's rows."""
    _, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    turn(c, "u4", "alice")
    wait_for(
        lambda: ("c", "alice") in by_node(ok_json(a, "sage", "usage", "--fleet")),
        10.0,
        "c's rows in a's fleet report",
    )
    c.signal(signal.SIGKILL)
    assert c.proc is not None
    c.proc.wait()
    report = ok_json(a, "sage", "usage", "--fleet")
    assert set(by_node(report)) == {("a", "alice"), ("b", "alice")}, report
    warning = report["warning"]
    assert "node 'c' " in warning, warning
    assert "no responders" in warning or "is lost" in warning, warning
