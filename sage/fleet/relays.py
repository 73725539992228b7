"""Session events across nodes: published by the owner, relayed where a client watches.

- **Out.** :func:`publish_events`: every event of this node's sessions goes on NATS
  as ``sage.fleet.<node>.event.<sid>.<name>`` with its principal, time and envelope
  id (a :class:`~sage.fleet.routes.ForwardedEvent`), while NATS is connected.
- **In.** :class:`Relays`: while a local client follows a session another node owns
  (a forwarded ``send``, ``session`` or ``wake``), its events are republished on
  this bus as ``sage.v1.event.<sid>.<name>`` on behalf of the session's principal as
  the registry names it (an event naming another is dropped, and logged once).  One
  relay per session however many requests open it; a relay lives while a local
  client (not the router) subscribes to its events, and ends at ``exited``.
- **Approvals.** While a client here answers a relayed session's approvals
  (``sage.v1.approver.<sid>``), the owner is told so every second; the owner's
  router stands in for it on its own bus (:meth:`Relays.stand_in`) for the seconds
  asked (at most 10).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusError, Envelope, Identity, Subscription
from sage import replies
from sage.contract.codes import ErrorCode
from sage.contract.sessions import SessionEvent, Verb, approver_topic, event_of, event_topic
from sage.errors import BadRoute, FleetError
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import describe, nats_errors
from sage.fleet.routes import (
    ForwardedEvent,
    decode_event,
    event_pattern,
    event_subject,
    parse_event_subject,
)
from sage.fleet.runner_link import RunnerLink
from sage.fleet.states import RELAY_TRANSITIONS, Machine, RelayState

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription as NatsSubscription

__all__ = ("APPROVER_FOR", "IDS_KEPT", "RELAY_CHECK", "Relay", "Relays", "publish_events")

log = structlog.get_logger("sage.fleet.router")

RELAY_CHECK = 1.0  # seconds between two looks at whether a relayed session is still watched
APPROVER_FOR = 3.0  # seconds an approver presence told to the owner lasts (renewed each second)
IDS_KEPT = 512  # republished events whose owner's id a relay remembers (watch --replay: 256)

Forward = Callable[[str, str, "str | None", Envelope, "bytes | None"], Awaitable[dict[str, Any]]]
"""A request forwarded to a node: node, verb, sid, the local request, payload -> reply."""


async def publish_events(events: Any, member: FleetMember) -> None:
    """Every event of this node's sessions, on NATS (see the module docstring)."""
    nc = member.nc
    async for envelope in events:
        if envelope.source.startswith("fleet:"):
            continue  # another node's event, republished here: not ours to send on
        found = event_of(envelope.topic)
        if found is None:
            continue
        sid, name = found
        if not nc.is_connected:
            continue  # the fleet is away: local watchers still have them
        event = ForwardedEvent(
            principal=envelope.principal,
            ts=envelope.ts,
            payload=msgspec.Raw(envelope.payload),
            id=envelope.id,
        )
        with contextlib.suppress(FleetError), nats_errors("an event's publish"):
            await nc.publish(event_subject(member.node, sid, name), event.encode())


class Relay:
    """A remote session's events, republished locally while someone here watches."""

    def __init__(
        self, node: str, sub: NatsSubscription, ids: dict[int, int], principal: str | None
    ) -> None:
        self.node = node
        self.sub = sub
        self.principal = principal
        """Whose session it is, as the caller that opened the relay was established."""
        self.machine = Machine(f"relay of {node}", RELAY_TRANSITIONS, RelayState.OPEN)
        """Open, approving (a local client answers its approvals: the owner is told every
        second), ended (its exited came), dropped (sage/fleet/states.py)."""
        self.ids = ids
        """The owner's envelope id -> this bus's, of the events republished (the last
        :data:`IDS_KEPT`): a watch's replay and its live events then share one order."""

    @property
    def state(self) -> RelayState:
        return self.machine.state

    def approving(self) -> None:
        """A local client answers this session's approvals: the owner is to be told."""
        if self.machine.may(RelayState.APPROVING):
            self.machine.move(RelayState.APPROVING)

    def ended(self) -> None:
        """The session's exited came: no more events."""
        if self.machine.may(RelayState.ENDED):
            self.machine.move(RelayState.ENDED)


