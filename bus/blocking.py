"""A blocking client of the bus server: one request at a time, no event loop.

For a program that asks one question and exits (``astrid status``): it
connects, says hello, sends ``req`` frames and reads up to each ``result``, in
the calling thread.  It speaks the wire protocol of :mod:`bus.wire` through
the same sans-IO pieces as :class:`bus.BusClient` (frames encoded by
:func:`~bus.wire.encode`, read by :class:`~bus.wire.FrameReader`, decoded by
:func:`~bus.wire.decode_server_frame`) and raises the same errors, but imports
neither anyio nor asyncio: a command that needs nothing else starts tens of
milliseconds sooner.  Anything more (subscriptions, streams of events, several
requests at once) is :class:`bus.BusClient`'s.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec

from bus.envelope import Envelope
from bus.errors import (
    BusError,
    ConnectionLost,
    FrameError,
    RequestTimeout,
    check_payload,
    connect_error,
    error_for_code,
)
from bus.wire import (
    Err,
    FrameReader,
    FrameTooLarge,
    Hello,
    Req,
    Result,
    ServerFrame,
    Welcome,
    decode_server_frame,
    encode,
    frame_limit,
)

__all__ = ("REQUEST_GRACE", "BlockingClient")

REQUEST_GRACE = 2.0
"""Seconds past a request's deadline the client still waits (the server enforces it)."""
MAX_LOCAL_WAIT = 60.0
"""Seconds a request without a deadline waits at most."""


class BlockingClient:
    """A connected blocking client.  Use :meth:`connect`."""

    def __init__(self, sock: socket.socket, max_frame: int) -> None:
        self._sock = sock
        self._reader = FrameReader(max_frame)
        self._frames: list[ServerFrame] = []
        self._ids = itertools.count(1)
        self.welcome: Welcome | None = None

    @classmethod
    @contextlib.contextmanager
    def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        role: str = "cli",
        name: str | None = None,
        principal: str | None = None,
        max_frame: int = frame_limit(1024 * 1024),
        hello_deadline: float = 5.0,
    ) -> Iterator[BlockingClient]:
        """Connect to the server at ``path`` and complete the hello."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(hello_deadline)
            try:
                sock.connect(os.fspath(path))
            except OSError as exc:
                raise (connect_error(path, exc) or exc) from exc
            client = cls(sock, max_frame)
            client._send(encode(Hello(role=role, name=name, principal=principal)))
            frame = client._next(time.monotonic() + hello_deadline, "the hello")
            if not isinstance(frame, Welcome):
                raise ConnectionLost("the supervisor did not answer the hello")
            client.welcome = frame
            yield client
        finally:
            sock.close()

    def request(self, topic: str, payload: Any, *, deadline: float | None = None) -> Envelope:
        """Ask and wait for the reply: its envelope, or the error the server answered."""
        body = msgspec.json.encode(payload)
        welcome = self.welcome
        check_payload(
            len(body), welcome.max_payload if welcome else None, f"the request on {topic!r}"
        )
        rid = next(self._ids)
        self._send(encode(Req(rid, topic, msgspec.Raw(body), deadline)))
        local = MAX_LOCAL_WAIT if deadline is None else deadline + REQUEST_GRACE
        end = time.monotonic() + local
        while True:
            frame = self._next(end, f"the request on {topic!r}")
            if isinstance(frame, Result) and frame.rid == rid:
                if frame.env is None:
                    raise error_for_code(frame.code or "bus_error", frame.message or "failed")
                return frame.env.to_envelope()

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost("the connection to the supervisor broke") from exc

    def _next(self, end: float, waiting_for: str) -> ServerFrame:
        """The next frame, read until ``end``; a fatal ``err`` is raised as its error."""
        while not self._frames:
            left = end - time.monotonic()
            if left <= 0:
                raise RequestTimeout(f"no answer to {waiting_for}")
            self._sock.settimeout(left)
            try:
                data = self._sock.recv(262144)
            except TimeoutError:
                continue
            except OSError as exc:
                raise ConnectionLost("the connection to the supervisor broke") from exc
            if not data:
                raise ConnectionLost("the supervisor closed the connection")
            for item in self._reader.feed(data):
                if isinstance(item, FrameTooLarge):
                    raise FrameError(f"server sent a frame of {item.size} bytes")
                self._frames.append(decode_server_frame(item))
        frame = self._frames.pop(0)
        if isinstance(frame, Err):  # it sends only a hello and requests: any error is theirs
            error: BusError = error_for_code(frame.code, frame.message)
            raise error
        return frame
