"""Events out: the Messages API's raw stream turned into ``llm.v1.stream.sage`` events.

:class:`StreamMapper` is fed the SDK's raw stream events one at a time and
returns the provider events each one makes; it does no I/O.  Text deltas
become ``TextDelta``; a ``tool_use`` block becomes ``ToolCallStart``, one
``ToolCallDelta`` per ``input_json_delta`` (its ``partial_json`` passed on as
it came: partial JSON is opaque, it is never parsed per chunk) and
``ToolCallEnd``.  Usage is gathered from ``message_start`` and
``message_delta`` and sent once, at the end, before ``Done``.  A stream
without ``message_stop`` did not finish: :meth:`StreamMapper.finish` says so.

Each event is a tagged msgspec Struct; on the bus it is
``{request_id, event: {type: "TextDelta", ...}}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import msgspec
from anthropic.types import (
    InputJSONDelta,
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
    RawMessageStreamEvent,
    ToolUseBlock,
)
from anthropic.types import (
    TextDelta as ApiTextDelta,
)

from sage.errors import UpstreamError

__all__ = (
    "Done",
    "Error",
    "StreamEvent",
    "StreamMapper",
    "TextDelta",
    "ToolCallDelta",
    "ToolCallEnd",
    "ToolCallStart",
    "Usage",
    "stream_payload",
)


class _Event(msgspec.Struct, frozen=True, tag_field="type", omit_defaults=True):
    pass


class TextDelta(_Event, frozen=True, tag="TextDelta"):
    text: str


class ToolCallStart(_Event, frozen=True, tag="ToolCallStart"):
    id: str
    name: str


class ToolCallDelta(_Event, frozen=True, tag="ToolCallDelta"):
    id: str
    args_delta: str


class ToolCallEnd(_Event, frozen=True, tag="ToolCallEnd"):
    id: str


class Usage(_Event, frozen=True, tag="Usage"):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Done(_Event, frozen=True, tag="Done"):
    stop_reason: str | None = None


class Error(_Event, frozen=True, tag="Error"):
    message: str
    code: str = "error"
    """A stable word for programs (see docs/llm.md); ``message`` is for people."""


StreamEvent: TypeAlias = (
    TextDelta | ToolCallStart | ToolCallDelta | ToolCallEnd | Usage | Done | Error
)


def stream_payload(request_id: str, event: StreamEvent) -> dict[str, object]:
    """The ``llm.v1.stream.sage`` payload of one event."""
    return {"request_id": request_id, "event": msgspec.to_builtins(event)}


class IncompleteStream(UpstreamError):
    """The stream ended before ``message_stop``."""

    code = "stream_incomplete"


@dataclass
class StreamMapper:
    """The state of one response stream: open tool blocks, usage, stop reason."""

    tools: dict[int, str] = field(default_factory=dict)
    """Open ``tool_use`` blocks: content block index -> tool call id."""
    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    stop_reason: str | None = None
    stopped: bool = False
    started: bool = False

    def feed(self, event: RawMessageStreamEvent) -> list[StreamEvent]:
        """The provider events for one raw event (often none)."""
        if isinstance(event, RawContentBlockDeltaEvent):
            delta = event.delta
            if isinstance(delta, ApiTextDelta):
                return [TextDelta(delta.text)] if delta.text else []
            if isinstance(delta, InputJSONDelta):
                call = self.tools.get(event.index)
                return [ToolCallDelta(call, delta.partial_json)] if call is not None else []
            return []  # thinking, signatures, citations: not part of llm.v1
        if isinstance(event, RawContentBlockStartEvent):
            block = event.content_block
            if isinstance(block, ToolUseBlock):
                self.tools[event.index] = block.id
                return [ToolCallStart(block.id, block.name)]
            return []
        if isinstance(event, RawContentBlockStopEvent):
            call = self.tools.pop(event.index, None)
            return [ToolCallEnd(call)] if call is not None else []
        if isinstance(event, RawMessageStartEvent):
            self.started = True
            usage = event.message.usage
            self.input_tokens = usage.input_tokens
            self.output_tokens = usage.output_tokens
            self.cache_read_input_tokens = usage.cache_read_input_tokens or 0
            self.cache_creation_input_tokens = usage.cache_creation_input_tokens or 0
            return []
        if isinstance(event, RawMessageDeltaEvent):
            delta_usage = event.usage  # cumulative counts: the last one wins
            self.output_tokens = delta_usage.output_tokens
            if delta_usage.input_tokens is not None:
                self.input_tokens = delta_usage.input_tokens
            if delta_usage.cache_read_input_tokens is not None:
                self.cache_read_input_tokens = delta_usage.cache_read_input_tokens
            if delta_usage.cache_creation_input_tokens is not None:
                self.cache_creation_input_tokens = delta_usage.cache_creation_input_tokens
            if event.delta.stop_reason is not None:
                self.stop_reason = event.delta.stop_reason
            return []
        if isinstance(event, RawMessageStopEvent):
            self.stopped = True
        return []

    def usage(self) -> Usage:
        return Usage(
            self.input_tokens,
            self.output_tokens,
            self.cache_read_input_tokens,
            self.cache_creation_input_tokens,
        )

    def finish(self) -> tuple[Usage, Done]:
        """``Usage`` and ``Done`` for a finished stream; raises
        :class:`IncompleteStream` when ``message_stop`` never came."""
        if not self.stopped:
            raise IncompleteStream(
                "the response stream ended before the message was complete"
                + (" (no message_start)" if not self.started else "")
            )
        return self.usage(), Done(self.stop_reason)
