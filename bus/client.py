"""An async client of the bus server, for the CLI, remote capsules and astrid-emit.

``async with BusClient.connect(path, role="cli") as client:`` opens the
socket, sends the hello and waits for the welcome; :meth:`BusClient.attach`
does the same over a stream already connected, :meth:`BusClient.attach_fd`
over an inherited socket descriptor (a worker capsule's end of the
supervisor's socketpair).  One reader task routes
incoming frames: messages to their subscription, results to the waiting
request, pongs to :meth:`BusClient.flush`.  Outgoing frames are coalesced
into one buffer that a single writer sends, so many publishes cost few
system calls.  Errors the server reports come back as the same
:class:`BusError` subclasses the server raised: those of a publish or a reply
on the next :meth:`BusClient.flush` (the first :data:`MAX_PENDING_ERRORS` are
kept) and, as they arrive, to :attr:`BusClient.on_error` when it is set.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import msgspec

from bus.envelope import Envelope
from bus.errors import (
    BusClosed,
    BusError,
    ConnectionLost,
    FrameError,
    RequestTimeout,
    check_payload,
    connect_error,
    error_for_code,
    sole_error,
)
from bus.stream import UnixStream, connect_unix
from bus.wire import (
    Err,
    FrameReader,
    FrameTooLarge,
    Hello,
    Msg,
    Ok,
    Ping,
    Pong,
    Pub,
    Reply,
    Req,
    Result,
    Sub,
    Unsub,
    Welcome,
    decode_server_frame,
    encode_into,
    frame_limit,
)

__all__ = ("BusClient", "PendingRequest", "RemoteSubscription")

_encode = msgspec.json.Encoder().encode


REQUEST_GRACE = 2.0
"""Seconds past a request's deadline before the client gives up on the server's answer."""
MAX_LOCAL_WAIT = 305.0
"""The same bound for a request without a deadline (the server caps deadlines at 300 s)."""
MAX_PENDING_ERRORS = 64
"""Errors kept for the next :meth:`BusClient.flush`; later ones are only passed to ``on_error``."""


class RemoteSubscription:
    """Envelopes for one pattern, received from the server."""

    def __init__(self, client: BusClient, sid: int, pattern: str) -> None:
        self.client = client
        self.sid = sid
        self.pattern = pattern
        self._queue: deque[Envelope] = deque()
        self._wake = anyio.Event()
        self._closed = False
        self._error: BusError | None = None

    def _put(self, envelope: Envelope) -> None:
        self._queue.append(envelope)

    def _end(self, error: BusError | None) -> None:
        self._closed = True
        self._error = error
        self._wake.set()

    async def get(self) -> Envelope:
        while not self._queue:
            if self._closed:
                if self._error is not None:
                    raise self._error
                raise anyio.EndOfStream
            self._wake = anyio.Event()
            await self._wake.wait()
        return self._queue.popleft()

    def __aiter__(self) -> RemoteSubscription:
        return self

    async def __anext__(self) -> Envelope:
        try:
            return await self.get()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def close(self) -> None:
        if not self._closed:
            self._end(None)
            self.client._subs.pop(self.sid, None)
            with contextlib.suppress(BusError):
                self.client._send(Unsub(self.sid))


class PendingRequest:
    """A request sent and not yet answered (:meth:`BusClient.begin_request`): await
    :meth:`result`, or :meth:`forget` it (its answer, when it comes, is dropped)."""

    def __init__(
        self, client: BusClient, rid: int, topic: str, deadline: float | None, slot: list[Any]
    ) -> None:
        self._client = client
        self._rid = rid
        self._topic = topic
        self._deadline = deadline
        self._event = anyio.Event()
        self._slot = slot

    async def result(self) -> Envelope:
        """The reply, or the error the request raised (as :meth:`BusClient.request_raw`)."""
        # the server enforces the deadline; this bound only guards against a
        # server that never answers (e.g. an error frame it could not tie to us)
        local = None if self._deadline is None else self._deadline + REQUEST_GRACE
        try:
            with anyio.move_on_after(local if local is not None else MAX_LOCAL_WAIT) as scope:
                await self._event.wait()
        finally:
            self.forget()
        if scope.cancelled_caught:
            raise RequestTimeout(f"no answer to the request on {self._topic!r}")
        value = self._slot[0]
        if isinstance(value, BusError):
            raise value
        result: Result = value
        if result.env is None:
            raise error_for_code(result.code or "bus_error", result.message or "request failed")
        return result.env.to_envelope()

    def forget(self) -> None:
        """No longer wait for the answer."""
        self._client._waiting.pop(("result", self._rid), None)


class BusClient:
    """A connected client.  Use :meth:`connect`."""

    def __init__(self, stream: anyio.abc.ByteStream, max_frame: int) -> None:
        self._stream = stream
        self._reader = FrameReader(max_frame)
        self._out = bytearray()
        self._wake = anyio.Event()
        self._subs: dict[int, RemoteSubscription] = {}
        self._touched: set[RemoteSubscription] = set()
        self._waiting: dict[tuple[str, int], tuple[anyio.Event, list[Any]]] = {}
        self._ids = itertools.count(1)
        self._errors: list[BusError] = []
        self._closed: BusError | None = None
        self.welcome: Welcome | None = None
        self.on_error: Callable[[BusError], None] | None = None
        """Called with each error the server reports that no waiting call receives (must not raise)."""

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        path: str | os.PathLike[str],
        *,
        role: str = "cli",
        name: str | None = None,
        principal: str | None = None,
        max_frame: int = frame_limit(1024 * 1024),
        hello_deadline: float = 5.0,
    ) -> AsyncIterator[BusClient]:
        """Connect to the server at ``path`` and complete the hello."""
        try:
            stream = await connect_unix(path)
        except OSError as exc:
            raise (connect_error(path, exc) or exc) from exc
        async with cls.attach(
            stream,
            role=role,
            name=name,
            principal=principal,
            max_frame=max_frame,
            hello_deadline=hello_deadline,
        ) as client:
            yield client

    @classmethod
    @contextlib.asynccontextmanager
    async def attach(
        cls,
        stream: anyio.abc.ByteStream,
        *,
        role: str = "cli",
        name: str | None = None,
        principal: str | None = None,
        max_frame: int = frame_limit(1024 * 1024),
        hello_deadline: float = 5.0,
    ) -> AsyncIterator[BusClient]:
        """Run the client over an already connected stream (e.g. a socketpair)."""
        client = cls(stream, max_frame)
        try:
            async with client._run(stream, role, name, principal, hello_deadline) as ready:
                yield ready
        except BaseExceptionGroup as group:
            # the caller's error surfaces as itself, not wrapped by our task group
            raise sole_error(group) from None

    @classmethod
    @contextlib.asynccontextmanager
    async def attach_fd(
        cls,
        fd: int,
        *,
        role: str = "capsule",
        name: str | None = None,
        max_frame: int = frame_limit(1024 * 1024),
        hello_deadline: float = 5.0,
    ) -> AsyncIterator[BusClient]:
        """Run the client over an inherited, connected Unix stream socket descriptor.

        The descriptor is owned from then on: it is closed when the block ends.
        """
        try:
            sock = socket.socket(fileno=fd)
        except OSError as exc:
            os.close(fd)
            raise ConnectionLost(f"descriptor {fd} is not a socket: {exc.strerror}") from exc
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            sock.close()
            raise ConnectionLost(f"descriptor {fd} is not a Unix stream socket")
        stream = UnixStream(sock)
        async with cls.attach(
            stream, role=role, name=name, max_frame=max_frame, hello_deadline=hello_deadline
        ) as client:
            yield client

    @contextlib.asynccontextmanager
    async def _run(
        self,
        stream: anyio.abc.ByteStream,
        role: str,
        name: str | None,
        principal: str | None,
        hello_deadline: float,
    ) -> AsyncIterator[BusClient]:
        client = self
        async with stream, anyio.create_task_group() as tg:
            tg.start_soon(client._writer)
            tg.start_soon(client._read_loop)
            try:
                client._send(Hello(role=role, name=name, principal=principal))
                with anyio.move_on_after(hello_deadline):
                    client.welcome = await client._wait("welcome", 0)
                if client.welcome is None:
                    raise ConnectionLost("the supervisor did not answer the hello")
                yield client
            finally:
                tg.cancel_scope.cancel()

    # -- operations ---------------------------------------------------------

    def publish(
        self,
        topic: str,
        payload: Any,
        *,
        correlation_id: str | None = None,
        on_behalf_of: str | None = None,
    ) -> None:
        """Queue a publish; errors come back on the next :meth:`flush`.

        ``on_behalf_of`` scopes the envelope to a principal; the server honours
        it only for a connection without a principal of its own."""
        self.publish_raw(
            topic, _encode(payload), correlation_id=correlation_id, on_behalf_of=on_behalf_of
        )

    def publish_raw(
        self,
        topic: str,
        payload: bytes,
        *,
        correlation_id: str | None = None,
        on_behalf_of: str | None = None,
    ) -> None:
        self._check_payload(payload, f"the publish on {topic!r}")
        self._send(Pub(topic, msgspec.Raw(payload), correlation_id, on_behalf_of))

    async def flush(self) -> None:
        """Wait until the server has handled everything sent so far; raise its errors."""
        n = next(self._ids)
        self._send(Ping(n))
        await self._wait("pong", n)
        self._raise_errors()

    async def subscribe(self, pattern: str) -> RemoteSubscription:
        sid = next(self._ids)
        sub = RemoteSubscription(self, sid, pattern)
        self._subs[sid] = sub
        self._send(Sub(sid, pattern))
        try:
            await self._wait("sub", sid)
        except BusError:
            self._subs.pop(sid, None)
            raise
        return sub

    async def request(self, topic: str, payload: Any, *, deadline: float | None = None) -> Envelope:
        return await self.request_raw(topic, _encode(payload), deadline=deadline)

    async def request_raw(
        self, topic: str, payload: bytes, *, deadline: float | None = None
    ) -> Envelope:
        return await self.begin_request(topic, payload, deadline=deadline).result()

    def begin_request(
        self, topic: str, payload: bytes, *, deadline: float | None = None
    ) -> PendingRequest:
        """Send a request (JSON text) now, and await its answer later, or never: several
        may be on their way at once without a task each."""
        if self._closed is not None:
            raise self._closed
        try:
            msgspec.json.decode(payload)
        except msgspec.DecodeError as exc:
            raise FrameError(f"request payload is not valid JSON: {exc}") from None
        self._check_payload(payload, f"the request on {topic!r}")
        rid = next(self._ids)
        self._send(Req(rid, topic, msgspec.Raw(payload), deadline))
        slot: list[Any] = []
        pending = PendingRequest(self, rid, topic, deadline, slot)
        self._waiting[("result", rid)] = (pending._event, slot)
        return pending

    def reply(self, request: Envelope, payload: Any) -> None:
        if request.reply_to is None:
            raise BusError("the envelope is not a request (no reply_to)")
        self.reply_raw(request.reply_to, _encode(payload))

    def reply_raw(self, reply_to: str, payload: bytes) -> None:
        """Answer the request whose ``reply_to`` token this is with JSON text."""
        self._check_payload(payload, "the reply")
        self._send(Reply(reply_to, msgspec.Raw(payload)))

    # -- plumbing -------------------------------------------------------------

    def _check_payload(self, payload: bytes, what: str) -> None:
        welcome = self.welcome
        check_payload(len(payload), welcome.max_payload if welcome else None, what)

    def _raise_errors(self) -> None:
        if self._errors:
            error = self._errors[0]
            self._errors.clear()
            raise error

    def _send(self, frame: Hello | Pub | Sub | Unsub | Req | Reply | Ping) -> None:
        if self._closed is not None:
            raise self._closed
        encode_into(frame, self._out)
        self._wake.set()

    async def _wait(self, kind: str, key: int) -> Any:
        if self._closed is not None:
            raise self._closed
        event = anyio.Event()
        slot: list[Any] = []
        self._waiting[(kind, key)] = (event, slot)
        try:
            await event.wait()
        finally:
            self._waiting.pop((kind, key), None)
        value = slot[0]
        if isinstance(value, BusError):
            raise value
        return value

    def _resolve(self, kind: str, key: int, value: Any) -> None:
        waiter = self._waiting.pop((kind, key), None)
        if waiter is not None:
            waiter[1].append(value)
            waiter[0].set()

    async def _writer(self) -> None:
        while True:
            if not self._out:
                self._wake = anyio.Event()
                await self._wake.wait()
                continue
            data, self._out = self._out, bytearray()
            try:
                await self._stream.send(bytes(data))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                self._fail(ConnectionLost("the connection to the supervisor broke"))
                return

    async def _read_loop(self) -> None:
        error: BusError = ConnectionLost("the supervisor closed the connection")
        try:
            while True:
                try:
                    data = await self._stream.receive(262144)
                except (
                    anyio.EndOfStream,
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                    OSError,
                ):
                    break
                touched = self._touched
                for item in self._reader.feed(data):
                    if isinstance(item, FrameTooLarge):
                        self._errors.append(BusError(f"server sent a frame of {item.size} bytes"))
                        continue
                    fatal = self._dispatch(decode_server_frame(item))
                    if fatal is not None:
                        error = fatal
                for sub in touched:
                    sub._wake.set()
                touched.clear()
        except BusError as exc:
            error = exc
        self._fail(error)

    def _dispatch(self, frame: object) -> BusError | None:
        if isinstance(frame, Msg):
            sub = self._subs.get(frame.sid)
            if sub is not None:
                sub._put(frame.env.to_envelope())
                self._touched.add(sub)
        elif isinstance(frame, Pong):
            self._resolve("pong", frame.n, None)
        elif isinstance(frame, Result):
            self._resolve("result", frame.rid, frame)
        elif isinstance(frame, Ok):
            self._resolve("sub", frame.sid, None)
        elif isinstance(frame, Welcome):
            self._resolve("welcome", 0, frame)
        elif isinstance(frame, Err):
            error = error_for_code(frame.code, frame.message)
            if frame.fatal:
                return error
            if frame.sid is not None and ("sub", frame.sid) in self._waiting:
                self._resolve("sub", frame.sid, error)
            else:
                if len(self._errors) < MAX_PENDING_ERRORS:
                    self._errors.append(error)
                if self.on_error is not None:
                    self.on_error(error)
        return None

    def _fail(self, error: BusError) -> None:
        if self._closed is None:
            self._closed = error
        for event, slot in list(self._waiting.values()):
            slot.append(self._closed)
            event.set()
        self._waiting.clear()
        for sub in self._subs.values():
            sub._end(self._closed)

    async def aclose(self) -> None:
        self._fail(BusClosed("the client was closed"))
        await self._stream.aclose()
