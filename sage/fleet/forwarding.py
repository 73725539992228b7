"""Requests between nodes: forwarded out to an owner, answered in for a peer.

- **Out.** :meth:`Forwarding.forward` asks another node's router on that node's own
  prefix, ``sage.fleet.<node>.request.<origin>.<verb>[.<sid>]``, with the principal
  this node's bus established for the caller (a :class:`~sage.fleet.routes.Forwarded`,
  never a field the caller wrote); the reply is the owner's runner's, or
  ``fleet_unavailable`` when the owner cannot be reached in the verb's deadline.
- **In.** :meth:`Forwarding.take` answers a request on this node's own prefix: the
  sending node is the subject's (the server lets a node publish only its own name
  there), the principal is taken only if that node may vouch for it
  (sage/fleet/vouching.py; else ``principal_not_authenticated``, logged and audited
  ``fleet_principal_rejected``), at most :data:`~sage.fleet.inflight.MAX_IN_FLIGHT`
  of one peer at once (``fleet_busy``).  It becomes the runner's own local request
  (listings with this node's name on each row, an approver presence a stand-in on
  this bus, ``usage`` this node's ledger rows for a fleet's usage report,
  sage/fleet/usage.py), and who vouched for whom is audited ``fleet_request`` (not for
  the reads: listings and usage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusError, Envelope, Identity
from sage import replies
from sage.contract.codes import ErrorCode
from sage.contract.sessions import Verb, audit_topic
from sage.contract.usage import USAGE_VERB
from sage.errors import BadRoute, FleetBusy, FleetError, FleetUnavailable, NotVouched
from sage.fleet.inflight import MAX_IN_FLIGHT, InFlight
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import describe, nats_errors
from sage.fleet.routes import (
    Forwarded,
    decode_forwarded,
    parse_request_subject,
    request_subject,
)
from sage.fleet.runner_link import NETWORK_SLACK, RunnerLink, deadline_of
from sage.fleet.vouching import REJECTED, REJECTED_EVENT, VouchedPrincipals, rejected_row

if TYPE_CHECKING:
    from nats.aio.msg import Msg

__all__ = ("LISTING_DEADLINE", "Forwarding", "respond", "unavailable")

log = structlog.get_logger("sage.fleet.router")

LISTING_DEADLINE = 3.0
"""Seconds a read of the buckets (a vouching check, a listing's) may take."""
LISTINGS = frozenset({Verb.SESSIONS, Verb.APPROVALS})
READS = LISTINGS | {USAGE_VERB}
"""Forwarded requests that only read: logged, not audited (as a local listing is not)."""

LocalListing = Callable[[bytes, "str | None", Identity, str], Awaitable[dict[str, Any]]]
StandIn = Callable[[str, "str | None", bytes], Awaitable[dict[str, Any]]]
UsageRows = Callable[[bytes, "str | None"], Awaitable[dict[str, Any]]]


def unavailable(message: str) -> dict[str, Any]:
    return replies.error(ErrorCode.FLEET_UNAVAILABLE, message)


class Forwarding:
    """This node's requests to other nodes and its answers to theirs (see the module
    docstring).  ``local_listing`` and ``stand_in`` answer what the runner alone does
    not: a listing with this node's name on its rows, an approver's presence."""

    def __init__(
        self,
        bus: Bus,
        member: FleetMember,
        identity: Identity,
        runner: RunnerLink,
        *,
        local_listing: LocalListing,
        stand_in: StandIn,
    ) -> None:
        self.bus = bus
        self.member = member
        self.node = member.node
        self.identity = identity
        self.runner = runner
        self.local_listing = local_listing
        self.stand_in = stand_in
        self.tg: anyio.abc.TaskGroup | None = None
        """The router's task group (set by its run, before the first request comes in)."""
        self.in_flight = InFlight("forwarded requests")
        """Each peer's forwarded requests being answered: at most MAX_IN_FLIGHT at once."""
        self.vouched = VouchedPrincipals(
            member.record_of, member.config.peers, ttl=member.config.heartbeat
        )
        """Whether a sending node may act for the principal it names (its record, our pins)."""
        self.usage_rows: UsageRows = _no_ledger
        """This node's ledger rows for another node's fleet report (sage/fleet/usage.py,
        set by the router when the supervisor keeps a usage ledger)."""

    # -- out --------------------------------------------------------------------------

    async def forward(
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
        return await self.ask(
            node,
            verb,
            sid,
            # the bus's, from the caller's connection (an admin's spawn: the one it names)
            acting_for if acting_for is not None else request.principal,
            request.payload if payload is None else payload,
        )

    async def ask(
        self,
        node: str,
        verb: str,
        sid: str | None,
        principal: str | None,
        payload: bytes,
        *,
        deadline: float | None = None,
    ) -> dict[str, Any]:
        """Ask ``node``'s router for ``principal`` (one this node's bus established:
        never a name a caller wrote); its reply dict, or fleet_unavailable when it does
        not answer within ``deadline`` (default: the verb's and the network's)."""
        if not self.member.connected:
            return unavailable(f"cannot reach node {node!r}: NATS is not connected")
        subject = request_subject(node, self.node, verb, sid)
        forwarded = Forwarded(principal=principal, payload=msgspec.Raw(payload))
        if deadline is None:
            deadline = deadline_of(verb) + NETWORK_SLACK
        try:
            with nats_errors(f"a request to node {node!r}"):
                msg = await self.member.nc.request(subject, forwarded.encode(), timeout=deadline)
        except FleetUnavailable as exc:
            if exc.no_responders:
                return unavailable(f"node {node!r} does not answer (no responders: is it running?)")
            if exc.timed_out:
                return unavailable(f"node {node!r} did not answer within {deadline:g} s")
            return unavailable(f"cannot reach node {node!r}: {describe(exc)}")
        except FleetError as exc:
            return unavailable(f"cannot reach node {node!r}: {describe(exc)}")
        try:
            data = msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            return replies.error(
                ErrorCode.INTERNAL_ERROR, f"node {node!r} answered with something not JSON"
            )
        if not isinstance(data, dict) or not isinstance(data.get("ok"), bool):
            return replies.error(
                ErrorCode.INTERNAL_ERROR, f"node {node!r} broke the reply contract"
            )
        return data

    # -- in ---------------------------------------------------------------------------

    async def take(self, msg: Msg) -> None:
        """A request on this node's own prefix: the runner answers it as for a local caller
        of the principal the sending node established (each in a task of its own)."""
        if not msg.reply:
            return
        try:
            origin, verb, sid = parse_request_subject(self.node, msg.subject)
            forwarded = decode_forwarded(msg.data)
        except BadRoute as exc:
            await respond(msg, replies.from_error(exc))
            return
        try:
            self.in_flight.take(origin)
        except FleetBusy as exc:
            log.warning("fleet.peer_busy", origin=origin, verb=verb, in_flight=MAX_IN_FLIGHT)
            await respond(msg, replies.from_error(exc))
            return
        assert self.tg is not None
        self.tg.start_soon(self._answer_counted, msg, origin, verb, sid, forwarded)

    async def _answer_counted(
        self, msg: Msg, origin: str, verb: str, sid: str | None, forwarded: Forwarded
    ) -> None:
        try:
            await self._answer(msg, origin, verb, sid, forwarded)
        finally:
            self.in_flight.give_back(origin)

    async def _vouched(
        self, msg: Msg, origin: str, verb: str, sid: str | None, principal: str | None
    ) -> bool:
        """Whether ``origin`` may act for ``principal`` here; if not, the sender is told
        why and this node's chain keeps the refusal (never the payload)."""
        try:
            with nats_errors("the node table"), anyio.fail_after(LISTING_DEADLINE):
                await self.vouched.check(origin, principal)
            return True
        except NotVouched as exc:
            refused = rejected_row(origin, principal, verb, sid, msg.subject, exc)
            log.warning(REJECTED_EVENT, **refused)
            with contextlib.suppress(BusError):
                self.bus.publish(self.identity, audit_topic(REJECTED), refused)
            await respond(msg, replies.from_error(exc))
        except FleetError as exc:  # the node bucket cannot be read now
            await respond(
                msg,
                unavailable(
                    f"node {self.node!r} cannot check node {origin!r}'s principals now:"
                    f" {describe(exc)}"
                ),
            )
        return False

    async def _answer(
        self, msg: Msg, origin: str, verb: str, sid: str | None, forwarded: Forwarded
    ) -> None:
        if not await self._vouched(msg, origin, verb, sid, forwarded.principal):
            return
        identity = Identity(f"fleet:{origin}")
        payload = bytes(forwarded.payload)
        if verb in LISTINGS:
            reply = await self.local_listing(payload, forwarded.principal, identity, verb)
        elif verb == USAGE_VERB:
            reply = await self.usage_rows(payload, forwarded.principal)
        elif verb == "approver":
            assert sid is not None
            reply = await self.stand_in(sid, forwarded.principal, payload)
            if not reply.get("ok"):
                log.info("fleet.approver_refused", origin=origin, session_id=sid)
            await respond(msg, reply)
            return
        else:
            reply = await self.runner.ask(
                verb, sid, payload, principal=forwarded.principal, identity=identity
            )
        what = {
            "origin": origin,
            "verb": verb,
            "session_id": sid,
            "principal_id": forwarded.principal,
            "ok": reply.get("ok"),
        }
        log.info("fleet.forwarded_in", **what)
        if verb not in READS:  # who vouched for whom, in this node's chain
            with contextlib.suppress(BusError):
                self.bus.publish(self.identity, audit_topic("fleet_request"), what)
        await respond(msg, reply)


async def _no_ledger(payload: bytes, principal: str | None) -> dict[str, Any]:
    return replies.error(
        ErrorCode.UNKNOWN_REQUEST, "this node keeps no usage ledger ([usage] ledger = false)"
    )


async def respond(msg: Msg, reply: dict[str, Any]) -> None:
    """Answer ``msg`` (the asker may be gone, or NATS: then nobody hears it)."""
    with contextlib.suppress(FleetError), nats_errors("an answer"):
        await msg.respond(msgspec.json.encode(reply))
