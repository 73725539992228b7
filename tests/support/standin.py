"""A scripted stand-in for the Anthropic Messages API, for end-to-end tests.

:class:`Standin` is a small HTTP/1.1 server on 127.0.0.1 (ephemeral port)
built on asyncio streams.  ``POST /v1/messages`` is answered from a queue
of scripted replies (:class:`Text`, :class:`ToolUse`, :class:`Error`,
:class:`Slow`): streaming requests get server-sent events, non-streaming
ones a JSON message.  Every request is recorded (method, path, headers,
parsed JSON body) so tests can assert on what the CLI sent.  Other paths
get a minimal answer: ``/v1/messages/count_tokens`` a token count, ``HEAD``
and ``GET /`` an empty 200, anything else a JSON 404.

Responses are chunked and keep-alive by default; ``connection_close=True``
answers with ``Connection: close`` and a body delimited by the close
instead.

A ``responder`` (a function of the request) answers what the queue does not,
for runs whose requests interleave (many sessions at once), and each request
records when it arrived and when its answer was written (``time.monotonic``),
so the time a CLI takes between two requests (a tool call) is seen from here
the same way whoever drives the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

__all__ = (
    "Error",
    "Recorded",
    "Reply",
    "Slow",
    "Standin",
    "Text",
    "ToolUse",
)


@dataclass(frozen=True)
class Text:
    """A text reply streamed in ``chunks`` text deltas, ending with ``end_turn``."""

    text: str
    chunks: int = 1


@dataclass(frozen=True)
class ToolUse:
    """One ``tool_use`` block (``name`` as the model sees it, e.g. ``mcp__sage__greet``)."""

    name: str
    input: dict[str, Any]
    id: str | None = None  # a fresh toolu_NN when None
    text: str | None = None  # optional text block before the tool call


@dataclass(frozen=True)
class Error:
    """An HTTP error with an Anthropic-style JSON error body."""

    status: int
    type: str
    message: str = "scripted error"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Slow:
    """A text reply whose first delta is sent at once and the rest after ``delay`` s."""

    text: str
    delay: float
    chunks: int = 2


Reply: TypeAlias = Text | ToolUse | Error | Slow

_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    529: "Overloaded",
}


@dataclass
class Recorded:
    """One request as the stand-in received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or None
    raw: bytes
    reply: Reply | None = None  # the scripted reply it got (messages only)
    received: float = 0.0
    """``time.monotonic()`` when the whole request had arrived."""
    answered: float = 0.0
    """``time.monotonic()`` when its answer was written to the end."""

    @property
    def is_messages(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0] == "/v1/messages"

    @property
    def tool_names(self) -> list[str]:
        body = self.body if isinstance(self.body, dict) else {}
        return [t.get("name", "") for t in body.get("tools", [])]

    @property
    def live_tool_names(self) -> list[str]:
        """``tools[].name`` without ``defer_loading`` placeholders (2.1.328 always
        sends a ``DeferredToolPlaceholder`` with ``defer_loading: true``)."""
        body = self.body if isinstance(self.body, dict) else {}
        return [t.get("name", "") for t in body.get("tools", []) if not t.get("defer_loading")]

    @property
    def last_user_message(self) -> dict[str, Any] | None:
        body = self.body if isinstance(self.body, dict) else {}
        for msg in reversed(body.get("messages", [])):
            if msg.get("role") == "user":
                return msg  # type: ignore[no-any-return]
        return None

    def tool_results(self) -> list[dict[str, Any]]:
        """The ``tool_result`` blocks of the last user message."""
        msg = self.last_user_message
        if msg is None or not isinstance(msg.get("content"), list):
            return []
        return [b for b in msg["content"] if b.get("type") == "tool_result"]


def _split(text: str, n: int) -> list[str]:
    n = max(1, min(n, len(text) or 1))
    size, rest = divmod(len(text), n)
    out, pos = [], 0
    for i in range(n):
        step = size + (1 if i < rest else 0)
        out.append(text[pos : pos + step])
        pos += step
    return out


