"""One supervised ``claude`` process: pipes, codec, control protocol, the end.

A :class:`ClaudeProcess` owns one child (:class:`sage.process.Child`), a
:class:`~sage.claude.protocol.StreamDecoder` on its stdout, a bounded ring on its
stderr, a single writer for its stdin and a :class:`~sage.claude.protocol.ControlChannel`.
All of its tasks live in one task group that :meth:`ClaudeProcess.run`
opens and closes, so a cancel never leaves a reader behind.

It is the thin async shell around a
:class:`~capsules.runner.conversation.Conversation`, the sans-IO core that
turns what the child says into turns, events and the process state
(``STARTING`` -> ``READY`` <-> ``BUSY`` -> ``STOPPING`` -> ``EXITED``) and
keeps the first reason to end (:meth:`ClaudeProcess.end`): ``stopped``,
``auth_failed`` (``system/api_retry`` with 401/403, or a turn the API refused
with 401/403, which the CLI does not retry), ``permission_mode_mismatch``
(the ``initialize`` answer or ``system/init`` names another permission mode
than the one sage passed; turns wait until ``initialize`` is checked, so
none reaches such a CLI), ``init_timeout``, ``line_too_long``,
``supervisor_shutdown``...; a child that exits on its
own ends with ``exited`` (code 0) or ``crashed``.  :meth:`run` returns an
:class:`Ending` once the child is reaped and every pending control request
has been failed.

Control requests from the CLI are each answered in a task of their own by
the :class:`Host` (the runner), so a slow approval does not hold up an MCP
message; a ``control_cancel_request`` cancels that task and nothing is
written for it.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec
import structlog

from capsules.runner.approvals import Verdict
from capsules.runner.command import Launch
from capsules.runner.conversation import (
    Conversation,
    EndReason,
    Output,
    ProcessState,
    Publish,
    Turn,
)
from capsules.runner.errors import SessionError
from sage.claude.protocol import (
    CanUseToolRequest,
    ChannelState,
    ControlCancelRequest,
    ControlChannel,
    ControlOutcome,
    ControlRequest,
    ControlResponse,
    Event,
    HookCallbackRequest,
    LineTooLong,
    McpMessageRequest,
    OutgoingState,
    StreamDecoder,
    SystemInit,
    encode_control_error,
    encode_control_success,
    encode_hook_response,
    encode_initialize,
    encode_interrupt,
    encode_mcp_notification,
    encode_mcp_response,
    encode_permission_allow,
    encode_permission_deny,
    encode_user_turn,
)
from sage.config import LimitsConfig
from sage.contract.sessions import TurnEnd, turn_too_large
from sage.errors import ProcessError, ProtocolError
from sage.process import Child, ExitStatus, Ring, stop

__all__ = (
    "ClaudeProcess",
    "EndReason",
    "Ending",
    "Host",
    "ProcessState",
    "SessionError",
    "Turn",
)

log = structlog.get_logger("sage.runner")

STDERR_TAIL = 16 * 1024
STDOUT_TAIL = 4 * 1024
EVENT_TAIL = 4 * 1024  # bytes of each tail carried in the exited event
DRAIN_AFTER_EXIT = 1.0  # seconds to read what the child wrote before it exited


class Host(Protocol):
    """What a process needs from the runner: events out, answers to the CLI's requests."""

    def event(self, proc: ClaudeProcess, name: str, payload: dict[str, Any]) -> None: ...

    async def mcp_message(self, proc: ClaudeProcess, request: McpMessageRequest) -> Any:
        """The JSON-RPC response for an sdk MCP message (None: a notification, ack it)."""
        ...

    async def can_use_tool(self, proc: ClaudeProcess, request: CanUseToolRequest) -> Verdict: ...

    async def hook_callback(
        self, proc: ClaudeProcess, request: HookCallbackRequest
    ) -> dict[str, Any]: ...


class _InitializeAnswer(msgspec.Struct, frozen=True):
    current_permission_mode: str | None = None


def _initialize_mode(response: msgspec.Raw) -> str | None:
    """The permission mode the CLI says it runs in, from its ``initialize`` answer."""
    try:
        return msgspec.json.decode(response, type=_InitializeAnswer).current_permission_mode
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


@dataclass(frozen=True)
class Ending:
    status: ExitStatus
    reason: str
    stdout_tail: str
    stderr_tail: str

    def payload(self) -> dict[str, Any]:
        return {
            "exit_code": self.status.exit_code,
            "signal": self.status.signal,
            "reason": self.reason,
            "stdout_tail": self.stdout_tail,
            "stderr_tail": self.stderr_tail,
        }


