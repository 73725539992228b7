"""A fleet's usage report, sans-IO: what another node's answer must be to be taken, and
the report made of this node's rows and the answers taken.  The shell that asks the
nodes and answers them is sage/fleet/usage.py.

- **Taking an answer** (:func:`taken`).  A node answers with its ledger's rows for the
  caller's principal (a principal's caller) or for all (an admin the node takes as one).
  The answer is taken whole or not at all, never in part and never guessed: a refusal,
  an error, an answer that breaks the contract (:class:`~sage.contract.usage.NodeRows`:
  at most :data:`~sage.contract.usage.MAX_NODE_ROWS` rows, every figure bounded), a
  row of another principal than the caller's, a row that is not of the report asked
  (a day before ``since``, a ``--by principal`` key that is not its principal) or one
  key twice: the node is named in the report's ``warning`` with why, and none of its
  rows count.  So a hostile node can leave its own rows out or make them up (they are
  its own ledger's, and only it knows them), but cannot show a principal another
  principal's rows, or a figure that breaks a sum.
- **The report** (:func:`fleet_report`).  ``rows`` lists each node's rows with its
  ``node`` (set by the asker from the node it asked, never from the answer), sorted by
  key, principal and node; ``totals`` adds them up across the nodes by key and
  principal (:func:`~sage.usage.ledger.merged`): ``--by principal`` shows each
  principal once per node in ``rows`` and once for the fleet in ``totals``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from sage.config import NAME_PATTERN
from sage.contract.codes import ErrorCode
from sage.contract.usage import (
    DAY_PATTERN,
    MAX_NODE_ROWS,
    BudgetRow,
    Grouping,
    NodeRows,
    ReportRow,
    UsageReport,
)
from sage.usage.ledger import merged

__all__ = ("MESSAGE_MOST", "fleet_report", "taken", "warning_of")

MESSAGE_MOST = 300
"""The most of a node's own words (an error's message) a warning repeats."""
_DAY = re.compile(DAY_PATTERN)
_NAME = re.compile(NAME_PATTERN)


def taken(reply: Any, *, principal: str | None, since: str, by: Grouping) -> list[ReportRow] | str:
    """A node's answer to a fleet report's ask: its rows, or why none are taken (see the
    module docstring).  ``principal``: the caller's (None: an admin's, every row)."""
    if not isinstance(reply, dict):
        return "broke the usage contract (its answer is not an object): none of its rows taken"
    if reply.get("ok") is not True:
        code = str(reply.get("error") or ErrorCode.ERROR)[:64]
        message = str(reply.get("message") or "")[:MESSAGE_MOST]
        if code == ErrorCode.PRINCIPAL_NOT_AUTHENTICATED:
            return f"refused: {code}: {message}"
        return f"answered {code}: {message}"
    rows = reply.get("rows")
    if isinstance(rows, list) and len(rows) > MAX_NODE_ROWS:
        return f"answered {len(rows)} rows, more than the {MAX_NODE_ROWS} taken from one node"
    try:
        answer = msgspec.convert(reply, NodeRows)
    except msgspec.ValidationError as exc:
        return f"broke the usage contract ({str(exc)[:MESSAGE_MOST]}): none of its rows taken"
    seen: set[tuple[str, str]] = set()
    for row in answer.rows:
        if principal is not None and row.principal != principal:
            return (
                f"answered rows of principals other than {principal!r}, which it was not"
                " asked for: none of its rows taken"
            )
        if not _NAME.match(row.principal) or not _of_report(row, since, by):
            return f"answered a row that is not of this report (by {by} since {since}): none taken"
        if (row.key, row.principal) in seen:
            return "answered the same row twice: none of its rows taken"
        seen.add((row.key, row.principal))
    return list(answer.rows)


def _of_report(row: ReportRow, since: str, by: Grouping) -> bool:
    if by == "day":
        return bool(_DAY.match(row.key)) and row.key >= since
    if by == "principal":
        return row.key == row.principal
    return True


def fleet_report(
    node: str,
    own: Iterable[ReportRow],
    answers: Mapping[str, Iterable[ReportRow]],
    missing: Mapping[str, str],
    *,
    since: str,
    by: Grouping,
    budgets: list[BudgetRow],
    note: str | None = None,
) -> UsageReport:
    """The report of ``node`` (this one, its ``own`` rows) and the nodes that answered
    (``answers``, by node); ``missing``: each node whose rows are not in it, and why;
    ``note``: why no other node was asked (NATS away, the node table unreadable)."""
    rows = [msgspec.structs.replace(row, node=node) for row in own]
    for other, theirs in answers.items():
        rows += [msgspec.structs.replace(row, node=other) for row in theirs]
    rows.sort(key=lambda row: (row.key, row.principal, row.node))
    return UsageReport(
        node=node,
        since=since,
        by=by,
        rows=rows,
        budgets=budgets,
        totals=merged(rows),
        warning=warning_of(missing, note),
    )


def warning_of(missing: Mapping[str, str], note: str | None = None) -> str | None:
    """One line naming each node whose rows are missing and why (None: none missing)."""
    parts = [note] if note else []
    parts += [f"node {node!r} {why}" for node, why in sorted(missing.items())]
    if not parts:
        return None
    return "rows missing from this report: " + "; ".join(parts)
