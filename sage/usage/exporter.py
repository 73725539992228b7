"""``GET /metrics``: the Prometheus exporter's thin HTTP shell (``[metrics] listen``).

The page itself is ``prometheus_client``'s exposition of :class:`Metrics`' registry
(``generate_latest``); this module only reads one request line, refreshes what is
read at scrape time (the runner's sessions by state, the fleet's nodes) and writes
the answer.  It runs on the supervisor's event loop (no thread: the collectors read
the usage service's state in place) and answers one request per connection.

Anything but ``GET /metrics`` is ``404``; a request line longer than
:data:`MAX_REQUEST` or slower than :data:`READ_TIMEOUT` is dropped, and at most
:data:`MAX_CLIENTS` scrapes are served at once (a flood waits in the kernel's
backlog, it does not grow the supervisor).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Final

import anyio
import anyio.abc
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sage.config import is_loopback, listen_address
from sage.usage.metrics import Metrics

__all__ = ("Exporter",)

log = structlog.get_logger("sage.usage")

MAX_REQUEST: Final = 8192
READ_TIMEOUT: Final = 5.0
MAX_CLIENTS: Final = 8


class Exporter:
    """Serves ``metrics`` on ``listen`` (``HOST:PORT``)."""

    def __init__(
        self, metrics: Metrics, listen: str, refresh: Callable[[], Awaitable[None]]
    ) -> None:
        self.metrics = metrics
        self.host, self.port = listen_address(listen)
        self.refresh = refresh
        self.scrapes = 0
        self._room = anyio.Semaphore(MAX_CLIENTS)

    async def serve(self, *, task_status: anyio.abc.TaskStatus[int]) -> None:
        """Listen until cancelled; ``task_status`` gets the port bound (for port 0)."""
        listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        port = int(listener.extra(anyio.abc.SocketAttribute.local_port))
        if not is_loopback(self.host):
            log.warning("metrics.not_loopback", host=self.host, port=port)
        log.info("metrics.listening", host=self.host, port=port)
        async with listener:
            task_status.started(port)
            await listener.serve(self._client)

    async def _client(self, stream: anyio.abc.SocketStream) -> None:
        async with stream, self._room:
            head = b""
            with anyio.move_on_after(READ_TIMEOUT):
                while b"\r\n" not in head and len(head) < MAX_REQUEST:
                    try:
                        head += await stream.receive(MAX_REQUEST)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        return
            line = head.split(b"\r\n", 1)[0].split(b" ")
            if len(line) != 3 or line[0] != b"GET" or line[1].split(b"?")[0] != b"/metrics":
                await _send(stream, b"404 Not Found", b"text/plain", b"GET /metrics only\n")
                return
            await self.refresh()
            self.scrapes += 1
            body = generate_latest(self.metrics.registry)
            await _send(stream, b"200 OK", CONTENT_TYPE_LATEST.encode(), body)


async def _send(stream: anyio.abc.SocketStream, status: bytes, kind: bytes, body: bytes) -> None:
    head = (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + kind
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(anyio.BrokenResourceError, OSError):
        await stream.send(head + body)
