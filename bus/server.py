"""The bus's Unix-socket server: one task group per connection, frames in and out.

The server binds a path socket (never the abstract namespace) in a private
directory, under umask 0077, after taking a lock file so that a stale socket
is replaced only when no other server holds it.  Each peer's uid comes from
``SO_PEERCRED``; an ``authorize`` callback maps it (and the principal the
hello asks for) to an :class:`Identity`, so a client never asserts who it
is.  :meth:`BusServer.adopt` serves a connection the caller made itself (the
supervisor's end of a worker capsule's socketpair) under an identity the
caller fixed, skipping ``SO_PEERCRED`` and ``authorize``.  What each frame
means in each state of a connection is decided by the sans-IO
:mod:`bus.connection`; the socket details are in :mod:`bus.unix`.  Delivery to a
remote subscriber goes through the connection's outbox, which one writer
task flushes in batches; a connection whose outbox stays over its limit past
the slow-consumer deadline is disconnected.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import cast

import anyio
import anyio.abc
import structlog

from bus.acl import Identity
from bus.broker import Bus
from bus.connection import ACTS, Act, Answer, Connection, Refuse, WelcomeAdopted
from bus.envelope import Envelope
from bus.errors import BusError, FrameError, NotAuthorized, SlowConsumer
from bus.stream import UnixStream, accept
from bus.unix import (
    PeerCred,
    SocketLock,
    bind_unix_socket,
    peer_credentials,
    prepare_socket_dir,
)
from bus.wire import (
    ClientFrame,
    Err,
    FrameReader,
    FrameTooLarge,
    Hello,
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
    check_payload,
    decode_client_frame,
    encode_into,
    encode_msg_into,
    frame_limit,
)

__all__ = ("Authorize", "BusServer")

log = structlog.get_logger("bus.server")

MAX_SUBSCRIPTIONS_PER_CONNECTION = 1024
MAX_REQUEST_DEADLINE = 300.0
"""The longest deadline a remote client may ask for, in seconds."""
_OUTBOX_MIN_BYTES = 64 * 1024 * 1024  # like NATS's default pending limit
UID_OUTBOX_BYTES = 256 * 1024 * 1024
"""Bytes the outboxes of one user uid's connections may hold together: without it a
uid's 64 connections that never read could make the supervisor hold 4 GiB."""


Authorize = Callable[[PeerCred, Hello], Identity]
"""Map a verified peer and its hello to an identity, or raise NotAuthorized."""


class _RemoteSubscription:
    __slots__ = ("conn", "delivered", "dropped", "owner", "pattern", "sid")

    def __init__(self, conn: _Connection, sid: int, pattern: str, owner: Identity) -> None:
        self.conn = conn
        self.sid = sid
        self.pattern = pattern
        self.owner = owner
        self.delivered = 0
        self.dropped = 0

    def deliver(self, envelope: Envelope) -> bool:
        conn = self.conn
        if conn.admit():
            encode_msg_into(self.sid, envelope, conn.outbox)
            conn.account()
            conn.queued += 1
            conn.wake.set()
            self.delivered += 1
            return True
        self.dropped += 1
        return False


