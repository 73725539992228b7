"""The contract of the usage ledger's report (``sage.v1.request.usage.report``): what the
supervisor's usage service answers and what ``sage.client`` and ``astrid sage usage``
read (docs/topics.md, "Usage ledger").  Sans-IO."""

from __future__ import annotations

from typing import Final, Literal

import msgspec

__all__ = (
    "BUDGET_TOPIC",
    "GROUPINGS",
    "REPORT_TOPIC",
    "BudgetRow",
    "Grouping",
    "ReportRequest",
    "ReportRow",
    "UsageReport",
)

REPORT_TOPIC: Final = "sage.v1.request.usage.report"
BUDGET_TOPIC: Final = "sage.v1.request.usage.budget"

Grouping = Literal["day", "session", "model", "principal"]
GROUPINGS: Final[tuple[Grouping, ...]] = ("day", "session", "model", "principal")


class ReportRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``sage.v1.request.usage.report``: ``principal_id`` (a principal's caller: only its
    own), ``since`` a UTC day ``YYYY-MM-DD`` (absent: the first day of the current
    month), ``by`` the grouping, ``fleet`` every node's ledger summed."""

    principal_id: str | None = None
    since: str | None = None
    by: Grouping = "day"
    fleet: bool = False


class ReportRow(msgspec.Struct, frozen=True):
    """One line of ``astrid sage usage``: a group's sums (``key`` the day, session, model
    or principal; a node's name in a fleet's report)."""

    key: str
    principal: str
    calls: int
    input_tokens: int
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    tokens: int
    est_usd: float
    cli_usd: float
    usd: float
    node: str = ""


class BudgetRow(msgspec.Struct, frozen=True):
    """A principal's budgets (``limits``: ``tokens_per_day``, ``usd_per_day``,
    ``usd_per_month``, each present when set), its ``spend`` this period
    (``tokens_day``, ``usd_day``, ``usd_month``), what ``remaining`` of each budget and
    when each ``resets_at`` (UNIX time); ``reported_age_s`` the age of the oldest other
    node's spend counted in (None: no other node's)."""

    principal_id: str
    limits: dict[str, float]
    spend: dict[str, float]
    remaining: dict[str, float]
    resets_at: dict[str, float]
    reported_age_s: float | None = None


class UsageReport(msgspec.Struct, frozen=True, kw_only=True):
    """A report: its ``rows`` grouped ``by`` day, session, model or principal since the
    UTC day ``since``, and the ``budgets`` of the principals it covers; ``node`` the
    node that answered; ``warning`` when part of a fleet's report is missing."""

    node: str | None = None
    since: str
    by: str
    rows: list[ReportRow]
    budgets: list[BudgetRow]
    warning: str | None = None
