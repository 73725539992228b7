"""The bus over a real Unix socket: a real BusServer, real BusClients and raw frames."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest

from bus import BlockingClient, BusClient, BusServer, PeerCred
from bus.acl import Identity
from bus.broker import Bus
from bus.errors import (
    BusError,
    ConnectionLost,
    NoResponders,
    NotAuthorized,
    PayloadTooLarge,
    TopicError,
)
from bus.wire import (
    Err,
    FrameReader,
    Hello,
    Ok,
    Ping,
    Pong,
    Result,
    ServerFrame,
    Sub,
    Welcome,
    decode_server_frame,
    encode,
)

pytestmark = pytest.mark.anyio

ROLES = ("cli", "capsule", "emit")


@pytest.fixture
def sock_path() -> Iterator[Path]:
    """A socket path in a short private directory (AF_UNIX paths must be < 108 bytes)."""
    base = tempfile.mkdtemp(prefix="sg", dir="/tmp")
    try:
        yield Path(base) / "run" / "bus.sock"
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Gate:
    """The authorize callback: role -> source, uid -> allowed principals; records peers."""

    def __init__(self) -> None:
        self.peers: list[PeerCred] = []
        self.allowed: dict[int, tuple[str, ...]] = {os.getuid(): ("alice", "ops")}

    def __call__(self, peer: PeerCred, hello: Hello) -> Identity:
        self.peers.append(peer)
        if hello.role not in ROLES:
            raise NotAuthorized(f"unknown role {hello.role!r}")
        mine = self.allowed.get(peer.uid, ())
        principal = hello.principal or (mine[0] if mine else None)
        if principal not in mine:
            raise NotAuthorized(f"uid {peer.uid} may not act for {principal!r}")
        return Identity(f"{hello.role}:{peer.uid}", principal=principal, uid=peer.uid)


@contextlib.asynccontextmanager
async def serving(path: Path, bus: Bus | None = None, **kw: Any) -> AsyncIterator[BusServer]:
    server = BusServer(bus or Bus(), path, kw.pop("authorize", None) or Gate(), **kw)
    async with anyio.create_task_group() as tg:
        await tg.start(server.serve)
        yield server
        # Let connections see their peers' EOF before cancelling: anyio 4.16's asyncio
        # UNIX stream raises InvalidStateError in a loop callback when a pending receive
        # is cancelled in the same iteration that the socket turns readable.
        with anyio.move_on_after(2):
            while server.connections:  # noqa: ASYNC110 - the server offers no event for this
                await anyio.sleep(0.005)
        tg.cancel_scope.cancel()


class Raw:
    """A hand-driven connection: send raw bytes or frames, read decoded server frames."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.reader = FrameReader(10 * 1024 * 1024)
        self.frames: list[ServerFrame] = []

    async def send(self, data: bytes | Any) -> None:
        await self.stream.send(data if isinstance(data, bytes) else encode(data))

    async def recv(self, within: float = 5.0) -> ServerFrame:
        with anyio.fail_after(within):
            while not self.frames:
                data = await self.stream.receive()
                for body in self.reader.feed(data):
                    assert isinstance(body, memoryview)
                    self.frames.append(decode_server_frame(body))
        return self.frames.pop(0)

    async def closed(self, within: float = 5.0) -> bool:
        """True once the server has closed the connection (frames before EOF are kept)."""
        with anyio.fail_after(within):
            while True:
                try:
                    data = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return True
                for body in self.reader.feed(data):
                    assert isinstance(body, memoryview)
                    self.frames.append(decode_server_frame(body))


@contextlib.asynccontextmanager
async def raw(path: Path, *, hello: bool = True) -> AsyncIterator[Raw]:
    async with await anyio.connect_unix(path) as stream:
        conn = Raw(stream)
        if hello:
            await conn.send(Hello(role="cli"))
            assert isinstance(await conn.recv(), Welcome)
        yield conn


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