class _Connection:
    """The async shell of one client connection: its stream, subscriptions and outbox.

    What each frame means, and which state the connection is in, is decided
    by its sans-IO :class:`bus.connection.Connection` (``self.protocol``);
    this class moves the bytes and carries out the steps on the bus.
    """

    def __init__(
        self,
        server: BusServer,
        stream: anyio.abc.SocketStream,
        peer: PeerCred,
        identity: Identity | None = None,
    ) -> None:
        self.server = server
        self.stream = stream
        self.peer = peer
        self.protocol = Connection(
            now=anyio.current_time(),
            hello_timeout=server.hello_timeout,
            idle_timeout=server.idle_timeout,
            identity=identity,
        )
        self.subs: dict[int, _RemoteSubscription] = {}
        self.requests = 0
        self.outbox = bytearray()
        self._charged = 0  # bytes of the outbox counted against the uid's budget
        self.queued = 0
        self.wake = anyio.Event()
        self._full_since: float | None = None
        self.scope = anyio.CancelScope()

    # -- outbound ---------------------------------------------------------

    def account(self) -> None:
        """Count the outbox's growth or shrinking against the uid's budget (users only)."""
        counted = len(self.outbox) if self.server.budgeted(self) else 0
        if counted != self._charged:
            self.server.charge(self.peer.uid, counted - self._charged)
            self._charged = counted

    def admit(self) -> bool:
        """Whether one more frame may be queued; cuts off a consumer slow past its deadline."""
        if not self.protocol.live:
            return False
        if len(self.outbox) > self.server.outbox_limit:
            self.kill(SlowConsumer(f"outbox over {self.server.outbox_limit} bytes"))
            return False
        if self.server.over_budget(self):
            self.kill(
                SlowConsumer(
                    f"uid {self.peer.uid}'s connections hold over"
                    f" {self.server.uid_outbox_limit} unread bytes"
                )
            )
            return False
        if self.queued >= self.server.bus.queue_size:
            now = time.monotonic()
            if self._full_since is None:
                self._full_since = now
            elif now - self._full_since > self.server.slow_consumer_timeout:
                self.kill(
                    SlowConsumer(
                        f"outbox over {self.server.bus.queue_size} frames past the deadline"
                    )
                )
                return False
        return True

    def push(self, frame: Result | Ok | Err | Pong | Welcome) -> bool:
        """Queue a frame; False if the connection is closing or was cut off as slow."""
        if not self.admit():
            return False
        encode_into(frame, self.outbox)
        self.account()
        self.queued += 1
        self.wake.set()
        return True

    async def writer(self) -> None:
        while True:
            if not self.outbox:
                if not self.protocol.live:
                    return
                self.wake = anyio.Event()
                await self.wake.wait()
                continue
            data, self.outbox = self.outbox, bytearray()
            self.account()
            self.queued = 0
            self._full_since = None
            # a fresh buffer took its place, so nothing mutates ``data`` while it is sent
            try:
                await self.stream.send(cast(bytes, data))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                self.close()
                self.scope.cancel()
                return

    def close(self) -> None:
        """End the connection: nothing more is read or queued, subscriptions go."""
        if self.protocol.live:
            self.protocol.close()
        self.drop_subscriptions()

    def kill(self, reason: BusError) -> None:
        """Cut the connection off now (slow consumer, fatal error)."""
        if not self.protocol.live:
            return
        log.warning(
            "bus.disconnect",
            uid=self.peer.uid,
            pid=self.peer.pid,
            reason=str(reason),
            code=reason.code,
        )
        self.close()
        self.server.disconnected_slow += isinstance(reason, SlowConsumer)
        self.scope.cancel()

    def drop_subscriptions(self) -> None:
        for sub in self.subs.values():
            self.server.bus.remove(sub)
        self.subs.clear()

    # -- inbound ----------------------------------------------------------

    async def run(self) -> None:
        reader = FrameReader(self.server.max_frame)
        async with anyio.create_task_group() as outer:
            outer.start_soon(self.writer)
            try:
                async with anyio.create_task_group() as tg:
                    self.tg = tg
                    await self._read_loop(reader)
                    tg.cancel_scope.cancel()
            finally:
                self.close()
                self.wake.set()
                # the writer flushes what is queued (e.g. a fatal error), briefly
                outer.cancel_scope.deadline = anyio.current_time() + 1.0

    async def _read_loop(self, reader: FrameReader) -> None:
        protocol = self.protocol
        while protocol.live:
            timeout = protocol.read_timeout(
                anyio.current_time(), busy=bool(self.subs or self.requests)
            )
            data = b""
            with anyio.move_on_after(timeout if timeout is not None else float("inf")):
                try:
                    data = await self.stream.receive(262144)
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    return
            if not data:
                self.push(protocol.timed_out().error)
                return
            for item in reader.feed(data):
                if not protocol.live:
                    return  # cut off while acting on an earlier frame of this read
                if isinstance(item, FrameTooLarge):
                    self.push(
                        Err(
                            "frame_too_large",
                            f"frame of {item.size} bytes is over the limit of {item.limit}",
                        )
                    )
                    continue
                if not self._handle(item):
                    return

    def _handle(self, body: memoryview) -> bool:
        """Act on one frame; False ends the connection."""
        frame: ClientFrame | FrameError
        try:
            frame = decode_client_frame(body)
        except FrameError as exc:
            frame = exc
        protocol = self.protocol
        identity = protocol.acts_as
        if identity is not None and type(frame) in ACTS:  # the hot path: no step built
            self._act(frame, identity)  # type: ignore[arg-type]
            return True
        step = protocol.receive(frame)
        if isinstance(step, Act):
            self._act(step.frame, step.identity)
            return True
        if isinstance(step, Answer):
            self.push(step.error)
            return True
        if isinstance(step, Refuse):
            self.push(step.error)
            return False
        if isinstance(step, WelcomeAdopted):
            self._welcome(
                step.identity, [] if step.identity.principal is None else [step.identity.principal]
            )
            return True
        return self._authorize(step.hello)

    def _act(self, frame: Pub | Sub | Unsub | Req | Reply | Ping, identity: Identity) -> None:
        bus = self.server.bus
        try:
            if isinstance(frame, Pub):
                payload = bytes(frame.payload)
                check_payload(payload)
                bus.publish_raw(
                    identity,
                    frame.topic,
                    payload,
                    correlation_id=frame.cid,
                    on_behalf_of=frame.obo,
                )
            elif isinstance(frame, Sub):
                self._subscribe(frame, identity)
            elif isinstance(frame, Unsub):
                sub = self.subs.pop(frame.sid, None)
                if sub is not None:
                    bus.remove(sub)
            elif isinstance(frame, Req):
                try:
                    check_payload(bytes(frame.payload))
                except FrameError as exc:
                    self.push(Result(frame.rid, code=exc.code, message=str(exc)))
                    return
                self.requests += 1
                self.tg.start_soon(self._request, frame, identity)
            elif isinstance(frame, Reply):
                payload = bytes(frame.payload)
                check_payload(payload)
                bus.reply_raw(identity, frame.to, payload)
            elif self.server.before_pong is None:
                self.push(Pong(frame.n))
            else:
                self.requests += 1
                self.tg.start_soon(self._pong_when_settled, frame.n)
        except BusError as exc:
            sid = frame.sid if isinstance(frame, Sub) else None
            self.push(Err(exc.code, str(exc), sid=sid))

    def _subscribe(self, frame: Sub, identity: Identity) -> None:
        if frame.sid in self.subs:
            raise FrameError(f"subscription id {frame.sid} is already in use")
        if len(self.subs) >= MAX_SUBSCRIPTIONS_PER_CONNECTION:
            raise FrameError(f"more than {MAX_SUBSCRIPTIONS_PER_CONNECTION} subscriptions")
        sub = _RemoteSubscription(self, frame.sid, frame.pattern, identity)
        self.server.bus.add(sub)
        self.subs[frame.sid] = sub
        self.push(Ok(frame.sid))

    async def _request(self, frame: Req, identity: Identity) -> None:
        try:
            env = await self.server.bus.request_raw(
                identity,
                frame.topic,
                bytes(frame.payload),
                deadline=None
                if frame.timeout is None
                else min(max(frame.timeout, 0.0), MAX_REQUEST_DEADLINE),
            )
        except BusError as exc:
            self.push(Result(frame.rid, code=exc.code, message=str(exc)))
        else:
            self.push(Result(frame.rid, env=env.to_wire()))
        finally:
            self.requests -= 1

    async def _pong_when_settled(self, n: int) -> None:
        """Answer a ping once the server's barrier says everything before it is settled."""
        try:
            hook = self.server.before_pong
            if hook is not None:
                try:
                    await hook()
                except BusError as exc:
                    self.push(Err(exc.code, str(exc)))
            self.push(Pong(n))
        finally:
            self.requests -= 1

    def _welcome(self, identity: Identity, principals: list[str]) -> None:
        self.push(
            Welcome(
                uid=self.peer.uid,
                source=identity.source,
                principal=identity.principal,
                principals=principals,
                max_payload=self.server.bus.max_payload,
                max_frame=self.server.max_frame,
            )
        )

    def _authorize(self, hello: Hello) -> bool:
        """Ask the server who this hello's peer is; welcome it, or refuse and end."""
        try:
            identity = self.server.authorize(self.peer, hello)
        except NotAuthorized as exc:
            log.warning(
                "bus.refused",
                uid=self.peer.uid,
                pid=self.peer.pid,
                role=hello.role,
                reason=str(exc),
            )
            self.push(Err(exc.code, str(exc), fatal=True))
            return False
        except BusError as exc:
            self.push(Err("bad_hello", str(exc), fatal=True))
            return False
        except Exception:
            log.exception("bus.authorize_failed", uid=self.peer.uid, pid=self.peer.pid)
            self.push(Err("not_authorized", "the server could not authorize this peer", fatal=True))
            return False
        self.protocol.open(hello, identity)
        self._welcome(identity, sorted(self.server.principals_of(self.peer.uid)))
        log.debug(
            "bus.connected",
            uid=self.peer.uid,
            pid=self.peer.pid,
            role=hello.role,
            source=identity.source,
        )
        return True


