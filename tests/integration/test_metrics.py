"""``GET /metrics`` of a running supervisor, read with prometheus_client's own parser."""

from __future__ import annotations

import socket

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio

EXPECTED = {
    "sage_sessions": ("gauge", {"state"}),
    "sage_session_starts": ("counter", {"reason"}),
    "sage_turns": ("counter", {"reason"}),
    "sage_turn_duration_seconds": ("histogram", set()),
    "sage_tool_calls": ("counter", {"tool", "result"}),
    "sage_approvals_pending": ("gauge", set()),
    "sage_approvals_decided": ("counter", {"decision", "source"}),
    "sage_approval_decision_seconds": ("histogram", set()),
    "sage_tokens": ("counter", {"principal", "model", "kind"}),
    "sage_cost_usd": ("counter", {"principal", "model"}),
    "sage_budget_limit": ("gauge", {"principal", "budget"}),
    "sage_budget_spent": ("gauge", {"principal", "budget"}),
    "sage_budget_remaining": ("gauge", {"principal", "budget"}),
    "sage_budget_refusals": ("counter", set()),
    "sage_budget_interrupts": ("counter", set()),
    "sage_bus_messages": ("counter", set()),
    "sage_bus_dropped": ("counter", set()),
    "sage_audit_appends": ("counter", set()),
    "sage_capsules": ("gauge", {"state"}),
    "sage_forge_calls": ("counter", {"result"}),
    "sage_forge_breakers_open": ("gauge", set()),
    "sage_fleet_nodes": ("gauge", {"state"}),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _get(port: int, path: str) -> tuple[bytes, str]:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body.decode()


async def test_a_scrape_has_every_family_with_its_type_and_labels() -> None:
    """After a turn, /metrics parses, and each named family has its type, its label
    names (never a session id) and the turn's figures."""
    port = _free_port()
    config = sage_config(
        FAKE_CLAUDE,
        {"FAKE_CLAUDE_MODE": ""},
        extra=f'[metrics]\nlisten = "127.0.0.1:{port}"\n',
        principal_extra="budget_tokens_per_day = 1000000\n",
    )
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-double"}) as sage:
        events = await sage.ready("m1")
        assert (await sage.send("m1", "hello"))["ok"]
        await events.text_until_done()
        head, body = await _get(port, "/metrics")
        missing, _ = await _get(port, "/other")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"text/plain" in head
    assert missing.startswith(b"HTTP/1.1 404")
    families = {f.name: f for f in text_string_to_metric_families(body)}
    for name, (kind, labels) in EXPECTED.items():
        assert name in families, name
        family = families[name]
        assert family.type == kind, name
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)
            assert "m1" not in sample.labels.values()
    turns = {s.labels["reason"]: s.value for s in families["sage_turns"].samples}
    assert turns["completed"] == 1
    starts = {s.labels["reason"]: s.value for s in families["sage_session_starts"].samples}
    assert starts["spawn"] == 1
    assert families["sage_sessions"].samples[0].labels["state"] == "ready"
    tokens = [s for s in families["sage_tokens"].samples if s.name == "sage_tokens_total"]
    assert tokens
    assert {s.labels["principal"] for s in tokens} == {"alice"}
    (left,) = families["sage_budget_remaining"].samples
    assert left.value < 1000000


def test_the_grafana_dashboard_uses_only_metrics_sage_serves() -> None:
    """Every metric a panel of docs/grafana-dashboard.json queries is one /metrics has."""
    import json
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "grafana-dashboard.json"
    dashboard = json.loads(doc.read_text())
    served = set(EXPECTED) | {"sage_bus_delivered"}
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\bsage_[a-z_]+", target["expr"]))
    suffixes = ("_total", "_bucket", "_sum", "_count")
    names = {next((u.removesuffix(s) for s in suffixes if u.endswith(s)), u) for u in used}
    assert names <= served, names - served
    assert {"sage_tokens", "sage_budget_remaining", "sage_turn_duration_seconds"} <= names
