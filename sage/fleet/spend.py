"""A principal's spend across a fleet, sans-IO: what the other nodes' heartbeat records
say they spent, taken or not, for the budgets (:attr:`UsageService.elsewhere`).

Each node writes what it spent this UTC day and month, by principal, into its
heartbeat record (:class:`~sage.contract.usage.SpendReport`, ``NodeRecord.spend``:
:meth:`~sage.usage.service.UsageService.spend_report`), and reads every other node's at
each of its own heartbeats (sage/fleet/usage.py, :meth:`FleetUsage.keep_counting`).
:func:`counted` decides what of those reports counts:

- **Another node's, never this node's** (this node counts its own from its ledger).
- **Only principals the node may vouch for here** (sage/fleet/vouching.py: its record
  declares them, and ``[fleet.peers.<node>] principals`` names them when it is set).  A
  report naming any other principal has that principal's row left out and named: a
  node cannot spend a budget of a principal it does not serve.  A node that may vouch
  for a principal is trusted with that principal's spend on it, as with its requests;
  it could overstate it (so refusing that principal's turns everywhere) or understate
  it.
- **Whatever its liveness.** A lost or stopped node's last report counts: what it spent
  was spent.  A report of an earlier day counts towards the month only, one of an
  earlier month not at all (:meth:`UsageService.total`).

How stale: a node's spend reaches another within two heartbeats (its write, the
other's read: 4 s with the default ``heartbeat = 2``), and a node cut off counts what it
last read; in that time a principal can spend past its budget by what its running turns
spend, on every node at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sage.config import FleetPeerConfig
from sage.contract.usage import SpendReport
from sage.errors import NotVouched
from sage.fleet.vouching import check_vouched
from sage.usage.budget import Spend
from sage.usage.service import NodeSpend

__all__ = ("Counted", "Reported", "counted")


@dataclass(frozen=True)
class Reported:
    """One node's heartbeat record, as far as spend goes."""

    node: str
    principals: list[str] | None
    """The principals it declares (None: unknown)."""
    at: float
    """Its heartbeat's time, by its own clock."""
    spend: SpendReport | None


@dataclass(frozen=True)
class Counted:
    """What counts (by node) and what was left out (node -> why)."""

    elsewhere: dict[str, NodeSpend]
    left_out: dict[str, str]


def counted(own: str, reports: Iterable[Reported], pins: Mapping[str, FleetPeerConfig]) -> Counted:
    """The other nodes' spend that counts against budgets here (see the module docstring);
    ``pins``: this node's ``[fleet.peers]``."""
    elsewhere: dict[str, NodeSpend] = {}
    left_out: dict[str, str] = {}
    for report in reports:
        if report.node == own or report.spend is None:
            continue
        declared = None if report.principals is None else frozenset(report.principals)
        pin = pins.get(report.node)
        taken: dict[str, Spend] = {}
        strangers: list[str] = []
        for principal, spent in report.spend.principals.items():
            try:
                check_vouched(report.node, principal, declared, pin)
            except NotVouched:
                strangers.append(principal)
            else:
                taken[principal] = Spend(spent.tokens_day, spent.usd_day, spent.usd_month)
        if strangers:
            names = ", ".join(sorted(strangers)[:5]) + (" ..." if len(strangers) > 5 else "")
            left_out[report.node] = f"reports spend of principals it may not vouch for: {names}"
        elsewhere[report.node] = NodeSpend(report.spend.day, report.spend.month, report.at, taken)
    return Counted(elsewhere, left_out)