def _sse(event: dict[str, Any]) -> bytes:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()


def offline_env(base_url: str) -> dict[str, str]:
    """What points the CLI at a stand-in and keeps it off the network (NOTES.md)."""
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
    }


class Standin:
    """The server; use ``async with Standin() as s`` or start()/stop()."""

    def __init__(
        self,
        *,
        connection_close: bool = False,
        default: Reply | None = None,
        responder: Callable[[Recorded], Reply] | None = None,
    ) -> None:
        self.connection_close = connection_close
        self.default: Reply = default if default is not None else Text("(unscripted)")
        self.responder = responder
        """Answers a messages request the script does not (before ``default``)."""
        self.script: deque[Reply] = deque()
        self.requests: list[Recorded] = []
        self.connections = 0
        self.unscripted = 0
        self.port = 0
        self.stream_started = asyncio.Event()  # set when a Slow reply has sent its first delta
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()

    # -- scripting and inspection --------------------------------------------

    def push(self, *replies: Reply) -> None:
        self.script.extend(replies)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def offline_env(self) -> dict[str, str]:
        """:func:`offline_env` for this stand-in."""
        return offline_env(self.url)

    @property
    def messages(self) -> list[Recorded]:
        """The POST /v1/messages requests, in order."""
        return [r for r in self.requests if r.is_messages]

    def calls(self) -> list[str]:
        """``METHOD path`` of every request, for reporting what the CLI calls."""
        return [f"{r.method} {r.path}" for r in self.requests]

    async def wait_messages(self, n: int) -> list[Recorded]:
        """Wait until at least ``n`` messages requests have arrived."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.messages) >= n)
        return self.messages

    # -- lifecycle -------------------------------------------------------------

    async def start(self, port: int = 0) -> Standin:
        """Listen on 127.0.0.1:``port`` (0: a free one, as tests use)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> Standin:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP ------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            while True:
                request = await self._read_request(reader)
                if request is None:
                    break
                await self._record(request)
                keep = await self._dispatch(request, writer)
                request.answered = time.monotonic()
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _record(self, request: Recorded) -> None:
        async with self._changed:
            self.requests.append(request)
            self._changed.notify_all()

    async def _read_request(self, reader: asyncio.StreamReader) -> Recorded | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, path, _version = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            raw = bytearray()
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers expected
                    break
                raw += await reader.readexactly(size)
                await reader.readexactly(2)
            body_bytes = bytes(raw)
        else:
            body_bytes = await reader.readexactly(int(headers.get("content-length", "0")))
        try:
            body = json.loads(body_bytes) if body_bytes else None
        except ValueError:
            body = None
        return Recorded(method, path, headers, body, body_bytes, received=time.monotonic())

    def _head(self, status: int, content_type: str, length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines.append(f"Content-Type: {content_type}")
        lines.append("request-id: req_standin")
        if length is not None:
            lines.append(f"Content-Length: {length}")
        elif not self.connection_close:
            lines.append("Transfer-Encoding: chunked")
        lines.append("Connection: close" if self.connection_close else "Connection: keep-alive")
        return ("\r\n".join(lines) + "\r\n").encode()

    async def _send_json(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        obj: Any,
        extra: tuple[tuple[str, str], ...] = (),
    ) -> bool:
        body = json.dumps(obj).encode()
        head = self._head(status, "application/json", len(body))
        head += "".join(f"{k}: {v}\r\n" for k, v in extra).encode()
        writer.write(head + b"\r\n" + body)
        await writer.drain()
        return not self.connection_close

    async def _dispatch(self, request: Recorded, writer: asyncio.StreamWriter) -> bool:
        path = request.path.split("?")[0]
        if request.method == "HEAD" or (request.method == "GET" and path == "/"):
            writer.write(self._head(200, "text/plain", 0) + b"\r\n")
            await writer.drain()
            return not self.connection_close
        if request.method == "POST" and path == "/v1/messages/count_tokens":
            return await self._send_json(writer, 200, {"input_tokens": 12})
        if not request.is_messages:
            return await self._send_json(
                writer,
                404,
                {"type": "error", "error": {"type": "not_found_error", "message": path}},
            )
        if self.script:
            reply = self.script.popleft()
        elif self.responder is not None:
            reply = self.responder(request)
        else:
            self.unscripted += 1
            reply = self.default
        request.reply = reply
        body = request.body if isinstance(request.body, dict) else {}
        if isinstance(reply, Error):
            err = {"type": "error", "error": {"type": reply.type, "message": reply.message}}
            return await self._send_json(writer, reply.status, err, reply.headers)
        model = body.get("model", "claude-standin")
        if not body.get("stream"):
            return await self._send_json(writer, 200, self._whole_message(reply, model))
        writer.write(self._head(200, "text/event-stream", None) + b"\r\n")
        await writer.drain()
        for delay, event in self._events(reply, model):
            if delay:
                await asyncio.sleep(delay)
            await self._write_chunk(writer, _sse(event))
            if isinstance(reply, Slow) and event["type"] == "content_block_delta":
                self.stream_started.set()
        if self.connection_close:
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def _write_chunk(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        if self.connection_close:
            writer.write(data)
        else:
            writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    # -- message bodies ----------------------------------------------------------

    def _msg_id(self) -> str:
        return f"msg_{next(self._ids):02d}"

    def _tool_id(self, reply: ToolUse) -> str:
        return reply.id or f"toolu_{next(self._ids):02d}"

    def _whole_message(self, reply: Reply, model: str) -> dict[str, Any]:
        content: list[dict[str, Any]]
        if isinstance(reply, ToolUse):
            content = [
                {
                    "type": "tool_use",
                    "id": self._tool_id(reply),
                    "name": reply.name,
                    "input": reply.input,
                }
            ]
            stop = "tool_use"
        else:
            assert isinstance(reply, Text | Slow)
            content = [{"type": "text", "text": reply.text}]
            stop = "end_turn"
        return {
            "id": self._msg_id(),
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 5},
        }

    def _events(self, reply: Reply, model: str) -> list[tuple[float, dict[str, Any]]]:
        """(delay before, event) pairs of one streamed reply."""
        out: list[tuple[float, dict[str, Any]]] = [
            (
                0.0,
                {
                    "type": "message_start",
                    "message": {
                        "id": self._msg_id(),
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": 12, "output_tokens": 1},
                    },
                },
            )
        ]
        index = 0

        def text_block(text: str, chunks: int, delay: float) -> None:
            nonlocal index
            out.append(
                (
                    0.0,
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {"type": "text", "text": ""},
                    },
                )
            )
            for i, part in enumerate(_split(text, chunks)):
                out.append(
                    (
                        delay if i == 1 else 0.0,
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "text_delta", "text": part},
                        },
                    )
                )
            out.append((0.0, {"type": "content_block_stop", "index": index}))
            index += 1

        if isinstance(reply, ToolUse):
            if reply.text:
                text_block(reply.text, 1, 0.0)
            out.append(
                (
                    0.0,
                    {
                        "type": "content_block_start",
                        "index": index,
                        "content_block": {
                            "type": "tool_use",
                            "id": self._tool_id(reply),
                            "name": reply.name,
                            "input": {},
                        },
                    },
                )
            )
            encoded = json.dumps(reply.input)
            for part in _split(encoded, 2):
                out.append(
                    (
                        0.0,
                        {
                            "type": "content_block_delta",
                            "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": part},
                        },
                    )
                )
            out.append((0.0, {"type": "content_block_stop", "index": index}))
            stop = "tool_use"
        elif isinstance(reply, Slow):
            text_block(reply.text, max(2, reply.chunks), reply.delay)
            stop = "end_turn"
        else:
            assert isinstance(reply, Text)
            text_block(reply.text, reply.chunks, 0.0)
            stop = "end_turn"
        out.append(
            (
                0.0,
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": {"output_tokens": 5},
                },
            )
        )
        out.append((0.0, {"type": "message_stop"}))
        return out
