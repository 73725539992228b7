"""Bytes in, typed events out: the sans-IO decoder of Claude Code's stdout.

:class:`StreamDecoder` owns line framing and message typing and does no I/O:
the caller feeds it whatever a read returned and gets back a list of events.
Lines are split on ``b"\\n"`` only, so a multi-byte UTF-8 character split
across reads is simply buffered until its line is complete; a trailing
``\\r`` is JSON whitespace and blank lines are skipped.  A line longer than
``max_line_bytes`` is reported once as :class:`LineTooLong` and the rest of
it is dropped as it arrives, never buffered, so a 80 MB line costs no more
memory than the limit.  Non-JSON and non-object lines become
:class:`InvalidLine`, unknown types :class:`UnknownMessage`; neither is
fatal, and each is counted in :attr:`StreamDecoder.counters`.

Decoding is one msgspec pass with a union tagged on ``type``; ``system``
lines, which need ``subtype`` too, are decoded a second time with the
subtype's own decoder.  Only failures take the slow path.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import msgspec

from sage.claude.protocol.messages import (
    AssistantMessage,
    ContentBlock,
    ControlCancelRequest,
    ControlRequest,
    ControlRequestBody,
    ControlResponse,
    McpServerStatus,
    Message,
    ResultMessage,
    StreamEvent,
    SystemApiRetry,
    SystemInformational,
    SystemInit,
    SystemPermissionDenied,
    SystemStatus,
    UnknownBlock,
    UnknownMessage,
    UnknownRequest,
    UserMessage,
)
from sage.errors import ProtocolError

__all__ = (
    "DEFAULT_MAX_LINE_BYTES",
    "DecoderCounters",
    "DecoderState",
    "Event",
    "InvalidLine",
    "LineTooLong",
    "StreamDecoder",
)

#: Default limit on one stdout line; the largest seen in the golden
#: transcripts (the ``initialize`` answer) is about 17 KB.
DEFAULT_MAX_LINE_BYTES = 1 << 20

#: Bytes of an invalid line kept in :attr:`InvalidLine.preview`.
PREVIEW_BYTES = 200


class InvalidLine(msgspec.Struct, frozen=True, gc=False):
    """A line that is not a JSON object; ``preview`` is at most its first 200 bytes."""

    kind: ClassVar[str] = "invalid"
    reason: str
    preview: bytes


class LineTooLong(msgspec.Struct, frozen=True, gc=False):
    """A line passed ``limit`` bytes after ``seen``; the rest of it is dropped."""

    kind: ClassVar[str] = "too_long"
    limit: int
    seen: int


Event: TypeAlias = Message | InvalidLine | LineTooLong


class DecoderState(enum.Enum):
    READING = "reading"
    SKIPPING = "skipping"  # inside a line that passed the limit
    CLOSED = "closed"  # after eof()


@dataclass(slots=True)
class DecoderCounters:
    """What the decoder has seen; ``mismatched`` lines are also ``unknown``."""

    messages: int = 0
    unknown: int = 0
    mismatched: int = 0
    invalid: int = 0
    too_long: int = 0
    skipped_bytes: int = 0


class _System(msgspec.Struct, tag_field="type", tag="system", frozen=True, gc=False):
    """Every field of the known system subtypes, so a system line is decoded once."""

    subtype: str = ""
    session_id: str = ""
    uuid: str = ""
    tools: list[str] = []
    mcp_servers: list[McpServerStatus] = []
    model: str = ""
    cwd: str = ""
    claude_code_version: str = ""
    capabilities: list[str] = []
    permissionMode: str | None = None  # wire name
    apiKeySource: str | None = None  # wire name
    attempt: int = 0
    max_retries: int = 0
    retry_delay_ms: int = 0
    error_status: int | None = None
    error: str | None = None
    status: str | None = None
    tool_name: str = ""
    tool_use_id: str = ""
    decision_reason_type: str | None = None
    decision_reason: str | None = None
    message: str | None = None
    content: str = ""


def _promote(s: _System) -> Message | None:
    """The public message for a system line, or None for an unknown subtype."""
    sub = s.subtype
    if sub == "init":
        return SystemInit(
            session_id=s.session_id,
            tools=s.tools,
            mcp_servers=s.mcp_servers,
            model=s.model,
            cwd=s.cwd,
            claude_code_version=s.claude_code_version,
            capabilities=s.capabilities,
            permission_mode=s.permissionMode,
            api_key_source=s.apiKeySource,
            uuid=s.uuid,
        )
    if sub == "api_retry":
        return SystemApiRetry(
            attempt=s.attempt,
            max_retries=s.max_retries,
            retry_delay_ms=s.retry_delay_ms,
            error_status=s.error_status,
            error=s.error,
            session_id=s.session_id,
            uuid=s.uuid,
        )
    if sub == "status":
        return SystemStatus(status=s.status, session_id=s.session_id, uuid=s.uuid)
    if sub == "permission_denied":
        return SystemPermissionDenied(
            tool_name=s.tool_name,
            tool_use_id=s.tool_use_id,
            decision_reason_type=s.decision_reason_type,
            decision_reason=s.decision_reason,
            message=s.message,
            session_id=s.session_id,
            uuid=s.uuid,
        )
    if sub == "informational":
        return SystemInformational(content=s.content, session_id=s.session_id, uuid=s.uuid)
    return None


class _Header(msgspec.Struct, frozen=True, gc=False):
    type: Any = None
    subtype: Any = None


class _LooseBody(msgspec.Struct, frozen=True, gc=False):
    content: str | list[msgspec.Raw] = ""


class _LooseConversation(msgspec.Struct, frozen=True, gc=False):
    message: _LooseBody


class _LooseControlRequest(msgspec.Struct, frozen=True, gc=False):
    request_id: str
    request: msgspec.Raw


_Top: TypeAlias = (
    AssistantMessage
    | UserMessage
    | ResultMessage
    | StreamEvent
    | ControlRequest
    | ControlResponse
    | ControlCancelRequest
    | _System
)

_TOP = msgspec.json.Decoder(_Top)
_HEADER = msgspec.json.Decoder(_Header)
_ANY = msgspec.json.Decoder()
_BLOCK = msgspec.json.Decoder(ContentBlock)
_LOOSE_CONVERSATION = msgspec.json.Decoder(_LooseConversation)
_LOOSE_CONTROL = msgspec.json.Decoder(_LooseControlRequest)
_SYSTEM: dict[str, msgspec.json.Decoder[Any]] = {
    "init": msgspec.json.Decoder(SystemInit),
    "api_retry": msgspec.json.Decoder(SystemApiRetry),
    "status": msgspec.json.Decoder(SystemStatus),
    "permission_denied": msgspec.json.Decoder(SystemPermissionDenied),
    "informational": msgspec.json.Decoder(SystemInformational),
}
_CONVERSATION: dict[str, type[AssistantMessage] | type[UserMessage]] = {
    "assistant": AssistantMessage,
    "user": UserMessage,
}


class StreamDecoder:
    """Turns chunks of stdout into :data:`Event` lists; see the module docstring."""

    def __init__(self, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> None:
        if max_line_bytes < 1:
            raise ValueError("max_line_bytes must be positive")
        self.max_line_bytes = max_line_bytes
        self.counters = DecoderCounters()
        self.state = DecoderState.READING
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished line held; never more than the limit."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Event]:
        """Decode every line completed by ``data``; keep the unfinished rest."""
        if self.state is DecoderState.CLOSED:
            raise ProtocolError("stream decoder fed after eof")
        if type(data) is not bytes:
            data = bytes(data)  # Raw fields must not see a reused buffer change
        events: list[Event] = []
        start = 0
        if self.state is DecoderState.SKIPPING:
            nl = data.find(b"\n")
            if nl < 0:
                self.counters.skipped_bytes += len(data)
                return events
            self.counters.skipped_bytes += nl
            self.state = DecoderState.READING
            start = nl + 1
        last = data.rfind(b"\n", start)
        if last < 0:
            self._stash(data, start, events)
            return events
        if self._buf:
            nl = data.find(b"\n", start)
            seen = len(self._buf) + nl - start
            if seen > self.max_line_bytes:
                self._buf.clear()
                self._too_long(seen, events)
            else:
                self._buf += memoryview(data)[start:nl]
                line = bytes(self._buf)
                self._buf.clear()
                self._decode_lines([line], events)
            start = nl + 1
        if last >= start:
            self._decode_block(data, start, last, events)
        self._stash(data, last + 1, events)
        return events

    def eof(self) -> list[Event]:
        """Decode a final unterminated line and close the decoder."""
        if self.state is DecoderState.CLOSED:
            raise ProtocolError("stream decoder closed twice")
        events: list[Event] = []
        if self._buf:
            line = bytes(self._buf)
            self._buf.clear()
            self._decode_lines([line], events)
        self.state = DecoderState.CLOSED
        return events

    # -- internals ----------------------------------------------------------

    def _stash(self, data: bytes, start: int, events: list[Event]) -> None:
        rest = len(data) - start
        if rest <= 0:
            return
        seen = len(self._buf) + rest
        if seen > self.max_line_bytes:
            self._buf.clear()
            self._too_long(seen, events)
            self.state = DecoderState.SKIPPING
        else:
            self._buf += memoryview(data)[start:]

    def _too_long(self, seen: int, events: list[Event]) -> None:
        self.counters.too_long += 1
        self.counters.skipped_bytes += seen
        events.append(LineTooLong(self.max_line_bytes, seen))

    def _decode_block(self, data: bytes, start: int, end: int, events: list[Event]) -> None:
        """Decode the complete lines ``data[start:end]`` (no final newline).

        Fast path: one ``decode_lines`` call in C over the whole block, taken
        when no line in it can pass the limit, every line is a typed message
        and no system subtype needs its raw line.  Anything else (invalid or
        unknown lines) redoes the block line by line, which is exact.  The
        one leniency of the fast path: ``decode_lines`` reads a JSON sequence,
        so a value broken across lines, or two values on one line (which the
        CLI never writes), may decode as messages instead of invalid lines.
        A block longer than the limit (a read bigger than ``max_line_bytes``)
        always goes line by line.
        """
        if end - start <= self.max_line_bytes:
            try:
                msgs = _TOP.decode_lines(memoryview(data)[start:end])
            except msgspec.DecodeError:
                pass
            else:
                out: list[Event] = []
                append = out.append
                for msg in msgs:
                    if isinstance(msg, _System):
                        promoted = _promote(msg)
                        if promoted is None:
                            break  # an unknown subtype keeps its raw line: redo
                        append(promoted)
                    else:
                        append(msg)
                else:
                    self.counters.messages += len(out)
                    events.extend(out)
                    return
        self._decode_lines(data[start:end].split(b"\n"), events)

    def _decode_lines(self, lines: list[bytes], events: list[Event]) -> None:
        decode = _TOP.decode
        limit = self.max_line_bytes
        counters = self.counters
        append = events.append
        for line in lines:
            if not line:
                continue
            if len(line) > limit:
                self._too_long(len(line), events)
                continue
            try:
                top = decode(line)
            except msgspec.DecodeError as exc:
                event = self._slow(line, exc)
                if event is not None:
                    append(event)
                continue
            msg: Message | None = top if not isinstance(top, _System) else _promote(top)
            if msg is None:
                subtype = top.subtype if isinstance(top, _System) else None
                append(self._unknown("system", subtype, line.strip(), None))
                continue
            counters.messages += 1
            append(msg)

    def _unknown(
        self, type_: str | None, subtype: str | None, raw: bytes, error: str | None
    ) -> UnknownMessage:
        self.counters.unknown += 1
        if error is not None:
            self.counters.mismatched += 1
        return UnknownMessage(type_, subtype, raw, error)

    def _slow(self, line: bytes, exc: msgspec.DecodeError) -> Event | None:
        raw = line.strip()
        if not raw:
            return None  # a blank line
        try:
            header = _HEADER.decode(raw)
        except msgspec.ValidationError:
            self.counters.invalid += 1
            return InvalidLine("not a JSON object", raw[:PREVIEW_BYTES])
        except msgspec.DecodeError as bad:
            self.counters.invalid += 1
            return InvalidLine(f"invalid JSON: {bad}", raw[:PREVIEW_BYTES])
        type_ = header.type if isinstance(header.type, str) else None
        subtype = header.subtype if isinstance(header.subtype, str) else None
        if not isinstance(exc, msgspec.ValidationError) or type_ not in _KNOWN_TYPES:
            return self._unknown(type_, subtype, raw, None)
        repaired: Message | None = None
        if type_ == "system":
            repaired = _system_exact(raw, subtype)
        elif type_ in _CONVERSATION:
            repaired = _repair_conversation(raw, _CONVERSATION[type_])
        elif type_ == "control_request":
            repaired = _repair_control_request(raw)
        if repaired is None:
            return self._unknown(type_, subtype, raw, str(exc))
        self.counters.messages += 1
        return repaired


_KNOWN_TYPES = frozenset(
    {
        "assistant",
        "user",
        "result",
        "stream_event",
        "control_request",
        "control_response",
        "control_cancel_request",
        "system",
    }
)


def _system_exact(raw: bytes, subtype: str | None) -> Message | None:
    """Decode a system line with its own subtype's schema only."""
    decoder = _SYSTEM.get(subtype or "")
    if decoder is None:
        return None
    try:
        msg: Message = decoder.decode(raw)
    except msgspec.ValidationError:
        return None
    return msg


