"""The contract of the usage ledger's report (``sage.v1.request.usage.report``): what the
supervisor's usage service answers and what ``sage.client`` and ``astrid sage usage``
read (docs/topics.md, "Usage ledger"); what one node asks another for a fleet's
report (``sage.fleet.<node>.request.<origin>.usage``: :class:`NodeRowsRequest`, answered
:class:`NodeRows`); and the spend a node tells the others in each heartbeat record, for
budgets that hold across the fleet (:class:`SpendReport`).  Sans-IO.

A row's fields are bounded (:class:`ReportRow`): another node's answer is decoded with
these bounds, so a node cannot hand the asker a negative, infinite or giant figure or
name."""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec

from sage.config import NAME_PATTERN

__all__ = (
    "BUDGET_TOPIC",
    "DAY_PATTERN",
    "GROUPINGS",
    "MAX_NODE_ROWS",
    "MAX_SPEND_PRINCIPALS",
    "MONTH_PATTERN",
    "REPORT_TOPIC",
    "USAGE_VERB",
    "BudgetRow",
    "Grouping",
    "NodeRows",
    "NodeRowsRequest",
    "ReportRequest",
    "ReportRow",
    "ReportedSpend",
    "SpendReport",
    "UsageReport",
)

REPORT_TOPIC: Final = "sage.v1.request.usage.report"
BUDGET_TOPIC: Final = "sage.v1.request.usage.budget"
USAGE_VERB: Final = "usage"
"""The verb of a node's rows asked by another node: ``sage.fleet.<node>.request.<origin>.usage``
(under the prefix every node may already publish to and answer on: no new permission)."""
MAX_NODE_ROWS: Final = 2000
"""The most rows one node answers another's fleet report with (about 500 KB of JSON, under
NATS's default 1 MiB payload): a node with more says so, and an answer with more is not
taken."""
DAY_PATTERN: Final = r"^\d{4}-\d{2}-\d{2}\Z"
"""A UTC day, ``YYYY-MM-DD``."""
MONTH_PATTERN: Final = r"^\d{4}-\d{2}\Z"
"""A UTC month, ``YYYY-MM``."""
MAX_SPEND_PRINCIPALS: Final = 10_000
"""The most principals one heartbeat's :class:`SpendReport` names (as its ``principals``)."""

_Count = Annotated[int, msgspec.Meta(ge=0, le=10**15)]
"""Tokens or calls: never negative; 10^15 is more than any ledger holds (and a float's
exact integers)."""
_Usd = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
"""US dollars: never negative, never infinite or NaN."""
_Name = Annotated[str, msgspec.Meta(max_length=64)]
"""A principal or node (1-64 of ``[A-Za-z0-9_-]`` where they are made)."""
_Key = Annotated[str, msgspec.Meta(max_length=256)]

Grouping = Literal["day", "session", "model", "principal"]
GROUPINGS: Final[tuple[Grouping, ...]] = ("day", "session", "model", "principal")


class ReportRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``sage.v1.request.usage.report``: ``principal_id`` (a principal's caller: only its
    own), ``since`` a UTC day ``YYYY-MM-DD`` (absent: the first day of the current
    month), ``by`` the grouping, ``fleet`` every live node's ledger (its rows per node,
    and their ``totals``: :class:`UsageReport`)."""

    principal_id: str | None = None
    since: str | None = None
    by: Grouping = "day"
    fleet: bool = False


class ReportRow(msgspec.Struct, frozen=True):
    """One line of ``astrid sage usage``: a group's sums (``key`` the day, session, model
    or principal); ``node`` the node whose ledger it is, in a fleet's report (empty in a
    node's own report and in a fleet's ``totals``)."""

    key: _Key
    principal: _Name
    calls: _Count
    input_tokens: _Count
    output_tokens: _Count
    cache_read_tokens: _Count
    cache_write_tokens: _Count
    tokens: _Count
    est_usd: _Usd
    cli_usd: _Usd
    usd: _Usd
    node: _Name = ""


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
    node that answered; ``warning`` when part of a fleet's report is missing.

    In a fleet's report (``fleet``) ``rows`` are listed per node, each with its ``node``
    (the same day or principal once for each node that has it), and ``totals`` are the
    same rows added up across the nodes that answered, by key and principal (``node``
    empty); a node's own report has no ``totals``."""

    node: str | None = None
    since: str
    by: str
    rows: list[ReportRow]
    budgets: list[BudgetRow]
    totals: list[ReportRow] = msgspec.field(default_factory=list)
    warning: str | None = None


class NodeRowsRequest(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True, omit_defaults=True
):
    """What a node asks another for a fleet's report: its rows since the UTC day ``since``,
    grouped ``by``.  No principal here: the one the asked node scopes the rows to is the
    forwarded request's, which the asking node's bus established and the asked node
    takes only if the asker may vouch for it (sage/fleet/vouching.py)."""

    since: Annotated[str, msgspec.Meta(pattern=DAY_PATTERN)]
    by: Grouping = "day"


class NodeRows(msgspec.Struct, frozen=True, kw_only=True):
    """A node's answer to :class:`NodeRowsRequest`: its ledger's ``rows`` (at most
    :data:`MAX_NODE_ROWS`), each without a ``node`` (the asker sets the node it asked)."""

    ok: bool = True
    rows: Annotated[list[ReportRow], msgspec.Meta(max_length=MAX_NODE_ROWS)]


class ReportedSpend(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One principal's spend on one node in a :class:`SpendReport`'s day and month."""

    tokens_day: _Count = 0
    usd_day: _Usd = 0.0
    usd_month: _Usd = 0.0

    def __post_init__(self) -> None:
        if self.usd_day > self.usd_month * (1 + 1e-9) + 1e-9:
            raise ValueError(f"usd_day {self.usd_day} is more than usd_month {self.usd_month}")


class SpendReport(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What a node has spent this UTC ``day`` and ``month``, by principal: carried in its
    heartbeat record (sage/fleet/nodes.py, ``NodeRecord.spend``) so that every node counts
    a principal's spend across the fleet against its budgets (sage/fleet/spend.py).
    Decoded with these bounds: a record that breaks them is read without its spend."""

    day: Annotated[str, msgspec.Meta(pattern=DAY_PATTERN)]
    month: Annotated[str, msgspec.Meta(pattern=MONTH_PATTERN)]
    principals: Annotated[
        dict[Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)], ReportedSpend],
        msgspec.Meta(max_length=MAX_SPEND_PRINCIPALS),
    ]

    def __post_init__(self) -> None:
        if not self.day.startswith(self.month):
            raise ValueError(f"day {self.day} is not of month {self.month}")