# -- identity and delivery ------------------------------------------------------


async def test_envelopes_carry_the_servers_identity_not_the_clients_claims(
    sock_path: Path,
) -> None:
    """source/principal on delivered envelopes come from authorize, not the hello or payload."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path, role="cli", name="sub") as sub_client,
        BusClient.connect(sock_path, role="capsule", name="root", principal="ops") as pub,
    ):
        assert pub.welcome is not None
        assert pub.welcome.source == f"capsule:{os.getuid()}"
        assert pub.welcome.principal == "ops"
        assert pub.welcome.uid == os.getuid()
        sub = await sub_client.subscribe("events.>")
        pub.publish("events.one", {"source": "forged", "principal": "root"})
        await pub.flush()
        with anyio.fail_after(5):
            env = await sub.get()
    assert env.topic == "events.one"
    assert env.source == f"capsule:{os.getuid()}"
    assert env.principal == "ops"
    assert env.data() == {"source": "forged", "principal": "root"}


async def test_on_behalf_of_only_for_a_publisher_without_a_principal(sock_path: Path) -> None:
    """A connection without a principal may scope an envelope to one; one with a
    principal cannot put another's name on what it publishes."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path, role="cli", name="sub") as sub_client,
        BusClient.connect(sock_path, role="cli", name="plain") as plain,
        BusClient.connect(sock_path, role="cli", name="ops", principal="ops") as ops,
    ):
        sub = await sub_client.subscribe("events.>")
        plain.publish("events.scoped", {}, on_behalf_of="alice")
        await plain.flush()
        ops.publish("events.claimed", {}, on_behalf_of="alice")
        await ops.flush()
        with anyio.fail_after(5):
            scoped, claimed = await sub.get(), await sub.get()
        plain.publish("events.bad", {}, on_behalf_of="../x")
        with pytest.raises(BusError, match="invalid frame"):
            await plain.flush()
    assert (scoped.topic, scoped.principal) == ("events.scoped", "alice")
    assert (claimed.topic, claimed.principal) == ("events.claimed", "ops")


async def test_wildcard_subscription_over_the_socket(sock_path: Path) -> None:
    """A '*' subscription gets matching topics only, in publish order."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path) as a,
        BusClient.connect(sock_path) as b,
    ):
        sub = await a.subscribe("job.*.done")
        for topic in ("job.1.started", "job.1.done", "job.2.x.done", "job.2.done"):
            b.publish(topic, topic)
        await b.flush()
        with anyio.fail_after(5):
            got = [(await sub.get()).data() for _ in range(2)]
        b.publish("job.3.done", "last")
        await b.flush()
        with anyio.fail_after(5):
            assert (await sub.get()).data() == "last"
    assert got == ["job.1.done", "job.2.done"]


async def test_peercred_uid_is_ours(sock_path: Path) -> None:
    """authorize sees the kernel's SO_PEERCRED uid and pid of the connecting process."""
    gate = Gate()
    async with serving(sock_path, authorize=gate), BusClient.connect(sock_path):
        pass
    assert gate.peers
    assert gate.peers[0].uid == os.getuid()
    assert gate.peers[0].pid == os.getpid()
    assert gate.peers[0].gid == os.getgid()


# -- errors that leave the connection up ----------------------------------------


