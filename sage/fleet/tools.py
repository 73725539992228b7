"""Tools anywhere: this node's catalogue in the fleet, and tool calls between nodes.

The supervisor's side of docs/fleet.md#tools-anywhere (the tool bridge's side
is capsules/tools/fleet.py and bridge.py); it runs only with ``[fleet]``.

- **Publishing.** When the bridge says its catalogue changed
  (``sage.v1.tools.changed``), the node asks it for the listing
  (``sage.v1.request.tools``) and puts its own tools (name, description,
  inputSchema, capsule) under its name in the ``sage_tools`` bucket, at most
  :data:`MAX_CATALOGUE` bytes.  A put that failed (NATS down) is tried again
  at the next heartbeat.
- **Reading.** Every heartbeat it reads the catalogue of each live node but
  itself and gives the bridge ``sage.v1.tools.fleet`` (when it changed, when
  a bridge came to listen, and every :data:`REPUBLISH_EVERY` heartbeats).  A
  lost or stopped node's tools leave at the next heartbeat.
- **Forwarding.** The bridge asks ``sage.v1.tool.forward``
  ``{node, deadline, call}``; the node sends it over NATS request/reply to
  ``sage.fleet.<node>.tool.call.<self>`` (the server lets a node publish only its
  own name there) and answers the MCP result, or an
  ``isError`` result saying why not (NATS not connected, no such node
  answering, no answer within the deadline): never a hang.
- **Serving.** Calls on its own ``sage.fleet.<self>.tool.call.<origin>`` are
  handed to the bridge as ``sage.v1.tool.remote`` ``{from_node, call}`` (the
  origin from the subject, never the payload) and its answer goes back as the
  NATS reply.  The principal is taken only if the origin may vouch for it
  (sage/fleet/vouching.py; else the call is refused with an ``isError`` result
  ``principal_not_authenticated`` and audited ``fleet_principal_rejected``); the
  session is the origin's claim; b's own checks, policy and audit still apply
  (docs/security.md).

Only the bridge's ``capsule:tools`` may ask a forward; node names are checked
before any subject is built.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusError, Envelope, Identity, NoResponders, Subscription
from sage.config import NAME_PATTERN
from sage.contract.sessions import audit_topic
from sage.errors import FleetBusy, FleetError, FleetNotFound, FleetUnavailable, NotVouched
from sage.fleet.inflight import MAX_IN_FLIGHT, InFlight
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import describe, nats_errors
from sage.fleet.nodes import NodeState
from sage.fleet.permissions import TOOLS_BUCKET, call_subject, parse_call_subject
from sage.fleet.vouching import REJECTED, REJECTED_EVENT, TOOL_CALL, VouchedPrincipals, rejected_row

if TYPE_CHECKING:
    from nats.aio.msg import Msg
    from nats.js.kv import KeyValue

__all__ = (
    "FLEET_TOOLS",
    "FORWARD_CALL",
    "MAX_CATALOGUE",
    "REMOTE_CALL",
    "FleetTools",
    "NodeCatalogue",
    "call_subject",
    "error_result",
)

log = structlog.get_logger("sage.fleet.tools")

FLEET_TOOLS = "sage.v1.tools.fleet"
FORWARD_CALL = "sage.v1.tool.forward"
REMOTE_CALL = "sage.v1.tool.remote"
BRIDGE = "capsule:tools"
MAX_CATALOGUE = 512 * 1024
"""Bytes of one node's catalogue in the bucket (tools past it are left out, logged)."""
REPUBLISH_EVERY = 10
"""Heartbeats between two ``sage.v1.tools.fleet`` of the same catalogues."""
REMOTE_SLACK = 2.0
"""Seconds the bridge on the serving node may take past the execute deadline."""

_NAME = re.compile(NAME_PATTERN)


def error_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


def valid_node(name: object) -> bool:
    """A node name is one subject token: no dots, no ``*`` or ``>``."""
    return isinstance(name, str) and _NAME.match(name) is not None


class NodeCatalogue(msgspec.Struct, frozen=True, kw_only=True):
    """What a node keeps under its name in the ``sage_tools`` bucket."""

    node: str
    tools: list[dict[str, Any]]


