"""The conversation with one ``claude`` child, without I/O: turns, process state, the end.

:class:`Conversation` is fed the messages a :class:`~sage.claude.protocol.StreamDecoder`
decoded from the child's stdout (:meth:`Conversation.receive`) and told what the
shell did (:meth:`~Conversation.sent`, :meth:`~Conversation.initialized`,
:meth:`~Conversation.end`, :meth:`~Conversation.exited`).  It answers with
outputs for the shell to carry out, in order: :class:`Publish` (an event for the
session's listeners) and :class:`Fail` (the session must end at once: log it,
publish an ``error`` event; the end itself is already recorded).  It reads no
clock (``now`` is passed in), writes no pipe and starts no task, so it is tested
with recorded transcripts alone.

States (:class:`ProcessState`, the table is :data:`PROCESS_TRANSITIONS`):
``STARTING`` (spawned, ``initialize`` sent) -> ``READY`` (answered; idle) <->
``BUSY`` (a turn is running) -> ``STOPPING`` -> ``EXITED``.  The first reason
to end wins (:meth:`Conversation.end`), except that an operator's ``stopped``
overrides a planned ``respawn`` or ``hibernate``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from sage.claude.protocol import (
    AssistantMessage,
    ContentBlock,
    Event,
    InvalidLine,
    LineTooLong,
    RedactedThinkingBlock,
    ResultMessage,
    StreamEvent,
    SystemApiRetry,
    SystemInformational,
    SystemInit,
    SystemPermissionDenied,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnknownMessage,
    Usage,
    UserMessage,
)
from sage.contract.sessions import EndReason, TurnEnd, turn_end
from sage.errors import IllegalTransition

__all__ = (
    "PROCESS_TRANSITIONS",
    "Conversation",
    "EndReason",
    "Fail",
    "Output",
    "ProcessState",
    "Publish",
    "Turn",
)

AUTH_STATUSES: Final = frozenset({401, 403})
MESSAGE_CHARS: Final = 1000
INTERRUPTED_EXIT_WITHIN: Final = 10.0
"""Seconds after an interrupted turn's result within which a child's error exit is the
interrupt's (Conversation.resumable), not a crash of its own."""
"""Of a failed turn's result text, what its ``done`` event carries as ``message``."""
AUTH_ERROR: Final = "authentication_failed"  # an assistant message's ``error`` for a 401/403
TOOL_INPUT_SHOWN: Final = (
    4096  # encoded bytes of a tool call's input a tool_use event carries whole
)
CONTENT_SHOWN: Final = 64 * 1024
"""Encoded bytes of a tool's result (``tool_result``), or characters of a text, a thinking
or the final result (``assistant``, ``done``), an event carries whole."""
ASSISTANT_SHOWN: Final = 512 * 1024
"""What one ``assistant`` event carries at most, all its blocks together (the bus's
payload limit is 1 MiB)."""
CALLS_KEPT: Final = 64
"""Model calls (message ids) whose usage a child remembers, to report only what is new."""


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    STOPPING = "stopping"
    EXITED = "exited"


PROCESS_TRANSITIONS: Final[dict[ProcessState, frozenset[ProcessState]]] = {
    ProcessState.STARTING: frozenset(
        {ProcessState.READY, ProcessState.BUSY, ProcessState.STOPPING, ProcessState.EXITED}
    ),
    ProcessState.READY: frozenset({ProcessState.BUSY, ProcessState.STOPPING, ProcessState.EXITED}),
    ProcessState.BUSY: frozenset({ProcessState.READY, ProcessState.STOPPING, ProcessState.EXITED}),
    ProcessState.STOPPING: frozenset({ProcessState.EXITED}),
    ProcessState.EXITED: frozenset(),
}


@dataclass
class Turn:
    """Counters a session shows in its listing."""

    started: int = 0
    finished: int = 0
    cost_usd: float = 0.0
    last_result: ResultMessage | None = None


@dataclass(frozen=True)
class Publish:
    """An event for the session's listeners: ``sage.v1.event.<sid>.<name>``."""

    name: str
    payload: dict[str, Any]