@pytest.mark.parametrize("topic", ["a.*", "a.>", "a..b", "a b"])
async def test_bad_publish_topic_errors_on_flush_and_connection_survives(
    sock_path: Path, topic: str
) -> None:
    """A publish to a wildcard or malformed topic raises TopicError on flush; later publishes work."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path) as listener,
        BusClient.connect(sock_path) as client,
    ):
        sub = await listener.subscribe("ok")
        client.publish(topic, 1)
        with pytest.raises(TopicError):
            await client.flush()
        client.publish("ok", 2)
        await client.flush()
        with anyio.fail_after(5):
            assert (await sub.get()).data() == 2


async def test_payload_over_limit_errors_and_connection_survives(sock_path: Path) -> None:
    """A payload over the welcome's max_payload is refused by the client before it is
    sent (a publish, a request: never a wait for an answer the server will not give);
    one the server gets anyway is refused there; the connection stays usable."""
    async with (
        serving(sock_path, Bus(max_payload=1000)),
        BusClient.connect(sock_path) as listener,
        BusClient.connect(sock_path) as client,
    ):
        assert client.welcome is not None
        assert client.welcome.max_payload == 1000
        sub = await listener.subscribe("t")
        big = b'"' + b"x" * 2000 + b'"'
        with pytest.raises(PayloadTooLarge, match="over the supervisor's limit of 1000"):
            client.publish_raw("t", big)
        with anyio.fail_after(2), pytest.raises(PayloadTooLarge, match="the request on 't'"):
            await client.request_raw("t", big, deadline=60)
        client.welcome = None  # as a client that does not check would
        client.publish_raw("t", big)
        with pytest.raises(PayloadTooLarge):
            await client.flush()
        client.publish("t", "small")
        await client.flush()
        with anyio.fail_after(5):
            assert (await sub.get()).data() == "small"


async def test_subscribe_to_malformed_pattern_raises(sock_path: Path) -> None:
    """subscribe() with a bad pattern raises TopicError and the client keeps working."""
    async with serving(sock_path), BusClient.connect(sock_path) as client:
        with pytest.raises(TopicError):
            await client.subscribe("a.>.b")
        sub = await client.subscribe("a.>")
        client.publish("a.b", 1)
        with anyio.fail_after(5):
            assert (await sub.get()).data() == 1


async def test_oversized_frame_is_refused_and_next_frame_handled(sock_path: Path) -> None:
    """A frame over max_frame gets err frame_too_large; the next frame on the same socket works."""
    async with serving(sock_path, Bus(max_payload=1000)) as server, raw(sock_path) as conn:
        size = server.max_frame + 1
        await conn.send(struct.pack(">I", size))
        for _ in range(size // 4096 + 1):
            await conn.send(b"z" * min(4096, size))
            size -= min(4096, size)
            if not size:
                break
        await conn.send(Ping(7))
        err = await conn.recv()
        assert isinstance(err, Err)
        assert err.code == "frame_too_large"
        assert not err.fatal
        assert await conn.recv() == Pong(7)


async def test_malformed_json_is_bad_frame_and_connection_survives(sock_path: Path) -> None:
    """A frame of broken JSON gets err bad_frame (not fatal); a ping afterwards is answered."""
    async with serving(sock_path), raw(sock_path) as conn:
        await conn.send(_frame(b'{"t":"pub","topic":'))
        await conn.send(Ping(1))
        err = await conn.recv()
        assert isinstance(err, Err)
        assert (err.code, err.fatal) == ("bad_frame", False)
        assert await conn.recv() == Pong(1)


async def test_unknown_frame_type_is_reported(sock_path: Path) -> None:
    """A frame with an unknown 't' gets err unknown_type and the connection survives."""
    async with serving(sock_path), raw(sock_path) as conn:
        await conn.send(_frame(b'{"t":"shutdown"}'))
        await conn.send(Ping(2))
        err = await conn.recv()
        assert isinstance(err, Err)
        assert (err.code, err.fatal) == ("unknown_type", False)
        assert await conn.recv() == Pong(2)


async def test_second_hello_is_an_error(sock_path: Path) -> None:
    """A hello after the welcome is refused with bad_frame, not a new identity."""
    async with serving(sock_path), raw(sock_path) as conn:
        await conn.send(Hello(role="capsule", principal="ops"))
        await conn.send(Ping(3))
        err = await conn.recv()
        assert isinstance(err, Err)
        assert err.code == "bad_frame"
        assert await conn.recv() == Pong(3)


# -- fatal errors and timeouts --------------------------------------------------


@pytest.mark.parametrize(
    "first",
    [encode(Ping(1)), encode(Sub(1, ">")), _frame(b"{not json"), _frame(b'{"t":"nope"}')],
)
async def test_first_frame_not_a_hello_is_fatal(sock_path: Path, first: bytes) -> None:
    """Anything but a hello first gets a fatal bad_hello and the server closes the socket."""
    async with serving(sock_path), raw(sock_path, hello=False) as conn:
        await conn.send(first)
        assert await conn.closed()
        (err,) = conn.frames
        assert isinstance(err, Err)
        assert (err.code, err.fatal) == ("bad_hello", True)


async def test_no_hello_within_timeout_closes(sock_path: Path) -> None:
    """A peer that sends nothing is disconnected after hello_timeout."""
    async with serving(sock_path, hello_timeout=0.2), raw(sock_path, hello=False) as conn:
        start = time.monotonic()
        assert await conn.closed(within=5)
        assert 0.15 <= time.monotonic() - start < 3
        assert [type(f) for f in conn.frames] == [Err]
        assert conn.frames[0].fatal  # type: ignore[union-attr]


async def test_idle_connection_is_closed(sock_path: Path) -> None:
    """A connected peer with no subscriptions and no traffic is closed after idle_timeout."""
    async with serving(sock_path, idle_timeout=0.2), raw(sock_path) as conn:
        assert await conn.closed(within=5)


@pytest.mark.parametrize(("role", "principal"), [("root", None), ("cli", "mallory")])
async def test_refused_hello_is_fatal_not_authorized(
    sock_path: Path, role: str, principal: str | None
) -> None:
    """An unknown role or a principal the uid may not act for ends in fatal not_authorized."""
    async with serving(sock_path):
        with pytest.raises(NotAuthorized):
            async with BusClient.connect(sock_path, role=role, principal=principal):
                pytest.fail("connected despite refusal")
        async with raw(sock_path, hello=False) as conn:
            await conn.send(Hello(role=role, principal=principal))
            assert await conn.closed()
            (err,) = conn.frames
            assert isinstance(err, Err)
            assert (err.code, err.fatal) == ("not_authorized", True)


async def test_connection_cap_per_uid(sock_path: Path) -> None:
    """Past max_connections_per_uid a new connection is refused; closing one frees a slot."""
    async with serving(sock_path, max_connections_per_uid=2) as server:
        async with BusClient.connect(sock_path), BusClient.connect(sock_path):
            with pytest.raises(NotAuthorized, match="limit 2"):
                async with BusClient.connect(sock_path):
                    pytest.fail("third connection accepted")
            assert server.refused == 1
            assert server.stats()["connections"] == 2
        with anyio.fail_after(5):
            while server.connections:  # noqa: ASYNC110 - the server offers no event for this
                await anyio.sleep(0.01)
        async with BusClient.connect(sock_path) as again:
            await again.flush()
        assert server.accepted == 3


async def test_slow_consumer_is_disconnected_and_publisher_never_blocks(sock_path: Path) -> None:
    """A subscriber that never reads is cut off and counted; each publish returns at once."""
    bus = Bus(queue_size=8)
    async with (
        serving(sock_path, bus, slow_consumer_timeout=0.2) as server,
        raw(sock_path) as conn,
    ):
        await conn.send(Sub(1, "flood"))
        assert await conn.recv() == Ok(1)
        payload = b'"' + b"p" * 4096 + b'"'
        pub = Identity("test")
        worst = 0.0
        published = 0
        with anyio.fail_after(20):
            while not server.disconnected_slow:
                for _ in range(50):
                    t0 = time.perf_counter()
                    bus.publish_raw(pub, "flood", payload)
                    worst = max(worst, time.perf_counter() - t0)
                    published += 1
                await anyio.sleep(0.005)
        assert server.disconnected_slow == 1
        assert bus.stats().subscriptions == 0
        assert worst < 0.05
        assert published > 8
        # the connection is gone: the socket reaches EOF once buffered frames are read
        assert await conn.closed(within=10)
        bus.publish_raw(pub, "flood", payload)  # nobody left to deliver to, no error


async def test_one_users_unread_outboxes_are_bounded_together(sock_path: Path) -> None:
    """Each connection's outbox has a cap; a user's connections together have one too,
    so many connections that never read cannot make the supervisor hold gigabytes."""
    from bus.acl import Acl

    def user(peer: PeerCred, hello: Hello) -> Identity:
        acl = Acl(publish=["demo.>"], subscribe=["demo.>"])
        return Identity(f"cli:{peer.uid}", principal="alice", acl=acl, uid=peer.uid)

    bus = Bus(queue_size=1_000_000)  # only the byte budgets cut anyone off here
    async with serving(sock_path, bus, authorize=user, slow_consumer_timeout=60) as server:
        server.outbox_limit = 4 * 1024 * 1024
        server.uid_outbox_limit = 6 * 1024 * 1024
        async with contextlib.AsyncExitStack() as stack:
            conns = [await stack.enter_async_context(raw(sock_path)) for _ in range(4)]
            for conn in conns:
                await conn.send(Sub(1, "demo.>"))
                assert await conn.recv() == Ok(1)
            payload = b'"' + b"p" * 65536 + b'"'
            pub = Identity("test")
            held = []
            with anyio.fail_after(20):
                while not server.disconnected_slow:
                    for _ in range(16):
                        bus.publish_raw(pub, "demo.x", payload, on_behalf_of="alice")
                    held.append(sum(len(c.outbox) for c in server.connections))
                    await anyio.lowlevel.checkpoint()
            # no single connection reached its own 4 MiB cap: the uid's budget cut in
            assert max(held) <= server.uid_outbox_limit + 16 * (len(payload) + 256) * 4
            assert server.disconnected_slow >= 1
        with anyio.fail_after(5):
            while server._uid_bytes:  # noqa: ASYNC110 - freed as the connections end
                await anyio.sleep(0.01)


# -- request / reply --------------------------------------------------------------


async def test_request_reply_across_two_clients(sock_path: Path) -> None:
    """A request from one client is answered by a subscriber on another client."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path, role="capsule", principal="ops") as responder,
        BusClient.connect(sock_path) as requester,
    ):
        sub = await responder.subscribe("svc.echo")

        async def serve() -> None:
            async for env in sub:
                assert env.source == f"cli:{os.getuid()}"
                responder.reply(env, {"echo": env.data()})

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            reply = await requester.request("svc.echo", [1, "two"], deadline=5)
            second = await requester.request("svc.echo", 3, deadline=5)
            tg.cancel_scope.cancel()
    assert reply.data() == {"echo": [1, "two"]}
    assert second.data() == {"echo": 3}
    assert reply.source == f"capsule:{os.getuid()}"
    assert reply.principal == "ops"


