"""The client's async shell: a connection to the supervisor, its sessions, their turns.

:func:`connect` opens the bus connection (the ``astrid`` CLI's, :mod:`bus.client`)
and yields a :class:`Sage`; :meth:`Sage.spawn` and :meth:`Sage.session` give a
:class:`Session`, whose :meth:`Session.send` streams the turn's typed messages
(:mod:`sage.client.messages`) and answers its approvals with ``can_use_tool``.
Requests about a session go where the CLI's go (:mod:`sage.client.routing`): the
local runner, else the fleet's router.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec

from bus import BusError, NoResponders
from bus.client import BusClient, RemoteSubscription
from bus.wire import frame_limit
from sage import replies
from sage.client.messages import (
    ApprovalInfo,
    ApprovalRequest,
    Message,
    ResultMessage,
    SessionInfo,
    TextDelta,
    decode_event,
)
from sage.config import load_config
from sage.contract.codes import ErrorCode
from sage.contract.sessions import approver_topic, event_pattern, request_topic
from sage.contract.usage import REPORT_TOPIC, Grouping, ReportRequest, UsageReport
from sage.errors import SageError
from sage.routing import NoFleet, call_runner, call_session, in_fleet

__all__ = ("Allow", "CanUseTool", "Deny", "Sage", "Session", "SessionEnded", "connect", "query")

SPAWN_TIMEOUT = 30.0
PLACE_TIMEOUT = 120.0  # a placed spawn may ask several nodes in turn
SEND_TIMEOUT = 180.0  # a hibernated session is woken first
REQUEST_TIMEOUT = 30.0


class SessionEnded(SageError):
    """The session ended while a turn was followed; ``reason`` is its end reason
    (``stopped``, ``crashed``, ``auth_failed``, ...: ``EndReason``)."""

    code = ErrorCode.SESSION_ENDED

    def __init__(self, session_id: str, reason: str) -> None:
        super().__init__(f"session {session_id!r} ended: {reason}")
        self.session_id = session_id
        self.reason = reason


@dataclass(frozen=True)
class Allow:
    """Let the tool call run; ``updated_input`` runs it with that input instead (the tool
    bridge checks it like any call: the tool's schema and the operator's policy)."""

    updated_input: dict[str, Any] | None = None


@dataclass(frozen=True)
class Deny:
    """Refuse the tool call; Claude reads ``message``."""

    message: str = ""


@dataclass(frozen=True)
class ToolPermissionContext:
    """What the SDK's context gives, and what sage knows of the call."""

    approval_id: str
    session_id: str
    tool_use_id: str | None
    expires_at: float
    signal: Any = None


CanUseTool = Callable[[str, dict[str, Any], ToolPermissionContext], Awaitable[Allow | Deny]]


@contextlib.asynccontextmanager
async def connect(
    config: str | os.PathLike[str] | None = None,
    *,
    socket: str | os.PathLike[str] | None = None,
    principal: str | None = None,
) -> AsyncIterator[Sage]:
    """Connect to the supervisor: at ``socket``, else the one ``config`` (a
    supervisor.toml; default ``$ASTRID_CONFIG``, else the embedded defaults) names.
    ``principal``: act for that principal (an admin connection only)."""
    loaded = load_config(str(config) if config is not None else None)
    path = Path(socket) if socket is not None else loaded.socket_path
    async with (
        BusClient.connect(
            path,
            role="cli",
            name="sage.client",
            principal=principal,
            max_frame=frame_limit(loaded.bus.max_payload),
        ) as client,
        anyio.create_task_group() as tg,
    ):
        try:
            yield Sage(client, tg)
        finally:
            tg.cancel_scope.cancel()


