"""Sessions anywhere: the registry, forwarded requests and relayed events (the async shell).

One :class:`Router` per node in a fleet, run by the supervisor beside the
session runner, which knows nothing of it:

- **Registry.** It follows the local bus's session events; a ``spawned``
  puts ``{node, principal_id, state}`` under ``<node>.<sid>`` in the
  ``sage_sessions`` bucket (the only keys its NATS user may write), an
  ``exited`` deletes it.  A session claimed by several nodes is the live one's;
  two live claimants are refused ``session_conflict`` and logged
  (sage/fleet/routes.py, :func:`~sage.fleet.routes.resolve`).
- **Events out.** Every local session event is published on NATS as
  ``sage.fleet.<node>.event.<sid>.<name>`` with its principal (a
  :class:`~sage.fleet.routes.ForwardedEvent`).
- **Requests in.** A request on the node's own prefix
  ``sage.fleet.<node>.request.<origin>.<verb>[.<sid>]`` (the server lets a node
  publish only its own name as ``<origin>``) becomes the runner's own local
  request, made on behalf of the principal the sending node established, if
  that node may vouch for it (sage/fleet/vouching.py; else it is refused
  ``principal_not_authenticated`` and audited ``fleet_principal_rejected``); the
  runner's reply goes back as it is.
- **Requests out.** The CLI asks the local runner first, as it always did; only
  when the runner does not know the session (``unknown_session``), or for
  ``spawn --node`` and the fleet-wide listing, it asks the router on
  ``sage.v1.request.fleet.<verb>[.<sid>]``.  The router finds the owner in the
  registry and forwards; while a local client watches that session, the
  owner's events are republished on the local bus (``sage.v1.event.<sid>.<name>``,
  on behalf of the session's principal), so ``send`` and ``watch`` work
  unchanged.  The local path is the same as on a single host.

- **Fencing.** Back after it may have been judged lost (a SIGSTOP, a partition),
  and every few heartbeats, it ends ``failed_over`` each of its sessions that
  ``sage_claims`` gives another node (``sage.v1.request.yield.<sid>`` to its runner;
  sage/fleet/fencing.py).

The principal a forwarded request carries is the local envelope's, which the
bus set from the caller's connection (SO_PEERCRED): nothing in the caller's
payload can name another (docs/security.md, "Fleet trust model").
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from bus import Bus, BusError, Envelope, Identity, NoResponders, Subscription
from sage import replies
from sage.config import Config
from sage.fleet.adoption import HIBERNATED
from sage.fleet.failover import CLAIMS_TOPIC, Failover
from sage.fleet.fencing import BATCH, SWEEP_BEATS, Sweep, runs_elsewhere
from sage.fleet.inflight import MAX_IN_FLIGHT, FleetBusy, InFlight
from sage.fleet.lifecycle import LifecycleEvents
from sage.fleet.member import FleetMember
from sage.fleet.nodes import NodeState
from sage.fleet.placement import ANY, NODE_REFUSALS, Passed, Placement, place, refusal_text
from sage.fleet.registry_copy import RegistryCopy, current_claims, follow
from sage.fleet.routes import (
    APPROVAL_VERBS,
    SESSION_VERBS,
    BadRoute,
    Forwarded,
    ForwardedEvent,
    SessionConflict,
    SessionEntry,
    approval_answer,
    check_name,
    decode_event,
    decode_forwarded,
    event_of,
    event_pattern,
    event_subject,
    local_topic,
    parse_event_subject,
    parse_request_subject,
    registry_key,
    registry_rows,
    request_subject,
    resolve,
    visible,
)
from sage.fleet.vouching import (
    REJECTED,
    REJECTED_EVENT,
    NotVouched,
    VouchedPrincipals,
    rejected_row,
)

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription as NatsSubscription

__all__ = ("LOCAL_REQUESTS", "Router")

log = structlog.get_logger("sage.fleet.router")

LOCAL_REQUESTS = (
    "sage.v1.request.fleet.*.*",
    "sage.v1.request.fleet.spawn",
    "sage.v1.request.fleet.approvals",
    CLAIMS_TOPIC,
)
"""What the router answers on the local bus (``sessions`` too, see :data:`LISTING`)."""
LISTING = "sage.v1.request.fleet.sessions"
APPROVALS_LISTING = "sage.v1.request.fleet.approvals"
DEADLINES = {
    "spawn": 30.0,
    "send": 120.0,
    "wake": 120.0,
    "stop": 30.0,
    "adopt": 120.0,
    "yield": 30.0,
}
"""Seconds a forwarded request may take at its owner (others: :data:`DEFAULT_DEADLINE`)."""
DEFAULT_DEADLINE = 10.0
NETWORK_SLACK = 2.0
RELAY_CHECK = 1.0  # seconds between two looks at whether a relayed session is still watched
LISTING_DEADLINE = 3.0
APPROVER_FOR = 3.0  # seconds an approver presence told to the owner lasts (renewed each second)
IDS_KEPT = 512  # republished events whose owner's id a relay remembers (watch --replay: 256)
RESYNC_CHECK = 1.0  # seconds between two looks at whether the registry needs a resync
LISTING_FROM_BUCKET = "ASTRID_TEST_LISTING_FROM_BUCKET"
"""Set to ``1`` in a supervisor's environment, its fleet listing reads the bucket even
while the registry copy could answer: for the bench and tests only (they compare the two
paths), never a config option."""


def unavailable(message: str) -> dict[str, Any]:
    return replies.error("fleet_unavailable", message)


class _Relay:
    """A remote session's events, republished locally while someone here watches."""

    def __init__(
        self, node: str, sub: NatsSubscription, ids: dict[int, int], principal: str | None
    ) -> None:
        self.node = node
        self.sub = sub
        self.ended = False
        self.principal = principal
        """Whose session it is, as the caller that opened the relay was established."""
        self.approver = False
        """Whether a local client answers its approvals (told to the owner every second)."""
        self.ids = ids
        """The owner's envelope id -> this bus's, of the events republished (the last
        :data:`IDS_KEPT`): a watch's replay and its live events then share one order."""


