"""One supervised ``claude`` process: pipes, codec, control protocol, the end.

A :class:`ClaudeProcess` owns one child (:class:`sage.process.Child`), a
:class:`~sage.claude.protocol.StreamDecoder` on its stdout, a bounded ring on its
stderr, a single writer for its stdin and a :class:`~sage.claude.protocol.ControlChannel`.
All of its tasks live in one task group that :meth:`ClaudeProcess.run`
opens and closes, so a cancel never leaves a reader behind.

States: ``STARTING`` (spawned, ``initialize`` sent) -> ``READY`` (answered;
idle) <-> ``BUSY`` (a turn is running) -> ``STOPPING`` -> ``EXITED``.  The
first reason to end wins (:meth:`ClaudeProcess.end`): ``stopped``,
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
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import anyio
import anyio.abc
import msgspec
import structlog

from capsules.runner.command import Launch
from sage.claude.protocol import (
    AssistantMessage,
    CanUseToolRequest,
    ChannelState,
    ControlCancelRequest,
    ControlChannel,
    ControlOutcome,
    ControlRequest,
    ControlResponse,
    Event,
    HookCallbackRequest,
    InvalidLine,
    LineTooLong,
    McpMessageRequest,
    OutgoingState,
    ResultMessage,
    StreamDecoder,
    StreamEvent,
    SystemApiRetry,
    SystemInformational,
    SystemInit,
    SystemPermissionDenied,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnknownMessage,
    UserMessage,
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
from sage.errors import ProcessError, ProtocolError
from sage.process import Child, ExitStatus, Ring, stop

__all__ = ("ClaudeProcess", "Ending", "Host", "ProcessState", "SessionError", "Turn")

log = structlog.get_logger("sage.runner")

AUTH_STATUSES = frozenset({401, 403})
AUTH_ERROR = "authentication_failed"  # an assistant message's ``error`` for a 401/403
TOOL_INPUT_SHOWN = 4096  # encoded bytes of a tool call's input a tool_use event carries whole
STDERR_TAIL = 16 * 1024
STDOUT_TAIL = 4 * 1024
EVENT_TAIL = 4 * 1024  # bytes of each tail carried in the exited event
GENTLE_REASONS = frozenset({"stopped", "respawn"})  # a running turn is interrupted first
DRAIN_AFTER_EXIT = 1.0  # seconds to read what the child wrote before it exited


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    EXITED = "exited"


class SessionError(Exception):
    """A request the session cannot carry out; ``code`` is the reason on the wire."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Host(Protocol):
    """What a process needs from the runner: events out, answers to the CLI's requests."""

    def event(self, proc: ClaudeProcess, name: str, payload: dict[str, Any]) -> None: ...

    async def mcp_message(self, proc: ClaudeProcess, request: McpMessageRequest) -> Any:
        """The JSON-RPC response for an sdk MCP message (None: a notification, ack it)."""
        ...

    async def can_use_tool(
        self, proc: ClaudeProcess, request: CanUseToolRequest
    ) -> tuple[bool, str]: ...

    async def hook_callback(
        self, proc: ClaudeProcess, request: HookCallbackRequest
    ) -> dict[str, Any]: ...


class _Delta(msgspec.Struct, frozen=True):
    type: str = ""
    text: str = ""


class _StreamEventBody(msgspec.Struct, frozen=True):
    type: str = ""
    delta: _Delta | None = None


_decode_stream_event = msgspec.json.Decoder(_StreamEventBody).decode


class _InitializeAnswer(msgspec.Struct, frozen=True):
    current_permission_mode: str | None = None


def _initialize_mode(response: msgspec.Raw) -> str | None:
    """The permission mode the CLI says it runs in, from its ``initialize`` answer."""
    try:
        return msgspec.json.decode(response, type=_InitializeAnswer).current_permission_mode
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