@dataclass(frozen=True)
class Fail:
    """The session ends at once for ``reason`` (already recorded): the shell logs
    ``session.<reason>`` with ``logged`` and publishes an ``error`` event with ``details``."""

    reason: EndReason
    details: dict[str, Any] = field(default_factory=dict)
    logged: dict[str, Any] = field(default_factory=dict)


Output = Publish | Fail


class _Delta(msgspec.Struct, frozen=True):
    type: str = ""
    text: str = ""


class _Started(msgspec.Struct, frozen=True):
    id: str = ""
    model: str = ""
    usage: Usage | None = None


class _StreamEventBody(msgspec.Struct, frozen=True):
    type: str = ""
    delta: _Delta | None = None
    message: _Started | None = None  # message_start
    usage: Usage | None = None  # message_delta: the call's output so far


_decode_stream_event = msgspec.json.Decoder(_StreamEventBody).decode


class Conversation:
    """The sans-IO state of one child's conversation; see the module docstring."""

    def __init__(self, principal_id: str, session_id: str, permission_mode: str) -> None:
        self.principal_id = principal_id
        self.session_id = session_id
        self.permission_mode = permission_mode
        self.state = ProcessState.STARTING
        self.turn = Turn()
        self.reason: EndReason | None = None
        self.busy_at_end = False  # a turn ran when the end was asked for
        self.init: SystemInit | None = None
        self.unknown = 0  # lines of stdout sage does not know
        self._deltas = 0  # text deltas since the last assistant message
        self._auth_refused = False  # the turn's assistant message said authentication_failed
        self._tool_started: dict[str, tuple[str, float]] = {}  # tool_use_id -> (name, when)
        self._calls: dict[str, tuple[str, Usage]] = {}  # message id -> (model, usage reported)
        self._streaming = ""  # the message id of the last message_start
        self.interrupt_sent = False
        """An interrupt went to the CLI during the running turn (:meth:`interrupting`)."""
        self.last_turn_interrupted_at: float | None = None
        """When the last turn that ended was interrupted with no other in flight (None:
        it was not, or a turn was sent since)."""
        self.interrupt_for: tuple[TurnEnd, str] | None = None
        """Why sage interrupts the running turn (a budget), for its ``done`` event."""

    # -- state ----------------------------------------------------------------

    def _move(self, new: ProcessState) -> None:
        """The one place the state changes, along :data:`PROCESS_TRANSITIONS`."""
        if new is self.state:
            return
        if new not in PROCESS_TRANSITIONS[self.state]:
            raise IllegalTransition(f"process {self.session_id}", self.state.value, new.value)
        self.state = new

    @property
    def ending(self) -> bool:
        return self.state in (ProcessState.STOPPING, ProcessState.EXITED)

    def end(self, reason: EndReason) -> None:
        """Record a reason to end (the first is kept, but ``stopped`` overrides a planned
        ``respawn`` or ``hibernate``)."""
        if self.reason is None or (
            self.reason.planned and reason in (EndReason.STOPPED, EndReason.FENCED)
        ):
            self.reason = reason
        if not self.ending:
            self.busy_at_end = (
                self.state is ProcessState.BUSY or self.turn.started > self.turn.finished
            )
            self._move(ProcessState.STOPPING)

    def sent(self) -> int:
        """A user turn was written; its number."""
        self.turn.started += 1
        self.last_turn_interrupted_at = None
        if self.state is ProcessState.READY:
            self._move(ProcessState.BUSY)
        return self.turn.started

    def interrupting(self, because: tuple[TurnEnd, str] | None = None) -> None:
        """An interrupt goes to the CLI while a turn runs: the turn's ``done`` says
        ``interrupted``, or sage's own reason when ``because`` gives one (a budget)."""
        self.interrupt_sent = True
        if because is not None:  # a person's interrupt after the ledger's keeps its why
            self.interrupt_for = because

    def initialized(self) -> None:
        """``initialize`` was answered in the right mode: the child takes turns."""
        if self.state is ProcessState.STARTING:
            # a turn sent while starting is already queued behind initialize
            busy = self.turn.started > self.turn.finished
            self._move(ProcessState.BUSY if busy else ProcessState.READY)

    def exited(self) -> None:
        self._move(ProcessState.EXITED)

    def outcome(self, exit_code: int | None) -> EndReason:
        """Why the child ended: the recorded reason, else how it exited."""
        if self.reason is not None:
            return self.reason
        return EndReason.EXITED if exit_code == 0 else EndReason.CRASHED

    def resumable(self, exit_code: int | None, signal: int | None, now: float) -> bool:
        """Whether a child that ended so, on its own, at ``now`` is to be resumed rather
        than the session ended: it exited with an error status (no signal, no reason of
        sage's) within :data:`INTERRUPTED_EXIT_WITHIN` seconds of an interrupted turn's
        result, with no turn sent since.  The floor of the supported range (2.1.275)
        exits 1 when a turn is interrupted between a tool's result and the next model
        call; the conversation is intact on disk."""
        at = self.last_turn_interrupted_at
        return (
            self.reason is None
            and at is not None
            and now - at <= INTERRUPTED_EXIT_WITHIN
            and signal is None
            and exit_code not in (None, 0)
        )

    def check_mode(self, mode: str | None, where: str) -> Fail | None:
        """None when the CLI runs in the permission mode sage asked for; else the
        session ends before a turn reaches it (or at once, mid-turn)."""
        expected = self.permission_mode
        if mode == expected:
            return None
        self.end(EndReason.PERMISSION_MODE_MISMATCH)
        details = {"expected": expected, "got": mode, "where": where}
        return Fail(EndReason.PERMISSION_MODE_MISMATCH, details, details)

    # -- what the child says ------------------------------------------------------

    def receive(self, event: Event, now: float) -> list[Output]:
        """The outputs of one decoded stdout message (control messages are the shell's)."""
        if isinstance(event, StreamEvent):
            return self._stream_event(event)
        if isinstance(event, AssistantMessage):
            return self._assistant(event, now)
        if isinstance(event, ResultMessage):
            return self._result(event, now)
        if isinstance(event, UserMessage):
            return self._tool_results(event, now)
        if isinstance(event, SystemApiRetry):
            return self._api_retry(event)
        if isinstance(event, SystemInit):
            self.init = event
            if self.state is not ProcessState.STOPPING:
                fail = self.check_mode(event.permission_mode, "system/init")
                return [fail] if fail is not None else []
            return []
        if isinstance(event, SystemPermissionDenied):
            return [
                Publish(
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
            ]
        if isinstance(event, SystemInformational):
            return [Publish("informational", {"content": event.content})]
        if isinstance(event, LineTooLong):
            self.end(EndReason.LINE_TOO_LONG)
            return [Fail(EndReason.LINE_TOO_LONG, {}, {"seen": event.seen})]
        if isinstance(event, UnknownMessage | InvalidLine):
            self.unknown += 1
        return []

    def _api_retry(self, event: SystemApiRetry) -> list[Output]:
        if self.reason is not None:
            return []
        if event.error_status in AUTH_STATUSES:
            self.end(EndReason.AUTH_FAILED)
            status = {"status": event.error_status}
            return [Fail(EndReason.AUTH_FAILED, status, status)]
        return [
            Publish(
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
        ]

    def _stream_event(self, msg: StreamEvent) -> list[Output]:
        try:
            body = _decode_stream_event(msg.event)
        except msgspec.DecodeError:
            return []
        if body.type == "message_start" and body.message is not None:
            started = body.message
            self._streaming = started.id or msg.api_message_id
            return self._usage(self._streaming, started.model, started.usage)
        if body.type == "message_delta" and body.usage is not None:
            return self._usage(msg.api_message_id or self._streaming, "", body.usage)
        delta = body.delta
        if body.type != "content_block_delta" or delta is None:
            return []
        if delta.type == "text_delta" and delta.text:
            self._deltas += 1
            return [Publish("text", {"delta": delta.text, "turn": self.turn.finished + 1})]
        return []

    def _usage(self, message_id: str, model: str, usage: Usage | None) -> list[Output]:
        """A ``usage`` event with what a model call used that was not reported yet: its
        input and cache tokens when it starts (``first``), its output as it grows.  A
        call is known by its message id, so the CLI's repeats (an assistant message per
        content block, the ``message_delta`` after them) are counted once."""
        if usage is None or not message_id:
            return []
        known = self._calls.get(message_id)
        first = known is None
        seen_model, before = known if known is not None else (model, Usage())
        counts = {
            "input_tokens": max(0, usage.input_tokens - before.input_tokens),
            "output_tokens": max(0, usage.output_tokens - before.output_tokens),
            "cache_read_input_tokens": max(
                0, usage.cache_read_input_tokens - before.cache_read_input_tokens
            ),
            "cache_creation_input_tokens": max(
                0, usage.cache_creation_input_tokens - before.cache_creation_input_tokens
            ),
        }
        if not first and not any(counts.values()):
            return []
        if first and len(self._calls) >= CALLS_KEPT:
            del self._calls[next(iter(self._calls))]
        self._calls[message_id] = (
            seen_model or model,
            Usage(
                max(usage.input_tokens, before.input_tokens),
                max(usage.output_tokens, before.output_tokens),
                max(usage.cache_creation_input_tokens, before.cache_creation_input_tokens),
                max(usage.cache_read_input_tokens, before.cache_read_input_tokens),
            ),
        )
        return [
            Publish(
                "usage",
                {
                    "message_id": message_id,
                    "model": seen_model or model,
                    **counts,
                    "first": first,
                    "turn": self.turn.finished + 1,
                },
            )
        ]

    def _assistant(self, msg: AssistantMessage, now: float) -> list[Output]:
        out: list[Output] = self._usage(msg.message.id, msg.message.model, msg.message.usage)
        if msg.error == AUTH_ERROR:
            self._auth_refused = True
        for block in msg.message.content:
            if isinstance(block, ToolUseBlock):
                self._tool_started[block.id] = (block.name, now)
                out.append(
                    Publish(
                        "tool_use",
                        {
                            "tool_use_id": block.id,
                            "name": block.name,
                            **shown("input", block.input, TOOL_INPUT_SHOWN),
                            "parent_tool_use_id": msg.parent_tool_use_id,
                            "turn": self.turn.finished + 1,
                        },
                    )
                )
        out.append(Publish("assistant", self._assistant_event(msg)))
        if self._deltas == 0 and msg.parent_tool_use_id is None:
            # not streamed (no partial messages for this one): send the text whole
            for block in msg.message.content:
                if isinstance(block, TextBlock) and block.text:
                    out.append(
                        Publish("text", {"delta": block.text, "turn": self.turn.finished + 1})
                    )
        self._deltas = 0
        return out

    def _assistant_event(self, msg: AssistantMessage) -> dict[str, Any]:
        """The whole message for a program (sage.client): its id, its blocks (text,
        thinking, tool calls), its usage; each block, and all of them, bounded."""
        body = msg.message
        budget = ASSISTANT_SHOWN
        blocks: list[dict[str, Any]] = []
        for block in body.content:
            shown_block = _block(block, min(CONTENT_SHOWN, budget))
            if shown_block is not None:
                budget = max(0, budget - len(msgspec.json.encode(shown_block)))
                blocks.append(shown_block)
        return {
            "message_id": body.id,
            "model": body.model,
            "content": blocks,
            "stop_reason": body.stop_reason,
            "usage": msgspec.to_builtins(body.usage) if body.usage else None,
            "parent_tool_use_id": msg.parent_tool_use_id,
            "turn": self.turn.finished + 1,
        }

    def approval_answered(self, tool_use_id: str | None, now: float) -> None:
        """The approval of call ``tool_use_id`` was answered at ``now``: the call's
        duration counts from here, so a person's time to answer is not the tool's."""
        if tool_use_id is not None and tool_use_id in self._tool_started:
            name, _ = self._tool_started[tool_use_id]
            self._tool_started[tool_use_id] = (name, now)

    def _tool_results(self, msg: UserMessage, now: float) -> list[Output]:
        """The CLI's echo of a tool's result: its end, ok or not, and how long it took."""
        if isinstance(msg.message.content, str):
            return []
        out: list[Output] = []
        for block in msg.message.content:
            if not isinstance(block, ToolResultBlock):
                continue
            name, started = self._tool_started.pop(block.tool_use_id, ("", None))
            out.append(
                Publish(
                    "tool_result",
                    {
                        "tool_use_id": block.tool_use_id,
                        "name": name,
                        "is_error": block.is_error,
                        "duration_ms": (
                            round((now - started) * 1000) if started is not None else None
                        ),
                        **(
                            shown("content", block.content, CONTENT_SHOWN)
                            if block.content is not None
                            else {}
                        ),
                        "turn": self.turn.finished + 1,
                    },
                )
            )
        return out

    def _result(self, msg: ResultMessage, now: float) -> list[Output]:
        self._tool_started.clear()  # a call the CLI never echoed ends with its turn
        self.turn.finished += 1
        self.turn.cost_usd = max(self.turn.cost_usd, msg.total_cost_usd)
        self.turn.last_result = msg
        if self.state is ProcessState.BUSY and self.turn.finished >= self.turn.started:
            self._move(ProcessState.READY)
        reason = turn_end(
            is_error=msg.is_error,
            subtype=msg.subtype,
            api_error_status=msg.api_error_status,
            terminal_reason=msg.terminal_reason,
        )
        message = (msg.result or "")[:MESSAGE_CHARS] if msg.is_error and msg.result else None
        if self.interrupt_sent and reason is TurnEnd.EXECUTION_ERROR:
            # CLIs before terminal_reason (2.1.275) end an interrupted turn this way
            reason = TurnEnd.INTERRUPTED
        if reason is TurnEnd.INTERRUPTED and self.interrupt_for is not None:
            reason, message = self.interrupt_for  # sage interrupted it, and says why
        # resumable only with nothing else in flight: a turn written after the interrupted
        # one went to the child that exits, and a resumed child would never answer it
        if self.interrupt_sent and self.turn.finished >= self.turn.started:
            self.last_turn_interrupted_at = now
        else:
            self.last_turn_interrupted_at = None
        self.interrupt_sent, self.interrupt_for = False, None
        out: list[Output] = [
            Publish(
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
                    "duration_ms": msg.duration_ms,
                    "turn": self.turn.finished,
                    "reason": reason.value,
                    **({"message": message} if message is not None else {}),
                    **({"result": msg.result[:CONTENT_SHOWN]} if msg.result is not None else {}),
                },
            )
        ]
        status = msg.api_error_status
        refused = status in AUTH_STATUSES or self._auth_refused
        if msg.is_error and refused and self.reason is None:
            # a 403 is not retried: the turn ends at once, and so does the session
            self.end(EndReason.AUTH_FAILED)
            out.append(Fail(EndReason.AUTH_FAILED, {"status": status}, {"status": status}))
        self._auth_refused = False
        return out


def shown(key: str, value: Any, limit: int) -> dict[str, Any]:
    """``{key: value}`` when ``value`` encodes to at most ``limit`` bytes; else its first
    ``limit`` bytes as ``<key>_preview`` and its size as ``<key>_bytes``."""
    encoded = msgspec.json.encode(value)
    if len(encoded) <= limit:
        return {key: value}
    return {
        f"{key}_preview": encoded[:limit].decode(errors="replace"),
        f"{key}_bytes": len(encoded),
    }


def _clipped(key: str, text: str, limit: int) -> dict[str, Any]:
    """``{key: text}``, its first ``limit`` characters and ``truncated`` when longer."""
    if len(text) <= limit:
        return {key: text}
    return {key: text[:limit], "truncated": True}


def _block(block: ContentBlock, limit: int) -> dict[str, Any] | None:
    """One content block of an ``assistant`` event; None for one a program cannot use
    (an unknown type, a tool result: those come as ``tool_result``)."""
    if isinstance(block, TextBlock):
        return {"type": "text", **_clipped("text", block.text, limit)}
    if isinstance(block, ThinkingBlock):
        return {"type": "thinking", **_clipped("thinking", block.thinking, limit)}
    if isinstance(block, RedactedThinkingBlock):
        return {"type": "redacted_thinking"}
    if isinstance(block, ToolUseBlock):
        return {
            "type": "tool_use",
            "id": block.id,
            "name": block.name,
            **shown("input", block.input, limit),
        }
    return None