def own_catalogue(node: str, listing: list[Any]) -> bytes:
    """The bucket value of this node's tools, from the bridge's listing (its own only),
    bounded by :data:`MAX_CATALOGUE` (the tools that do not fit are left out)."""
    tools: list[dict[str, Any]] = []
    size = 64
    for entry in listing:
        if not isinstance(entry, dict) or entry.get("node") not in ("", node):
            continue
        name = entry.get("name")
        tool = {
            "name": name.removeprefix("mcp__sage__") if isinstance(name, str) else name,
            "description": entry.get("description", ""),
            "inputSchema": entry.get("inputSchema"),
            "capsule": entry.get("capsule"),
        }
        encoded = len(msgspec.json.encode(tool)) + 1
        if size + encoded > MAX_CATALOGUE:
            log.error("fleet.catalogue_truncated", node=node, kept=len(tools), limit=MAX_CATALOGUE)
            break
        size += encoded
        tools.append(tool)
    return msgspec.json.encode(NodeCatalogue(node=node, tools=tools))


def read_catalogue(key: str, data: bytes) -> list[dict[str, Any]] | None:
    """The tools of node ``key``'s bucket value, or None when it is not usable."""
    if len(data) > MAX_CATALOGUE + 1024:
        return None
    try:
        catalogue = msgspec.json.decode(data, type=NodeCatalogue)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return catalogue.tools if catalogue.node == key else None


def fit(remote: dict[str, list[dict[str, Any]]], budget: int) -> dict[str, list[dict[str, Any]]]:
    """The nodes' catalogues, by node name, as many as fit in ``budget`` bytes of JSON
    (a local bus payload is bounded; the nodes that do not fit are left out)."""
    kept: dict[str, list[dict[str, Any]]] = {}
    size = 64
    for node in sorted(remote):
        size += len(msgspec.json.encode(remote[node])) + len(node) + 8
        if size > budget:
            break
        kept[node] = remote[node]
    return kept


