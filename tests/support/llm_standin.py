"""The e2e Messages API stand-in, with the replies the completion provider's tests need.

:class:`LlmStandin` is :class:`tests.support.standin.Standin` plus:

- :class:`SplitToolUse`: a ``tool_use`` block whose input JSON comes in
  ``chunks`` ``input_json_delta`` events (split at any character, so most
  chunks are not JSON on their own);
- :class:`Cut`: a text reply whose connection is closed after ``after``
  text deltas, mid-stream, with no ``message_stop`` and no end of the
  chunked body;
- a count of the streams open at once (:attr:`LlmStandin.peak`), to show
  the provider's concurrency limit.

Errors (401, 429, 500, 529, 400) are the base class's :class:`Error`; give
them ``retry-after-ms`` headers (:func:`retry_soon`) so the SDK's retries
take milliseconds, not seconds.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from tests.support.standin import Error, Recorded, Reply, Slow, Standin, Text, ToolUse

__all__ = (
    "Cut",
    "Error",
    "LlmStandin",
    "MidStreamError",
    "Recorded",
    "Slow",
    "SplitToolUse",
    "Text",
    "ToolUse",
    "retry_soon",
)


@dataclass(frozen=True)
class SplitToolUse:
    """A tool call whose input JSON is streamed in ``chunks`` deltas."""

    name: str
    input: dict[str, Any]
    chunks: int = 10
    id: str = "toolu_split"


@dataclass(frozen=True)
class Cut:
    """A text reply cut off (connection closed) after ``after`` of ``chunks`` deltas."""

    text: str
    chunks: int = 6
    after: int = 2


@dataclass(frozen=True)
class MidStreamError:
    """A text reply that sends ``text`` and then an SSE ``error`` event (status 200)."""

    text: str
    type: str = "overloaded_error"
    message: str = "Overloaded"


def retry_soon(status: int, type_: str, message: str = "scripted error") -> Error:
    """An error the SDK retries after 10 ms (``retry-after-ms``)."""
    return Error(status, type_, message, headers=(("retry-after-ms", "10"),))


def _pieces(text: str, n: int) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)]


def _frame(event: dict[str, Any]) -> bytes:
    data = f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _start(model: str) -> dict[str, Any]:
    return {
        "type": "message_start",
        "message": {
            "id": "msg_llm",
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 21, "output_tokens": 1, "cache_read_input_tokens": 7},
        },
    }


def _end(stop: str) -> list[dict[str, Any]]:
    return [
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop, "stop_sequence": None},
            "usage": {"output_tokens": 9},
        },
        {"type": "message_stop"},
    ]


class LlmStandin(Standin):
    """The stand-in with :class:`SplitToolUse`, :class:`Cut` and a count of open streams."""

    def __init__(self) -> None:
        super().__init__()
        self.open_streams = 0
        self.peak = 0

    def push(self, *replies: Reply | SplitToolUse | Cut | MidStreamError) -> None:
        self.script.extend(replies)  # type: ignore[arg-type]

    async def _dispatch(self, request: Recorded, writer: asyncio.StreamWriter) -> bool:
        self.open_streams += 1
        self.peak = max(self.peak, self.open_streams)
        try:
            reply = self.script[0] if self.script else None
            if request.is_messages and isinstance(reply, SplitToolUse | Cut | MidStreamError):
                self.script.popleft()
                request.reply = reply
                return await self._send_own(reply, request, writer)
            return await super()._dispatch(request, writer)
        finally:
            self.open_streams -= 1

    async def _send_own(
        self,
        reply: SplitToolUse | Cut | MidStreamError,
        request: Recorded,
        writer: asyncio.StreamWriter,
    ) -> bool:
        body = request.body if isinstance(request.body, dict) else {}
        model = str(body.get("model", "claude-standin"))
        writer.write(self._head(200, "text/event-stream", None) + b"\r\n")
        events = [_start(model)]
        if isinstance(reply, SplitToolUse):
            block = {"type": "tool_use", "id": reply.id, "name": reply.name, "input": {}}
            events.append({"type": "content_block_start", "index": 0, "content_block": block})
            for part in _pieces(json.dumps(reply.input), reply.chunks):
                delta = {"type": "input_json_delta", "partial_json": part}
                events.append({"type": "content_block_delta", "index": 0, "delta": delta})
            events.append({"type": "content_block_stop", "index": 0})
            events += _end("tool_use")
        elif isinstance(reply, MidStreamError):
            block = {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": 0, "content_block": block})
            delta = {"type": "text_delta", "text": reply.text}
            events.append({"type": "content_block_delta", "index": 0, "delta": delta})
            error = {"type": reply.type, "message": reply.message}
            events.append({"type": "error", "error": error})
        else:
            block = {"type": "text", "text": ""}
            events.append({"type": "content_block_start", "index": 0, "content_block": block})
            for part in _pieces(reply.text, reply.chunks)[: reply.after]:
                delta = {"type": "text_delta", "text": part}
                events.append({"type": "content_block_delta", "index": 0, "delta": delta})
        for event in events:
            writer.write(_frame(event))
            await writer.drain()
        if isinstance(reply, Cut):
            return False  # closed mid-body: no message_stop, no last chunk
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
