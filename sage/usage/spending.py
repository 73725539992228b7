"""The supervisor's spending parts, opened and started together (sage/daemon/supervisor.py).

:func:`spending` opens the usage ledger (``[usage] ledger``), makes the usage
service and the metrics (``[metrics] listen``) and adds their taps to the bus;
:meth:`Spending.start` starts answering (admission, reports, budgets) and serving
``/metrics``.  Leaving the context commits what the ledger still holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio.abc
import msgspec

from bus import Bus, BusError, Identity
from sage.config import Config
from sage.contract.sessions import SlotsReply, Verb, request_topic
from sage.usage.exporter import Exporter
from sage.usage.ledger import Ledger
from sage.usage.metrics import Metrics
from sage.usage.service import UsageService

__all__ = ("Spending", "spending")

SLOTS_WAIT: Final = 2.0
"""How long a scrape waits for the runner's sessions by state (then shows none)."""


@dataclass
class Spending:
    """The usage service (None: ``[usage] ledger = false``) and the metrics (None: off)."""

    bus: Bus
    identity: Identity
    usage: UsageService | None
    metrics: Metrics | None
    listen: str
    fleet_nodes: Callable[[], Awaitable[dict[str, int] | None]] | None = None
    exporter: Exporter | None = None
    port: int | None = None
    """The port ``/metrics`` is served on, once started."""

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        if self.usage is not None:
            await tg.start(self.usage.run)
        if self.metrics is not None:
            self.exporter = Exporter(self.metrics, self.listen, self._refresh)
            self.port = await tg.start(self.exporter.serve)

    async def _refresh(self) -> None:
        assert self.metrics is not None
        await self.metrics.refresh(self._sessions)
        if self.fleet_nodes is not None:
            self.metrics.snapshot.fleet_nodes = await self.fleet_nodes()

    async def _sessions(self) -> dict[str, int] | None:
        """The runner's sessions by state (``sage.v1.request.slots``, as the supervisor)."""
        try:
            answer = await self.bus.request(
                self.identity, request_topic(Verb.SLOTS), {}, deadline=SLOTS_WAIT
            )
            return msgspec.json.decode(answer.payload, type=SlotsReply).states
        except (BusError, msgspec.DecodeError, msgspec.ValidationError):
            return None


@contextlib.asynccontextmanager
async def spending(
    bus: Bus,
    identity: Identity,
    config_of: Callable[[], Config],
    *,
    audit_stats: Callable[[], dict[str, Any]],
    capsules: Callable[[], list[dict[str, Any]]],
) -> AsyncIterator[Spending]:
    config = config_of()
    async with contextlib.AsyncExitStack() as stack:
        usage = None
        if config.usage.ledger:
            ledger = await stack.enter_async_context(Ledger.open(config.usage_path))
            usage = UsageService(bus, identity, config_of, ledger)
            await usage.load()
            for tap in usage.taps():
                bus.add(tap)
        metrics = None
        if config.metrics.listen:
            metrics = Metrics(
                bus, identity, usage=usage, audit_stats=audit_stats, capsules=capsules
            )
            for tap in metrics.taps():
                bus.add(tap)
        yield Spending(bus, identity, usage, metrics, config.metrics.listen)