class FleetTools:
    """This node's part in tools anywhere (see the module's docstring)."""

    def __init__(
        self,
        member: FleetMember,
        bus: Bus,
        identity: Identity,
        execute_deadline: Callable[[], float],
    ) -> None:
        self.member = member
        self.node = member.node
        self.bus = bus
        self.identity = identity
        self.execute_deadline = execute_deadline
        self._kv: KeyValue | None = None
        self._published: bytes | None = None
        self._dirty = True
        self._put_failing = False
        self._listening = False
        self._remote: dict[str, list[dict[str, Any]]] | None = None
        self._rounds = 0
        self.vouched = VouchedPrincipals(
            member.record_of, member.config.peers, ttl=member.config.heartbeat
        )
        self._in_flight = InFlight("tool calls")
        """Each peer's calls being served here: at most MAX_IN_FLIGHT at once."""

    async def run(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        """Subscribe on the local bus, then start; runs until cancelled."""
        changed = self.bus.subscribe("sage.v1.tools.changed", self.identity)
        forwards = self.bus.subscribe(FORWARD_CALL, self.identity)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_forwards, forwards, tg)
            tg.start_soon(self._watch_changes, changed)
            tg.start_soon(self._serve_calls, tg)
            tg.start_soon(self._every_heartbeat)
            task_status.started()

    # -- the catalogues ---------------------------------------------------

    async def _bucket(self) -> KeyValue:
        """The ``sage_tools`` bucket (opened, made or checked, at the node's join)."""
        if self._kv is None:
            if self.member.tools is not None:
                self._kv = self.member.tools
            else:
                with nats_errors(f"the {TOOLS_BUCKET} bucket"):
                    self._kv = await self.member.jetstream.key_value(TOOLS_BUCKET)
        return self._kv

    async def _watch_changes(self, changed: Subscription) -> None:
        async for _ in changed:
            self._dirty = True
            await self._publish_own()

    async def _every_heartbeat(self) -> None:
        while True:
            with anyio.move_on_after(max(1.0, self.member.config.heartbeat * 2)):
                if self._dirty:
                    await self._publish_own()
                await self._read_remote()
            await anyio.sleep(self.member.config.heartbeat)

    async def _publish_own(self) -> None:
        try:
            reply = await self.bus.request(self.identity, "sage.v1.request.tools", {}, deadline=5.0)
            listing = msgspec.json.decode(reply.payload).get("tools", [])
        except NoResponders:  # no bridge on this node: it serves no tools
            listing = []
        except (BusError, msgspec.DecodeError, AttributeError) as exc:
            log.warning("fleet.tools_listing_failed", error=str(exc))
            return
        value = own_catalogue(self.node, listing if isinstance(listing, list) else [])
        self._dirty = False
        if value == self._published:
            return
        try:
            with (
                nats_errors(f"the {TOOLS_BUCKET} bucket"),
                anyio.fail_after(max(1.0, self.member.config.heartbeat * 2)),
            ):
                await (await self._bucket()).put(self.node, value)
        except FleetError as exc:  # NATS down or refusing: tried again at the next heartbeat
            self._dirty = True
            if not self._put_failing:  # once an outage
                log.warning(
                    "fleet.catalogue_put_failed", node=self.node, code=exc.code, error=describe(exc)
                )
            self._put_failing = True
            return
        self._put_failing = False
        self._published = value
        log.info("fleet.catalogue_published", node=self.node, bytes=len(value))

    async def _read_remote(self) -> None:
        remote: dict[str, list[dict[str, Any]]] = {}
        try:
            views = await self.member.nodes()
            with nats_errors(f"the {TOOLS_BUCKET} bucket"):
                kv = await self._bucket()
            for view in views:
                if view.state is not NodeState.LIVE or view.node == self.node:
                    continue
                try:
                    with nats_errors(f"the {TOOLS_BUCKET} bucket"):
                        entry = await kv.get(view.node)
                except FleetNotFound:
                    continue
                tools = read_catalogue(view.node, entry.value or b"")
                if tools is None:
                    log.warning("fleet.catalogue_ignored", node=view.node)
                    continue
                remote[view.node] = tools
        except FleetError as exc:  # NATS down: the last known catalogues stay until it is back
            log.debug("fleet.catalogues_unread", code=exc.code, error=describe(exc))
            if self.member.connected:
                return
            remote = {}  # not connected: no remote tool can be called now
        self._rounds += 1
        listening = self.bus.has_subscribers(FLEET_TOOLS)
        came = listening and not self._listening  # a bridge (re)started since
        self._listening = listening
        if remote == self._remote and not came and self._rounds % REPUBLISH_EVERY:
            return
        self._remote = remote
        nodes = fit(remote, self.bus.max_payload - 1024)
        if len(nodes) < len(remote):
            log.error("fleet.catalogues_left_out", nodes=sorted(remote.keys() - nodes.keys()))
        try:
            self.bus.publish(self.identity, FLEET_TOOLS, {"node": self.node, "nodes": nodes})
        except BusError as exc:
            log.error("fleet.catalogues_publish_failed", error=str(exc))

    # -- calls from this node ---------------------------------------------

    async def _serve_forwards(self, forwards: Subscription, tg: anyio.abc.TaskGroup) -> None:
        async for envelope in forwards:
            if envelope.source != BRIDGE or envelope.reply_to is None:
                log.warning("fleet.forward_ignored", source=envelope.source)
                continue
            tg.start_soon(self._forward, envelope)

    async def _forward(self, envelope: Envelope) -> None:
        result = await self.forward(envelope.payload)
        assert envelope.reply_to is not None
        try:
            self.bus.reply(self.identity, envelope.reply_to, result)
        except BusError as exc:
            with contextlib.suppress(BusError):
                self.bus.reply(
                    self.identity,
                    envelope.reply_to,
                    error_result(f"the answer of the tool's node could not be passed on: {exc}"),
                )

    async def forward(self, payload: bytes) -> Any:
        """The answer of the node a forward names (an ``isError`` result when none came)."""
        try:
            request = msgspec.json.decode(payload)
            node, deadline, call = request["node"], float(request["deadline"]), request["call"]
            tool = call["tool_name"]
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            return error_result(f"bad forward: {exc}")
        if not valid_node(node) or node == self.node:
            return error_result(f"cannot forward to node {str(node)[:64]!r}")
        if not self.member.connected:
            return error_result(f"node {node} cannot be reached: NATS is not connected")
        data = msgspec.json.encode({"call": call})
        nc = self.member.nats
        subject = call_subject(node, self.node)
        try:
            with nats_errors(f"a tool call to node {node}"):
                msg = await nc.request(subject, data, timeout=deadline + REMOTE_SLACK)
        except FleetUnavailable as exc:
            if exc.no_responders:
                return error_result(f"node {node} does not answer tool calls (lost or stopped?)")
            if exc.timed_out:
                return error_result(
                    f"tool {tool!r} of node {node} did not answer within"
                    f" {deadline + REMOTE_SLACK:g} s"
                )
            return error_result(f"node {node} cannot be reached: {describe(exc)}")
        except FleetError as exc:  # a connection closed or draining meanwhile
            return error_result(f"node {node} cannot be reached: {describe(exc)}")
        try:
            return msgspec.json.decode(msg.data)
        except msgspec.DecodeError:
            return error_result(f"node {node} sent a bad answer for tool {tool!r}")

    # -- calls to this node -----------------------------------------------

    async def _serve_calls(self, tg: anyio.abc.TaskGroup) -> None:
        while True:  # a subscription refused now (a closed connection) is asked again
            try:
                with nats_errors("the tool calls' subscription"):
                    sub = await self.member.nats.subscribe(call_subject(self.node, "*"))
                break
            except FleetError as exc:
                log.warning(
                    "fleet.calls_unserved", node=self.node, code=exc.code, error=describe(exc)
                )
                await anyio.sleep(max(1.0, self.member.config.heartbeat))
        try:
            async for msg in sub.messages:
                await self._take_call(tg, msg)
        finally:
            with (
                anyio.move_on_after(1.0, shield=True),
                contextlib.suppress(FleetError),
                nats_errors("the tool calls' unsubscribe"),
            ):
                await sub.unsubscribe()

    async def _take_call(self, tg: anyio.abc.TaskGroup, msg: Msg) -> None:
        """Serve ``msg`` in a task of its own, unless its origin has MAX_IN_FLIGHT calls
        being served here already: then an ``isError`` result ``fleet_busy`` at once."""
        if not msg.reply:
            return
        origin = parse_call_subject(self.node, msg.subject)
        if origin is None or not valid_node(origin):
            await self._serve_call(msg)  # refused at once: a bad tool call
            return
        try:
            self._in_flight.take(origin)
        except FleetBusy as exc:
            log.warning("fleet.peer_busy", origin=origin, verb="tool.call", in_flight=MAX_IN_FLIGHT)
            with contextlib.suppress(FleetError), nats_errors("an answer"):
                await msg.respond(msgspec.json.encode(error_result(f"{exc.code}: {exc}")))
            return
        tg.start_soon(self._serve_counted, msg, origin)

    async def _serve_counted(self, msg: Msg, origin: str) -> None:
        try:
            await self._serve_call(msg)
        finally:
            self._in_flight.give_back(origin)

    async def _serve_call(self, msg: Msg) -> None:
        if not msg.reply:
            return
        origin = parse_call_subject(self.node, msg.subject)
        result = await self.run_remote(origin, msg.data)
        try:
            with nats_errors("an answer"):
                await msg.respond(msgspec.json.encode(result))
        except FleetError as exc:  # too big for NATS, or the connection went
            log.warning("fleet.tool_answer_failed", code=exc.code, error=describe(exc))
            with contextlib.suppress(FleetError), nats_errors("an answer"):
                await msg.respond(msgspec.json.encode(error_result(f"answer not sent: {exc}")))

    async def run_remote(self, from_node: str | None, data: bytes) -> Any:
        """Hand node ``from_node``'s call (the origin the server proved, from the
        subject) to the local bridge, and its answer back, if that node may act for the
        call's principal here."""
        try:
            call = msgspec.json.decode(data)["call"]
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            return error_result(f"bad tool call from the fleet: {exc}")
        if not valid_node(from_node) or not isinstance(call, dict):
            return error_result("bad tool call from the fleet: origin or call")
        assert from_node is not None
        refused = await self._vouched(from_node, call)
        if refused is not None:
            return refused
        deadline = self.execute_deadline() + REMOTE_SLACK
        try:
            reply = await self.bus.request(
                self.identity,
                REMOTE_CALL,
                {"from_node": from_node, "call": call},
                deadline=deadline,
            )
            return msgspec.json.decode(reply.payload)
        except BusError as exc:
            return error_result(f"node {self.node} could not run the tool: {exc}")
        except msgspec.DecodeError:
            return error_result(f"node {self.node}'s bridge sent a bad answer")

    async def _vouched(self, origin: str, call: dict[str, Any]) -> dict[str, Any] | None:
        """None if ``origin`` may act for the call's principal here; else the error
        result to answer (a refusal is audited, without the call's arguments)."""
        principal = call.get("principal_id")
        if principal is not None and not isinstance(principal, str):
            return error_result("bad tool call from the fleet: principal_id")
        try:
            with (
                nats_errors("the node table"),
                anyio.fail_after(max(1.0, self.member.config.heartbeat * 2)),
            ):
                await self.vouched.check(origin, principal)
        except NotVouched as exc:
            tool = call.get("tool_name")
            session = call.get("session_id")
            refused = rejected_row(
                origin,
                principal,
                TOOL_CALL,
                session if isinstance(session, str) else None,
                call_subject(self.node, origin),
                exc,
                tool_name=tool if isinstance(tool, str) else None,
            )
            log.warning(REJECTED_EVENT, **refused)
            with contextlib.suppress(BusError):
                self.bus.publish(self.identity, audit_topic(REJECTED), refused)
            return error_result(f"{exc.code}: {exc}")
        except FleetError as exc:  # the node bucket cannot be read now
            return error_result(
                f"node {self.node} cannot check node {origin}'s principals now: {describe(exc)}"
            )
        return None
