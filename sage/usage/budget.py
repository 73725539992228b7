"""Budgets per principal: what is over, what is near, when it resets (sans-IO).

A principal may have any of three budgets (``[[principals]] budget_tokens_per_day``,
``budget_usd_per_day``, ``budget_usd_per_month``, or an admin's runtime change):
:class:`Limits`.  What it spent in the current UTC day and month is a :class:`Spend`
(this node's ledger plus what the fleet's other nodes report).  The functions here
take both and a clock reading and return decisions as data, each with its reasons:

- :func:`over`: the first budget at or past its limit (an :class:`Over`, with the
  spend, the limit and when it resets), or None.  A spawn, send or wake, an
  ``llm generate``, a REPL's start or its tool calls are refused while one is;
  a model call that starts while one is interrupts its turn.
- :func:`crossed`: the budgets a change of spend took past :data:`WARN_AT` of their
  limit (a warning each, once a period) or past the limit itself.
- :func:`remaining`: what is left of each budget (the metrics' gauge).

Periods are UTC: a day ends at 00:00 UTC, a month at 00:00 UTC of its last day's
morrow.  Tokens are every token a model call read or wrote: input, output, cache
read and cache write (:func:`token_total`).
"""

from __future__ import annotations

import calendar
import enum
import time
from dataclasses import dataclass
from typing import Final

import msgspec

from sage.usage.pricing import TokenCounts

__all__ = (
    "WARN_AT",
    "BudgetKind",
    "Crossing",
    "Limits",
    "Over",
    "Period",
    "Spend",
    "crossed",
    "over",
    "remaining",
    "token_total",
)

WARN_AT: Final = 0.8
"""The share of a budget whose crossing is warned of (an event and an audit entry)."""


class BudgetKind(enum.StrEnum):
    """One of a principal's budgets; the value is its name after ``budget_``."""

    TOKENS_PER_DAY = "tokens_per_day"
    USD_PER_DAY = "usd_per_day"
    USD_PER_MONTH = "usd_per_month"

    @property
    def unit(self) -> str:
        return "tokens" if self is BudgetKind.TOKENS_PER_DAY else "USD"

    @property
    def daily(self) -> bool:
        return self is not BudgetKind.USD_PER_MONTH

    def amount(self, value: float) -> str:
        """``value`` in this budget's unit, as a person reads it."""
        if self is BudgetKind.TOKENS_PER_DAY:
            return f"{int(value):,} tokens"
        return f"${value:,.4f}"


def token_total(usage: TokenCounts) -> int:
    """The tokens a budget counts of ``usage``: input, output, cache read and write."""
    return (
        usage.input_tokens
        + usage.output_tokens
        + usage.cache_read_input_tokens
        + usage.cache_creation_input_tokens
    )


class Limits(msgspec.Struct, frozen=True, omit_defaults=True):
    """A principal's budgets in force; None: no such budget."""

    tokens_per_day: int | None = None
    usd_per_day: float | None = None
    usd_per_month: float | None = None

    def of(self, kind: BudgetKind) -> float | None:
        value: float | None = getattr(self, kind.value)
        return value

    @property
    def any(self) -> bool:
        return any(self.of(kind) is not None for kind in BudgetKind)


class Spend(msgspec.Struct, frozen=True):
    """What a principal spent in a period's day and month (tokens; USD as counted)."""

    tokens_day: int = 0
    usd_day: float = 0.0
    usd_month: float = 0.0

    def of(self, kind: BudgetKind) -> float:
        if kind is BudgetKind.TOKENS_PER_DAY:
            return float(self.tokens_day)
        return self.usd_day if kind is BudgetKind.USD_PER_DAY else self.usd_month

    def plus(self, tokens: int, usd: float) -> Spend:
        return Spend(self.tokens_day + tokens, self.usd_day + usd, self.usd_month + usd)

    def __add__(self, other: Spend) -> Spend:
        return Spend(
            self.tokens_day + other.tokens_day,
            self.usd_day + other.usd_day,
            self.usd_month + other.usd_month,
        )