class Sage:
    """A connection to the supervisor; see :func:`connect`."""

    def __init__(self, client: BusClient, tg: anyio.abc.TaskGroup) -> None:
        self.bus = client
        self._tg = tg

    async def spawn(
        self,
        principal: str,
        *,
        cwd: str | os.PathLike[str] | None = None,
        model: str | None = None,
        session_id: str | None = None,
        node: str | None = None,
    ) -> Session:
        """Start a session for ``principal`` (as ``astrid sage spawn``): in a fleet its
        router places it (``node``: that node, ``"any"``: the least loaded)."""
        payload: dict[str, Any] = {"principal_id": principal}
        if session_id is not None:
            payload["session_id"] = session_id
        if cwd is not None:
            payload["cwd"] = str(await anyio.Path(cwd).absolute())
        if model is not None:
            payload["model"] = model
        if node is not None:
            data = await in_fleet(self.bus, "spawn", {**payload, "node": node}, PLACE_TIMEOUT)
        else:
            try:
                data = await in_fleet(self.bus, "spawn", payload, PLACE_TIMEOUT)
            except NoFleet:
                data = await call_runner(self.bus, request_topic("spawn"), payload, SPAWN_TIMEOUT)
        return Session(self, str(data["session_id"]), node=data.get("node"))

    async def session(self, session_id: str) -> Session:
        """A session that exists (live, asleep or ended): ``unknown_session`` otherwise."""
        data = await call_session(self.bus, "session", session_id, {}, REQUEST_TIMEOUT)
        return Session(self, session_id, info=msgspec.convert(data["session"], SessionInfo))

    async def sessions(self, *, all: bool = False) -> AsyncIterator[SessionInfo]:
        """The caller's sessions (an admin's: all); ``all`` adds the ended ones kept."""
        try:
            data = await in_fleet(self.bus, "sessions", {"all": all}, REQUEST_TIMEOUT)
            for row in data["sessions"]:
                yield msgspec.convert(row, SessionInfo)
            return
        except NoFleet:
            pass
        offset: int | None = 0
        while offset is not None:
            page = await call_runner(
                self.bus, request_topic("sessions"), {"all": all, "offset": offset}, REQUEST_TIMEOUT
            )
            for row in page["sessions"]:
                yield msgspec.convert(row, SessionInfo)
            offset = page.get("next_offset")

    async def approvals(self) -> list[ApprovalInfo]:
        """The tool calls waiting for the caller's decision (an admin's: all)."""
        try:
            data = await in_fleet(self.bus, "approvals", {}, REQUEST_TIMEOUT)
        except NoFleet:
            data = await call_runner(self.bus, request_topic("approvals"), {}, REQUEST_TIMEOUT)
        return [msgspec.convert(row, ApprovalInfo) for row in data["approvals"]]

    async def usage(
        self,
        *,
        principal: str | None = None,
        since: str | None = None,
        by: Grouping = "day",
        fleet: bool = False,
    ) -> UsageReport:
        """What the usage ledger recorded (as ``astrid sage usage``): rows grouped ``by``
        day, session, model or principal since the UTC day ``since`` (default: the first
        of this month), and the budgets with their spend.  A principal's caller sees its
        own; ``not_authorized`` for another's.  ``SageError`` when the ledger is off."""
        request = ReportRequest(principal_id=principal, since=since, by=by, fleet=fleet)
        try:
            reply = await self.bus.request_raw(
                REPORT_TOPIC, msgspec.json.encode(request), deadline=REQUEST_TIMEOUT
            )
        except NoResponders:
            raise SageError("the usage ledger is off ([usage] ledger = false)") from None
        return msgspec.convert(replies.parse(reply.payload), UsageReport)

    async def decide(self, approval_id: str, decision: Allow | Deny) -> dict[str, Any]:
        """Answer a pending approval (as ``astrid sage approve`` / ``deny``)."""
        answer: dict[str, Any]
        if isinstance(decision, Allow):
            answer = {"allowed": True}
            if decision.updated_input is not None:
                answer["updated_input"] = decision.updated_input
        else:
            answer = {
                "allowed": False,
                **({"reason": decision.message} if decision.message else {}),
            }
        return await call_session(self.bus, "approve", approval_id, answer, REQUEST_TIMEOUT)


