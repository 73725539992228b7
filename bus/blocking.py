"""A blocking client of the bus server: one request at a time, no event loop.

For a program that asks a few questions and exits (``astrid status``,
``astrid sage send``): it connects, says hello, sends ``req`` and ``sub``
frames and reads up to each ``result`` or ``ok``, in the calling thread;
frames that arrive meanwhile (a subscription's messages, the answer to
another request) are kept in order for :meth:`BlockingClient.take`.  It speaks
the wire protocol of :mod:`bus.wire` through the same sans-IO pieces as
:class:`bus.BusClient` (frames encoded by :func:`~bus.wire.encode`, read by
:class:`~bus.wire.FrameReader`, decoded by
:func:`~bus.wire.decode_server_frame`) and raises the same errors, but imports
neither anyio nor asyncio: a command that needs nothing else starts tens of
milliseconds sooner.  A program that waits on something besides the socket
(a signal, a terminal) selects on :meth:`~BlockingClient.fileno` and calls
:meth:`~BlockingClient.receive` when it is readable.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections.abc import Callable, Iterator
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
    Ok,
    Req,
    Result,
    ServerFrame,
    Sub,
    Welcome,
    decode_server_frame,
    encode,
    frame_limit,
)

__all__ = ("REQUEST_GRACE", "BlockingClient", "answer")

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
        self._topics: dict[int, str] = {}
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
            frame = client._wait(lambda f: True, time.monotonic() + hello_deadline, "the hello")
            if not isinstance(frame, Welcome):
                raise ConnectionLost("the supervisor did not answer the hello")
            client.welcome = frame
            yield client
        finally:
            sock.close()

    def fileno(self) -> int:
        """The socket's descriptor, to select on beside others."""
        return self._sock.fileno()

    def request(self, topic: str, payload: Any, *, deadline: float | None = None) -> Envelope:
        """Ask and wait for the reply: its envelope, or the error the server answered."""
        return self.result(self.begin(topic, payload, deadline=deadline), deadline)

    def begin(self, topic: str, payload: Any, *, deadline: float | None = None) -> int:
        """Send a request now; its id, for :meth:`result` (or a :class:`Result` frame
        :meth:`take` returns).  A reply nobody waits for is dropped unread."""
        body = msgspec.json.encode(payload)
        welcome = self.welcome
        check_payload(
            len(body), welcome.max_payload if welcome else None, f"the request on {topic!r}"
        )
        rid = next(self._ids)
        self._send(encode(Req(rid, topic, msgspec.Raw(body), deadline)))
        self._topics[rid] = topic
        return rid

    def result(self, rid: int, deadline: float | None = None) -> Envelope:
        """Wait for the answer to request ``rid``: its envelope, or the error it got."""
        topic = self._topics.pop(rid, "?")
        local = MAX_LOCAL_WAIT if deadline is None else deadline + REQUEST_GRACE
        frame = self._wait(
            lambda f: isinstance(f, Result) and f.rid == rid,
            time.monotonic() + local,
            f"the request on {topic!r}",
        )
        assert isinstance(frame, Result)
        return answer(frame)

    def subscribe(self, pattern: str, *, deadline: float = 10.0) -> int:
        """Subscribe to ``pattern``; the ``sid`` its :class:`~bus.wire.Msg` frames carry."""
        sid = next(self._ids)
        self._send(encode(Sub(sid, pattern)))
        frame = self._wait(
            lambda f: isinstance(f, (Ok, Err)) and f.sid == sid,
            time.monotonic() + deadline,
            f"the subscription to {pattern!r}",
        )
        if isinstance(frame, Err):
            raise error_for_code(frame.code, frame.message)
        return sid

    def take(self) -> list[ServerFrame]:
        """The frames read and not yet taken, oldest first (no wait)."""
        frames, self._frames = self._frames, []
        return frames

    def receive(self, timeout: float) -> list[ServerFrame]:
        """The frames kept, else what one read brings within ``timeout`` seconds
        (none: nothing came).  A closed connection raises :class:`ConnectionLost`."""
        if not self._frames:
            self._read(time.monotonic() + timeout, wait=False)
        return self.take()

    def _wait(
        self, match: Callable[[ServerFrame], bool], end: float, waiting_for: str
    ) -> ServerFrame:
        """The first frame ``match`` takes, read until ``end``; the others are kept."""
        while True:
            for i, frame in enumerate(self._frames):
                if match(frame):
                    return self._frames.pop(i)
            self._read(end, waiting_for=waiting_for)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except OSError as exc:
            raise ConnectionLost("the connection to the supervisor broke") from exc

    def _read(self, end: float, *, waiting_for: str = "", wait: bool = True) -> None:
        """Read once (until ``end``) and keep the frames it brings.  Past ``end``:
        :class:`RequestTimeout` (``wait``) or nothing.  A fatal ``err`` (one that names
        no subscription) is raised as its error."""
        left = end - time.monotonic()
        if left <= 0:
            if wait:
                raise RequestTimeout(f"no answer to {waiting_for}")
            left = 0.0
        self._sock.settimeout(left)
        try:
            data = self._sock.recv(262144)
        except TimeoutError:
            return
        except BlockingIOError:  # a zero timeout: nothing to read
            return
        except OSError as exc:
            raise ConnectionLost("the connection to the supervisor broke") from exc
        if not data:
            raise ConnectionLost("the supervisor closed the connection")
        for item in self._reader.feed(data):
            if isinstance(item, FrameTooLarge):
                raise FrameError(f"server sent a frame of {item.size} bytes")
            frame = decode_server_frame(item)
            if isinstance(frame, Err) and frame.sid is None:
                error: BusError = error_for_code(frame.code, frame.message)
                raise error
            self._frames.append(frame)


def answer(frame: Result) -> Envelope:
    """A ``result`` frame's envelope, or the error the server answered with."""
    if frame.env is None:
        raise error_for_code(frame.code or "bus_error", frame.message or "failed")
    return frame.env.to_envelope()