@dataclass(frozen=True)
class Period:
    """The UTC day and month a clock reading falls in, and when each ends."""

    day: str
    """``YYYY-MM-DD``"""
    month: str
    """``YYYY-MM``"""
    day_ends_at: float
    month_ends_at: float

    @classmethod
    def at(cls, now: float) -> Period:
        t = time.gmtime(now)
        day_start = calendar.timegm((t.tm_year, t.tm_mon, t.tm_mday, 0, 0, 0))
        year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
        return cls(
            day=f"{t.tm_year:04d}-{t.tm_mon:02d}-{t.tm_mday:02d}",
            month=f"{t.tm_year:04d}-{t.tm_mon:02d}",
            day_ends_at=float(day_start + 86400),
            month_ends_at=float(calendar.timegm((year, month, 1, 0, 0, 0))),
        )

    def resets_at(self, kind: BudgetKind) -> float:
        return self.day_ends_at if kind.daily else self.month_ends_at

    def key(self, kind: BudgetKind) -> str:
        """The period a budget of ``kind`` counts in now (its day, or its month)."""
        return self.day if kind.daily else self.month


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


@dataclass(frozen=True)
class Over:
    """A budget at or past its limit: why a request is refused or a turn interrupted."""

    principal: str
    kind: BudgetKind
    spent: float
    limit: float
    resets_at: float

    def message(self, now: float) -> str:
        left = max(0, int(self.resets_at - now))
        hours, minutes = divmod(left // 60, 60)
        per = "a day" if self.kind.daily else "a month"
        return (
            f"principal {self.principal!r} has spent {self.kind.amount(self.spent)} of its"
            f" budget of {self.kind.amount(self.limit)} {per} (budget_{self.kind.value},"
            f" UTC); it resets at {_when(self.resets_at)} (in {hours}h{minutes:02d}m)"
        )

    def fields(self) -> dict[str, object]:
        """The refusal's facts, as a reply, an event and an audit entry carry them."""
        return {
            "principal_id": self.principal,
            "budget": self.kind.value,
            "spent": round(self.spent, 6),
            "limit": self.limit,
            "resets_at": self.resets_at,
        }


@dataclass(frozen=True)
class Crossing:
    """A change of spend that took a budget past ``share`` of its limit (``WARN_AT``, or
    1.0: the limit itself)."""

    kind: BudgetKind
    share: float
    spent: float
    limit: float
    period: str
    """The day or month it happened in: a warning is given once a period."""


def over(principal: str, limits: Limits, spend: Spend, period: Period) -> Over | None:
    """The first of ``principal``'s budgets that ``spend`` has reached (None: none)."""
    for kind in BudgetKind:
        limit = limits.of(kind)
        if limit is not None and spend.of(kind) >= limit:
            return Over(principal, kind, spend.of(kind), limit, period.resets_at(kind))
    return None


def crossed(limits: Limits, before: Spend, after: Spend, period: Period) -> list[Crossing]:
    """The budgets ``after`` took past :data:`WARN_AT` of their limit, or past the limit,
    that ``before`` had not reached (a budget of 0 is never warned of: it is over)."""
    out: list[Crossing] = []
    for kind in BudgetKind:
        limit = limits.of(kind)
        if not limit:
            continue
        for share in (WARN_AT, 1.0):
            line = limit * share
            if before.of(kind) < line <= after.of(kind):
                out.append(Crossing(kind, share, after.of(kind), limit, period.key(kind)))
    return out


def remaining(limits: Limits, spend: Spend) -> dict[BudgetKind, float]:
    """What is left of each budget ``limits`` sets (never below 0)."""
    return {
        kind: max(0.0, limit - spend.of(kind))
        for kind in BudgetKind
        if (limit := limits.of(kind)) is not None
    }
