"""What sage does, as Prometheus metrics (the ``prometheus_client`` library).

:class:`Metrics` owns a registry of its own (never the library's global one) with two
kinds of metric:

- **Counted as it happens**, by synchronous taps on the bus (sage/usage/tap.py): the
  session events (starts by reason, turns by end reason and their duration, tool
  calls by tool and result, approvals asked and decided), the forge's audit entries
  (calls, breakers), and every ledger entry (tokens and USD by principal and model).
- **Read when scraped**, by a collector: sessions by state (the runner's
  ``sage.v1.request.slots``, asked just before), budgets (limit, spent, remaining by
  principal), bus messages and drops, audit appends, capsules by state, fleet nodes
  by state.

Every label has a bounded set of values: principals (the config's), models and tools
(the first :data:`MAX_VALUES` seen, the rest ``other``), and enums (reasons, states,
results).  No session id, approval id or request id is ever a label.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bus import Bus, Envelope, Identity
from sage.usage.budget import BudgetKind
from sage.usage.ledger import Entry
from sage.usage.service import UsageService
from sage.usage.tap import Tap

__all__ = ("MAX_VALUES", "BoundedLabel", "Metrics", "Snapshot")

MAX_VALUES: Final = 200
"""Distinct values a free-form label (model, tool) takes before the rest are ``other``."""
TURN_BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
DECISION_BUCKETS: Final = (0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
START_REASONS: Final = {"supervisor_restart": "restart", "failover": "failover"}


class BoundedLabel:
    """The first ``limit`` distinct values pass; any later one is ``other``."""

    def __init__(self, limit: int = MAX_VALUES) -> None:
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self.limit:
            return "other"
        self._seen.add(value)
        return value


@dataclass
class Snapshot:
    """What the collector reads at a scrape (refreshed by the exporter just before)."""

    sessions: dict[str, int] | None = None
    """Sessions by state, from the runner (None: no runner answered)."""
    fleet_nodes: dict[str, int] | None = None


class _Event(msgspec.Struct, frozen=True):
    """The fields of a session event the metrics read (any of them absent)."""

    reason: str = ""
    duration_ms: int | None = None
    name: str = ""
    is_error: bool = False
    approval_id: str = ""
    allowed: bool = False
    source: str = ""
    expires_at: float = 0.0


class _Forge(msgspec.Struct, frozen=True):
    ok: bool = False
    breaker: str = ""
    name: str = ""


_decode_event = msgspec.json.Decoder(_Event).decode
_decode_forge = msgspec.json.Decoder(_Forge).decode


@dataclass
class Metrics:
    """The registry and the taps that feed it; see the module docstring."""

    bus: Bus
    identity: Identity
    usage: UsageService | None = None
    audit_stats: Callable[[], dict[str, Any]] = dict
    capsules: Callable[[], list[dict[str, Any]]] = list
    snapshot: Snapshot = field(default_factory=Snapshot)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _waking: set[str] = field(default_factory=set)
    _spawned: set[str] = field(default_factory=set)
    _asked: dict[str, tuple[float, float]] = field(default_factory=dict)
    _breakers: set[tuple[str, str]] = field(default_factory=set)
    _models: BoundedLabel = field(default_factory=BoundedLabel)
    _tools: BoundedLabel = field(default_factory=BoundedLabel)

    def __post_init__(self) -> None:
        r = self.registry
        self.starts = Counter(
            "sage_session_starts",
            "Sessions started, by reason: spawn, wake, restart (a supervisor start resumed"
            " it), failover (adopted from a lost node)",
            ["reason"],
            registry=r,
        )
        self.turns = Counter(
            "sage_turns",
            "Turns ended, by the reason their done event gives",
            ["reason"],
            registry=r,
        )
        self.turn_seconds = Histogram(
            "sage_turn_duration_seconds",
            "How long a turn took, as the CLI measured it (its result's duration_ms)",
            buckets=TURN_BUCKETS,
            registry=r,
        )
        self.tool_calls = Counter(
            "sage_tool_calls",
            "Tool calls that ended, by tool (as Claude names it) and result",
            ["tool", "result"],
            registry=r,
        )
        self.approvals_pending = Gauge(
            "sage_approvals_pending", "Tool calls waiting for a person's approval", registry=r
        )
        self.approvals = Counter(
            "sage_approvals_decided",
            "Approvals decided, by decision (allowed, denied) and by whom (approver,"
            " allow_rule, no_approver, timeout)",
            ["decision", "source"],
            registry=r,
        )
        self.approval_seconds = Histogram(
            "sage_approval_decision_seconds",
            "From an approval's request to its decision",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "sage_tokens",
            "Tokens of model calls and generations, by principal, model and kind (input,"
            " output, cache_read, cache_write)",
            ["principal", "model", "kind"],
            registry=r,
        )
        self.usd = Counter(
            "sage_cost_usd",
            "US dollars counted against budgets (sage's estimate; the CLI's figure for a"
            " model the price table does not know), by principal and model",
            ["principal", "model"],
            registry=r,
        )
        self.forge_calls = Counter(
            "sage_forge_calls", "Forged tool calls, by result (ok, error)", ["result"], registry=r
        )
        r.register(_ReadAtScrape(self))

    def taps(self) -> list[Tap]:
        """The synchronous subscribers to add to the bus."""
        owner = self.identity
        taps = [
            Tap(f"sage.v1.event.*.{name}", owner, self._on_session_event)
            for name in (
                "spawned",
                "waking",
                "resumed",
                "init",
                "exited",
                "done",
                "tool_result",
                "approval_request",
                "approval",
            )
        ]
        taps += [
            Tap(f"forge.v1.audit.{name}", owner, self._on_forge)
            for name in ("called", "breaker_open", "breaker_closed")
        ]
        if self.usage is not None:
            self.usage.listeners.append(self._on_entry)
        return taps

    # -- counted as it happens -------------------------------------------------------

    def _on_session_event(self, envelope: Envelope) -> None:
        if envelope.source != "capsule:runner":
            return
        parts = envelope.topic.split(".")
        sid, name = parts[3], parts[4]
        data = _decode_event(envelope.payload)
        if name == "waking":
            self._waking.add(sid)
        elif name == "spawned":
            if sid in self._waking:
                self._waking.discard(sid)
                self.starts.labels("wake").inc()
            else:
                self._spawned.add(sid)
        elif name == "resumed":
            if sid in self._spawned:
                self._spawned.discard(sid)
                self.starts.labels(START_REASONS.get(data.reason, "restart")).inc()
        elif name in ("init", "exited"):
            if sid in self._spawned:  # a spawned session that was not resumed: a spawn
                self._spawned.discard(sid)
                self.starts.labels("spawn").inc()
            if name == "exited":
                self._waking.discard(sid)
        elif name == "done":
            self.turns.labels(data.reason or "completed").inc()
            if data.duration_ms is not None:
                self.turn_seconds.observe(data.duration_ms / 1000)
        elif name == "tool_result":
            result = "error" if data.is_error else "ok"
            self.tool_calls.labels(self._tools(data.name or "unknown"), result).inc()
        elif name == "approval_request":
            self._asked[data.approval_id] = (envelope.ts, data.expires_at)
            self.approvals_pending.set(len(self._asked))
        elif name == "approval":
            asked = self._asked.pop(data.approval_id, None)
            decision = "allowed" if data.allowed else "denied"
            self.approvals.labels(decision, data.source or "unknown").inc()
            if asked is not None:
                self.approval_seconds.observe(max(0.0, envelope.ts - asked[0]))
            self.approvals_pending.set(len(self._asked))

    def _on_forge(self, envelope: Envelope) -> None:
        if envelope.source != "capsule:forge":
            return
        name = envelope.topic.rsplit(".", 1)[1]
        data = _decode_forge(envelope.payload)
        if name == "called":
            self.forge_calls.labels("ok" if data.ok else "error").inc()
        elif name == "breaker_open":
            self._breakers.add((data.breaker, data.name))
        else:
            self._breakers.discard((data.breaker, data.name))

    def _on_entry(self, entry: Entry) -> None:
        model = self._models(entry.model or "unknown")
        for kind, count in (
            ("input", entry.input),
            ("output", entry.output),
            ("cache_read", entry.cache_read),
            ("cache_write", entry.cache_write),
        ):
            if count:
                self.tokens.labels(entry.principal, model, kind).inc(count)
        if entry.usd:
            self.usd.labels(entry.principal, model).inc(entry.usd)

    def expire_approvals(self, now: float | None = None) -> None:
        """Forget approvals past their deadline that no decision was seen for (a session
        that ended while one waited)."""
        now = time.time() if now is None else now
        for approval_id, (_, expires_at) in list(self._asked.items()):
            if expires_at and now > expires_at + 5.0:
                del self._asked[approval_id]
        self.approvals_pending.set(len(self._asked))

    async def refresh(self, sessions: Callable[[], Awaitable[dict[str, int] | None]]) -> None:
        """Read what the next scrape shows of other parts (the runner's sessions)."""
        self.snapshot.sessions = await sessions()
        self.expire_approvals()


class _ReadAtScrape(Collector):
    """The metrics read from the other parts when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        m = self.metrics
        stats = m.bus.stats(top=0)
        yield _counter("sage_bus_messages", "Messages published on the bus", stats.published)
        yield _counter("sage_bus_delivered", "Deliveries to subscribers", stats.delivered)
        yield _counter(
            "sage_bus_dropped", "Messages dropped: a subscriber's queue was full", stats.dropped
        )
        audit = m.audit_stats()
        yield _counter(
            "sage_audit_appends",
            "Entries appended to the audit log since the supervisor started",
            float(audit.get("appended", audit.get("entries", 0)) or 0),
        )
        capsules = GaugeMetricFamily("sage_capsules", "Capsules by state", labels=["state"])
        by_state: dict[str, int] = {}
        for row in m.capsules():
            state = str(row.get("state", "unknown"))
            by_state[state] = by_state.get(state, 0) + 1
        for state, count in sorted(by_state.items()):
            capsules.add_metric([state], count)
        yield capsules
        sessions = GaugeMetricFamily(
            "sage_sessions",
            "Sessions by state (as astrid sage sessions lists them)",
            labels=["state"],
        )
        for state, count in sorted((m.snapshot.sessions or {}).items()):
            sessions.add_metric([state], count)
        yield sessions
        nodes = GaugeMetricFamily("sage_fleet_nodes", "Fleet nodes by state", labels=["state"])
        for state, count in sorted((m.snapshot.fleet_nodes or {}).items()):
            nodes.add_metric([state], count)
        yield nodes
        yield GaugeMetricFamily(
            "sage_forge_breakers_open",
            "Forge circuit breakers open now",
            value=len(m._breakers),
        )
        yield from _budgets(m.usage)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _budgets(usage: UsageService | None) -> Iterator[Any]:
    limit = GaugeMetricFamily(
        "sage_budget_limit", "A principal's budget in force", labels=["principal", "budget"]
    )
    spent = GaugeMetricFamily(
        "sage_budget_spent",
        "What a principal spent against a budget this UTC day or month, every node of a"
        " fleet as last reported",
        labels=["principal", "budget"],
    )
    left = GaugeMetricFamily(
        "sage_budget_remaining", "What is left of a budget", labels=["principal", "budget"]
    )
    refusals = CounterMetricFamily(
        "sage_budget_refusals", "Requests refused budget_exceeded", value=0
    )
    interrupts = CounterMetricFamily(
        "sage_budget_interrupts", "Turns interrupted for a budget", value=0
    )
    if usage is not None:
        refusals = CounterMetricFamily(
            "sage_budget_refusals", "Requests refused budget_exceeded", value=usage.refusals
        )
        interrupts = CounterMetricFamily(
            "sage_budget_interrupts", "Turns interrupted for a budget", value=usage.interrupts
        )
        for principal in usage.principals():
            limits = usage.limits(principal)
            total = usage.total(principal)
            for kind in BudgetKind:
                value = limits.of(kind)
                if value is None:
                    continue
                limit.add_metric([principal, kind.value], value)
                spent.add_metric([principal, kind.value], total.of(kind))
                left.add_metric([principal, kind.value], max(0.0, value - total.of(kind)))
    yield limit
    yield spent
    yield left
    yield refusals
    yield interrupts