class Relays:
    """This node's relays of remote sessions' events, and its stand-ins for remote
    approvers (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        member: FleetMember,
        identity: Identity,
        runner: RunnerLink,
        forward: Forward,
    ) -> None:
        self.bus = bus
        self.member = member
        self.identity = identity
        self.runner = runner
        self.forward = forward
        self.tg: anyio.abc.TaskGroup | None = None
        """The router's task group (set by its run)."""
        self._relays: dict[str, Relay] = {}
        self._locks: dict[str, anyio.Lock] = {}
        """sid -> held while its relay is opened: one subscription per session."""
        self._stand_ins: dict[str, tuple[Subscription, float]] = {}
        """sid -> this bus's approver subscription for a client on another node, and until when."""

    def get(self, sid: str) -> Relay | None:
        return self._relays.get(sid)

    async def open(self, node: str, sid: str, principal: str | None, owner: str) -> Relay | None:
        """The relay of ``sid``'s events from ``node``: one per session however many
        requests open it at once (each would otherwise subscribe, and the losers'
        subscriptions republish every event again, for ever)."""
        lock = self._locks.setdefault(sid, anyio.Lock())
        try:
            async with lock:
                return await self._open(node, sid, principal, owner)
        finally:
            stats = lock.statistics()
            if not stats.locked and not stats.tasks_waiting:
                self._locks.pop(sid, None)

    async def _open(self, node: str, sid: str, principal: str | None, owner: str) -> Relay | None:
        relay = self._relays.get(sid)
        if relay is not None and relay.node == node and relay.state is not RelayState.ENDED:
            return relay
        if relay is not None:
            self.drop_soon(sid)
        source = Identity(f"fleet:{node}")
        ids: dict[int, int] = {}
        warned = False

        async def republish(msg: Msg) -> None:
            nonlocal warned
            try:
                _, event_sid, name = parse_event_subject(msg.subject)
                event = decode_event(msg.data)
            except BadRoute:
                return
            if event_sid != sid:
                return
            if event.principal != owner:
                # the owner's word for another principal: never on this bus as that one
                if not warned:
                    warned = True
                    log.warning(
                        "fleet.relayed_event_dropped",
                        node=node,
                        session_id=sid,
                        event_name=name,
                        principal_id=event.principal,
                        expected=owner,
                    )
                return
            with contextlib.suppress(BusError):
                local = self.bus.publish_raw(
                    source,
                    event_topic(sid, name),
                    bytes(event.payload),
                    on_behalf_of=event.principal,
                )
                if event.id:
                    ids[event.id] = local.id
                    if len(ids) > IDS_KEPT:
                        del ids[next(iter(ids))]
            if name == SessionEvent.EXITED:
                current = self._relays.get(sid)
                if current is not None:
                    current.ended()

        try:
            with nats_errors(f"the relay of {sid!r}"):
                sub = await self.member.nc.subscribe(event_pattern(node, sid), cb=republish)
                # subscribed at the servers before the request
                await self.member.nc.flush(timeout=2)
        except FleetError as exc:
            log.warning(
                "fleet.relay_failed", node=node, session_id=sid, code=exc.code, error=describe(exc)
            )
            return None
        relay = self._relays[sid] = Relay(node, sub, ids, principal)
        return relay

    def drop_soon(self, sid: str) -> None:
        relay = self._relays.pop(sid, None)
        if relay is None:
            return
        relay.machine.move(RelayState.DROPPED)
        if self.tg is not None:
            self.tg.start_soon(_unsubscribe, relay.sub)

    async def prune(self) -> None:
        """A relay lives while a local client (not the router) subscribes to its events;
        while one answers its approvals too, the owner is told so every second."""
        while True:
            await anyio.sleep(RELAY_CHECK)
            for sid, relay in list(self._relays.items()):
                topic = event_topic(sid, SessionEvent.EXITED)
                ended = relay.state is RelayState.ENDED
                if ended or not self.bus.has_subscribers(topic, besides=self.identity):
                    self.drop_soon(sid)
                elif relay.state is RelayState.APPROVING and self.approver_here(sid):
                    assert self.tg is not None
                    self.tg.start_soon(self.tell_approver, relay.node, sid, relay)
            now = anyio.current_time()
            for sid, (stand_in, until) in list(self._stand_ins.items()):
                if until <= now:
                    del self._stand_ins[sid]
                    stand_in.close()

    def approver_here(self, sid: str) -> bool:
        return self.bus.has_subscribers(approver_topic(sid), besides=self.identity)

    async def tell_approver(self, node: str, sid: str, relay: Relay) -> None:
        """Tell ``node`` that a client here answers ``sid``'s approvals for a while."""
        request = Envelope(0, "", b"", self.identity.source, relay.principal)
        payload = msgspec.json.encode({"seconds": APPROVER_FOR})
        reply = await self.forward(node, "approver", sid, request, payload)
        if not reply.get("ok"):
            log.warning("fleet.approver_not_told", node=node, session_id=sid, reply=reply)

    async def stand_in(self, sid: str, principal: str | None, payload: bytes) -> dict[str, Any]:
        """An approver on another node answers ``sid``'s approvals: be present for it on
        this bus (``sage.v1.approver.<sid>``) for the seconds asked (at most 10), if the
        session is that principal's."""
        try:
            seconds = float(msgspec.json.decode(payload).get("seconds", 0))
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            return replies.error(ErrorCode.BAD_REQUEST, "approver: {seconds} expected")
        seen = await self.runner.ask(Verb.SESSION, sid, principal=principal)
        if not seen.get("ok"):
            return seen  # unknown_session: another principal's, or none
        until = anyio.current_time() + max(0.0, min(seconds, 10.0))
        held = self._stand_ins.get(sid)
        if held is None:
            stand_in = self.bus.subscribe(approver_topic(sid), self.identity, limit=1)
            self._stand_ins[sid] = (stand_in, until)
        else:
            self._stand_ins[sid] = (held[0], until)
        return replies.ok(session_id=sid)

    async def close(self) -> None:
        """Unsubscribe every relay (the router is stopping)."""
        for relay in self._relays.values():
            with contextlib.suppress(FleetError), nats_errors("a relay's unsubscribe"):
                await relay.sub.unsubscribe()


async def _unsubscribe(sub: NatsSubscription) -> None:
    with (
        contextlib.suppress(FleetError),
        nats_errors("a relay's unsubscribe"),
        anyio.move_on_after(1.0),
    ):
        await sub.unsubscribe()
