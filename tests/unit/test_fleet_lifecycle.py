"""The registry's and failover's lifecycle events have a queue of their own: a flood of
text deltas (NATS slow to take the events out) cannot crowd out a spawned or an exited."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from bus import Bus, Envelope, Identity
from sage.config import FleetConfig
from sage.fleet.lifecycle import LifecycleEvents
from sage.fleet.router import Router

RUNNER = Identity("runner")


def _envelope(topic: str) -> Envelope:
    return Envelope(1, topic, b"{}", "runner", "alice")


def test_only_lifecycle_events_are_queued_and_a_full_queue_is_logged() -> None:
    events = LifecycleEvents(Identity("fleet"), limit=2)
    for _ in range(100):
        assert events.deliver(_envelope("sage.v1.event.s1.text"))
    assert events.deliver(_envelope("sage.v1.event.s1.spawned"))
    assert events.deliver(_envelope("sage.v1.event.s1.done"))
    assert not events.lost
    with capture_logs() as logs:
        assert not events.deliver(_envelope("sage.v1.event.s1.exited"))
    assert events.lost
    assert (events.delivered, events.dropped) == (2, 1)
    (logged,) = logs
    assert logged["event"] == "fleet.lifecycle_event_dropped"
    assert logged["topic"] == "sage.v1.event.s1.exited"
    assert [e.topic for e in events.queue.drain()] == [
        "sage.v1.event.s1.spawned",
        "sage.v1.event.s1.done",
    ]


class Nats:
    """A connection whose publishes hang: the events out stall, as on a slow link."""

    is_connected = True

    def __init__(self) -> None:
        self.stalled = anyio.Event()

    async def subscribe(self, subject: str, **_: Any) -> Any:
        return self

    async def unsubscribe(self) -> None:
        return None

    async def publish(self, subject: str, data: bytes) -> None:
        await self.stalled.wait()


class Registry:
    def __init__(self) -> None:
        self.puts: list[str] = []

    async def put(self, key: str, value: bytes) -> int:
        self.puts.append(key)
        return 1


class Member:
    def __init__(self) -> None:
        self.node = "a"
        self.config = FleetConfig(url="nats://127.0.0.1:4222", node="a")
        self.nc = Nats()
        self.registry = Registry()
        self.connected = False  # no resync: only the events write the registry here
        self.claims = None  # no fencing reads either
        self.returned = anyio.Event()

    async def record_of(self, name: str) -> None:
        return None


@pytest.mark.anyio
async def test_a_spawned_after_a_flood_of_deltas_still_reaches_the_registry() -> None:
    """20,000 deltas of s1 fill the events-out queue (8192) while NATS hangs; s2's
    spawned, published after them, is still put in the registry."""
    bus = Bus()
    member = Member()
    router = Router(bus, member)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        await tg.start(router.run)
        for i in range(20_000):
            bus.publish(RUNNER, "sage.v1.event.s1.text", {"text": str(i)}, on_behalf_of="alice")
        bus.publish(RUNNER, "sage.v1.event.s2.spawned", {"pid": 1}, on_behalf_of="alice")
        with anyio.fail_after(5):
            await anyio.wait_all_tasks_blocked()  # the books kept, the events out stalled
        tg.cancel_scope.cancel()
    assert [key for key in member.registry.puts if key.endswith("s2")], member.registry.puts
    assert "s2" in router.keeper.here