class Router:
    """This node's side of sessions anywhere (see the module docstring)."""

    def __init__(
        self, bus: Bus, member: FleetMember, config_of: Callable[[], Config] | None = None
    ) -> None:
        self.bus = bus
        self.member = member
        self.node = member.node
        self.identity = Identity("fleet")
        self.config_of = config_of
        """The config in force (``[sessions] resume``, the principals): failover needs it."""
        self.failover = (
            None if config_of is None else Failover(bus, member, config_of, self._ask_as_supervisor)
        )
        self._relays: dict[str, _Relay] = {}
        self._relay_locks: dict[str, anyio.Lock] = {}
        """sid -> held while its relay is opened: one subscription per session."""
        self._stand_ins: dict[str, tuple[Subscription, float]] = {}
        """sid -> this bus's approver subscription for a client on another node, and until when."""
        self._registry_writes: MemoryObjectSendStream[tuple[str, SessionEntry | None]]
        self.registry_copy = RegistryCopy()
        """The registry as a watch keeps it here: a remote owner without a NATS round trip."""
        self._listing_from_copy = os.environ.get(LISTING_FROM_BUCKET) != "1"
        self._here: set[str] = set()
        """Sessions this node's runner has: spawned and not exited, as its events said, and
        those its listing had at a resync (restored at a start, say)."""
        self._exited_meanwhile: set[str] | None = None
        """During a resync: the sessions whose ``exited`` came after its listing was asked."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._lifecycle = LifecycleEvents(self.identity)
        """The lifecycle events' own queue (made again, and added to the bus, by run)."""
        self._in_flight = InFlight("forwarded requests")
        """Each peer's forwarded requests being answered: at most MAX_IN_FLIGHT at once."""
        self.vouched = VouchedPrincipals(
            member.record_of, member.config.peers, ttl=member.config.heartbeat
        )
        """Whether a sending node may act for the principal it names (its record, our pins)."""

    # -- life -----------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        events = self.bus.subscribe("sage.v1.event.>", self.identity, limit=8192)
        lifecycle = self._lifecycle = LifecycleEvents(self.identity)
        self.bus.add(lifecycle)  # the registry's and failover's own queue: no delta fills it
        local = [
            self.bus.subscribe(pattern, self.identity) for pattern in (*LOCAL_REQUESTS, LISTING)
        ]
        send, receive = anyio.create_memory_object_stream[tuple[str, SessionEntry | None]](1024)
        self._registry_writes = send
        nats_sub: NatsSubscription | None = None
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg  # before the first forwarded request can come in
                nats_sub = await self.member.nc.subscribe(
                    f"sage.fleet.{self.node}.request.>", cb=self._forwarded_in
                )
                tg.start_soon(self._events_out, events)
                tg.start_soon(self._keep_books, lifecycle.queue)
                tg.start_soon(self._write_registry, receive)
                for sub in local:
                    tg.start_soon(self._serve_local, sub)
                tg.start_soon(self._prune_relays)
                tg.start_soon(self._keep_registry)
                tg.start_soon(self._keep_fenced)
                if self.failover is not None:
                    await self.failover.run(tg)
                if self.member.registry is not None:
                    connected = lambda: self.member.connected  # noqa: E731
                    tg.start_soon(follow, self.member.registry, self.registry_copy, connected)
                task_status.started()
        finally:
            self.bus.remove(lifecycle)
            lifecycle.close()
            send.close()
            receive.close()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                if nats_sub is not None:
                    with contextlib.suppress(Exception):
                        await nats_sub.unsubscribe()
                for relay in self._relays.values():
                    with contextlib.suppress(Exception):
                        await relay.sub.unsubscribe()

    # -- registry and events out -----------------------------------------------

    async def _keep_books(self, lifecycle: Any) -> None:
        """The registry and failover follow this node's sessions' lifecycle events (their
        own queue, sage/fleet/lifecycle.py: deltas never crowd them out)."""
        async for envelope in lifecycle:
            if envelope.source.startswith("fleet:"):
                continue  # another node's session, republished here: not in our books
            found = event_of(envelope.topic)
            if found is None:
                continue
            sid, name = found
            if name in ("spawned", "hibernated") and envelope.principal:
                # a hibernated session says so: a node that adopts it keeps it asleep
                entry = SessionEntry(
                    node=self.node,
                    principal_id=envelope.principal,
                    state="running" if name == "spawned" else HIBERNATED,
                    at=time.time(),
                    resume=self._resumes(),
                )
                self._note(sid, entry)
                self._here.add(sid)
            elif name == "exited":
                self._note(sid, None)
                self._here.discard(sid)
                if self._exited_meanwhile is not None:
                    self._exited_meanwhile.add(sid)
                if self.failover is not None:
                    self.failover.ended(sid)
            elif name == "done" and self.failover is not None:
                self.failover.turn_done(sid)

    async def _events_out(self, events: Any) -> None:
        nc = self.member.nc
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
            with contextlib.suppress(Exception):
                await nc.publish(event_subject(self.node, sid, name), event.encode())

    def _resumes(self) -> bool:
        """Whether this node's sessions are resumed (here after a restart, elsewhere after
        its loss): ``[sessions] resume``."""
        return self.config_of is not None and self.config_of().sessions.resume

    async def _ask_as_supervisor(self, topic: str, payload: dict[str, Any]) -> dict[str, Any]:
        verb = topic.split(".")[3]
        return await self._ask_runner(
            self.identity, topic, msgspec.json.encode(payload), None, verb
        )

    def _note(self, sid: str, entry: SessionEntry | None) -> None:
        try:
            self._registry_writes.send_nowait((sid, entry))
        except anyio.WouldBlock:  # the registry is told again by the next resync
            log.warning("fleet.registry_write_dropped", session_id=sid)
            self._lifecycle.lost = True

    async def _write_registry(self, writes: Any) -> None:
        registry = self.member.registry
        assert registry is not None
        async for sid, entry in writes:
            try:
                with anyio.fail_after(5.0):
                    if entry is None:
                        await self._forget(registry, sid)
                    else:
                        await registry.put(registry_key(self.node, sid), entry.encode())
            except Exception as exc:
                log.warning("fleet.registry_write_failed", session_id=sid, error=_describe(exc))

    async def _forget(self, registry: Any, sid: str) -> None:
        """Delete this node's claim to ``sid`` (a session this node ended ``failed_over``
        runs on another, whose claim is under that node's name and stays).  Its
        ``sage_claims`` key goes too when it names this node and no other node claims
        the session; while a lost node's stale claim remains, the key stays, saying the
        session was taken from that node, so no one adopts it from there again."""
        from nats.js.errors import KeyWrongLastSequenceError

        await registry.delete(registry_key(self.node, sid))
        claims = self.member.claims
        if claims is None:
            return
        claim, revision = await self.member.claim_of(sid)
        if claim is None or claim.node != self.node or await self.member.claims_of(sid):
            return
        with contextlib.suppress(KeyWrongLastSequenceError):  # taken meanwhile: it stays
            await claims.delete(sid, last=revision)

    # -- fencing: sessions another node took while this one was judged lost ------

    async def _keep_fenced(self) -> None:
        """Look for this node's sessions another node runs now (sage/fleet/fencing.py):
        at once when the node may have been judged lost and is back, else every
        :data:`~sage.fleet.fencing.SWEEP_BEATS` heartbeats, a batch at a time."""
        sweep = Sweep()
        every = SWEEP_BEATS * self.member.config.heartbeat
        while True:
            returned = False
            with anyio.move_on_after(every):
                await self.member.returned.wait()
                returned = True
            if returned:
                self.member.returned = anyio.Event()
                sids = sorted(self._here)  # all of them, now, and claimed again
            else:
                sids = sweep.next(self._here)
            if sids and self.member.connected:
                await self.fence(sids, take_back=returned)

    async def fence(self, sids: list[str], *, take_back: bool = False) -> list[str]:
        """End ``failed_over`` each of ``sids`` (sessions here) whose ``sage_claims`` key
        names another node; the sessions still this node's are returned (those whose
        claim could not be read too: the next sweep looks again).  ``take_back`` (the
        node is back after it may have been judged lost): the others are claimed again
        for this node, so an adoption under way loses its race
        (:meth:`~sage.fleet.failover.Failover.take_back`)."""
        if self.member.claims is None:
            return sids
        elsewhere: dict[str, str] = {}
        unread: set[str] = set()
        for at in range(0, len(sids), BATCH):
            batch = sids[at : at + BATCH]
            try:
                with anyio.fail_after(10.0):
                    if take_back and self.failover is not None:
                        elsewhere |= await self.failover.take_back(batch)
                        continue
                    for sid in batch:
                        claim, _ = await self.member.claim_of(sid)
                        node = runs_elsewhere(self.node, claim)
                        if node is not None:
                            elsewhere[sid] = node
            except Exception as exc:
                log.warning("fleet.fence_check_failed", sessions=len(batch), error=_describe(exc))
                unread |= set(batch) - elsewhere.keys()
        registry = self.member.registry
        for sid, node in sorted(elsewhere.items()):
            log.warning("fleet.fenced", session_id=sid, node=node)
            if not take_back and registry is not None:  # (take_back deleted it already)
                # this node's claim goes first: beside the adopter's, a conflict
                with contextlib.suppress(Exception), anyio.move_on_after(5.0):
                    await registry.delete(registry_key(self.node, sid))
            reply = await self._ask_runner(
                self.identity,
                f"sage.v1.request.yield.{sid}",
                msgspec.json.encode({"node": node}),
                None,
                "yield",
            )
            if not reply.get("ok") and reply.get("error") != "unknown_session":
                log.error("fleet.fence_failed", session_id=sid, node=node, reply=reply)
                continue  # still here: the next sweep tries again
            self._here.discard(sid)
        return [sid for sid in sids if sid not in elsewhere or sid in unread]

    async def _keep_registry(self) -> None:
        """Make the registry agree with the runner at start and after each outage: a
        spawn or an end whose write was lost meanwhile (or a restart that ended
        sessions without ``exited``) is written again."""
        synced = False
        while True:
            if self._lifecycle.lost:  # a spawned or exited was dropped (logged): look again
                self._lifecycle.lost = False
                synced = False
            connected = self.member.connected
            if connected and not synced:
                synced = await self._resync()
            elif not connected:
                synced = False
            await anyio.sleep(RESYNC_CHECK)

    async def _resync(self) -> bool:
        """One pass (False: the runner or the registry could not be read; try again)."""
        since = time.time()
        self._exited_meanwhile = set()
        try:
            listing = await self._ask_runner(
                self.identity, "sage.v1.request.sessions", b"{}", None, "sessions"
            )
            if not listing.get("ok"):
                return False  # no runner yet (it starts after the router), or none at all
            live = {
                str(row["session_id"]): str(row.get("principal_id") or "")
                for row in listing.get("sessions") or []
                if isinstance(row, dict) and row.get("state") != "ended"
            }
            self._here |= live.keys() - self._exited_meanwhile
        finally:
            self._exited_meanwhile = None
        try:
            with anyio.fail_after(LISTING_DEADLINE):
                entries = await self.member.session_entries()
        except Exception as exc:
            log.warning("fleet.registry_unreadable", error=_describe(exc))
            return False
        mine = {sid: entry for sid, entry, _ in entries if entry.node == self.node}
        # a session another node took while this one was away is never claimed again:
        # it ends here (its exited deletes this node's claim), the adopter keeps it
        missing = [sid for sid, principal in live.items() if principal and sid not in mine]
        taken = set(missing) - set(await self.fence(sorted(missing)))
        put = delete = 0
        for sid, principal in sorted(live.items()):
            if principal and sid not in mine and sid not in taken:
                self._note(
                    sid,
                    SessionEntry(
                        node=self.node, principal_id=principal, at=since, resume=self._resumes()
                    ),
                )
                put += 1
        for sid, entry in sorted(mine.items()):
            # an entry written after the listing was taken is a spawn's: left alone
            if sid not in live and entry.at < since:
                self._note(sid, None)
                delete += 1
        if put or delete:
            log.info("fleet.registry_resynced", put=put, deleted=delete)
        return True

    async def lookup(self, sid: str, principal: str | None = None) -> SessionEntry | None:
        """The claim a request for ``sid`` by a caller acting for ``principal`` (None: an
        admin) follows: of the claims it may see, the live node's when there are several
        (sage/fleet/routes.py, :func:`~sage.fleet.routes.resolve`).  Two live claimants:
        SessionConflict, logged; raises what nats-py raised when it cannot ask."""
        claims = await self.member.claims_of(check_name(sid, "session id"))
        claims = {node: entry for node, entry in claims.items() if visible(entry, principal)}
        live: set[str] = set()
        if len(claims) > 1:
            views = await self.member.nodes()
            live = {view.node for view in views if view.state is NodeState.LIVE}
        try:
            return resolve(sid, claims, live)
        except SessionConflict:
            log.warning("fleet.session_conflict", session_id=sid, nodes=sorted(claims))
            raise

    # -- requests in (from other nodes) ----------------------------------------

    async def _forwarded_in(self, msg: Msg) -> None:
        """A request on this node's own prefix: the runner answers it as for a local caller
        of the principal the sending node established."""
        if not msg.reply:
            return
        try:
            origin, verb, sid = parse_request_subject(self.node, msg.subject)
            forwarded = decode_forwarded(msg.data)
        except BadRoute as exc:
            await _respond(msg, replies.from_error(exc))
            return
        try:
            self._in_flight.take(origin)
        except FleetBusy as exc:
            log.warning("fleet.peer_busy", origin=origin, verb=verb, in_flight=MAX_IN_FLIGHT)
            await _respond(msg, replies.from_error(exc))
            return
        assert self._tg is not None
        self._tg.start_soon(self._answer_counted, msg, origin, verb, sid, forwarded)

    async def _answer_counted(
        self, msg: Msg, origin: str, verb: str, sid: str | None, forwarded: Forwarded
    ) -> None:
        try:
            await self._answer_forwarded(msg, origin, verb, sid, forwarded)
        finally:
            self._in_flight.give_back(origin)

    async def _vouched(
        self, msg: Msg, origin: str, verb: str, sid: str | None, principal: str | None
    ) -> bool:
        """Whether ``origin`` may act for ``principal`` here; if not, the sender is told
        why and this node's chain keeps the refusal (never the payload)."""
        try:
            with anyio.fail_after(LISTING_DEADLINE):
                await self.vouched.check(origin, principal)
            return True
        except NotVouched as exc:
            refused = rejected_row(origin, principal, verb, sid, msg.subject, exc)
            log.warning(REJECTED_EVENT, **refused)
            with contextlib.suppress(BusError):
                self.bus.publish(self.identity, f"sage.v1.audit.{REJECTED}", refused)
            await _respond(msg, replies.from_error(exc))
        except Exception as exc:  # the node bucket cannot be read now
            await _respond(
                msg,
                unavailable(
                    f"node {self.node!r} cannot check node {origin!r}'s principals now:"
                    f" {_describe(exc)}"
                ),
            )
        return False

    async def _answer_forwarded(
        self, msg: Msg, origin: str, verb: str, sid: str | None, forwarded: Forwarded
    ) -> None:
        if not await self._vouched(msg, origin, verb, sid, forwarded.principal):
            return
        identity = Identity(f"fleet:{origin}")
        payload = bytes(forwarded.payload)
        if verb in ("sessions", "approvals"):
            reply = await self._local_listing(payload, forwarded.principal, identity, verb)
        elif verb == "approver":
            assert sid is not None
            reply = await self._stand_in(sid, forwarded.principal, payload)
            if not reply.get("ok"):
                log.info("fleet.approver_refused", origin=origin, session_id=sid)
            await _respond(msg, reply)
            return
        else:
            reply = await self._ask_runner(
                identity, local_topic(verb, sid), payload, forwarded.principal, verb
            )
        what = {
            "origin": origin,
            "verb": verb,
            "session_id": sid,
            "principal_id": forwarded.principal,
            "ok": reply.get("ok"),
        }
        log.info("fleet.forwarded_in", **what)
        if verb not in ("sessions", "approvals"):  # who vouched for whom, in this node's chain
            with contextlib.suppress(BusError):
                self.bus.publish(self.identity, "sage.v1.audit.fleet_request", what)
        await _respond(msg, reply)

    async def _ask_runner(
        self, identity: Identity, topic: str, payload: bytes, principal: str | None, verb: str
    ) -> dict[str, Any]:
        try:
            answer = await self.bus.request_raw(
                identity,
                topic,
                payload,
                deadline=DEADLINES.get(verb, DEFAULT_DEADLINE),
                on_behalf_of=principal,
            )
        except NoResponders:
            return replies.error("no_runner", f"node {self.node!r} runs no session runner")
        except BusError as exc:
            return replies.error("fleet_unavailable", f"node {self.node!r}: {exc}")
        try:
            data = msgspec.json.decode(answer.payload)
        except msgspec.DecodeError:
            return replies.error("internal_error", f"node {self.node!r}: a reply that is not JSON")
        return data if isinstance(data, dict) else replies.error("internal_error", "bad reply")

    async def _local_listing(
        self, payload: bytes, principal: str | None, identity: Identity, verb: str = "sessions"
    ) -> dict[str, Any]:
        """This node's ``sessions`` (or ``approvals``), each row with its ``node``."""
        reply = await self._ask_runner(
            identity, f"sage.v1.request.{verb}", payload, principal, verb
        )
        for row in reply.get(verb) or []:
            if isinstance(row, dict):
                row["node"] = self.node
        return reply

    # -- requests out (from local clients) -------------------------------------

    async def _serve_local(self, requests: Any) -> None:
        async for request in requests:
            if request.reply_to:
                assert self._tg is not None
                self._tg.start_soon(self._answer_local, request)

    async def _answer_local(self, request: Envelope) -> None:
        try:
            reply = await self._route(request)
        except BadRoute as exc:
            reply = replies.from_error(exc)
        except Exception as exc:  # a bug must not take the supervisor down
            log.exception("fleet.route_failed", topic=request.topic)
            reply = replies.error("internal_error", f"fleet routing failed ({type(exc).__name__})")
        with contextlib.suppress(BusError):
            self.bus.reply(self.identity, request.reply_to or "", reply)

    async def _route(self, request: Envelope) -> dict[str, Any]:
        parts = request.topic.split(".")
        verb = parts[4] if len(parts) > 4 else ""
        if request.topic == LISTING:
            return await self._listing(request)
        if request.topic == CLAIMS_TOPIC:
            if self.failover is None:
                return replies.ok(elsewhere={})
            return await self.failover.claims(request)
        if request.topic == APPROVALS_LISTING:
            return await self._approvals(request)
        if verb in APPROVAL_VERBS and len(parts) == 6:
            return await self._approve(request, verb, check_name(parts[5], "approval id"))
        if verb == "spawn" and len(parts) == 5:
            return await self._spawn(request)
        if verb not in SESSION_VERBS or len(parts) != 6:
            return replies.error("bad_request", f"no fleet request {request.topic!r}")
        sid = check_name(parts[5], "session id")
        if sid in self._here:
            # the runner has it and answers (the CLI asks both at once): nothing to forward
            return replies.error("unknown_session", f"session {sid!r} is on this node")
        if not self.member.connected:
            return unavailable(
                f"session {sid!r} is not on node {self.node!r}, and the fleet cannot be asked"
                " now: NATS is not connected"
            )
        cached = self._remote_in_copy(sid, request.principal)
        entry = cached
        if entry is None:
            try:
                entry = await self._remote_owner(sid, request.principal)
            except SessionConflict as exc:
                return replies.from_error(exc)
            except Exception as exc:
                return unavailable(f"cannot read the session registry now: {_describe(exc)}")
        if entry is None:
            # another principal's session looks the same as none, as on one node
            return replies.error("unknown_session", f"no session {sid!r}")
        relay, reply = await self._forward_session(entry, verb, sid, request)
        if cached is not None and not reply.get("ok"):
            # the copy may be stale (the session moved, ended, or its node is gone): the
            # bucket decides, and only another node it names is asked again
            try:
                fresh = await self._remote_owner(sid, request.principal)
            except SessionConflict as exc:
                self.registry_copy.found_stale()
                return replies.from_error(exc)
            except Exception as exc:
                return unavailable(f"cannot read the session registry now: {_describe(exc)}")
            if fresh is None or fresh.node != entry.node:
                self.registry_copy.found_stale()
                log.info(
                    "fleet.registry_copy_stale",
                    session_id=sid,
                    copy=entry.node,
                    node=fresh.node if fresh is not None else None,
                )
            if fresh is not None and fresh.node != entry.node:
                entry = fresh
                relay, reply = await self._forward_session(entry, verb, sid, request)
        if verb == "session":
            ids = relay.ids if relay is not None else {}
            for event in reply.get("events") or []:
                if isinstance(event, dict):  # the owner's envelope ids, made this bus's
                    owner_id = event.get("id")
                    event["id"] = ids.get(owner_id, 0) if isinstance(owner_id, int) else 0
            if isinstance(reply.get("session"), dict):
                reply["session"]["node"] = entry.node
        if relay is not None and not reply.get("ok"):
            self._drop_relay_soon(sid)
        return reply

    def _remote_in_copy(self, sid: str, principal: str | None) -> SessionEntry | None:
        """The owner the registry copy names, if another node and the caller may see
        the session; anything else is left to the bucket (see sage/fleet/registry_copy.py)."""
        entry = self.registry_copy.owner(sid)
        if entry is None or entry.node == self.node or not visible(entry, principal):
            return None
        return entry

    async def _remote_owner(self, sid: str, principal: str | None) -> SessionEntry | None:
        """The bucket's owner of ``sid`` if another node and visible to ``principal``."""
        with anyio.fail_after(LISTING_DEADLINE):
            entry = await self.lookup(sid, principal)
        if entry is None or entry.node == self.node:
            return None
        return entry

    async def _forward_session(
        self, entry: SessionEntry, verb: str, sid: str, request: Envelope
    ) -> tuple[_Relay | None, dict[str, Any]]:
        """Forward a request about ``sid`` to its owner (``entry.node``), with the relay of
        its events opened first when the caller follows them: only the events of the
        session's principal in the registry are republished."""
        node = entry.node
        relay = None
        if verb in ("send", "session", "wake"):  # the caller follows the events
            relay = await self._relay(node, sid, request.principal, entry.principal_id)
            if relay is not None and verb == "send" and self._approver_here(sid):
                relay.approver = True  # before the turn: its first tool call may need us
                await self._tell_approver(node, sid, relay)
        return relay, await self._forward(node, verb, sid, request)

    async def _spawn(self, request: Envelope) -> dict[str, Any]:
        try:
            body = msgspec.json.decode(request.payload or b"{}")
        except msgspec.DecodeError as exc:
            return replies.error("bad_request", f"not JSON: {exc}")
        if not isinstance(body, dict):
            return replies.error("bad_request", "a spawn is a JSON object")
        node = str(body.pop("node", "") or "")
        if not node:  # no --node: as [fleet] placement says
            node = ANY if self.member.config.placement == "least_loaded" else self.node
        if node == ANY:
            return await self._place(request, body)
        node = check_name(node, "node")
        reply = await self._spawn_on(node, request, msgspec.json.encode(body))
        if reply.get("ok"):
            reply["node"] = node
        return reply

    async def _spawn_on(self, node: str, request: Envelope, payload: bytes) -> dict[str, Any]:
        if node == self.node:
            return await self._ask_runner(
                self.identity, "sage.v1.request.spawn", payload, request.principal, "spawn"
            )
        reply = await self._forward(node, "spawn", None, request, payload)
        if request.principal is not None or reply.get("error") != "principal_not_authenticated":
            return reply
        # an admin's that node does not take: `spawn PRINCIPAL` names whom the admin acts
        # for, so ask again as that principal's request (what --principal PRINCIPAL does);
        # a refused spawn started nothing
        named = msgspec.json.decode(payload).get("principal_id")
        if not isinstance(named, str):
            return reply
        return await self._forward(node, "spawn", None, request, payload, acting_for=named)

    async def _place(self, request: Envelope, body: dict[str, Any]) -> dict[str, Any]:
        """``spawn --node any``: on the least loaded live node that takes it
        (sage/fleet/placement.py), asking the next when one refuses for a reason of its
        own; none: one error naming each node and why.  A node that does not answer
        within the spawn's deadline ends it: the session may yet start there.  NATS down
        or the node table unreadable: this node only, with a warning."""
        principal = body.get("principal_id")
        if not isinstance(principal, str):
            return replies.error("bad_request", "a spawn names its principal_id")
        warning = None
        try:
            if not self.member.connected:
                raise RuntimeError("NATS is not connected")
            with anyio.fail_after(LISTING_DEADLINE):
                nodes = await self.member.nodes()
            placement = place(nodes, principal, self.node)
        except Exception as exc:
            warning = f"placed on this node only: the fleet's load is unknown ({_describe(exc)})"
            placement = Placement((self.node,), ())
        payload = msgspec.json.encode(body)
        refused: list[Passed] = []
        for node in placement.candidates:
            began = anyio.current_time()
            reply = await self._spawn_on(node, request, payload)
            if (
                reply.get("error") == "fleet_unavailable"
                and anyio.current_time() - began >= DEADLINES["spawn"]
            ):  # no answer in time: it may yet start there, so not a second one elsewhere
                reply["message"] = f"{reply.get('message')} (it may yet start on {node!r})"
                return reply
            if reply.get("ok"):
                reply["node"], reply["placed"] = node, True
                reply["refused"] = [{"node": p.node, "why": p.why} for p in refused]
                if warning:
                    reply["warning"] = warning
                return reply
            if reply.get("error") not in NODE_REFUSALS:
                return reply  # the caller's to mend: another node would say the same
            refused.append(Passed(node, f"{reply.get('error')}: {reply.get('message')}"))
        passed = [*placement.passed, *refused]
        log.info("fleet.placement_failed", principal_id=principal, nodes=len(passed))
        return replies.error("placement_failed", refusal_text(principal, passed))

    async def _forward(
        self,
        node: str,
        verb: str,
        sid: str | None,
        request: Envelope,
        payload: bytes | None = None,
        *,
        acting_for: str | None = None,
    ) -> dict[str, Any]:
        """Ask ``node``'s router; the reply as its runner gave it, or fleet_unavailable.
        ``acting_for``: the principal the request is for (default: the caller's)."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        if not self.member.connected:
            return unavailable(f"cannot reach node {node!r}: NATS is not connected")
        subject = request_subject(node, self.node, verb, sid)
        forwarded = Forwarded(
            # the bus's, from the caller's connection (an admin's spawn: the one it names)
            principal=acting_for if acting_for is not None else request.principal,
            payload=msgspec.Raw(request.payload if payload is None else payload),
        )
        deadline = DEADLINES.get(verb, DEFAULT_DEADLINE) + NETWORK_SLACK
        try:
            msg = await self.member.nc.request(subject, forwarded.encode(), timeout=deadline)
        except NoRespondersError:
            return unavailable(f"node {node!r} does not answer (no responders: is it running?)")
        except NatsTimeout:
            return unavailable(f"node {node!r} did not answer within {deadline:g} s")
        except Exception as exc:
            return unavailable(f"cannot reach node {node!r}: {_describe(exc)}")
        try:
            data = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            return replies.error(
                "internal_error", f"node {node!r} answered with something not JSON"
            )
        if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
            return replies.error("internal_error", f"node {node!r} broke the reply contract")
        return data

    # -- approvals on other nodes ------------------------------------------------

    async def _live_peers(self) -> list[str]:
        with anyio.fail_after(LISTING_DEADLINE):
            nodes = await self.member.nodes()
        return [v.node for v in nodes if v.node != self.node and v.state is NodeState.LIVE]

    async def _approve(self, request: Envelope, verb: str, cid: str) -> dict[str, Any]:
        """An approval the local runner does not hold: asked of every live node; the one
        that holds it answers (for the caller's principal, as locally)."""
        if not self.member.connected:
            return unavailable(
                f"approval {cid!r} is not on node {self.node!r}, and the fleet cannot be asked"
                " now: NATS is not connected"
            )
        try:
            peers = await self._live_peers()
        except Exception as exc:
            return unavailable(f"cannot read the node bucket now: {_describe(exc)}")
        answers: list[dict[str, Any]] = []

        async def ask(node: str) -> None:
            answers.append(await self._forward(node, verb, cid, request))

        async with anyio.create_task_group() as tg:
            for node in peers:
                tg.start_soon(ask, node)
        answer = approval_answer(answers)
        if answer is not None:
            return answer
        return replies.error(
            "unknown_approval", f"no pending approval {cid!r} (unknown, decided or expired)"
        )

    async def _approvals(self, request: Envelope) -> dict[str, Any]:
        """Every live node's pending approvals the caller may answer, with their node."""
        reply = await self._local_listing(
            request.payload or b"{}", request.principal, self.identity, "approvals"
        )
        if not reply.get("ok") or not self.member.connected:
            return reply
        try:
            peers = await self._live_peers()
        except Exception as exc:
            reply["warning"] = f"this node's approvals only: {_describe(exc)}"
            return reply
        rows: list[dict[str, Any]] = list(reply.get("approvals") or [])
        refused: dict[str, str] = {}

        async def ask(node: str) -> None:
            with anyio.move_on_after(LISTING_DEADLINE):
                data = await self._forward(node, "approvals", None, request)
                rows.extend(r for r in data.get("approvals") or [] if isinstance(r, dict))
                _note_refusal(refused, node, data)

        async with anyio.create_task_group() as tg:
            for node in peers:
                tg.start_soon(ask, node)
        reply["approvals"] = rows
        if refused:
            reply["warning"] = _refusals(refused)
        return reply

    # -- the fleet-wide listing --------------------------------------------------

    async def _listing(self, request: Envelope) -> dict[str, Any]:
        principal = request.principal
        reply = await self._local_listing(request.payload or b"{}", principal, self.identity)
        if not reply.get("ok"):
            return reply
        rows: list[dict[str, Any]] = list(reply.get("sessions") or [])
        if not self.member.connected:
            reply["warning"] = "this node's sessions only: NATS is not connected"
            return reply
        try:
            with anyio.fail_after(LISTING_DEADLINE):
                nodes = await self.member.nodes()
                source, entries = await self._listed_entries()
        except Exception as exc:
            reply["warning"] = f"this node's sessions only: {_describe(exc)}"
            return reply
        states = {view.node: view.state for view in nodes}
        answers: dict[str, list[dict[str, Any]] | None] = {}
        refused: dict[str, str] = {}

        async def ask(node: str) -> None:
            with anyio.move_on_after(LISTING_DEADLINE):
                data = await self._forward(node, "sessions", None, request)
                if data.get("ok"):
                    answers[node] = [r for r in data.get("sessions") or [] if isinstance(r, dict)]
                    return
                _note_refusal(refused, node, data)
            answers[node] = None

        async with anyio.create_task_group() as tg:
            for node, state in states.items():
                if node != self.node and state is NodeState.LIVE:
                    tg.start_soon(ask, node)
        for node in sorted(states):
            answered = answers.get(node)
            if node != self.node and answered is not None:
                rows += answered
        listed = {row.get("session_id") for row in rows}
        # a node that cannot (or will not) say: what the registry knows, with the node's
        # state (a session another node listed, its adopter, is shown there only)
        shown = {
            node: "refused"
            if node in refused
            else "unreachable"
            if state is NodeState.LIVE
            else state.value
            for node, state in states.items()
            if node != self.node and answers.get(node) is None
        }
        rows += registry_rows(entries, shown, listed, principal)
        log.info("fleet.listing", registry=source, claims=len(entries), rows=len(rows))
        reply["sessions"] = rows
        reply["nodes"] = {node: state.value for node, state in sorted(states.items())}
        if refused:
            reply["warning"] = _refusals(refused)
        return reply

    async def _listed_entries(self) -> tuple[str, list[tuple[str, SessionEntry]]]:
        """Where the listing took the registry's claims from (``copy`` or ``bucket``), and
        them: from the registry copy once it holds the bucket's latest update (one round
        trip asks which; thousands of keys read one at a time would not fit
        :data:`LISTING_DEADLINE`), else from the bucket, key by key."""
        if self._listing_from_copy:
            found = await current_claims(self.registry_copy, self.member.registry_revision)
            if found is not None:
                return "copy", [(sid, entry) for sid, entry, _ in found]
        return "bucket", [(sid, entry) for sid, entry, _ in await self.member.session_entries()]

    # -- events of remote sessions, republished here -------------------------------

    async def _relay(self, node: str, sid: str, principal: str | None, owner: str) -> _Relay | None:
        """The relay of ``sid``'s events from ``node``: one per session however many
        requests open it at once (each would otherwise subscribe, and the losers'
        subscriptions republish every event again, for ever)."""
        lock = self._relay_locks.setdefault(sid, anyio.Lock())
        try:
            async with lock:
                return await self._open_relay(node, sid, principal, owner)
        finally:
            stats = lock.statistics()
            if not stats.locked and not stats.tasks_waiting:
                self._relay_locks.pop(sid, None)

    async def _open_relay(
        self, node: str, sid: str, principal: str | None, owner: str
    ) -> _Relay | None:
        relay = self._relays.get(sid)
        if relay is not None and relay.node == node and not relay.ended:
            return relay
        if relay is not None:
            self._drop_relay_soon(sid)
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
                    f"sage.v1.event.{sid}.{name}",
                    bytes(event.payload),
                    on_behalf_of=event.principal,
                )
                if event.id:
                    ids[event.id] = local.id
                    if len(ids) > IDS_KEPT:
                        del ids[next(iter(ids))]
            if name == "exited":
                current = self._relays.get(sid)
                if current is not None:
                    current.ended = True

        try:
            sub = await self.member.nc.subscribe(event_pattern(node, sid), cb=republish)
            await self.member.nc.flush(timeout=2)  # subscribed at the servers before the request
        except Exception as exc:
            log.warning("fleet.relay_failed", node=node, session_id=sid, error=_describe(exc))
            return None
        relay = self._relays[sid] = _Relay(node, sub, ids, principal)
        return relay

    def _drop_relay_soon(self, sid: str) -> None:
        relay = self._relays.pop(sid, None)
        if relay is not None and self._tg is not None:
            self._tg.start_soon(_unsubscribe, relay.sub)

    async def _prune_relays(self) -> None:
        """A relay lives while a local client (not the router) subscribes to its events;
        while one answers its approvals too, the owner is told so every second."""
        while True:
            await anyio.sleep(RELAY_CHECK)
            for sid, relay in list(self._relays.items()):
                topic = f"sage.v1.event.{sid}.exited"
                if relay.ended or not self.bus.has_subscribers(topic, besides=self.identity):
                    self._drop_relay_soon(sid)
                elif relay.approver and self._approver_here(sid):
                    assert self._tg is not None
                    self._tg.start_soon(self._tell_approver, relay.node, sid, relay)
            now = anyio.current_time()
            for sid, (stand_in, until) in list(self._stand_ins.items()):
                if until <= now:
                    del self._stand_ins[sid]
                    stand_in.close()

    def _approver_here(self, sid: str) -> bool:
        return self.bus.has_subscribers(f"sage.v1.approver.{sid}", besides=self.identity)

    async def _tell_approver(self, node: str, sid: str, relay: _Relay) -> None:
        """Tell ``node`` that a client here answers ``sid``'s approvals for a while."""
        request = Envelope(0, "", b"", self.identity.source, relay.principal)
        payload = msgspec.json.encode({"seconds": APPROVER_FOR})
        reply = await self._forward(node, "approver", sid, request, payload)
        if not reply.get("ok"):
            log.warning("fleet.approver_not_told", node=node, session_id=sid, reply=reply)

    async def _stand_in(self, sid: str, principal: str | None, payload: bytes) -> dict[str, Any]:
        """An approver on another node answers ``sid``'s approvals: be present for it on
        this bus (``sage.v1.approver.<sid>``) for the seconds asked (at most 10), if the
        session is that principal's."""
        try:
            seconds = float(msgspec.json.decode(payload).get("seconds", 0))
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            return replies.error("bad_request", "approver: {seconds} expected")
        seen = await self._ask_runner(
            self.identity, local_topic("session", sid), b"{}", principal, "session"
        )
        if not seen.get("ok"):
            return seen  # unknown_session: another principal's, or none
        until = anyio.current_time() + max(0.0, min(seconds, 10.0))
        held = self._stand_ins.get(sid)
        if held is None:
            stand_in = self.bus.subscribe(f"sage.v1.approver.{sid}", self.identity, limit=1)
            self._stand_ins[sid] = (stand_in, until)
        else:
            self._stand_ins[sid] = (held[0], until)
        return replies.ok(session_id=sid)


async def _unsubscribe(sub: NatsSubscription) -> None:
    with contextlib.suppress(Exception), anyio.move_on_after(1.0):
        await sub.unsubscribe()


async def _respond(msg: Msg, reply: dict[str, Any]) -> None:
    with contextlib.suppress(Exception):
        await msg.respond(msgspec.json.encode(reply))


def _note_refusal(refused: dict[str, str], node: str, reply: dict[str, Any]) -> None:
    """Keep ``node``'s answer if it refused the caller's principal (NotVouched)."""
    if reply.get("error") == NotVouched.code:
        refused[node] = str(reply.get("message") or "")


def _refusals(refused: dict[str, str]) -> str:
    return "; ".join(
        f"node {node!r} refused: {NotVouched.code}: {why}" for node, why in sorted(refused.items())
    )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