@dataclass
class Session:
    """One session: :meth:`send` a turn, :meth:`interrupt` it, :meth:`stop` the session."""

    sage: Sage
    session_id: str
    node: str | None = None
    info: SessionInfo | None = None
    _turning: anyio.Lock = field(default_factory=anyio.Lock)

    async def send(
        self,
        prompt: str,
        *,
        can_use_tool: CanUseTool | None = None,
        include_partial_messages: bool = False,
    ) -> AsyncIterator[Message]:
        """Send a user turn; its messages until its :class:`ResultMessage` (the last).

        ``can_use_tool`` decides the turn's tool calls that need approval (without it,
        the approvals are left to other approvers, and with none the call is denied);
        an exception it raises denies the call with its text.  A session that ends
        meanwhile raises :class:`SessionEnded`."""
        bus = self.sage.bus
        async with self._turning:
            events = await bus.subscribe(event_pattern(self.session_id))
            approver: RemoteSubscription | None = None
            try:
                if can_use_tool is not None:  # present: the session's calls wait for us
                    approver = await bus.subscribe(approver_topic(self.session_id))
                sent = await call_session(
                    bus, "send", self.session_id, {"text": prompt}, SEND_TIMEOUT
                )
                number = int(sent.get("turn") or 0)
                async for envelope in events:
                    name = envelope.topic.rsplit(".", 1)[1]
                    if name == "exited":
                        reason = msgspec.json.decode(envelope.payload).get("reason", "")
                        raise SessionEnded(self.session_id, str(reason))
                    message = decode_event(name, envelope.payload)
                    if message is None or getattr(message, "turn", number) < number:
                        continue  # not a message, or the tail of an earlier turn
                    if isinstance(message, ApprovalRequest) and can_use_tool is not None:
                        self.sage._tg.start_soon(self._decide, can_use_tool, message)
                    if isinstance(message, TextDelta) and not include_partial_messages:
                        continue
                    yield message
                    if isinstance(message, ResultMessage):
                        return
                raise SageError("the connection ended before the turn did")
            finally:
                with contextlib.suppress(BusError):
                    await events.close()
                    if approver is not None:
                        await approver.close()

    async def _decide(self, can_use_tool: CanUseTool, request: ApprovalRequest) -> None:
        context = ToolPermissionContext(
            approval_id=request.approval_id,
            session_id=self.session_id,
            tool_use_id=request.tool_use_id,
            expires_at=request.expires_at,
        )
        decision: Allow | Deny
        try:
            decision = await can_use_tool(request.tool_name, request.input, context)
        except Exception as exc:  # the program's bug denies the call, visibly
            decision = Deny(f"can_use_tool failed: {type(exc).__name__}: {exc}")
        if not isinstance(decision, Allow | Deny):
            decision = Deny(f"can_use_tool returned {type(decision).__name__}, not Allow or Deny")
        with contextlib.suppress(SageError, BusError):  # decided elsewhere, or expired
            await self.sage.decide(request.approval_id, decision)

    async def interrupt(self) -> bool:
        """Interrupt the running turn; False when none was running."""
        data = await call_session(self.sage.bus, "interrupt", self.session_id, {}, REQUEST_TIMEOUT)
        return bool(data.get("interrupted", True))

    async def stop(self) -> None:
        """Stop the session (interrupt, end its input, then signals)."""
        await call_session(self.sage.bus, "stop", self.session_id, {}, REQUEST_TIMEOUT)


async def query(
    prompt: str,
    *,
    principal: str,
    config: str | os.PathLike[str] | None = None,
    socket: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    model: str | None = None,
    can_use_tool: CanUseTool | None = None,
) -> AsyncIterator[Message]:
    """One turn in a new session of ``principal``, stopped after it (the SDK's ``query()``)."""
    async with connect(config, socket=socket) as sage:
        session = await sage.spawn(principal, cwd=cwd, model=model)
        try:
            async for message in session.send(prompt, can_use_tool=can_use_tool):
                yield message
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(SageError, BusError):
                await session.stop()
