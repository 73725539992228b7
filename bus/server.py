"""The bus's Unix-socket server: one task group per connection, frames in and out.

The server binds a path socket (never the abstract namespace) in a private
directory, under umask 0077, after taking a lock file so that a stale socket
is replaced only when no other server holds it.  Each peer's uid comes from
``SO_PEERCRED``; an ``authorize`` callback maps it (and the principal the
hello asks for) to an :class:`Identity`, so a client never asserts who it
is.  :meth:`BusServer.adopt` serves a connection the caller made itself (the
supervisor's end of a worker capsule's socketpair) under an identity the
caller fixed, skipping ``SO_PEERCRED`` and ``authorize``.  Delivery to a
remote subscriber goes through the connection's outbox, which one writer
task flushes in batches; a connection whose outbox stays over its limit past
the slow-consumer deadline is disconnected.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import anyio
import anyio.abc
import structlog

from bus.acl import Identity
from bus.broker import Bus
from bus.envelope import Envelope
from bus.errors import BusError, FrameError, NotAuthorized, SlowConsumer
from bus.stream import UnixStream, accept
from bus.wire import (
    PROTOCOL_VERSION,
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

__all__ = ("BusServer", "PeerCred", "SocketLock", "peer_credentials")

log = structlog.get_logger("bus.server")

MAX_SUBSCRIPTIONS_PER_CONNECTION = 1024
MAX_REQUEST_DEADLINE = 300.0
"""The longest deadline a remote client may ask for, in seconds."""
_OUTBOX_MIN_BYTES = 64 * 1024 * 1024  # like NATS's default pending limit
UID_OUTBOX_BYTES = 256 * 1024 * 1024
"""Bytes the outboxes of one user uid's connections may hold together: without it a
uid's 64 connections that never read could make the supervisor hold 4 GiB."""