async def test_requests_begun_together_are_answered_each_and_a_forgotten_one_dropped(
    sock_path: Path,
) -> None:
    """begin_request sends at once: two requests on their way without a task each; the
    second's answer, awaited after the first's, is there; a forgotten one's answer
    arrives later and is dropped, and the connection goes on."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path, role="capsule", principal="ops") as responder,
        BusClient.connect(sock_path) as requester,
    ):
        slow = await responder.subscribe("svc.slow")
        fast = await responder.subscribe("svc.fast")

        async def serve(sub: Any, delay: float) -> None:
            async for env in sub:
                await anyio.sleep(delay)
                responder.reply(env, {"answer": env.data()})

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve, slow, 0.2)
            tg.start_soon(serve, fast, 0.0)
            first = requester.begin_request("svc.slow", b'"one"', deadline=5)
            second = requester.begin_request("svc.fast", b'"two"', deadline=5)
            with anyio.fail_after(2):
                assert (await first.result()).data() == {"answer": "one"}
                assert (await second.result()).data() == {"answer": "two"}
            forgotten = requester.begin_request("svc.slow", b'"three"', deadline=5)
            forgotten.forget()
            await anyio.sleep(0.4)  # its answer came meanwhile, and was dropped
            with anyio.fail_after(2):
                again = await requester.request("svc.fast", "four", deadline=5)
            assert again.data() == {"answer": "four"}
            with pytest.raises(NoResponders):
                await requester.begin_request("nobody.home", b"1", deadline=5).result()
            tg.cancel_scope.cancel()


async def test_no_responders_over_the_socket(sock_path: Path) -> None:
    """A request to a topic nobody subscribes to raises NoResponders at once."""
    async with serving(sock_path), BusClient.connect(sock_path) as client:
        with anyio.fail_after(2):
            with pytest.raises(NoResponders):
                await client.request("nobody.home", 1, deadline=30)
        await client.flush()


async def test_request_deadline_over_the_socket(sock_path: Path) -> None:
    """A request whose responder never answers fails with a timeout error after its deadline."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path) as silent,
        BusClient.connect(sock_path) as client,
    ):
        await silent.subscribe("svc.silent")
        start = time.monotonic()
        with pytest.raises(BusError) as info:
            await client.request("svc.silent", 1, deadline=0.2)
        assert info.value.code == "timeout"
        assert time.monotonic() - start < 3