class BusServer:
    """Serves a :class:`Bus` to remote clients over a Unix socket."""

    def __init__(
        self,
        bus: Bus,
        path: Path,
        authorize: Authorize,
        *,
        principals_of: Callable[[int], frozenset[str]] = lambda uid: frozenset(),
        group: int | None = None,
        extra_group: int | None = None,
        hello_timeout: float = 5.0,
        idle_timeout: float = 600.0,
        slow_consumer_timeout: float = 2.0,
        max_connections_per_uid: int = 64,
        before_pong: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.bus = bus
        self.before_pong = before_pong
        """Awaited before each pong, so a client's flush() means "all I sent is settled"
        (the supervisor makes it wait for audit entries to be committed)."""
        self.path = path
        self.authorize = authorize
        self.principals_of = principals_of
        self.group = group
        self.extra_group = extra_group
        """A second group that may connect (with ``group`` set): an ACL entry on the
        socket and its folder (bus.unix.grant_group)."""
        self.hello_timeout = hello_timeout
        self.idle_timeout = idle_timeout
        self.slow_consumer_timeout = slow_consumer_timeout
        self.max_connections_per_uid = max_connections_per_uid
        self.max_frame = frame_limit(bus.max_payload)
        self.outbox_limit = max(_OUTBOX_MIN_BYTES, 4 * self.max_frame)
        """Bytes a connection's outbox may hold before it is cut off as a slow consumer."""
        self.uid_outbox_limit = max(UID_OUTBOX_BYTES, self.outbox_limit)
        """Bytes the outboxes of one user uid's connections may hold together."""
        self._uid_bytes: dict[int, int] = {}
        self.connections: set[_Connection] = set()
        self._per_uid: dict[int, int] = {}
        self.accepted = 0
        self.refused = 0
        self.disconnected_slow = 0

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Bind, signal readiness, accept until cancelled; then remove the socket."""
        prepare_socket_dir(self.path, self.group, self.extra_group)
        lock = SocketLock(self.path)
        lock.acquire()
        bound = False
        try:
            sock = bind_unix_socket(self.path, self.group, self.extra_group)
            bound = True
            try:
                async with anyio.create_task_group() as tg:
                    task_status.started()
                    log.info("bus.listening", path=str(self.path))
                    while True:
                        conn = await accept(sock)
                        tg.start_soon(self._serve_socket, conn)
            finally:
                anyio.notify_closing(sock)
                sock.close()
        finally:
            # only our own socket: a path bind refused (e.g. a regular file) is left alone
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            lock.release()

    async def _serve_socket(self, sock: socket.socket) -> None:
        stream = UnixStream(sock)
        try:
            peer = peer_credentials(sock)
        except OSError:
            await stream.aclose()
            return
        await self.serve_connection(stream, peer)

    def budgeted(self, conn: _Connection) -> bool:
        """A user's connection (not an admin's, a capsule's or the supervisor's own)."""
        protocol = conn.protocol
        identity = protocol.identity
        return identity is not None and identity.acl is not None and not protocol.adopted

    def charge(self, uid: int, delta: int) -> None:
        left = self._uid_bytes.get(uid, 0) + delta
        if left > 0:
            self._uid_bytes[uid] = left
        else:
            self._uid_bytes.pop(uid, None)

    def over_budget(self, conn: _Connection) -> bool:
        return self.budgeted(conn) and self._uid_bytes.get(conn.peer.uid, 0) > (
            self.uid_outbox_limit
        )

    async def serve_connection(self, stream: anyio.abc.SocketStream, peer: PeerCred) -> None:
        """Serve one already-connected stream (also used for inherited socketpairs)."""
        count = self._per_uid.get(peer.uid, 0)
        if count >= self.max_connections_per_uid:
            self.refused += 1
            buf = bytearray()
            encode_into(
                Err(
                    "not_authorized",
                    f"uid {peer.uid} has {count} connections (limit {self.max_connections_per_uid})",
                    fatal=True,
                ),
                buf,
            )
            with contextlib.suppress(Exception):
                with anyio.move_on_after(1):
                    await stream.send(bytes(buf))
            await stream.aclose()
            return
        self._per_uid[peer.uid] = count + 1
        self.accepted += 1
        conn = _Connection(self, stream, peer)
        try:
            await self._serve(conn)
        finally:
            conn.outbox = bytearray()  # what it never read is freed with it
            conn.account()
            left = self._per_uid.get(peer.uid, 1) - 1
            if left:
                self._per_uid[peer.uid] = left
            else:
                self._per_uid.pop(peer.uid, None)

    async def adopt(self, sock: socket.socket, identity: Identity, *, pid: int = 0) -> None:
        """Serve ``sock`` as ``identity`` until the peer closes it (or this is cancelled).

        For a connection the caller made and vouches for, such as its end of
        a socketpair whose other end it handed to a child: no ``SO_PEERCRED``,
        no ``authorize``, no per-uid limit, no hello deadline or idle timeout.
        The peer may send a hello (its role and principal are ignored) and
        gets a welcome naming ``identity``.  ``pid`` is the peer's, for logs.
        ``sock`` is closed when this returns.
        """
        stream = UnixStream(sock)
        peer = PeerCred(pid, os.getuid(), os.getgid())
        log.info("bus.adopted", pid=pid, source=identity.source)
        await self._serve(_Connection(self, stream, peer, identity))

    async def _serve(self, conn: _Connection) -> None:
        peer = conn.peer
        self.connections.add(conn)
        try:
            with conn.scope:
                await conn.run()
        except* (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # the peer went away underneath us
        except* Exception:
            # one connection's bug must never take the server down
            log.exception("bus.connection_failed", uid=peer.uid, pid=peer.pid)
        finally:
            conn.close()
            self.connections.discard(conn)
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()
            conn.protocol.finish()

    def reauthorize(self) -> int:
        """Check every live connection again (after a change of access rules).

        A connection whose identity would now differ, or that would be
        refused, is cut off; it may reconnect under the new rules.  Returns
        how many were cut off.
        """
        cut = 0
        for conn in list(self.connections):
            # adopted connections (no hello) keep the identity their owner fixed
            hello, before = conn.protocol.hello, conn.protocol.identity
            if hello is None or before is None:
                continue
            try:
                now = self.authorize(conn.peer, hello)
            except BusError as exc:
                conn.kill(NotAuthorized(f"access changed: {exc}"))
                cut += 1
                continue
            same_acl = (before.acl is None) == (now.acl is None) and (
                before.acl is None
                or now.acl is None
                or (before.acl.publish, before.acl.subscribe)
                == (now.acl.publish, now.acl.subscribe)
            )
            if (before.source, before.principal, before.uid) != (
                now.source,
                now.principal,
                now.uid,
            ) or not same_acl:
                conn.kill(NotAuthorized("access changed by a reload; reconnect"))
                cut += 1
        return cut

    def stats(self) -> dict[str, int]:
        return {
            "connections": len(self.connections),
            "accepted": self.accepted,
            "refused": self.refused,
            "disconnected_slow": self.disconnected_slow,
        }
