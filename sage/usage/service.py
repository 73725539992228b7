"""The usage service: the supervisor's part that records spend and holds budgets.

It runs in the supervisor (like the audit sink), beside the bus, and is the thin
shell around the ledger (sage/usage/ledger.py) and the budget policy
(sage/usage/budget.py):

- **Recording.** Synchronous taps (sage/usage/tap.py) on the session runner's
  ``sage.v1.event.<sid>.usage`` (one per model call as it starts, and as its output
  grows), its ``done`` (the CLI's own ``total_cost_usd``) and the completion
  provider's ``llm.v1.audit.generate``, each taken only from its capsule
  (``capsule:runner``, ``capsule:llm``): a principal cannot write a figure.  Each is
  priced (sage/usage/pricing.py), added to the principal's spend in memory and to the
  ledger; a change that takes a budget past 80 % is warned of once a period
  (``sage.v1.event.budget_warning``, the session's ``budget_warning``, audited).
- **Interrupting.** A model call that starts while its principal is at or past a
  budget interrupts its turn: ``sage.v1.event.<sid>.budget_exceeded``, the audit
  entry ``budget_interrupted``, and ``sage.v1.request.interrupt.<sid>`` with ``why:
  budget_exceeded`` (the turn's ``done`` says so; the session stays).
- **Admitting.** ``sage.v1.request.usage.admit`` (capsules only; sage/usage/
  admission.py): refused ``budget_exceeded`` while a budget is reached, audited
  ``budget_refused``.
- **Reporting.** ``sage.v1.request.usage.report``: the ledger grouped by day,
  session, model or principal, and the budgets in force (a principal: its own only);
  ``fleet`` adds every live node's rows (:attr:`UsageService.fleet_report`, set by the
  fleet's router: sage/fleet/usage.py), each node answering with :meth:`local_rows`.
- **Changing.** ``sage.v1.request.usage.budget`` (admins): a principal's budgets at
  runtime, kept in the ledger, audited ``budget_changed`` with before and after.

In a fleet the spend that counts is this node's plus what the other nodes last
reported in their heartbeat records (:attr:`UsageService.elsewhere`: sage/fleet/
spend.py decides what counts, sage/fleet/usage.py keeps it).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusError, Envelope, Identity
from sage import replies
from sage.config import NAME_PATTERN, Config, PrincipalConfig
from sage.contract.codes import ErrorCode
from sage.contract.sessions import InterruptRequest, TurnEnd, Verb, request_topic
from sage.contract.usage import (
    BUDGET_TOPIC,
    DAY_PATTERN,
    MAX_SPEND_PRINCIPALS,
    REPORT_TOPIC,
    BudgetRow,
    ReportedSpend,
    ReportRequest,
    ReportRow,
    SpendReport,
)
from sage.errors import SageError
from sage.usage.admission import ADMIT_TOPIC, AdmitRequest
from sage.usage.budget import (
    WARN_AT,
    BudgetKind,
    Crossing,
    Limits,
    Over,
    Period,
    Spend,
    crossed,
    over,
    remaining,
    token_total,
)
from sage.usage.ledger import GROUPINGS, Entry, Ledger
from sage.usage.pricing import cost_usd
from sage.usage.tap import Tap

__all__ = (
    "BUDGET_TOPIC",
    "REPORT_TOPIC",
    "BudgetChange",
    "ReportRequest",
    "UsageService",
)

log = structlog.get_logger("sage.usage")

USAGE_EVENTS: Final = "sage.v1.event.*.usage"
DONE_EVENTS: Final = "sage.v1.event.*.done"
EXITED_EVENTS: Final = "sage.v1.event.*.exited"
GENERATIONS: Final = "llm.v1.audit.generate"
RUNNER: Final = "capsule:runner"
LLM: Final = "capsule:llm"
INTERRUPT_DEADLINE: Final = 10.0
_DAY = re.compile(DAY_PATTERN)
_NAME = re.compile(NAME_PATTERN)


class UsageCounts(msgspec.Struct, frozen=True):
    """A ``usage`` event of the runner: what a model call used that was not reported yet."""

    model: str = ""
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    first: bool = False
    message_id: str = ""


class TurnDone(msgspec.Struct, frozen=True):
    total_cost_usd: float = 0.0
    turn: int = 0


class Generation(msgspec.Struct, frozen=True):
    """What ``llm.v1.audit.generate`` says of a generation's usage."""

    request_id: str = ""
    model: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class BudgetChange(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``sage.v1.request.usage.budget``: each field a new value, ``null`` for no budget of
    that kind, absent to keep it; ``reset``: forget every runtime change first (the
    config's budgets apply again)."""

    principal_id: str
    tokens_per_day: int | msgspec.UnsetType | None = msgspec.UNSET
    usd_per_day: float | msgspec.UnsetType | None = msgspec.UNSET
    usd_per_month: float | msgspec.UnsetType | None = msgspec.UNSET
    reset: bool = False

    def __post_init__(self) -> None:
        for kind in BudgetKind:
            value = getattr(self, kind.value)
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"{kind.value}: a budget is 0 or more")

    @property
    def changes(self) -> dict[str, float | None]:
        return {
            kind.value: value
            for kind in BudgetKind
            if (value := getattr(self, kind.value)) is not msgspec.UNSET
        }


def configured(principal: PrincipalConfig) -> Limits:
    """The budgets ``[[principals]]`` gives ``principal``."""
    return Limits(
        tokens_per_day=principal.budget_tokens_per_day,
        usd_per_day=principal.budget_usd_per_day,
        usd_per_month=principal.budget_usd_per_month,
    )


def overlaid(limits: Limits, changes: dict[str, float | None]) -> Limits:
    """``limits`` with the runtime ``changes`` (kind -> value, None: no budget) over it."""
    values: dict[str, Any] = {kind.value: limits.of(kind) for kind in BudgetKind}
    values.update(changes)
    if values["tokens_per_day"] is not None:
        values["tokens_per_day"] = int(values["tokens_per_day"])
    return Limits(**values)


@dataclass
class NodeSpend:
    """What another node of the fleet last reported: its day and month, and each
    principal's spend in them (sage/fleet/spend.py)."""

    day: str
    month: str
    at: float
    principals: dict[str, Spend]


@dataclass
class _TurnBook:
    """A session's running turn, for the CLI's cost at its ``done``."""

    principal: str
    model: str = ""
    est: float = 0.0
    unpriced: bool = False
    cli_total: float = 0.0
    last_turn: int = 0


@dataclass
class UsageService:
    """See the module docstring."""

    bus: Bus
    identity: Identity
    config_of: Callable[[], Config]
    ledger: Ledger
    clock: Callable[[], float] = time.time
    spend: dict[str, Spend] = field(default_factory=dict)
    """This node's spend in :attr:`period`, by principal."""
    elsewhere: dict[str, NodeSpend] = field(default_factory=dict)
    """Other nodes' last reports, by node (sage/fleet/usage.py keeps it)."""
    runtime: dict[str, dict[str, float | None]] = field(default_factory=dict)
    """Budgets an admin set at runtime, by principal: kind -> value (None: no budget)."""
    listeners: list[Callable[[Entry], None]] = field(default_factory=list)
    """Told of every entry recorded (the metrics)."""
    fleet_report: Callable[[ReportRequest, str | None], Awaitable[dict[str, Any]]] | None = None
    """Every live node's report (sage/fleet/usage.py, set by the fleet's router), when in a
    fleet; None: ``fleet`` is ``not_in_fleet``."""
    interrupts: int = 0
    refusals: int = 0
    _period: Period | None = None
    _warned: set[tuple[str, str, str]] = field(default_factory=set)
    _turns: dict[str, _TurnBook] = field(default_factory=dict)
    _interrupting: set[str] = field(default_factory=set)
    _tg: anyio.abc.TaskGroup | None = None

    @property
    def config(self) -> Config:
        return self.config_of()

    @property
    def node(self) -> str:
        fleet = self.config.fleet
        return fleet.node if fleet is not None else ""

    @property
    def period(self) -> Period:
        now = self.clock()
        period = self._period
        if period is None or now >= period.day_ends_at:
            self._roll(Period.at(now))
        assert self._period is not None
        return self._period

    def _roll(self, new: Period) -> None:
        """A new UTC day (or month): what was spent before it no longer counts."""
        old = self._period
        self._period = new
        if old is None:
            return
        if new.month != old.month:
            self.spend = {}
        elif new.day != old.day:
            self.spend = {p: Spend(0, 0.0, s.usd_month) for p, s in self.spend.items()}

    # -- start ---------------------------------------------------------------------

    async def load(self) -> None:
        """The spend of this period and the runtime budgets, from the ledger; budgets
        already past 80 % are not warned of again."""
        period = self.period
        self.spend = await self.ledger.spend(period)
        self.runtime = await self.ledger.budgets()
        for principal in list(self.spend):
            limits = self.limits(principal)
            total = self.total(principal)
            for kind in BudgetKind:
                limit = limits.of(kind)
                if limit and total.of(kind) >= limit * WARN_AT:
                    self._warned.add((principal, kind.value, period.key(kind)))

    def taps(self) -> list[Tap]:
        """The synchronous subscribers to add to the bus (``Bus.add``)."""
        return [
            Tap(USAGE_EVENTS, self.identity, self._on_usage),
            Tap(DONE_EVENTS, self.identity, self._on_done),
            Tap(EXITED_EVENTS, self.identity, self._on_exited),
            Tap(GENERATIONS, self.identity, self._on_generation),
        ]

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Answer the usage requests until cancelled (the taps are added by the caller)."""
        handlers: dict[str, Callable[[Envelope], Awaitable[dict[str, Any]]]] = {
            ADMIT_TOPIC: self._admit,
            REPORT_TOPIC: self._report,
            BUDGET_TOPIC: self._budget,
        }
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for topic, handler in handlers.items():
                tg.start_soon(self._serve, self.bus.subscribe(topic, self.identity), handler)
            task_status.started()

    async def _serve(
        self,
        requests: AsyncIterable[Envelope],
        handler: Callable[[Envelope], Awaitable[dict[str, Any]]],
    ) -> None:
        async for request in requests:
            assert self._tg is not None
            self._tg.start_soon(self._answer, request, handler)

    async def _answer(
        self, request: Envelope, handler: Callable[[Envelope], Awaitable[dict[str, Any]]]
    ) -> None:
        try:
            reply = await handler(request)
        except SageError as exc:
            reply = replies.from_error(exc)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            reply = replies.error(ErrorCode.BAD_REQUEST, str(exc))
        except Exception as exc:  # a bug: answered, logged, the service goes on
            log.exception("usage.handler_failed", topic=request.topic)
            reply = replies.error(
                ErrorCode.INTERNAL_ERROR, f"the usage ledger failed ({type(exc).__name__})"
            )
        if request.reply_to:
            try:
                self.bus.reply(self.identity, request.reply_to, reply)
            except BusError as exc:
                log.warning("usage.reply_failed", topic=request.topic, error=str(exc))

    # -- budgets ---------------------------------------------------------------------

    def limits(self, principal: str) -> Limits:
        """``principal``'s budgets in force: the config's, with an admin's changes over them."""
        configured_ = self.config.principal(principal)
        base = configured(configured_) if configured_ is not None else Limits()
        return overlaid(base, self.runtime.get(principal, {}))

    def total(self, principal: str) -> Spend:
        """What ``principal`` spent this period: here, and on the nodes that reported it."""
        period = self.period
        total = self.spend.get(principal, Spend())
        for report in self.elsewhere.values():
            theirs = report.principals.get(principal)
            if theirs is None or report.month != period.month:
                continue
            if report.day == period.day:
                total = total + theirs
            else:  # a report of an earlier day of this month: its month counts
                total = total + Spend(0, 0.0, theirs.usd_month)
        return total

    def over(self, principal: str) -> Over | None:
        return over(principal, self.limits(principal), self.total(principal), self.period)

    def principals(self) -> list[str]:
        """Every principal the config names or that spent this period, sorted."""
        names = {p.name for p in self.config.principals} | set(self.spend)
        return sorted(names)

    def spend_report(self) -> SpendReport:
        """This node's spend this period, for the other nodes (each heartbeat carries it:
        sage/fleet/spend.py).  At most :data:`MAX_SPEND_PRINCIPALS` principals,
        the largest spenders this month first (more: a warning, the rest unreported)."""
        period = self.period
        spent = self.spend
        if len(spent) > MAX_SPEND_PRINCIPALS:
            log.warning(
                "usage.spend_report_truncated", principals=len(spent), most=MAX_SPEND_PRINCIPALS
            )
            biggest = sorted(spent, key=lambda p: (-spent[p].usd_month, p))
            spent = {p: spent[p] for p in biggest[:MAX_SPEND_PRINCIPALS]}
        return SpendReport(
            period.day,
            period.month,
            {p: ReportedSpend(s.tokens_day, s.usd_day, s.usd_month) for p, s in spent.items()},
        )

    def budget_row(self, principal: str) -> BudgetRow:
        """A principal's budgets, its spend against them and when each resets."""
        period = self.period
        limits = self.limits(principal)
        total = self.total(principal)
        ages = [self.clock() - r.at for r in self.elsewhere.values() if principal in r.principals]
        return BudgetRow(
            principal_id=principal,
            limits=msgspec.to_builtins(limits),
            spend=msgspec.to_builtins(total),
            remaining={k.value: round(v, 6) for k, v in remaining(limits, total).items()},
            resets_at={
                k.value: period.resets_at(k) for k in BudgetKind if limits.of(k) is not None
            },
            reported_age_s=round(max(ages), 1) if ages else None,
        )

    # -- recording ---------------------------------------------------------------------

    def record(self, entry: Entry, *, session: str | None = None) -> None:
        """Add ``entry`` to the ledger and its principal's spend; warn of a crossing."""
        principal = entry.principal
        before = self.total(principal)
        self.spend[principal] = self.spend.get(principal, Spend()).plus(entry.tokens, entry.usd)
        after = before.plus(entry.tokens, entry.usd)
        self.ledger.add(entry)
        for listener in self.listeners:
            listener(entry)
        for crossing in crossed(self.limits(principal), before, after, self.period):
            self._crossed(principal, crossing, session)

    def _crossed(self, principal: str, crossing: Crossing, session: str | None) -> None:
        if crossing.share >= 1.0:
            log.info(
                "usage.budget_reached",
                principal=principal,
                budget=crossing.kind.value,
                spent=crossing.spent,
                limit=crossing.limit,
            )
            return
        key = (principal, crossing.kind.value, crossing.period)
        if key in self._warned:
            return
        self._warned.add(key)
        payload: dict[str, Any] = {
            "principal_id": principal,
            "budget": crossing.kind.value,
            "spent": round(crossing.spent, 6),
            "limit": crossing.limit,
            "share": WARN_AT,
            "resets_at": self.period.resets_at(crossing.kind),
            "session_id": session,
        }
        self._publish("sage.v1.event.budget_warning", payload, principal)
        if session is not None:
            self._publish(f"sage.v1.event.{session}.budget_warning", payload, principal)
        self._publish("sage.v1.audit.budget_warning", payload, principal)

    def _on_usage(self, envelope: Envelope) -> None:
        principal = envelope.principal
        if envelope.source != RUNNER or principal is None:
            return
        sid = envelope.topic.split(".")[3]
        counts = msgspec.json.decode(envelope.payload, type=UsageCounts)
        if counts.first:
            reached = self.over(principal)
            if reached is not None:
                self._interrupt(sid, reached)
        period = self.period
        book = self._turns.get(sid)
        if book is None:
            book = self._turns[sid] = _TurnBook(principal)
        est = cost_usd(counts.model, counts)
        if est is None:
            book.unpriced = True
        book.model = counts.model or book.model
        book.est += est or 0.0
        self.record(
            Entry(
                day=period.day,
                principal=principal,
                session=sid,
                node=self.node,
                model=counts.model,
                source="session",
                calls=1 if counts.first else 0,
                input=counts.input_tokens,
                output=counts.output_tokens,
                cache_read=counts.cache_read_input_tokens,
                cache_write=counts.cache_creation_input_tokens,
                est_usd=est or 0.0,
                usd=est or 0.0,
            ),
            session=sid,
        )

    def _on_done(self, envelope: Envelope) -> None:
        """The CLI's own cost of the turn, beside sage's estimate; for a turn with a call
        of a model the price table does not know, what the estimate missed counts."""
        principal = envelope.principal
        if envelope.source != RUNNER or principal is None:
            return
        sid = envelope.topic.split(".")[3]
        self._interrupting.discard(sid)
        done = msgspec.json.decode(envelope.payload, type=TurnDone)
        book = self._turns.get(sid)
        if book is None:
            book = self._turns[sid] = _TurnBook(principal)
        previous = book.cli_total if done.turn > book.last_turn else 0.0  # a new child: 0
        cli = max(0.0, done.total_cost_usd - previous)
        book.cli_total, book.last_turn = done.total_cost_usd, done.turn
        extra = max(0.0, cli - book.est) if book.unpriced else 0.0
        book.est, book.unpriced = 0.0, False
        if cli or extra:
            self.record(
                Entry(
                    day=self.period.day,
                    principal=principal,
                    session=sid,
                    node=self.node,
                    model=book.model,
                    source="session",
                    cli_usd=cli,
                    usd=extra,
                ),
                session=sid,
            )

    def _on_exited(self, envelope: Envelope) -> None:
        if envelope.source == RUNNER:
            sid = envelope.topic.split(".")[3]
            self._turns.pop(sid, None)
            self._interrupting.discard(sid)

    def _on_generation(self, envelope: Envelope) -> None:
        principal = envelope.principal
        if envelope.source != LLM or principal is None:
            return
        gen = msgspec.json.decode(envelope.payload, type=Generation)
        model = gen.model or ""
        est = cost_usd(model, gen) or 0.0
        if not token_total(gen):
            return  # refused before it ran: nothing was spent
        self.record(
            Entry(
                day=self.period.day,
                principal=principal,
                session="",
                node=self.node,
                model=model,
                source="llm",
                calls=1,
                input=gen.input_tokens,
                output=gen.output_tokens,
                cache_read=gen.cache_read_input_tokens,
                cache_write=gen.cache_creation_input_tokens,
                est_usd=est,
                usd=est,
            )
        )

    # -- interrupting ------------------------------------------------------------------

    def _interrupt(self, sid: str, reached: Over) -> None:
        """A model call of ``sid`` started while its principal is over a budget: its turn
        is interrupted (once per turn), said and audited."""
        if sid in self._interrupting or self._tg is None:
            return
        self._interrupting.add(sid)
        self.interrupts += 1
        message = reached.message(self.clock())
        payload = {**reached.fields(), "session_id": sid, "message": message}
        self._publish(f"sage.v1.event.{sid}.budget_exceeded", payload, reached.principal)
        self._publish("sage.v1.audit.budget_interrupted", payload, reached.principal)
        log.warning("usage.turn_interrupted", session_id=sid, **reached.fields())
        self._tg.start_soon(self._ask_interrupt, sid, message)

    async def _ask_interrupt(self, sid: str, message: str) -> None:
        why = InterruptRequest(why=TurnEnd.BUDGET_EXCEEDED.value, message=message[:1000])
        try:
            await self.bus.request(
                self.identity,
                request_topic(Verb.INTERRUPT, sid),
                why,
                deadline=INTERRUPT_DEADLINE,
            )
        except BusError as exc:
            log.error("usage.interrupt_failed", session_id=sid, error=str(exc))

    # -- requests ----------------------------------------------------------------------

    async def _admit(self, request: Envelope) -> dict[str, Any]:
        if request.principal is not None:
            return replies.error(
                ErrorCode.NOT_AUTHORIZED, "only sage's own parts ask the usage ledger to admit"
            )
        req = msgspec.json.decode(request.payload, type=AdmitRequest)
        reached = self.over(req.principal_id)
        if reached is None:
            return replies.ok()
        self.refusals += 1
        facts = {**reached.fields(), "verb": req.verb, "session_id": req.session_id}
        self._publish(
            "sage.v1.audit.budget_refused",
            {**facts, "source": request.source},
            req.principal_id,
        )
        return replies.error(ErrorCode.BUDGET_EXCEEDED, reached.message(self.clock()), **facts)

    def _visible(self, request: Envelope, named: str | None) -> str | None:
        """The principal a report is about: a principal's caller sees only its own."""
        if request.principal is None:
            return named
        if named not in (None, request.principal):
            raise SageError(
                "you may see only your own principal's usage", code=ErrorCode.NOT_AUTHORIZED
            )
        return request.principal

    async def _report(self, request: Envelope) -> dict[str, Any]:
        req = msgspec.json.decode(request.payload or b"{}", type=ReportRequest)
        if req.since is not None and not _DAY.match(req.since):
            raise SageError("since: a UTC day, YYYY-MM-DD", code=ErrorCode.BAD_REQUEST)
        if req.by not in GROUPINGS:
            raise SageError(f"by: one of {', '.join(GROUPINGS)}", code=ErrorCode.BAD_REQUEST)
        principal = self._visible(request, req.principal_id)
        since = req.since or f"{self.period.month}-01"
        if req.fleet:
            if self.fleet_report is None:
                raise SageError(
                    "this supervisor is not in a fleet (its config has no [fleet])",
                    code=ErrorCode.NOT_IN_FLEET,
                )
            return await self.fleet_report(
                msgspec.structs.replace(req, principal_id=principal, since=since), principal
            )
        rows = await self.ledger.report(principal=principal, since=since, by=req.by)
        return replies.ok(
            node=self.node,
            since=since,
            by=req.by,
            rows=msgspec.to_builtins(rows),
            budgets=msgspec.to_builtins(self.budget_rows(principal)),
        )

    def budget_rows(self, principal: str | None) -> list[BudgetRow]:
        names = [principal] if principal is not None else self.principals()
        return [self.budget_row(name) for name in names]

    async def local_rows(self, req: ReportRequest) -> list[ReportRow]:
        """This node's rows of a report (answering another node's ``--fleet``)."""
        return await self.ledger.report(
            principal=req.principal_id, since=req.since or "", by=req.by
        )

    async def _budget(self, request: Envelope) -> dict[str, Any]:
        change = msgspec.json.decode(request.payload, type=BudgetChange)
        name = change.principal_id
        if request.principal is not None:
            return replies.error(
                ErrorCode.NOT_AUTHORIZED, "only an admin may change a principal's budgets"
            )
        if not _NAME.match(name) or self.config.principal(name) is None:
            return replies.error(
                ErrorCode.UNKNOWN_PRINCIPAL, f"no principal {name!r} is configured"
            )
        before = self.limits(name)
        runtime = {} if change.reset else dict(self.runtime.get(name, {}))
        runtime.update(change.changes)
        self.runtime[name] = runtime
        after = self.limits(name)
        await self.ledger.set_budget(name, runtime, at=self.clock(), by=request.source)
        if not runtime:
            self.runtime.pop(name, None)
        if after != before:
            self._publish(
                "sage.v1.audit.budget_changed",
                {
                    "principal_id": name,
                    "before": msgspec.to_builtins(before),
                    "after": msgspec.to_builtins(after),
                    "source": request.source,
                },
                name,
            )
        return replies.ok(
            principal_id=name,
            before=msgspec.to_builtins(before),
            after=msgspec.to_builtins(after),
            changed=after != before,
            budget=msgspec.to_builtins(self.budget_row(name)),
        )

    def _publish(self, topic: str, payload: dict[str, Any], principal: str) -> None:
        try:
            self.bus.publish(self.identity, topic, payload, on_behalf_of=principal)
        except BusError as exc:
            log.error("usage.publish_failed", topic=topic, error=str(exc))