# -- the socket file --------------------------------------------------------------


async def test_socket_and_directory_modes(sock_path: Path) -> None:
    """The socket is 0600 and its directory 0700, owned by us."""
    async with serving(sock_path):
        info = os.lstat(sock_path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(sock_path.parent).st_mode) == 0o700
        assert os.lstat(sock_path.parent).st_uid == os.getuid()


async def test_second_server_on_same_path_fails(sock_path: Path) -> None:
    """A second server on a path another server holds fails on the lock; the first keeps serving."""
    async with serving(sock_path):
        second = BusServer(Bus(), sock_path, Gate())
        with pytest.raises(BusError, match="another server"):
            await second.serve()
        async with BusClient.connect(sock_path) as client:
            await client.flush()


async def test_stale_socket_is_replaced(sock_path: Path) -> None:
    """A socket file left by a dead server is replaced and the new server accepts clients."""
    os.mkdir(sock_path.parent, mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(sock_path))
    dead.close()
    assert stat.S_ISSOCK(os.lstat(sock_path).st_mode)
    with pytest.raises(ConnectionLost):
        async with BusClient.connect(sock_path):
            pass
    async with serving(sock_path), BusClient.connect(sock_path) as client:
        await client.flush()


async def test_non_socket_file_is_not_replaced(sock_path: Path) -> None:
    """A regular file at the socket path is refused, not deleted."""
    os.mkdir(sock_path.parent, mode=0o700)
    with open(sock_path, "w") as f:  # noqa: ASYNC230 - test setup, tiny file
        f.write("keep me")
    with pytest.raises(BusError, match="not a socket"):
        await BusServer(Bus(), sock_path, Gate()).serve()
    with open(sock_path) as f:  # noqa: ASYNC230 - tiny file
        assert f.read() == "keep me"


