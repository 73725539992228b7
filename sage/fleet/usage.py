"""A fleet's usage: every live node's ledger, asked at once (``astrid sage usage
--fleet``, ``sage.client.Sage.usage(fleet=True)``), and every node's spend counted
against budgets here.

The thin shell around sage/usage/fleet_report.py, wired by the router:

- **Asking** (:meth:`FleetUsage.report`, the usage service's ``fleet_report``): this
  node's rows, then each live node's, asked at once over
  ``sage.fleet.<node>.request.<origin>.usage`` (a :class:`~sage.contract.usage.NodeRowsRequest`,
  for the caller's principal as this node's bus established it: a node takes it only
  if this node may vouch for it, sage/fleet/vouching.py; an admin's only where
  ``[fleet.peers.<this node>] admins = true``), each within :data:`USAGE_DEADLINE`.
  A node that refuses, fails, does not answer in time, is not live, or answers what
  is not taken (sage/usage/fleet_report.py) is named in the reply's ``warning`` and
  its rows are missing.  NATS away or the node table unreadable: this node's rows,
  with a warning.
- **Answering** (:meth:`FleetUsage.answer`, for the forwarding's ``usage`` verb):
  this node's rows for the principal the forwarded request carries (vouched before it
  gets here), at most :data:`~sage.contract.usage.MAX_NODE_ROWS` (more:
  ``payload_too_large``, and the asker names this node).
- **Counting** (:meth:`FleetUsage.keep_counting`): at every heartbeat, the other nodes'
  spend as their heartbeat records report it, taken as sage/fleet/spend.py
  decides, becomes the usage service's ``elsewhere``.  The node table unreadable: the
  last count stays (logged once, and once when it reads again).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import Any, Final, Protocol

import anyio
import msgspec
import structlog

from sage import replies
from sage.contract.codes import ErrorCode
from sage.contract.usage import (
    MAX_NODE_ROWS,
    USAGE_VERB,
    NodeRows,
    NodeRowsRequest,
    ReportRequest,
    ReportRow,
)
from sage.errors import FleetError
from sage.fleet.forwarding import LISTING_DEADLINE
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.nodes import NodeState
from sage.fleet.spend import Reported, counted
from sage.usage.fleet_report import fleet_report, taken
from sage.usage.service import UsageService

__all__ = ("USAGE_DEADLINE", "FleetUsage")

log = structlog.get_logger("sage.fleet.usage")

USAGE_DEADLINE: Final = 5.0
"""Seconds a node has to answer a fleet report (a month of its ledger, grouped)."""


class Ask(Protocol):
    """How another node is asked (sage/fleet/forwarding.py, ``Forwarding.ask``)."""

    def __call__(
        self,
        node: str,
        verb: str,
        sid: str | None,
        principal: str | None,
        payload: bytes,
        *,
        deadline: float | None = None,
    ) -> Awaitable[dict[str, Any]]: ...


class FleetUsage:
    """This node's side of a fleet's usage report (see the module docstring)."""

    def __init__(self, member: FleetMember, usage: UsageService, ask: Ask) -> None:
        self.member = member
        self.node = member.node
        self.usage = usage
        self.ask = ask
        self._left_out: dict[str, str] = {}

    async def keep_counting(self) -> None:
        """Count the other nodes' spend at every heartbeat, for ever (see the module
        docstring)."""
        failing = False
        while True:
            try:
                with nats_errors("the node table"), anyio.fail_after(LISTING_DEADLINE):
                    views = await self.member.nodes()
            except FleetError as exc:
                if not failing:
                    log.warning("fleet.spend_unread", node=self.node, error=describe(exc))
                failing = True
            else:
                if failing:
                    log.info("fleet.spend_read", node=self.node)
                failing = False
                self.count(Reported(v.node, v.principals, v.heartbeat_at, v.spend) for v in views)
            await anyio.sleep(self.member.config.heartbeat)

    def count(self, reports: Iterable[Reported]) -> None:
        """The other nodes' ``reports`` become the usage service's ``elsewhere``; a node
        whose report is left out in part is logged when that changes."""
        fleet = self.usage.config.fleet
        found = counted(self.node, reports, fleet.peers if fleet is not None else {})
        self.usage.elsewhere = found.elsewhere
        for node, why in found.left_out.items():
            if self._left_out.get(node) != why:
                log.warning("fleet.spend_left_out", node=node, reason=why)
        self._left_out = found.left_out

    async def report(self, req: ReportRequest, principal: str | None) -> dict[str, Any]:
        """Every live node's rows of ``req`` for ``principal`` (None: an admin's, all),
        with this node's; ``req.since`` is set (the usage service's default)."""
        since = req.since or ""
        own = await self.usage.local_rows(req)
        answers: dict[str, list[ReportRow]] = {}
        missing: dict[str, str] = {}
        note = None
        if not self.member.connected:
            note = "this node's rows only: NATS is not connected"
        else:
            try:
                with nats_errors("the node table"), anyio.fail_after(LISTING_DEADLINE):
                    nodes = await self.member.nodes()
            except FleetError as exc:
                note = f"this node's rows only: {describe(exc)}"
            else:
                payload = msgspec.json.encode(NodeRowsRequest(since=since, by=req.by))

                async def ask(node: str) -> None:
                    reply = await self.ask(
                        node, USAGE_VERB, None, principal, payload, deadline=USAGE_DEADLINE
                    )
                    found = taken(reply, principal=principal, since=since, by=req.by)
                    if isinstance(found, str):
                        missing[node] = found
                    else:
                        answers[node] = found

                async with anyio.create_task_group() as tg:
                    for view in nodes:
                        if view.node == self.node:
                            continue
                        if view.state is NodeState.LIVE:
                            tg.start_soon(ask, view.node)
                        else:
                            missing[view.node] = f"is {view.state.value}: not asked"
        if missing:
            log.warning("fleet.usage_rows_missing", nodes=sorted(missing))
        report = fleet_report(
            self.node,
            own,
            answers,
            missing,
            since=since,
            by=req.by,
            budgets=self.usage.budget_rows(principal),
            note=note,
        )
        return replies.ok(**msgspec.to_builtins(report))

    async def answer(self, payload: bytes, principal: str | None) -> dict[str, Any]:
        """This node's rows for another node's fleet report, for ``principal`` (the
        forwarded request's, vouched; None: an admin of a node this one takes as one)."""
        try:
            asked = msgspec.json.decode(payload, type=NodeRowsRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return replies.error(ErrorCode.BAD_REQUEST, f"a usage rows request: {exc}")
        try:
            rows = await self.usage.local_rows(
                ReportRequest(principal_id=principal, since=asked.since, by=asked.by)
            )
        except Exception as exc:  # the ledger failed: answered, logged; the router goes on
            log.exception("fleet.usage_rows_failed", code=code_of(exc))
            return replies.error(
                ErrorCode.INTERNAL_ERROR, f"the usage ledger failed ({type(exc).__name__})"
            )
        if len(rows) > MAX_NODE_ROWS:
            return replies.error(
                ErrorCode.PAYLOAD_TOO_LARGE,
                f"node {self.node!r} has {len(rows)} rows of this report, more than the"
                f" {MAX_NODE_ROWS} a fleet's report takes from one node: ask it alone"
                " (astrid sage usage on that node), or a later --since",
            )
        answer: dict[str, Any] = msgspec.to_builtins(NodeRows(rows=rows))
        return answer