def _block(raw: msgspec.Raw) -> ContentBlock:
    try:
        return _BLOCK.decode(raw)
    except msgspec.ValidationError:
        header = _HEADER.decode(raw)
        block_type = header.type if isinstance(header.type, str) else ""
        return UnknownBlock(block_type=block_type, raw=raw)


def _repair_conversation(
    raw: bytes, cls: type[AssistantMessage] | type[UserMessage]
) -> AssistantMessage | UserMessage | None:
    """Retype a conversation line whose content has unknown block types."""
    try:
        loose = _LOOSE_CONVERSATION.decode(raw)
        content = loose.message.content
        blocks: str | list[ContentBlock] = (
            content if isinstance(content, str) else [_block(b) for b in content]
        )
        obj = _ANY.decode(raw)
        obj["message"]["content"] = blocks
        return msgspec.convert(obj, cls)
    except (msgspec.ValidationError, TypeError, KeyError):
        return None


def _repair_control_request(raw: bytes) -> ControlRequest | None:
    """Keep a control request of unknown subtype answerable (it has an id)."""
    try:
        loose = _LOOSE_CONTROL.decode(raw)
        header = _HEADER.decode(loose.request)
    except msgspec.ValidationError:
        return None
    name = header.subtype if isinstance(header.subtype, str) else ""
    body: ControlRequestBody = UnknownRequest(name=name, raw=loose.request)
    return ControlRequest(request_id=loose.request_id, request=body)