async def test_socket_removed_after_server_cancelled(sock_path: Path) -> None:
    """Cancelling the server task removes the socket file, and clients then cannot connect."""
    async with serving(sock_path):
        assert os.path.exists(sock_path)  # noqa: ASYNC240 - a stat, not I/O
    assert not os.path.exists(sock_path)  # noqa: ASYNC240
    with pytest.raises(ConnectionLost):
        async with BusClient.connect(sock_path):
            pass


async def test_client_sees_server_shutdown(sock_path: Path) -> None:
    """A remote subscription ends with ConnectionLost when the server goes away."""
    server = BusServer(Bus(), sock_path, Gate())
    async with anyio.create_task_group() as outer:
        server_scope = anyio.CancelScope()

        async def run_server(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            with server_scope:
                await server.serve(task_status=task_status)

        await outer.start(run_server)
        async with BusClient.connect(sock_path) as client:
            sub = await client.subscribe("x")
            server_scope.cancel()
            with anyio.fail_after(5), pytest.raises(ConnectionLost):
                await sub.get()


@pytest.mark.anyio
async def test_reauthorize_cuts_connections_whose_access_changed(sock_path: Path) -> None:
    """After the rules change, a connection that would now be refused is cut off; others stay."""
    gate = Gate()
    async with (
        serving(sock_path, authorize=gate) as server,
        BusClient.connect(sock_path, principal="ops") as ops,
        BusClient.connect(sock_path, principal="alice") as alice,
    ):
        sub = await ops.subscribe("demo.>")
        await alice.subscribe("demo.>")
        assert server.reauthorize() == 0
        gate.allowed = {os.getuid(): ("alice",)}  # "ops" is taken away
        assert server.reauthorize() == 1
        with pytest.raises(BusError):
            with anyio.fail_after(5):
                await sub.get()
        alice.publish("demo.still", {})
        await alice.flush()


# -- payloads that are not JSON text --------------------------------------------


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b'"\xff"', "bad_payload"),
        (b'{"a": "\xc3"}', "bad_payload"),
        (b'"\\ud800"', "bad_frame"),  # the frame decoder checks escapes itself
        (b'["\\udfff x"]', "bad_frame"),
    ],
    ids=["not-utf8", "truncated-utf8", "lone-surrogate", "lone-low-surrogate"],
)
async def test_a_payload_that_is_not_json_text_is_refused_and_nothing_is_delivered(
    sock_path: Path, payload: bytes, code: str
) -> None:
    """pub, req and reply with such a payload are each refused; subscribers see nothing
    and the connection goes on."""
    bus = Bus()
    watcher = bus.subscribe(">", Identity("watcher"))
    async with serving(sock_path, bus), raw(sock_path) as conn:
        await conn.send(_frame(b'{"t":"pub","topic":"demo.bad","payload":' + payload + b"}"))
        await conn.send(Ping(1))
        err = await conn.recv()
        assert isinstance(err, Err)
        assert (err.code, err.fatal) == (code, False)
        assert await conn.recv() == Pong(1)
        await conn.send(
            _frame(b'{"t":"req","rid":5,"topic":"demo.v1.echo","payload":' + payload + b"}")
        )
        answer = await conn.recv()
        if code == "bad_payload":  # a request the server could read gets its result
            assert isinstance(answer, Result)
            assert (answer.rid, answer.code, answer.env) == (5, code, None)
        else:
            assert isinstance(answer, Err)
            assert answer.code == code
        await conn.send(_frame(b'{"t":"reply","to":"x","payload":' + payload + b"}"))
        await conn.send(Ping(2))
        err = await conn.recv()
        assert isinstance(err, Err)
        assert err.code == code
        assert await conn.recv() == Pong(2)
    assert watcher.drain() == []
    assert bus.published == 0