@dataclass
class _Waiter:
    event: anyio.Event = field(default_factory=anyio.Event)
    outcome: ControlOutcome | None = None


class ClaudeProcess:
    """One ``claude`` child of a session; see the module docstring."""

    def __init__(
        self,
        session_id: str,
        principal_id: str,
        launch: Launch,
        host: Host,
        *,
        max_line_bytes: int,
        init_timeout: float,
        stop_grace: float,
        stdin_quota: int,
        hooks: dict[str, list[Any]] | None = None,
        initial_message: str | None = None,
    ) -> None:
        self.session_id = session_id
        self.principal_id = principal_id
        self.launch = launch
        self.host = host
        self.conversation = Conversation(principal_id, session_id, launch.permission_mode)
        self.started_at = time.time()
        self.child: Child | None = None
        self.stdin_quota = stdin_quota
        self._init_timeout = init_timeout
        self._stop_grace = stop_grace
        self._hooks = hooks
        self._initial = initial_message
        self._decoder = StreamDecoder(max_line_bytes)
        self._channel = ControlChannel("sage")
        self._stdout_tail = Ring(STDOUT_TAIL)
        self._stderr_tail = Ring(STDERR_TAIL)
        self._waiters: dict[str, _Waiter] = {}
        self._handlers: dict[str, anyio.CancelScope] = {}
        self._send, self._outbox = anyio.create_memory_object_stream[bytes](64)
        self._tg: anyio.abc.TaskGroup | None = None
        self._ready = anyio.Event()
        self._ending = anyio.Event()
        self._stdout_done = anyio.Event()
        self._sending = 0  # sends under way (not yet written): the process is not idle

    # -- public -------------------------------------------------------------

    @property
    def state(self) -> ProcessState:
        return self.conversation.state

    @property
    def turn(self) -> Turn:
        return self.conversation.turn

    @property
    def reason(self) -> EndReason | None:
        return self.conversation.reason

    @property
    def init(self) -> SystemInit | None:
        return self.conversation.init

    @property
    def unknown(self) -> int:
        return self.conversation.unknown

    @classmethod
    def within(
        cls,
        limits: LimitsConfig,
        session_id: str,
        principal_id: str,
        launch: Launch,
        host: Host,
        *,
        hooks: dict[str, list[Any]],
        initial_message: str | None = None,
    ) -> ClaudeProcess:
        """A process bounded by ``[limits]`` (the runner's sessions and its spares)."""
        return cls(
            session_id,
            principal_id,
            launch,
            host,
            max_line_bytes=limits.max_line_bytes,
            init_timeout=limits.init_timeout,
            stop_grace=limits.stop_grace,
            stdin_quota=limits.stdin_quota,
            hooks=hooks,
            initial_message=initial_message,
        )

    @property
    def initialized(self) -> bool:
        """Whether ``initialize`` was answered in the right mode (the child takes turns)."""
        return self._ready.is_set()

    @property
    def idle(self) -> bool:
        """Ready, with no turn in flight and no control request of the CLI's unanswered
        (an approval, a tool call): it may be stopped without losing anything."""
        return (
            self.state is ProcessState.READY
            and self.turn.started == self.turn.finished
            and not self._handlers
            and not self._sending
            and not self._initial
        )

    @property
    def pid(self) -> int | None:
        return self.child.pid if self.child is not None else None

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED
    ) -> Ending:
        """Start the child, serve it until it is gone; ``task_status`` gets its pid."""
        self.child = child = Child.spawn(
            self.launch.command, env=self.launch.env, cwd=self.launch.cwd
        )
        init_id = self._queue_initialize()
        task_status.started(child.pid)
        log.info("session.spawned", session_id=self.session_id, pid=child.pid)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._read_stdout, child)
                tg.start_soon(self._read_stderr, child)
                tg.start_soon(self._write_stdin, child)
                tg.start_soon(self._initialize, init_id)
                tg.start_soon(self._enforce_ending, child)
                status = await child.wait()
                await self._after_exit(child)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if child.running:  # cancelled from outside: the supervisor is stopping
                    self.end(EndReason.SUPERVISOR_SHUTDOWN)
                    await stop(child, grace=min(self._stop_grace, 1.0))
                child.close()
                self._send.close()
                self._outbox.close()
                self._fail_pending("process exited")
                self.conversation.exited()
                self._ending.set()  # a turn waiting for initialize learns it never comes
        assert child.status is not None
        status = child.status
        return Ending(
            status=status,
            reason=self.conversation.outcome(status.exit_code).value,
            stdout_tail=self._stdout_tail.text(EVENT_TAIL),
            stderr_tail=self._stderr_tail.text(EVENT_TAIL),
        )

    def end(self, reason: EndReason) -> None:
        """Ask the process to end for ``reason`` (the first reason given is kept,
        except that an operator's ``stopped`` overrides a planned ``respawn`` or
        ``hibernate``)."""
        self.conversation.end(reason)
        self._ending.set()

    def fence(self) -> None:
        """The node lost its fleet lease (sage/lease.py): the child is killed now
        (SIGKILL to its group, no grace, whatever stop is under way)."""
        self.end(EndReason.FENCED)
        child = self.child
        if child is not None and child.running:
            child.signal_group(signal.SIGKILL)

    async def send(self, text: str) -> int:
        """Write one user turn; returns the turn's number.

        A turn sent while the process starts waits until ``initialize`` is answered
        and its permission mode checked: no turn reaches a CLI that sage has not
        seen run in the mode it asked for."""
        self._sending += 1
        try:
            return await self._send_turn(text)
        finally:
            self._sending -= 1

    async def _send_turn(self, text: str) -> int:
        if self.conversation.ending:
            raise SessionError("session_ended", f"session {self.session_id} is ending")
        line = encode_user_turn(text)
        if len(line) > self.stdin_quota:
            raise SessionError("payload_too_large", turn_too_large(len(line), self.stdin_quota))
        if self.state is ProcessState.STARTING:
            await self._ready_or_ending()
            if self.conversation.ending:
                raise SessionError("session_ended", f"session {self.session_id} has ended")
        await self._write(line)
        return self.conversation.sent()

    async def _ready_or_ending(self) -> None:
        async with anyio.create_task_group() as tg:

            async def wait(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(wait, self._ready)
            tg.start_soon(wait, self._ending)

    async def interrupt(
        self, within: float = 10.0, *, because: tuple[TurnEnd, str] | None = None
    ) -> dict[str, Any]:
        """Interrupt the running turn; the CLI's answer.  ``because``: why sage does
        (a budget), which the turn's ``done`` event says."""
        if self.state is ProcessState.STARTING:
            raise SessionError("not_ready", f"session {self.session_id} is still starting")
        if self.conversation.ending:
            raise SessionError("session_ended", f"session {self.session_id} is ending")
        busy = self.state is ProcessState.BUSY
        if busy:
            self.conversation.interrupting(because)
        outcome = await self.request("interrupt", encode_interrupt, within=within)
        response: Any = msgspec.json.decode(outcome.response) if outcome.response else {}
        return {"interrupted": busy, "response": response}

    async def tools_changed(self, server: str = "sage") -> None:
        """Tell the CLI that the tool list of sdk MCP server ``server`` changed."""
        if self.state in (ProcessState.READY, ProcessState.BUSY):
            await self.request(
                "mcp_message",
                lambda rid: encode_mcp_notification(
                    rid, server, "notifications/tools/list_changed"
                ),
            )

    async def request(
        self, subtype: str, encode: Callable[[str], bytes], *, within: float = 10.0
    ) -> ControlOutcome:
        """Send a control request and wait for its answer (SessionError on failure)."""
        if self._channel.state is not ChannelState.OPEN:
            raise SessionError("session_ended", f"session {self.session_id} has ended")
        request_id = self._channel.open_request(subtype)
        self._waiters[request_id] = _Waiter()
        try:
            await self._write(encode(request_id))
        except BaseException:
            self._waiters.pop(request_id, None)
            raise
        return await self._answer_to(request_id, subtype, within)

    async def _answer_to(self, request_id: str, subtype: str, within: float) -> ControlOutcome:
        waiter = self._waiters[request_id]
        try:
            with anyio.move_on_after(within) as scope:
                await waiter.event.wait()
        finally:
            self._waiters.pop(request_id, None)
        if scope.cancelled_caught:
            raise SessionError("timeout", f"no answer to {subtype} within {within:g} s")
        outcome = waiter.outcome
        assert outcome is not None
        if outcome.state is not OutgoingState.COMPLETED:
            raise SessionError("control_failed", f"{subtype} failed: {outcome.error}")
        return outcome

    async def stop(self, reason: EndReason = EndReason.STOPPED) -> None:
        """End the process for ``reason`` and wait until it is reaped."""
        self.end(reason)
        child = self.child
        if child is not None and child.running:
            await child.wait()

    def describe(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "principal_id": self.principal_id,
            "pid": self.pid,
            "state": self.state.value,
            "age_s": round(time.time() - self.started_at, 1),
            "turns": self.turn.finished,
            "cost_usd": self.turn.cost_usd,
            "model": self.init.model if self.init else "",
        }

    # -- tasks ----------------------------------------------------------------

    def _queue_initialize(self) -> str:
        """Put ``initialize`` first in the child's input, before anything can be sent."""
        request_id = self._channel.open_request("initialize")
        self._waiters[request_id] = _Waiter()
        self._send.send_nowait(encode_initialize(request_id, self._hooks))
        return request_id

    async def _initialize(self, request_id: str) -> None:
        try:
            outcome = await self._answer_to(request_id, "initialize", self._init_timeout)
        except SessionError as exc:
            if exc.code == "timeout":
                log.warning("session.init_timeout", session_id=self.session_id)
                self._error(EndReason.INIT_TIMEOUT.value)
                self.end(EndReason.INIT_TIMEOUT)
            elif exc.code == "control_failed" and self._channel.state is ChannelState.OPEN:
                # an error answer from the CLI (not the child going away)
                log.warning("session.init_failed", session_id=self.session_id, error=str(exc))
                self._error(EndReason.INIT_FAILED.value, message=str(exc))
                self.end(EndReason.INIT_FAILED)
            return  # session_ended: the child is gone; its exit tells the rest
        fail = self.conversation.check_mode(_initialize_mode(outcome.response), "initialize")
        if fail is not None:
            self._carry_out([fail])
            return
        self.conversation.initialized()
        self._ready.set()
        self.host.event(
            self,
            "init",
            {
                "session_id": self.session_id,
                "model": self.launch_model(),
                "cwd": str(self.launch.cwd),
                "tools": [],
                "claude_code_version": "",
                "pid": self.pid,
            },
        )
        if self._initial:
            try:
                await self.send(self._initial)
            except SessionError as exc:
                self._error(exc.code)
            finally:
                self._initial = None  # sent (or not): it no longer keeps the process busy

    def launch_model(self) -> str:
        argv = self.launch.argv
        return argv[argv.index("--model") + 1] if "--model" in argv else ""

    async def _enforce_ending(self, child: Child) -> None:
        """The one place that runs the stop sequence, once a reason to end appears."""
        await self._ending.wait()
        if not child.running:
            return
        if self.reason is EndReason.FENCED:  # fenced before the child ran: no grace
            child.signal_group(signal.SIGKILL)
            await child.wait()
            return
        if self.reason is None or not self.reason.gentle:
            # a fail-fast ending has no turn worth finishing: stop at once
            await stop(child, grace=min(self._stop_grace, 1.0))
            return

        async def interrupt() -> None:
            if self.conversation.busy_at_end and self._channel.state is ChannelState.OPEN:
                with contextlib.suppress(SessionError):
                    await self.request("interrupt", encode_interrupt, within=self._stop_grace)

        await stop(child, grace=self._stop_grace, end_input=interrupt)

    async def _write_stdin(self, child: Child) -> None:
        async for line in self._outbox:
            try:
                await child.write(line)
            except ProcessError as exc:
                log.info("session.stdin_closed", session_id=self.session_id, error=str(exc))
                return

    async def _write(self, line: bytes) -> None:
        try:
            await self._send.send(line)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise SessionError("session_ended", f"session {self.session_id} has ended") from None

    async def _read_stdout(self, child: Child) -> None:
        decoder = self._decoder
        try:
            while chunk := await child.read_stdout():
                self._stdout_tail.append(chunk)
                for event in decoder.feed(chunk):
                    self._dispatch(event)
                    if isinstance(event, LineTooLong):
                        return  # the session ends; the rest of the output is not read
            for event in decoder.eof():
                self._dispatch(event)
        finally:
            self._stdout_done.set()

    async def _read_stderr(self, child: Child) -> None:
        while chunk := await child.read_stderr():
            self._stderr_tail.append(chunk)

    async def _after_exit(self, child: Child) -> None:
        """The child is gone: let the reader take what is left in the pipe, briefly."""
        with anyio.move_on_after(DRAIN_AFTER_EXIT):
            await self._stdout_done.wait()
        child.close_output()
        self._fail_pending(f"process exited ({child.status.describe() if child.status else ''})")

    # -- stdout ---------------------------------------------------------------

    def _dispatch(self, event: Event) -> None:
        if isinstance(event, ControlRequest):
            self._control_request(event)
        elif isinstance(event, ControlResponse):
            self._control_response(event)
        elif isinstance(event, ControlCancelRequest):
            if self._channel.state is ChannelState.OPEN and self._channel.receive_cancel(event):
                scope = self._handlers.get(event.request_id)
                if scope is not None:
                    scope.cancel()
        else:
            self._carry_out(self.conversation.receive(event, time.monotonic()))

    def _carry_out(self, outputs: list[Output]) -> None:
        """Do what the conversation asks, in order: publish events, report a failure."""
        for output in outputs:
            if isinstance(output, Publish):
                self.host.event(self, output.name, output.payload)
            else:
                log.warning(f"session.{output.reason}", session_id=self.session_id, **output.logged)
                self._error(output.reason.value, **output.details)
                self._ending.set()

    # -- control protocol -------------------------------------------------------

    def _control_response(self, msg: ControlResponse) -> None:
        if self._channel.state is not ChannelState.OPEN:
            return
        outcome = self._channel.receive_response(msg)
        if outcome is None:
            return
        waiter = self._waiters.get(outcome.request_id)
        if waiter is not None:
            waiter.outcome = outcome
            waiter.event.set()

    def _fail_pending(self, reason: str) -> None:
        if self._channel.state is not ChannelState.OPEN:
            return
        for request_id in self._channel.fail_all(reason):
            waiter = self._waiters.get(request_id)
            if waiter is not None:
                waiter.outcome = ControlOutcome(request_id, "", OutgoingState.FAILED, error=reason)
                waiter.event.set()
        for scope in self._handlers.values():
            scope.cancel()

    def _control_request(self, msg: ControlRequest) -> None:
        if self._channel.state is not ChannelState.OPEN or self._tg is None:
            return
        try:
            self._channel.receive_request(msg)
        except ProtocolError as exc:
            log.warning("session.protocol_error", session_id=self.session_id, error=str(exc))
            return
        self._tg.start_soon(self._answer, msg)

    async def _answer(self, msg: ControlRequest) -> None:
        rid = msg.request_id
        line: bytes | None = None
        with anyio.CancelScope() as scope:
            self._handlers[rid] = scope
            try:
                line = await self._handle(msg)
            except SessionError as exc:
                line = encode_control_error(rid, str(exc))
            except Exception as exc:  # a handler bug must not take the session down
                log.exception("session.handler_failed", session_id=self.session_id)
                line = encode_control_error(rid, f"host error: {type(exc).__name__}")
            finally:
                self._handlers.pop(rid, None)
        if self._channel.state is not ChannelState.OPEN:
            return
        if self._channel.incoming_state(rid) is None:
            return
        if self._channel.answer(rid) and line is not None and not scope.cancelled_caught:
            with contextlib.suppress(SessionError):
                await self._write(line)

    async def _handle(self, msg: ControlRequest) -> bytes:
        rid = msg.request_id
        body = msg.request
        if isinstance(body, McpMessageRequest):
            response = await self.host.mcp_message(self, body)
            if response is None:
                return encode_control_success(
                    rid, {"mcp_response": {"jsonrpc": "2.0", "result": {}}}
                )
            return encode_mcp_response(rid, response)
        if isinstance(body, CanUseToolRequest):
            verdict = await self.host.can_use_tool(self, body)
            self.conversation.approval_answered(body.tool_use_id, time.monotonic())
            if verdict.allowed:
                given = verdict.updated_input
                return encode_permission_allow(rid, body.input if given is None else given)
            return encode_permission_deny(rid, verdict.message)
        if isinstance(body, HookCallbackRequest):
            return encode_hook_response(rid, await self.host.hook_callback(self, body))
        name = getattr(body, "name", "") or type(body).__name__
        return encode_control_error(rid, f"sage does not handle control request {name!r}")

    def _error(self, reason: str, **details: Any) -> None:
        self.host.event(
            self,
            "error",
            {
                "principal_id": self.principal_id,
                "session_id": self.session_id,
                "reason": reason,
                **details,
            },
        )