@dataclass(frozen=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred:
    """The peer's pid, uid and gid as the kernel reports them."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


Authorize = Callable[[PeerCred, Hello], Identity]
"""Map a verified peer and its hello to an identity, or raise NotAuthorized."""


class SocketLock:
    """The lock file beside a socket: held while a server owns the path."""

    def __init__(self, socket_path: Path) -> None:
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BusError(
                    f"another server holds {self.path} (is the supervisor already running?)"
                ) from exc
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def ensure_private_dir(directory: Path, *, group: int | None = None) -> None:
    """Make ``directory`` ours and private: created 0700 (0750 with a group).

    A folder this call creates gets exactly that mode.  One that already
    exists is tightened only if it is ours and nobody else can write to it;
    a folder others can write to (``/tmp``, say) is refused, never chmod'ed.
    """
    existed = directory.exists()
    old = os.umask(0o077)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise BusError(f"cannot create {directory}: {exc.strerror}") from exc
    finally:
        os.umask(old)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise BusError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise BusError(f"{directory} belongs to uid {info.st_uid}, not to us")
    mode = stat.S_IMODE(info.st_mode)
    if existed and mode & 0o022:
        raise BusError(f"{directory} is writable by others (mode {mode:04o}); use a private folder")
    want = 0o750 if group is not None else 0o700
    if mode != want:
        os.chmod(directory, want)
    if group is not None:
        os.chown(directory, -1, group)


def prepare_socket_dir(path: Path, group: int | None) -> None:
    """The socket's directory: private, see :func:`ensure_private_dir`."""
    ensure_private_dir(path.parent, group=group)


def bind_unix_socket(path: Path, group: int | None) -> socket.socket:
    """Bind ``path`` under umask 0077; 0600, or 0660 with a group."""
    if len(os.fsencode(path)) > 107:
        raise BusError(f"socket path too long (over 107 bytes): {path}")
    with contextlib.suppress(FileNotFoundError):
        info = path.lstat()
        if not stat.S_ISSOCK(info.st_mode):
            raise BusError(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o077)
    try:
        sock.bind(os.fspath(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    if group is not None:
        os.chown(path, -1, group)
        os.chmod(path, 0o660)
    else:
        os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


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
    """One client connection: its identity, subscriptions and outbox.

    An adopted connection (``identity`` given) starts with its identity: a
    hello is optional, answered with a welcome for that identity whatever it
    claims, and neither the hello deadline nor the idle timeout applies.
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
        self.identity: Identity | None = identity
        self.adopted = identity is not None
        self._welcomed = False
        self.hello: Hello | None = None
        self.subs: dict[int, _RemoteSubscription] = {}
        self.requests = 0
        self.outbox = bytearray()
        self._charged = 0  # bytes of the outbox counted against the uid's budget
        self.queued = 0
        self.wake = anyio.Event()
        self._full_since: float | None = None
        self._closing = False
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
        if self._closing:
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
                if self._closing:
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
                self._closing = True
                self.drop_subscriptions()
                self.scope.cancel()
                return

    def kill(self, reason: BusError) -> None:
        """Cut the connection off now (slow consumer, fatal error)."""
        if self._closing:
            return
        log.warning(
            "bus.disconnect",
            uid=self.peer.uid,
            pid=self.peer.pid,
            reason=str(reason),
            code=reason.code,
        )
        self._closing = True
        self.drop_subscriptions()
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
                self._closing = True
                self.drop_subscriptions()
                self.wake.set()
                # the writer flushes what is queued (e.g. a fatal error), briefly
                outer.cancel_scope.deadline = anyio.current_time() + 1.0

    async def _read_loop(self, reader: FrameReader) -> None:
        server = self.server
        hello_by = anyio.current_time() + server.hello_timeout
        while not self._closing:
            if self.identity is None:
                # one deadline for the whole handshake, however the bytes trickle in
                timeout: float | None = max(0.0, hello_by - anyio.current_time())
            elif self.subs or self.requests or self.adopted:
                timeout = None
            else:
                timeout = server.idle_timeout
            data = b""
            with anyio.move_on_after(timeout if timeout is not None else float("inf")):
                try:
                    data = await self.stream.receive(262144)
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    return
            if not data:
                if self.identity is None:
                    message = f"no hello within {server.hello_timeout:g} s"
                else:
                    message = f"no activity within {timeout:g} s"
                self.push(Err("timeout", message, fatal=True))
                return
            for item in reader.feed(data):
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
        try:
            frame = decode_client_frame(body)
        except FrameError as exc:
            if self.identity is None:
                self.push(Err("bad_hello", f"expected a hello frame first: {exc}", fatal=True))
                return False
            self.push(Err(exc.code, str(exc)))
            return True
        if self.identity is None:
            return self._hello(frame)
        identity = self.identity
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
                    return True
                self.requests += 1
                self.tg.start_soon(self._request, frame, identity)
            elif isinstance(frame, Reply):
                payload = bytes(frame.payload)
                check_payload(payload)
                bus.reply_raw(identity, frame.to, payload)
            elif isinstance(frame, Ping):
                if self.server.before_pong is None:
                    self.push(Pong(frame.n))
                else:
                    self.requests += 1
                    self.tg.start_soon(self._pong_when_settled, frame.n)
            elif self.adopted and not self._welcomed:
                return self._welcome_adopted(frame, identity)
            else:
                self.push(Err("bad_frame", "hello may be sent only once"))
        except BusError as exc:
            sid = frame.sid if isinstance(frame, Sub) else None
            self.push(Err(exc.code, str(exc), sid=sid))
        return True

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

    def _version_ok(self, frame: Hello) -> bool:
        if frame.version == PROTOCOL_VERSION:
            return True
        self.push(
            Err(
                "bad_hello",
                f"protocol version {frame.version} is not supported (server speaks {PROTOCOL_VERSION})",
                fatal=True,
            )
        )
        return False

    def _welcome_adopted(self, frame: Hello, identity: Identity) -> bool:
        """Answer an adopted peer's hello: its claims (role, principal) change nothing."""
        if not self._version_ok(frame):
            return False
        self._welcomed = True
        self.push(
            Welcome(
                uid=self.peer.uid,
                source=identity.source,
                principal=identity.principal,
                principals=[] if identity.principal is None else [identity.principal],
                max_payload=self.server.bus.max_payload,
                max_frame=self.server.max_frame,
            )
        )
        return True

    def _hello(self, frame: object) -> bool:
        if not isinstance(frame, Hello):
            self.push(Err("bad_hello", "the first frame must be a hello", fatal=True))
            return False
        if not self._version_ok(frame):
            return False
        try:
            identity = self.server.authorize(self.peer, frame)
        except NotAuthorized as exc:
            log.warning(
                "bus.refused",
                uid=self.peer.uid,
                pid=self.peer.pid,
                role=frame.role,
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
        self.identity = identity
        self.hello = frame
        self.push(
            Welcome(
                uid=self.peer.uid,
                source=identity.source,
                principal=identity.principal,
                principals=sorted(self.server.principals_of(self.peer.uid)),
                max_payload=self.server.bus.max_payload,
                max_frame=self.server.max_frame,
            )
        )
        log.info(
            "bus.connected",
            uid=self.peer.uid,
            pid=self.peer.pid,
            role=frame.role,
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
        prepare_socket_dir(self.path, self.group)
        lock = SocketLock(self.path)
        lock.acquire()
        bound = False
        try:
            sock = bind_unix_socket(self.path, self.group)
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
        identity = conn.identity
        return identity is not None and identity.acl is not None and not conn.adopted

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
            conn.drop_subscriptions()
            self.connections.discard(conn)
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()

    def reauthorize(self) -> int:
        """Check every live connection again (after a change of access rules).

        A connection whose identity would now differ, or that would be
        refused, is cut off; it may reconnect under the new rules.  Returns
        how many were cut off.
        """
        cut = 0
        for conn in list(self.connections):
            # adopted connections (conn.hello is None) keep the identity their owner fixed
            if conn.identity is None or conn.hello is None:
                continue
            try:
                now = self.authorize(conn.peer, conn.hello)
            except BusError as exc:
                conn.kill(NotAuthorized(f"access changed: {exc}"))
                cut += 1
                continue
            before = conn.identity
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
