"""The tool bridge: the catalogue on the bus, and every tool call from check to answer.

Catalogue (catalogue.py).  At start, on ``sage.v1.tools.describe`` and on
every ``sage.v1.capsules.changed`` the bridge broadcasts
``tool.v1.request.describe`` ``{}``; each tool capsule answers on
``tool.v1.response.describe.<capsule>`` ``{"tools": [...]}`` (the capsule is
the topic's last token), and may do so unsolicited at any time: its answer
replaces its tools.  A dropped tool is logged (``tools.tool_rejected``) and
audited as ``sage.v1.audit.tool_rejected`` ``{capsule, tool, reason}``.
When the catalogue changes the bridge publishes ``sage.v1.tools.list``
``{"tools": [{"name": "mcp__sage__<n>", "description", "inputSchema"}]}``
and then ``sage.v1.tools.changed`` ``{"names": ["mcp__sage__<n>", ...]}``
(the names that appeared, went or changed); ``sage.v1.tools.describe``
also republishes the list at once, for a subscriber that came late.  A
capsule reported ``failed``, ``stopped`` or ``backoff`` loses its tools at
once and each call pending on it is answered ``isError`` at once.

Calls.  Each ``sage.v1.tool.call.<cid>`` ``{session_id, principal_id,
tool_name, arguments, tool_use_id}`` runs in a task of its own: unknown
tool, then the arguments against the tool's inputSchema, then the policy
(policy.py), each a refusal the capsule never sees; then
``tool.v1.execute.<name>`` ``{"type": "tool_execute_request", "call_id",
"tool_name", "arguments"}`` (on behalf of the caller's principal) and a wait
of up to :data:`EXECUTE_DEADLINE` seconds for ``tool.v1.execute.<name>.result``
``{call_id, content, is_error}`` with this call's id; the answer is
``sage.v1.tool.result.<cid>`` ``{"content": [...], "isError": bool}``.
Answers with an unknown call id, a second answer, an answer on another
tool's topic or from another capsule are ignored and logged
(``tools.result_ignored``).  Every failure (timeout, capsule gone, a bad
result, a bus error, the bridge stopping) is an ``isError`` answer, so
nothing waits for ever.  Each decision is audited as
``sage.v1.audit.tool_call`` ``{principal_id, session_id, call_id, tool_name,
allowed, decision_source}`` (source ``unknown_tool``, ``schema``,
``policy:<i>``, ``default``, ``policy_invalid``, or ``foreign_session`` for
a direct call naming a session not of its principal), on behalf of the
principal.

Fleet (fleet.py, docs/fleet.md#tools-anywhere).  With ``[fleet]`` the
supervisor publishes ``sage.v1.tools.fleet`` (the other live nodes' tools);
they join the catalogue with their ``node`` (a local tool wins its name).  A
call to a tool of node b is checked here (schema, policy, audited with
``node``) and then forwarded: ``sage.v1.tool.forward`` to the supervisor,
which asks b over NATS; the answer (or an ``isError`` saying why not) is
audited as ``sage.v1.audit.tool_forwarded``.  A call b's supervisor brings
in comes as ``sage.v1.tool.remote`` (only the supervisor's is taken) and
runs the same path as a local call, for the principal a named; it is never
forwarded again.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from bus import BusError, Envelope, Subscription
from capsules.tools.catalogue import PREFIX, Change, Rejection, Tool
from capsules.tools.fleet import FleetCatalogue
from capsules.tools.policy import PolicyFile
from sage import replies
from sage.capsule.context import CapsuleContext
from sage.capsule.sdk import follow
from sage.capsule.sessions import foreign_session
from sage.contract.sessions import SUPERVISOR_SOURCE
from sage.errors import SageError
from sage.usage.admission import REPL_TOOL_CALL, admit

__all__ = ("DOWN_STATES", "EXECUTE_DEADLINE", "POLICY_FILE", "ToolBridge", "run")

FLEET_TOOLS = "sage.v1.tools.fleet"
"""The other nodes' tools, from the supervisor."""
FORWARD_CALL = "sage.v1.tool.forward"
"""A call of another node's tool, asked of the supervisor."""
REMOTE_CALL = "sage.v1.tool.remote"
"""Another node's call, brought in by the supervisor."""
FORWARD_SLACK = 5.0
"""Seconds a forwarded call may take past the execute deadline (NATS, two bridges)."""
SUPERVISOR = SUPERVISOR_SOURCE
"""The supervisor's source on the bus: the only one the fleet topics are taken from."""