async def test_astrid_bus_sub_survives_an_envelope_that_is_not_json_text(
    sock_path: Path, tmp_path: Path
) -> None:
    """An in-process publisher is not checked by the server: astrid bus sub prints such an
    envelope as a JSON line flagged bad_payload, and goes on to the next."""
    import json
    import subprocess
    import sys

    config = tmp_path / "s.toml"
    config.write_text(f'[supervisor]\nstate_dir = "{tmp_path}"\nsocket = "{sock_path}"\n')
    bus = Bus()
    async with serving(sock_path, bus):
        proc = await anyio.open_process(
            [
                sys.executable,
                "-m",
                "sage.cli",
                "bus",
                "sub",
                ">",
                "-n",
                "2",
                "--config",
                str(config),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        async with proc:
            with anyio.fail_after(20):
                while not bus.has_subscribers("demo.bad"):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
                bus.publish_raw(Identity("capsule:buggy"), "demo.bad", b'"\xff"')
                bus.publish_raw(Identity("capsule:buggy"), "demo.good", b'{"ok": 1}')
                await proc.wait()
            assert proc.stdout is not None
            assert proc.stderr is not None
            out = (await _read_all(proc.stdout)).decode()
            err = await _read_all(proc.stderr)
    assert proc.returncode == 0, err
    bad, good = (json.loads(line) for line in out.splitlines())
    assert (bad["topic"], bad["payload"], bad["bad_payload"]) == ("demo.bad", '"\ufffd"', True)
    assert (good["topic"], good["payload"]) == ("demo.good", {"ok": 1})


async def _read_all(stream: anyio.abc.ByteReceiveStream) -> bytes:
    data = b""
    with contextlib.suppress(anyio.EndOfStream):
        while True:
            data += await stream.receive()
    return data


# -- the blocking client: one request at a time, no event loop ---------------------------


def _ask(path: Path, topic: str, payload: Any, deadline: float = 5.0, **kw: Any) -> Any:
    """A BlockingClient request (in a worker thread: it blocks); the reply or the error."""
    try:
        with BlockingClient.connect(path, **kw) as client:
            return client.request(topic, payload, deadline=deadline)
    except BusError as exc:
        return exc


async def test_the_blocking_client_asks_and_gets_the_reply(sock_path: Path) -> None:
    """Its request is answered like BusClient's: the reply envelope, the responder's identity."""
    async with (
        serving(sock_path),
        BusClient.connect(sock_path, role="capsule", principal="ops") as responder,
    ):
        sub = await responder.subscribe("svc.echo")

        async def serve() -> None:
            async for env in sub:
                assert env.source == f"cli:{os.getuid()}"
                responder.reply(env, {"echo": env.data()})

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            reply = await anyio.to_thread.run_sync(_ask, sock_path, "svc.echo", [1, "two"])
            tg.cancel_scope.cancel()
    assert reply.data() == {"echo": [1, "two"]}
    assert reply.source == f"capsule:{os.getuid()}"
    assert reply.principal == "ops"


async def test_the_blocking_client_raises_what_the_server_answered(sock_path: Path) -> None:
    """No responders, a deadline passed, a refused hello: the errors BusClient raises."""
    async with serving(sock_path), BusClient.connect(sock_path) as silent:
        await silent.subscribe("svc.silent")
        nobody = await anyio.to_thread.run_sync(_ask, sock_path, "nobody.home", 1)
        assert isinstance(nobody, NoResponders)
        start = time.monotonic()
        late = await anyio.to_thread.run_sync(
            lambda: _ask(sock_path, "svc.silent", 1, deadline=0.2)
        )
        assert isinstance(late, BusError)
        assert late.code == "timeout"
        assert time.monotonic() - start < 3
        refused = await anyio.to_thread.run_sync(
            lambda: _ask(sock_path, "svc.echo", 1, principal="mallory")
        )
        assert isinstance(refused, NotAuthorized)


async def test_the_blocking_client_says_why_it_cannot_connect(sock_path: Path) -> None:
    """No socket: the same one line as BusClient's, not an OSError."""
    missing = await anyio.to_thread.run_sync(_ask, sock_path, "svc.echo", 1)
    assert isinstance(missing, ConnectionLost)
    assert str(missing) == f"no supervisor socket at {sock_path} (is it running?)"
    with pytest.raises(ConnectionLost) as caught:
        async with BusClient.connect(sock_path):
            pass
    assert str(caught.value) == str(missing)
