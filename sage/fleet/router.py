"""Sessions anywhere: this node's router, the thin shell of the fleet's session parts.

One :class:`Router` per node in a fleet, run by the supervisor beside the session
runner, which knows nothing of it.  Each concern is a module of its own, wired here:

- **Registry keeping** (sage/fleet/registry_keeper.py): this node's claims in the
  ``sage_sessions`` bucket, kept from its runner's lifecycle events, resynced after
  an outage.
- **Fencing** (sage/fleet/fencer.py over sage/fleet/fencing.py): its copy of a
  session another node took while this one was judged lost ends ``failed_over``.
- **Relays** (sage/fleet/relays.py): its sessions' events published on NATS; a
  remote session's republished here while a local client watches; approvers.
- **Forwarding** (sage/fleet/forwarding.py): requests to an owner over NATS, and
  other nodes' requests answered by the runner here, if their node may vouch for
  the principal.
- **Listing** (sage/fleet/listing.py): the fleet-wide sessions and approvals.
- **Usage** (sage/fleet/usage.py): a fleet's usage report, every live node's ledger
  (when the supervisor keeps one).
- **Failover** (sage/fleet/failover.py): replicas and adoptions.

What stays here is the routing of the local requests the CLI makes of the fleet
(``sage.v1.request.fleet.<verb>[.<sid>]``): the CLI asks the local runner first,
and the router only when the runner does not know the session
(``unknown_session``), or for ``spawn --node`` and the fleet-wide listing.  The
router finds the owner (the registry copy's word, checked against the bucket when
the owner refuses; sage/fleet/registry_copy.py), opens the relay of its events when
the caller follows them, and forwards.  A placed spawn (``--node any``) asks the
candidates of sage/fleet/placement.py in turn.

The principal a forwarded request carries is the local envelope's, which the
bus set from the caller's connection (SO_PEERCRED): nothing in the caller's
payload can name another (docs/security.md, "Fleet trust model").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusError, Envelope, Identity
from sage import replies
from sage.config import Config
from sage.contract.codes import ErrorCode
from sage.contract.sessions import (
    CLAIMS_TOPIC,
    EVENTS,
    FLEET_APPROVALS_TOPIC,
    FLEET_KEYED,
    FLEET_SESSIONS_TOPIC,
    FLEET_SPAWN_TOPIC,
    Verb,
)
from sage.errors import BadRoute, FleetError, FleetUnavailable, SessionConflict
from sage.fleet.failover import Failover
from sage.fleet.fencer import Fencer
from sage.fleet.forwarding import LISTING_DEADLINE, Forwarding, unavailable
from sage.fleet.lifecycle import LifecycleEvents
from sage.fleet.listing import Listing
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.nodes import NodeState
from sage.fleet.placement import ANY, NODE_REFUSALS, Passed, Placement, place, refusal_text
from sage.fleet.registry_copy import RegistryCopy, follow
from sage.fleet.registry_keeper import RegistryKeeper
from sage.fleet.relays import Relay, Relays, publish_events
from sage.fleet.routes import (
    APPROVAL_VERBS,
    REGISTRY,
    SESSION_VERBS,
    SessionEntry,
    check_name,
    resolve,
    visible,
)
from sage.fleet.runner_link import RunnerLink, deadline_of
from sage.fleet.usage import FleetUsage
from sage.usage.service import UsageService

if TYPE_CHECKING:
    from nats.aio.subscription import Subscription as NatsSubscription

__all__ = ("LOCAL_REQUESTS", "Router")

log = structlog.get_logger("sage.fleet.router")

LOCAL_REQUESTS = (
    FLEET_KEYED,
    FLEET_SPAWN_TOPIC,
    FLEET_APPROVALS_TOPIC,
    FLEET_SESSIONS_TOPIC,
    CLAIMS_TOPIC,
)
"""What the router answers on the local bus."""
EVENTS_QUEUED = 8192  # session events on their way out to NATS, at most


class Router:
    """This node's side of sessions anywhere (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        member: FleetMember,
        config_of: Callable[[], Config] | None = None,
        *,
        usage: UsageService | None = None,
    ) -> None:
        self.bus = bus
        self.member = member
        self.node = member.node
        self.identity = Identity("fleet")
        self.config_of = config_of
        """The config in force (``[sessions] resume``, the principals): failover needs it."""
        self.runner = RunnerLink(bus, self.identity, self.node)
        self.failover = (
            None
            if config_of is None
            else Failover(bus, member, config_of, self.runner.ask_as_supervisor)
        )
        self.registry_copy = RegistryCopy()
        """The registry as a watch keeps it here: a remote owner without a NATS round trip."""
        self.keeper = RegistryKeeper(
            member, self.runner, self.failover, self._resumes, LifecycleEvents(self.identity)
        )
        self.fencer = Fencer(member, self.runner, self.failover, self.keeper.here)
        self.keeper.fence = self.fencer.fence
        self.listing = Listing(member, self.identity, self.runner, self.registry_copy)
        self.forwarding = Forwarding(
            bus,
            member,
            self.identity,
            self.runner,
            local_listing=self.listing.local,
            stand_in=self._stand_in,
        )
        self.listing.forward = self.forwarding.forward
        self.usage = None if usage is None else FleetUsage(member, usage, self.forwarding.ask)
        """The fleet's usage report (None: this supervisor keeps no ledger)."""
        if usage is not None and self.usage is not None:
            usage.fleet_report = self.usage.report  # ``fleet``: no longer not_in_fleet
            self.forwarding.usage_rows = self.usage.answer
            member.spend_source = usage.spend_report  # each heartbeat says what it spent
        self.relays = Relays(bus, member, self.identity, self.runner, self.forwarding.forward)

    async def _stand_in(self, sid: str, principal: str | None, payload: bytes) -> dict[str, Any]:
        return await self.relays.stand_in(sid, principal, payload)

    def _resumes(self) -> bool:
        """Whether this node's sessions are resumed (here after a restart, elsewhere after
        its loss): ``[sessions] resume``."""
        return self.config_of is not None and self.config_of().sessions.resume

    async def fence(self, sids: list[str], *, take_back: bool = False) -> list[str]:
        """See :meth:`sage.fleet.fencer.Fencer.fence`."""
        return await self.fencer.fence(sids, take_back=take_back)

    # -- life -----------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        events = self.bus.subscribe(EVENTS, self.identity, limit=EVENTS_QUEUED)
        lifecycle = self.keeper.lifecycle = LifecycleEvents(self.identity)
        self.bus.add(lifecycle)  # the registry's and failover's own queue: no delta fills it
        local = [self.bus.subscribe(pattern, self.identity) for pattern in LOCAL_REQUESTS]
        writes = self.keeper.writes()
        nats_sub: NatsSubscription | None = None
        try:
            async with anyio.create_task_group() as tg:
                # before the first forwarded request can come in
                self.forwarding.tg = self.relays.tg = tg
                nats_sub = await self.member.nc.subscribe(
                    f"sage.fleet.{self.node}.request.>", cb=self.forwarding.take
                )
                tg.start_soon(publish_events, events, self.member)
                tg.start_soon(self.keeper.keep_books, lifecycle.queue)
                tg.start_soon(self.keeper.write, writes)
                for sub in local:
                    tg.start_soon(self._serve_local, sub)
                tg.start_soon(self.relays.prune)
                tg.start_soon(self.keeper.keep)
                tg.start_soon(self.fencer.keep)
                if self.usage is not None:  # budgets count the other nodes' spend
                    tg.start_soon(self.usage.keep_counting)
                if self.failover is not None:
                    await self.failover.run(tg)
                if self.member.registry is not None:
                    connected = lambda: self.member.connected  # noqa: E731
                    tg.start_soon(follow, self.member.registry, self.registry_copy, connected)
                task_status.started()
        finally:
            self.bus.remove(lifecycle)
            lifecycle.close()
            self.keeper.close()
            writes.close()
            with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
                if nats_sub is not None:
                    with contextlib.suppress(FleetError), nats_errors("the unsubscribe"):
                        await nats_sub.unsubscribe()
                await self.relays.close()

    # -- requests out (from local clients) -------------------------------------

    async def _serve_local(self, requests: Any) -> None:
        async for request in requests:
            if request.reply_to:
                assert self.forwarding.tg is not None
                self.forwarding.tg.start_soon(self._answer_local, request)

    async def _answer_local(self, request: Envelope) -> None:
        try:
            reply = await self._route(request)
        except BadRoute as exc:
            reply = replies.from_error(exc)
        except Exception as exc:  # a request's task outlives any error: a bug, logged
            log.exception("fleet.route_failed", topic=request.topic, code=code_of(exc))
            reply = replies.error(
                ErrorCode.INTERNAL_ERROR, f"fleet routing failed ({type(exc).__name__})"
            )
        with contextlib.suppress(BusError):
            self.bus.reply(self.identity, request.reply_to or "", reply)

    async def _route(self, request: Envelope) -> dict[str, Any]:
        parts = request.topic.split(".")
        verb = parts[4] if len(parts) > 4 else ""
        if request.topic == FLEET_SESSIONS_TOPIC:
            return await self.listing.sessions(request)
        if request.topic == CLAIMS_TOPIC:
            if self.failover is None:
                return replies.ok(elsewhere={})
            return await self.failover.claims(request)
        if request.topic == FLEET_APPROVALS_TOPIC:
            return await self.listing.approvals(request)
        if verb in APPROVAL_VERBS and len(parts) == 6:
            return await self.listing.approve(request, verb, check_name(parts[5], "approval id"))
        if verb == Verb.SPAWN and len(parts) == 5:
            return await self._spawn(request)
        if verb not in SESSION_VERBS or len(parts) != 6:
            return replies.error(ErrorCode.BAD_REQUEST, f"no fleet request {request.topic!r}")
        sid = check_name(parts[5], "session id")
        if sid in self.keeper.here and request.principal in (None, self.keeper.here[sid]):
            # the runner has it and answers (the CLI asks both at once): nothing to forward
            # (another principal's session of the same id here is not the one asked for)
            return replies.error(ErrorCode.UNKNOWN_SESSION, f"session {sid!r} is on this node")
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
            except FleetError as exc:
                return unavailable(f"cannot read the session registry now: {describe(exc)}")
        if entry is None:
            # another principal's session looks the same as none, as on one node
            return replies.error(ErrorCode.UNKNOWN_SESSION, f"no session {sid!r}")
        relay, reply = await self._forward_session(entry, verb, sid, request)
        if cached is not None and not reply.get("ok"):
            # the copy may be stale (the session moved, ended, or its node is gone): the
            # bucket decides, and only another node it names is asked again
            try:
                fresh = await self._remote_owner(sid, request.principal)
            except SessionConflict as exc:
                self.registry_copy.found_stale()
                return replies.from_error(exc)
            except FleetError as exc:
                return unavailable(f"cannot read the session registry now: {describe(exc)}")
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
        if verb == Verb.SESSION:
            ids = relay.ids if relay is not None else {}
            for event in reply.get("events") or []:
                if isinstance(event, dict):  # the owner's envelope ids, made this bus's
                    owner_id = event.get("id")
                    event["id"] = ids.get(owner_id, 0) if isinstance(owner_id, int) else 0
            if isinstance(reply.get("session"), dict):
                reply["session"]["node"] = entry.node
        if relay is not None and not reply.get("ok"):
            self.relays.drop_soon(sid)
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
        with nats_errors(f"the {REGISTRY} bucket"), anyio.fail_after(LISTING_DEADLINE):
            entry = await self.lookup(sid, principal)
        if entry is None or entry.node == self.node:
            return None
        return entry

    async def _forward_session(
        self, entry: SessionEntry, verb: str, sid: str, request: Envelope
    ) -> tuple[Relay | None, dict[str, Any]]:
        """Forward a request about ``sid`` to its owner (``entry.node``), with the relay of
        its events opened first when the caller follows them: only the events of the
        session's principal in the registry are republished."""
        node = entry.node
        relay = None
        if verb in (Verb.SEND, Verb.SESSION, Verb.WAKE):  # the caller follows the events
            relay = await self.relays.open(node, sid, request.principal, entry.principal_id)
            if relay is not None and verb == "send" and self.relays.approver_here(sid):
                relay.approving()  # before the turn: its first tool call may need us
                await self.relays.tell_approver(node, sid, relay)
        return relay, await self.forwarding.forward(node, verb, sid, request)

    async def _spawn(self, request: Envelope) -> dict[str, Any]:
        try:
            body = msgspec.json.decode(request.payload or b"{}")
        except msgspec.DecodeError as exc:
            return replies.error(ErrorCode.BAD_REQUEST, f"not JSON: {exc}")
        if not isinstance(body, dict):
            return replies.error(ErrorCode.BAD_REQUEST, "a spawn is a JSON object")
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
            return await self.runner.ask(Verb.SPAWN, None, payload, principal=request.principal)
        reply = await self.forwarding.forward(node, "spawn", None, request, payload)
        if request.principal is not None or reply.get("error") != "principal_not_authenticated":
            return reply
        # an admin's that node does not take: `spawn PRINCIPAL` names whom the admin acts
        # for, so ask again as that principal's request (what --principal PRINCIPAL does);
        # a refused spawn started nothing
        named = msgspec.json.decode(payload).get("principal_id")
        if not isinstance(named, str):
            return reply
        return await self.forwarding.forward(
            node, "spawn", None, request, payload, acting_for=named
        )

    async def _place(self, request: Envelope, body: dict[str, Any]) -> dict[str, Any]:
        """``spawn --node any``: on the least loaded live node that takes it
        (sage/fleet/placement.py), asking the next when one refuses for a reason of its
        own; none: one error naming each node and why.  A node that does not answer
        within the spawn's deadline ends it: the session may yet start there.  NATS down
        or the node table unreadable: this node only, with a warning."""
        principal = body.get("principal_id")
        if not isinstance(principal, str):
            return replies.error(ErrorCode.BAD_REQUEST, "a spawn names its principal_id")
        warning = None
        try:
            if not self.member.connected:
                raise FleetUnavailable("NATS is not connected")
            with nats_errors("the node table"), anyio.fail_after(LISTING_DEADLINE):
                nodes = await self.member.nodes()
            placement = place(nodes, principal, self.node)
        except FleetError as exc:
            warning = f"placed on this node only: the fleet's load is unknown ({describe(exc)})"
            placement = Placement((self.node,), ())
        payload = msgspec.json.encode(body)
        refused: list[Passed] = []
        for node in placement.candidates:
            began = anyio.current_time()
            reply = await self._spawn_on(node, request, payload)
            if reply.get(
                "error"
            ) == ErrorCode.FLEET_UNAVAILABLE and anyio.current_time() - began >= deadline_of(
                Verb.SPAWN
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
        return replies.error(ErrorCode.PLACEMENT_FAILED, refusal_text(principal, passed))

    async def lookup(self, sid: str, principal: str | None = None) -> SessionEntry | None:
        """The entry a request for ``sid`` by a caller acting for ``principal`` (None: an
        admin) follows: of the claims it may see, the live node's when there are several
        (sage/fleet/routes.py, :func:`~sage.fleet.routes.resolve`).  Two live claimants:
        SessionConflict, logged; a FleetError when it cannot ask."""
        found = await self.member.entries_of(check_name(sid, "session id"))
        entries = {node: entry for node, entry in found.items() if visible(entry, principal)}
        live: set[str] = set()
        if len(entries) > 1:
            views = await self.member.nodes()
            live = {view.node for view in views if view.state is NodeState.LIVE}
        try:
            return resolve(sid, entries, live)
        except SessionConflict:
            log.warning("fleet.session_conflict", session_id=sid, nodes=sorted(entries))
            raise