EXECUTE_DEADLINE = 50.0
"""The default of ``[limits] execute_deadline``."""
"""Seconds a capsule has to answer ``tool.v1.execute.<name>`` (read when a bridge
is built; tests lower it).  Less than the runner's ``limits.tool_timeout`` (60 s),
so the runner gets the bridge's ``isError`` rather than giving up first."""
POLICY_FILE = "tools-policy.json"
"""The policy's file name in the state folder."""
DOWN_STATES = frozenset({"failed", "stopped", "backoff"})
"""Capsule states in ``sage.v1.capsules.changed`` that take a capsule's tools away."""


def error_result(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class ToolCall(msgspec.Struct, frozen=True):
    """``sage.v1.tool.call.<cid>`` from the session runner."""

    tool_name: str
    arguments: dict[str, Any] | None = None
    session_id: str | None = None
    principal_id: str | None = None
    tool_use_id: str | None = None


class RemoteCall(msgspec.Struct, frozen=True):
    """``sage.v1.tool.remote`` from this node's supervisor: a call node ``from_node`` sent."""

    from_node: str
    call: ToolCall


class CapsuleChanged(msgspec.Struct, frozen=True):
    """``sage.v1.capsules.changed`` from the supervisor."""

    capsule: str
    state: str


@dataclass
class _Pending:
    """A call waiting for its capsule's answer."""

    call_id: str
    tool: str
    capsule: str
    done: anyio.Event = field(default_factory=anyio.Event)
    result: dict[str, Any] | None = None

    def finish(self, result: dict[str, Any]) -> bool:
        if self.done.is_set():
            return False
        self.result = result
        self.done.set()
        return True


def _parse_result(data: dict[str, Any], capsule: str, tool: str) -> dict[str, Any]:
    """The MCP result for a capsule's ``{call_id, content, is_error}`` answer."""
    content = data.get("content", [])
    is_error = data.get("is_error", False)
    if (
        not isinstance(content, list)
        or not all(isinstance(c, dict) and isinstance(c.get("type"), str) for c in content)
        or not isinstance(is_error, bool)
    ):
        return error_result(
            f"capsule {capsule} sent a bad result for tool {tool!r}: expected "
            '{"call_id": str, "content": [{"type": ...}], "is_error": bool}'
        )
    return {"content": content, "isError": is_error}


class ToolBridge:
    """The bridge's state: the catalogue, the policy, the calls in flight."""

    def __init__(
        self,
        ctx: CapsuleContext,
        *,
        execute_deadline: float | None = None,
        policy_path: Path | None = None,
    ) -> None:
        self.ctx = ctx
        self.log = ctx.log
        self._deadline = execute_deadline
        self.catalogue = FleetCatalogue()
        self.policy = PolicyFile(policy_path or ctx.config.state_dir / POLICY_FILE)
        self.pending: dict[str, _Pending] = {}
        self._rejected: set[tuple[str, str | None, str]] = set()
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def deadline(self) -> float:
        """``[limits] execute_deadline`` as configured now (a reload applies), unless fixed."""
        if self._deadline is not None:
            return self._deadline
        return self.ctx.config.limits.execute_deadline

    # -- life -------------------------------------------------------------

    async def run(self) -> None:
        ctx = self.ctx
        # every subscription before the first describe request or call can arrive
        followed: list[tuple[Subscription, Callable[[Envelope], None]]] = [
            (ctx.subscribe("tool.v1.response.describe.*"), self._on_describe),
            (ctx.subscribe("tool.v1.execute.*.result"), self._on_result),
            (ctx.subscribe("sage.v1.tools.describe"), self._on_refresh),
            (ctx.subscribe("sage.v1.capsules.changed"), self._on_capsule_changed),
            (ctx.subscribe(FLEET_TOOLS), self._on_fleet_tools),
        ]
        remote = ctx.subscribe(REMOTE_CALL)
        calls = ctx.subscribe("sage.v1.tool.call.*")
        direct = ctx.subscribe("sage.v1.request.tool.call")
        followed.append((ctx.subscribe("sage.v1.request.tools"), self._on_listing))
        self._refresh_policy()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                for sub, handler in followed:
                    tg.start_soon(follow, sub, handler, self.log, "tools.handler_failed")
                tg.start_soon(self._serve_calls, calls)
                tg.start_soon(self._serve_direct, direct)
                tg.start_soon(self._serve_remote, remote)
                self._request_describe()
                ctx.ready()
        finally:
            self._tg = None

    async def _serve_calls(self, calls: Subscription) -> None:
        async for envelope in calls:
            assert self._tg is not None
            self._tg.start_soon(self._call, envelope)

    async def _serve_direct(self, requests: Subscription) -> None:
        async for envelope in requests:
            assert self._tg is not None
            self._tg.start_soon(self._direct_call, envelope)

    async def _serve_remote(self, requests: Subscription) -> None:
        async for envelope in requests:
            assert self._tg is not None
            self._tg.start_soon(self._remote_call, envelope)

    async def _remote_call(self, envelope: Envelope) -> None:
        """``sage.v1.tool.remote``: a call another node forwarded, brought in by this
        node's supervisor (anyone else's is ignored); answered as a reply."""
        if envelope.source != SUPERVISOR or envelope.reply_to is None:
            self.log.warning("tools.remote_call_ignored", source=envelope.source)
            return
        cid = f"f{secrets.token_hex(15)}"
        try:
            remote = msgspec.json.decode(envelope.payload, type=RemoteCall)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            result = error_result(f"bad forwarded tool call: {exc}")
        else:
            call = remote.call
            result = await self._decide_and_run(
                cid, call, call.principal_id, from_node=remote.from_node
            )
        try:
            self.ctx.reply(envelope, result)
        except BusError as exc:
            self.log.warning("tools.reply_failed", call_id=cid, error=str(exc))
            with contextlib.suppress(BusError):
                self.ctx.reply(
                    envelope, error_result(f"the tool's answer could not be sent: {exc}")
                )

    async def _direct_call(self, envelope: Envelope) -> None:
        """``sage.v1.request.tool.call`` ``{tool_name, arguments, session_id?}``: the same
        checks, policy, audit and execution as a session's call, answered as a reply
        (``astrid mcp serve`` for REPL sessions).  The principal is the requester's;
        only a caller without one (an admin) may name ``principal_id``.  A
        ``session_id`` must name a session of that principal, else the call is
        refused (``unknown_session``) and audited without it.  A principal at or past a
        budget is refused ``budget_exceeded`` (audited, ``decision_source`` the code)."""
        cid = f"r{secrets.token_hex(15)}"
        try:
            call = msgspec.json.decode(envelope.payload, type=ToolCall)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            result = error_result(f"bad tool call: {exc}")
        else:
            principal = envelope.principal if envelope.principal is not None else call.principal_id
            foreign = await self._foreign_session(call, principal)
            over = None if foreign is not None else await self._over_budget(principal, call)
            if foreign is not None:  # audited without the session id: it is not theirs
                self._refused(cid, call, principal, None, "foreign_session")
                result = error_result(foreign)
            elif over is not None:
                self._refused(cid, call, principal, call.session_id, over.code)
                result = error_result(f"{over.code}: {over}")
            else:
                result = await self._decide_and_run(cid, call, principal)
        if envelope.reply_to is not None:
            try:
                self.ctx.reply(envelope, result)
            except BusError as exc:
                self.log.warning("tools.reply_failed", call_id=cid, error=str(exc))

    async def _over_budget(self, principal: str | None, call: ToolCall) -> SageError | None:
        """Why a direct call (a REPL's, through ``astrid mcp serve``) may not run: its
        principal is at or past a budget, or the ledger cannot say (sage/usage/
        admission.py); None: it may.  A REPL's model calls never pass through sage, so
        its tool calls are where sage holds it to a budget."""
        try:
            await admit(self.ctx, principal, REPL_TOOL_CALL, call.session_id)
        except SageError as exc:
            return exc
        return None

    def _refused(
        self, cid: str, call: ToolCall, principal: str | None, sid: str | None, source: str
    ) -> None:
        """Audit a direct call refused before its policy was asked (``decision_source``)."""
        self._audit(
            "tool_call",
            {
                "principal_id": principal,
                "session_id": sid,
                "call_id": cid,
                "tool_use_id": call.tool_use_id,
                "tool_name": call.tool_name.removeprefix(PREFIX),
                "allowed": False,
                "decision_source": source,
            },
            principal,
        )

    async def _foreign_session(self, call: ToolCall, principal: str | None) -> str | None:
        """Why the session a direct call names is not the caller's, else None.

        The session id is the caller's claim; it names the caller's session
        only if the runner's record (``sessions``) or the REPL token record
        (``hook_tokens``) of that id belongs to the call's principal.  The
        answer is the same for another principal's session and for none."""
        try:
            return await foreign_session(self.ctx.state, call.session_id, principal)
        except SageError as exc:
            self.log.error("tools.session_check_failed", error=str(exc))
            return f"unknown_session: session {call.session_id!r} could not be checked: {exc}"

    # -- the catalogue ----------------------------------------------------

    def _request_describe(self) -> None:
        try:
            self.ctx.publish("tool.v1.request.describe", {})
        except BusError as exc:
            self.log.error("tools.describe_failed", error=str(exc))

    def _on_describe(self, envelope: Envelope) -> None:
        capsule = envelope.topic.rsplit(".", 1)[1]
        if envelope.source.startswith("capsule:") and envelope.source != f"capsule:{capsule}":
            reason = f"published by {envelope.source}, not by the capsule: ignored"
            self._apply(Change(rejected=[Rejection(capsule, None, reason)]))
            return
        try:
            response = msgspec.json.decode(envelope.payload)
        except msgspec.DecodeError:
            response = None
        self._apply(self.catalogue.offer(capsule, response))

    def _on_listing(self, envelope: Envelope) -> None:
        """``sage.v1.request.tools``: the catalogue with each tool's capsule (astrid tools list)."""
        if envelope.reply_to is None:
            return
        here = self.catalogue.node
        tools = [
            {**tool.mcp(), "capsule": tool.capsule, "node": tool.node or here}
            for tool in self.catalogue.tools()
        ]
        try:
            self.ctx.reply(envelope, replies.ok(tools=tools, clashes=self.catalogue.clashes()))
        except BusError as exc:
            self.log.error("tools.listing_failed", error=str(exc))

    def _on_fleet_tools(self, envelope: Envelope) -> None:
        """``sage.v1.tools.fleet`` from the supervisor: the other live nodes' tools."""
        if envelope.source != SUPERVISOR:
            self.log.warning("tools.fleet_catalogue_ignored", source=envelope.source)
            return
        try:
            data = msgspec.json.decode(envelope.payload)
        except msgspec.DecodeError:
            data = None
        if not isinstance(data, dict):
            data = {}
        self._apply(self.catalogue.set_remote(data.get("node", ""), data.get("nodes")))

    def _on_refresh(self, envelope: Envelope) -> None:
        self._publish_list()
        self._request_describe()

    def _on_capsule_changed(self, envelope: Envelope) -> None:
        try:
            event = msgspec.json.decode(envelope.payload, type=CapsuleChanged)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self.log.warning("tools.bad_capsule_event", error=str(exc))
            return
        if event.capsule == self.ctx.manifest.name:
            return
        if event.state in DOWN_STATES:
            self._apply(self.catalogue.remove(event.capsule))
            for pending in list(self.pending.values()):
                if pending.capsule == event.capsule:
                    text = f"capsule {event.capsule} stopped ({event.state}) before it answered"
                    pending.finish(error_result(text))
        self._request_describe()

    def _apply(self, change: Change) -> None:
        for rejection in change.rejected:
            key = (rejection.capsule, rejection.tool, rejection.reason)
            if key in self._rejected:
                continue  # each describe round offers it again: audit it once
            if len(self._rejected) > 10_000:
                self._rejected.clear()
            self._rejected.add(key)
            self.log.warning(
                "tools.tool_rejected",
                offered_by=rejection.capsule,
                tool=rejection.tool,
                reason=rejection.reason,
            )
            self._audit("tool_rejected", rejection.audit())
        if change.changed:
            self.log.info("tools.catalogue_changed", names=change.changed)
            self._publish_list()
            try:
                self.ctx.publish(
                    "sage.v1.tools.changed", {"names": [PREFIX + n for n in change.changed]}
                )
            except BusError as exc:
                self.log.error(
                    "tools.publish_failed", topic="sage.v1.tools.changed", error=str(exc)
                )

    def _publish_list(self) -> None:
        try:
            self.ctx.publish("sage.v1.tools.list", {"tools": self.catalogue.mcp_tools()})
        except BusError as exc:  # e.g. a catalogue over the bus's payload limit
            self.log.error("tools.publish_failed", topic="sage.v1.tools.list", error=str(exc))

    # -- the policy -------------------------------------------------------

    def _refresh_policy(self) -> None:
        reload = self.policy.refresh()
        if reload is None:
            return
        if reload.ok:
            self.log.info("tools.policy_loaded", path=reload.path)
        else:
            self.log.error("tools.policy_reload_failed", **reload.audit())
            self._audit("policy_reload_failed", reload.audit())

    # -- calls ------------------------------------------------------------

    async def _call(self, envelope: Envelope) -> None:
        cid = envelope.topic.rsplit(".", 1)[1]
        principal = envelope.principal
        try:
            try:
                call = msgspec.json.decode(envelope.payload, type=ToolCall)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                self.log.warning("tools.bad_call", call_id=cid, error=str(exc))
                self._answer(cid, error_result(f"bad tool call: {exc}"), principal)
                return
            # a publisher's verified principal wins over the payload's claim
            principal = principal if principal is not None else call.principal_id
            result = await self._decide_and_run(cid, call, principal)
        except anyio.get_cancelled_exc_class():
            self._answer(cid, error_result("the tool bridge stopped"), principal)
            raise
        self._answer(cid, result, principal)

    async def _decide_and_run(
        self, cid: str, call: ToolCall, principal: str | None, *, from_node: str | None = None
    ) -> dict[str, Any]:
        name = call.tool_name.removeprefix(PREFIX)
        arguments: dict[str, Any] = call.arguments if call.arguments is not None else {}
        tool = self.catalogue.get(name)
        if tool is not None and tool.node and from_node is not None:
            tool = None  # a forwarded call runs here or nowhere: never forwarded again

        def audit(allowed: bool, source: str) -> None:
            where = {"node": tool.node} if tool is not None and tool.node else {}
            if from_node is not None:
                where["from_node"] = from_node
            payload = {
                **where,
                "principal_id": principal,
                "session_id": call.session_id,
                "call_id": cid,
                "tool_use_id": call.tool_use_id,
                "tool_name": name,
                "allowed": allowed,
                "decision_source": source,
            }
            self._audit("tool_call", payload, principal)

        if cid in self.pending:
            return error_result(f"call id {cid} is already in flight")
        if tool is None:
            audit(False, "unknown_tool")
            return error_result(f"unknown tool {name!r}")
        problem = tool.check(arguments)
        if problem is not None:
            audit(False, "schema")
            return error_result(f"invalid arguments for tool {name!r}: {problem}")
        self._refresh_policy()
        decision = self.policy.decide(name, principal, arguments)
        audit(decision.allowed, decision.source)
        if not decision.allowed:
            return error_result(decision.reason)
        if tool.node:
            return await self._forward(cid, tool, call, arguments, principal)
        return await self._execute(cid, tool, arguments, principal, call.session_id)

    async def _forward(
        self,
        cid: str,
        tool: Tool,
        call: ToolCall,
        arguments: dict[str, Any],
        principal: str | None,
    ) -> dict[str, Any]:
        """Run ``tool`` on its node through the supervisor (sage/fleet/tools.py)."""
        request = {
            "node": tool.node,
            "deadline": self.deadline,
            "call": {
                "tool_name": tool.name,
                "arguments": arguments,
                "session_id": call.session_id,
                "principal_id": principal,
                "tool_use_id": call.tool_use_id,
            },
        }
        try:
            reply = await self.ctx.request(
                FORWARD_CALL, request, deadline=self.deadline + FORWARD_SLACK
            )
            data = msgspec.json.decode(reply.payload)
            result = (
                _parse_result(
                    {"content": data.get("content"), "is_error": data.get("isError")},
                    f"{tool.capsule} of node {tool.node}",
                    tool.name,
                )
                if isinstance(data, dict)
                else error_result(f"node {tool.node} sent a bad result for tool {tool.name!r}")
            )
        except (BusError, msgspec.DecodeError) as exc:
            result = error_result(
                f"tool {tool.name!r} of node {tool.node} could not be called: {exc}"
            )
        self._audit(
            "tool_forwarded",
            {
                "principal_id": principal,
                "session_id": call.session_id,
                "call_id": cid,
                "tool_use_id": call.tool_use_id,
                "tool_name": tool.name,
                "node": tool.node,
                "is_error": result["isError"],
            },
            principal,
        )
        return result

    async def _execute(
        self,
        cid: str,
        tool: Tool,
        arguments: dict[str, Any],
        principal: str | None,
        session_id: str | None = None,
    ) -> dict[str, Any]:
        topic = f"tool.v1.execute.{tool.name}"
        if not self.ctx.bus.has_subscribers(topic):
            return error_result(f"capsule {tool.capsule} is not serving tool {tool.name!r}")
        # the answer's subscription (tool.v1.execute.*.result) is open since start
        pending = self.pending[cid] = _Pending(cid, tool.name, tool.capsule)
        try:
            try:
                self.ctx.publish(
                    topic,
                    {
                        "type": "tool_execute_request",
                        "call_id": cid,
                        "tool_name": tool.name,
                        "arguments": arguments,
                        "session_id": session_id,
                        "principal_id": principal,
                    },
                    on_behalf_of=principal,
                )
            except BusError as exc:
                return error_result(f"tool {tool.name!r} could not be called: {exc}")
            with anyio.move_on_after(self.deadline):
                await pending.done.wait()
        finally:
            self.pending.pop(cid, None)
        if pending.result is None:
            self.log.warning("tools.call_timeout", call_id=cid, tool=tool.name)
            return error_result(
                f"tool {tool.name!r} (capsule {tool.capsule}) did not answer"
                f" within {self.deadline:g} s"
            )
        return pending.result

    def _on_result(self, envelope: Envelope) -> None:
        tool = envelope.topic.split(".")[3]
        try:
            data = msgspec.json.decode(envelope.payload)
        except msgspec.DecodeError:
            data = None
        call_id = data.get("call_id") if isinstance(data, dict) else None
        pending = self.pending.get(call_id) if isinstance(call_id, str) else None

        def ignore(reason: str) -> None:
            self.log.info(
                "tools.result_ignored",
                tool=tool,
                call_id=call_id,
                source=envelope.source,
                reason=reason,
            )

        if pending is None or pending.done.is_set():
            ignore("no call waits for this call_id (unknown, or answered already)")
        elif pending.tool != tool:
            ignore(f"the call is for tool {pending.tool!r}")
        elif envelope.source.startswith("capsule:") and envelope.source != (
            f"capsule:{pending.capsule}"
        ):
            ignore(f"tool {tool!r} belongs to capsule {pending.capsule}")
        else:
            assert isinstance(data, dict)
            pending.finish(_parse_result(data, pending.capsule, tool))
            del self.pending[pending.call_id]

    def _answer(self, cid: str, result: dict[str, Any], principal: str | None) -> None:
        topic = f"sage.v1.tool.result.{cid}"
        try:
            self.ctx.publish(topic, result, on_behalf_of=principal)
            return
        except BusError as exc:
            self.log.warning("tools.answer_failed", call_id=cid, error=str(exc))
            fallback = error_result(f"the tool's answer could not be delivered: {exc}")
        try:
            self.ctx.publish(topic, fallback, on_behalf_of=principal)
        except BusError as exc:
            self.log.error("tools.answer_failed", call_id=cid, error=str(exc))

    # -- audit ------------------------------------------------------------

    def _audit(self, event: str, payload: dict[str, Any], principal: str | None = None) -> None:
        try:
            self.ctx.publish(f"sage.v1.audit.{event}", payload, on_behalf_of=principal)
        except BusError as exc:
            self.log.error("tools.audit_failed", audit=event, error=str(exc))


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point (``capsules.tools.bridge:run``)."""
    await ToolBridge(ctx).run()