@dataclass
class Turn:
    """Counters a session shows in its listing."""

    started: int = 0
    finished: int = 0
    cost_usd: float = 0.0
    last_result: ResultMessage | None = None


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
        self.state = ProcessState.STARTING
        self.turn = Turn()
        self.init: SystemInit | None = None
        self.started_at = time.time()
        self.child: Child | None = None
        self.reason: str | None = None
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
        self._deltas = 0  # text deltas since the last assistant message
        self._busy_at_end = False
        self._auth_refused = False  # the turn's assistant message said authentication_failed
        self._tool_started: dict[str, tuple[str, float]] = {}  # tool_use_id -> (name, when)
        self.unknown = 0

    # -- public -------------------------------------------------------------

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
                    self.end("supervisor_shutdown")
                    await stop(child, grace=min(self._stop_grace, 1.0))
                child.close()
                self._send.close()
                self._outbox.close()
                self._fail_pending("process exited")
                self.state = ProcessState.EXITED
        assert child.status is not None
        status = child.status
        reason = self.reason or ("exited" if status.exit_code == 0 else "crashed")
        return Ending(
            status=status,
            reason=reason,
            stdout_tail=self._stdout_tail.text(EVENT_TAIL),
            stderr_tail=self._stderr_tail.text(EVENT_TAIL),
        )

    def end(self, reason: str) -> None:
        """Ask the process to end for ``reason`` (the first reason given is kept,
        except that an operator's ``stopped`` overrides a planned ``respawn``)."""
        if self.reason is None or (self.reason == "respawn" and reason == "stopped"):
            self.reason = reason
        if self.state not in (ProcessState.STOPPING, ProcessState.EXITED):
            self._busy_at_end = (
                self.state is ProcessState.BUSY or self.turn.started > self.turn.finished
            )
            self.state = ProcessState.STOPPING
        self._ending.set()

    async def send(self, text: str) -> int:
        """Write one user turn; returns the turn's number.

        A turn sent while the process starts waits until ``initialize`` is answered
        and its permission mode checked: no turn reaches a CLI that sage has not
        seen run in the mode it asked for."""
        if self.state in (ProcessState.STOPPING, ProcessState.EXITED):
            raise SessionError("session_ended", f"session {self.session_id} is ending")
        line = encode_user_turn(text)
        if len(line) > self.stdin_quota:
            raise SessionError(
                "stdin_quota",
                f"the encoded turn is {len(line)} bytes; the limit is {self.stdin_quota}",
            )
        if self.state is ProcessState.STARTING:
            await self._ready_or_ending()
            if self.state in (ProcessState.STOPPING, ProcessState.EXITED):
                raise SessionError("session_ended", f"session {self.session_id} has ended")
        await self._write(line)
        self.turn.started += 1
        if self.state is ProcessState.READY:
            self.state = ProcessState.BUSY
        return self.turn.started

    async def _ready_or_ending(self) -> None:
        async with anyio.create_task_group() as tg:

            async def wait(event: anyio.Event) -> None:
                await event.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(wait, self._ready)
            tg.start_soon(wait, self._ending)

    async def interrupt(self, within: float = 10.0) -> dict[str, Any]:
        """Interrupt the running turn; the CLI's answer."""
        if self.state is ProcessState.STARTING:
            raise SessionError("not_ready", f"session {self.session_id} is still starting")
        if self.state in (ProcessState.STOPPING, ProcessState.EXITED):
            raise SessionError("session_ended", f"session {self.session_id} is ending")
        busy = self.state is ProcessState.BUSY
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

    async def stop(self, reason: str = "stopped") -> None:
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
                self._error("init_timeout")
                self.end("init_timeout")
            elif exc.code == "control_failed" and self._channel.state is ChannelState.OPEN:
                # an error answer from the CLI (not the child going away)
                log.warning("session.init_failed", session_id=self.session_id, error=str(exc))
                self._error("init_failed", message=str(exc))
                self.end("init_failed")
            return  # session_ended: the child is gone; its exit tells the rest
        if not self._mode_is_ours(_initialize_mode(outcome.response), "initialize"):
            return
        if self.state is ProcessState.STARTING:
            # a turn sent while starting is already queued behind initialize
            busy = self.turn.started > self.turn.finished
            self.state = ProcessState.BUSY if busy else ProcessState.READY
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

    def _mode_is_ours(self, mode: str | None, where: str) -> bool:
        """Whether the CLI runs in the permission mode sage asked for; if not, the
        session ends before a turn reaches it (or at once, mid-turn)."""
        expected = self.launch.permission_mode
        if mode == expected:
            return True
        log.warning(
            "session.permission_mode_mismatch",
            session_id=self.session_id,
            expected=expected,
            got=mode,
            where=where,
        )
        self._error("permission_mode_mismatch", expected=expected, got=mode, where=where)
        self.end("permission_mode_mismatch")
        return False

    def launch_model(self) -> str:
        argv = self.launch.argv
        return argv[argv.index("--model") + 1] if "--model" in argv else ""

    async def _enforce_ending(self, child: Child) -> None:
        """The one place that runs the stop sequence, once a reason to end appears."""
        await self._ending.wait()
        if not child.running:
            return
        if self.reason not in GENTLE_REASONS:
            # a fail-fast ending has no turn worth finishing: stop at once
            await stop(child, grace=min(self._stop_grace, 1.0))
            return

        async def interrupt() -> None:
            if self._busy_at_end and self._channel.state is ChannelState.OPEN:
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
        if isinstance(event, StreamEvent):
            self._stream_event(event)
        elif isinstance(event, AssistantMessage):
            self._assistant(event)
        elif isinstance(event, ResultMessage):
            self._result(event)
        elif isinstance(event, ControlRequest):
            self._control_request(event)
        elif isinstance(event, ControlResponse):
            self._control_response(event)
        elif isinstance(event, ControlCancelRequest):
            if self._channel.state is ChannelState.OPEN and self._channel.receive_cancel(event):
                scope = self._handlers.get(event.request_id)
                if scope is not None:
                    scope.cancel()
        elif isinstance(event, UserMessage):
            self._tool_results(event)
        elif isinstance(event, SystemApiRetry):
            if event.error_status in AUTH_STATUSES and self.reason is None:
                log.warning(
                    "session.auth_failed", session_id=self.session_id, status=event.error_status
                )
                self._error("auth_failed", status=event.error_status)
                self.end("auth_failed")
            elif self.reason is None:
                self.host.event(
                    self,
                    "retry",
                    {
                        "attempt": event.attempt,
                        "max_retries": event.max_retries,
                        "status": event.error_status,
                        "error": event.error,
                        "delay_ms": event.retry_delay_ms,
                        "turn": self.turn.finished + 1,
                    },
                )
        elif isinstance(event, SystemInit):
            self.init = event
            if self.state is not ProcessState.STOPPING:
                self._mode_is_ours(event.permission_mode, "system/init")
        elif isinstance(event, SystemPermissionDenied):
            self.host.event(
                self,
                "permission_denied",
                {
                    "principal_id": self.principal_id,
                    "session_id": self.session_id,
                    "tool_name": event.tool_name,
                    "tool_use_id": event.tool_use_id,
                    "decision_reason_type": event.decision_reason_type,
                    "decision_reason": event.decision_reason,
                },
            )
        elif isinstance(event, SystemInformational):
            self.host.event(self, "informational", {"content": event.content})
        elif isinstance(event, LineTooLong):
            log.warning("session.line_too_long", session_id=self.session_id, seen=event.seen)
            self._error("line_too_long")
            self.end("line_too_long")
        elif isinstance(event, UnknownMessage | InvalidLine):
            self.unknown += 1

    def _stream_event(self, msg: StreamEvent) -> None:
        try:
            body = _decode_stream_event(msg.event)
        except msgspec.DecodeError:
            return
        delta = body.delta
        if body.type != "content_block_delta" or delta is None:
            return
        if delta.type == "text_delta" and delta.text:
            self._deltas += 1
            self.host.event(self, "text", {"delta": delta.text, "turn": self.turn.finished + 1})

    def _assistant(self, msg: AssistantMessage) -> None:
        if msg.error == AUTH_ERROR:
            self._auth_refused = True
        for block in msg.message.content:
            if isinstance(block, ToolUseBlock):
                self._tool_started[block.id] = (block.name, time.monotonic())
                encoded = msgspec.json.encode(block.input)
                shown: dict[str, Any] = (
                    {"input": block.input}
                    if len(encoded) <= TOOL_INPUT_SHOWN
                    else {
                        "input_preview": encoded[:TOOL_INPUT_SHOWN].decode(errors="replace"),
                        "input_bytes": len(encoded),
                    }
                )
                self.host.event(
                    self,
                    "tool_use",
                    {
                        "tool_use_id": block.id,
                        "name": block.name,
                        **shown,
                        "parent_tool_use_id": msg.parent_tool_use_id,
                        "turn": self.turn.finished + 1,
                    },
                )
        if self._deltas == 0 and msg.parent_tool_use_id is None:
            # not streamed (no partial messages for this one): send the text whole
            for block in msg.message.content:
                if isinstance(block, TextBlock) and block.text:
                    self.host.event(
                        self, "text", {"delta": block.text, "turn": self.turn.finished + 1}
                    )
        self._deltas = 0

    def _tool_results(self, msg: UserMessage) -> None:
        """The CLI's echo of a tool's result: its end, ok or not, and how long it took."""
        if isinstance(msg.message.content, str):
            return
        for block in msg.message.content:
            if not isinstance(block, ToolResultBlock):
                continue
            name, started = self._tool_started.pop(block.tool_use_id, ("", None))
            self.host.event(
                self,
                "tool_result",
                {
                    "tool_use_id": block.tool_use_id,
                    "name": name,
                    "is_error": block.is_error,
                    "duration_ms": (
                        round((time.monotonic() - started) * 1000) if started is not None else None
                    ),
                    "turn": self.turn.finished + 1,
                },
            )

    def _result(self, msg: ResultMessage) -> None:
        self._tool_started.clear()  # a call the CLI never echoed ends with its turn
        self.turn.finished += 1
        self.turn.cost_usd = max(self.turn.cost_usd, msg.total_cost_usd)
        self.turn.last_result = msg
        if self.state is ProcessState.BUSY and self.turn.finished >= self.turn.started:
            self.state = ProcessState.READY
        self.host.event(
            self,
            "done",
            {
                "usage": msgspec.to_builtins(msg.usage) if msg.usage else {},
                "is_error": msg.is_error,
                "subtype": msg.subtype,
                "permission_denials": [
                    {"tool_name": d.tool_name, "tool_use_id": d.tool_use_id}
                    for d in msg.permission_denials
                ],
                "total_cost_usd": msg.total_cost_usd,
                "num_turns": msg.num_turns,
                "turn": self.turn.finished,
            },
        )
        status = msg.api_error_status
        refused = status in AUTH_STATUSES or self._auth_refused
        if msg.is_error and refused and self.reason is None:
            # a 403 is not retried: the turn ends at once, and so does the session
            log.warning("session.auth_failed", session_id=self.session_id, status=status)
            self._error("auth_failed", status=status)
            self.end("auth_failed")
        self._auth_refused = False

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
            allowed, message = await self.host.can_use_tool(self, body)
            if allowed:
                return encode_permission_allow(rid, body.input)
            return encode_permission_deny(rid, message)
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
