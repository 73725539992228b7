"""A supervisor as a node of a fleet: its NATS connection, the bucket, its heartbeats.

The thin async shell around :mod:`sage.fleet.nodes`.  :func:`join` connects to
NATS (nats-py) as the node's own user (its password, its NKey seed, or its user
credentials file, a JWT and its seed: each read from a 0600 file, never from the
config text or argv), opens the ``sage_nodes``
key-value bucket (creating it when it is not there) and writes the node's first
heartbeat; failing any of these, the supervisor does not start: NATS unreachable
within ``connect_timeout`` is :class:`FleetUnreachable` naming the URLs, a
refused user, password, key or JWT is :class:`FleetAuthFailed`; a ``[fleet]`` naming no
credentials is refused before any connection (:class:`~sage.errors.FleetNoAuth`, unless
``insecure_no_auth``: sage/fleet/auth.py), and with TLS configured no CONNECT is ever
written over a connection that is not TLS (:func:`new_client`).  After that a lost
connection is retried for ever by nats-py while the node goes on serving its
local sessions; heartbeats that fail meanwhile are logged once, and again when
they resume.  On leaving, the node writes a last record saying it stopped.

Each heartbeat carries the node's load, which the supervisor's ``load_source``
reads from the session runner (:func:`runner_load`, ``sage.v1.request.slots``),
and the principals its config names: what placement by load reads
(sage/fleet/placement.py).  A runner that does not answer within
:data:`LOAD_WAIT` seconds leaves the load out of that heartbeat, never the beat.  And
it carries what the node spent this period, by principal (``spend_source``), which
the other nodes count against budgets (sage/fleet/spend.py).

nats-py is imported only here (and by ``astrid doctor``'s sage/fleet/probe.py), and
only when ``[fleet]`` is set: a single host runs without it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import msgspec
import structlog

from bus import Bus, BusError, Identity
from sage import replies
from sage.config import FleetConfig
from sage.contract.codes import ErrorCode
from sage.contract.sessions import FLEET_STATUS_TOPIC, SlotsReply, Verb, request_topic
from sage.contract.usage import SpendReport
from sage.errors import (
    FleetAuthFailed,
    FleetError,
    FleetNotFound,
    FleetRecordError,
    FleetStreamUnsafe,
    FleetTlsFailed,
    FleetUnavailable,
    FleetUnreachable,
    NotInFleet,
    SageError,
)
from sage.files import read_private
from sage.fleet.auth import AuthMethod, auth_method, tls_on
from sage.fleet.claims import Claims
from sage.fleet.creds import UserCreds, parse_creds
from sage.fleet.fencing import may_have_been_lost
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.nodes import NodeLoad, NodeRecord, NodeTable, NodeView, decode_record
from sage.fleet.permissions import BUCKET, STREAM, TOOLS_BUCKET, inbox_prefix
from sage.fleet.routes import (
    REGISTRY,
    REGISTRY_STREAM,
    Claim,
    SessionEntry,
    check_name,
    decode_keyed,
)
from sage.fleet.states import MEMBERSHIP_TRANSITIONS, Machine, MembershipState
from sage.fleet.streams import STREAMS, StreamSpec, describe_unsafe, stream_config, unsafe
from sage.fleet.transcript_store import TranscriptStore
from sage.fleet.transcripts import TRANSCRIPTS
from sage.lease import beat_interval

if TYPE_CHECKING:
    from nats.aio.client import Client as Nats
    from nats.js.client import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = (
    "FleetMember",
    "is_auth_refusal",
    "join",
    "new_client",
    "refused_who",
    "runner_load",
    "sign_in_options",
    "status_reply",
)

log = structlog.get_logger("sage.fleet")

T = TypeVar("T")

BUCKET_WAIT = 4
"""How many ``connect_timeout`` periods a start waits for JetStream to serve the bucket."""

STATUS_TOPIC = FLEET_STATUS_TOPIC
LEAVE_STEP = 1.0  # seconds the last record may take at stop, and then the close
LOAD_WAIT = 1.0
"""Seconds a heartbeat waits for the node's load (at most half its interval)."""


def is_auth_refusal(exc: BaseException) -> bool:
    """Whether nats-py's ``exc`` is a server's refusal of the credentials."""
    text = str(exc).lower()
    return "authorization violation" in text or "authentication" in text


def _read_private(path: Path, what: str) -> bytes:
    """``path``'s bytes, if it is ours and 0600 (a FleetError naming the file if not)."""

    def error(message: str) -> SageError:
        return FleetError(f"fleet: {message}", code="fleet_credentials_invalid")

    try:
        return read_private(path, what=what, error=error, limit=64 * 1024)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None


def _read_secret(path: Path, what: str) -> str:
    """The one line of a password or seed file (ours, 0600)."""
    text = _read_private(path, what).decode(errors="replace").strip()
    if not text or "\n" in text:
        raise FleetError(
            f"fleet: {path}: the {what} must hold one non-empty line",
            code="fleet_credentials_invalid",
        )
    return text


def _nkey_seed(path: Path) -> str:
    """The seed in ``path``, checked to be a user's NKey seed (never echoed)."""
    import nkeys

    seed = _read_secret(path, "NKey seed file")
    try:
        pair = nkeys.from_seed(bytearray(seed.encode()))
        public = pair.public_key.decode()
        pair.wipe()
    except Exception:  # nkeys raises its own errors, and binascii's, for a bad seed
        raise FleetError(
            f"fleet: {path}: not an NKey seed", code="fleet_credentials_invalid"
        ) from None
    if not public.startswith("U"):
        raise FleetError(
            f"fleet: {path}: the NKey seed is not a user's (its key is {public[:1]}...)",
            code="fleet_credentials_invalid",
        )
    return seed


def _user_creds(path: Path) -> UserCreds:
    """The checked credentials of the ``.creds`` file at ``path`` (ours, 0600)."""
    data = _read_private(path, "credentials file")
    return parse_creds(data, str(path), now=time.time())


def _creds_options(creds: UserCreds) -> dict[str, Any]:
    """nats-py's callbacks for a JWT login: the JWT, and the nonce signed by its seed."""
    import base64

    import nkeys

    def user_jwt() -> bytes:
        return creds.jwt.encode()

    def sign(nonce: str) -> bytes:
        pair = nkeys.from_seed(bytearray(creds.seed.encode()))
        try:
            return base64.b64encode(pair.sign(nonce.encode()))
        finally:
            pair.wipe()

    return {"user_jwt_cb": user_jwt, "signature_cb": sign}


def _tls_context(config: FleetConfig, path_of: Callable[[str], Path]) -> ssl.SSLContext | None:
    if not tls_on(config):
        return None
    try:
        context = ssl.create_default_context(cafile=str(path_of(config.ca)) if config.ca else None)
        if config.cert:
            key = path_of(config.key)
            _read_private(key, "TLS key file")  # its mode and owner, before ssl reads it
            context.load_cert_chain(str(path_of(config.cert)), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise FleetError(f"fleet: TLS files: {describe(exc)}", code="fleet_tls_invalid") from exc
    return context


class FleetMember:
    """This node's place in the fleet, once joined (see :func:`join`)."""

    def __init__(
        self,
        nc: Nats,
        js: JetStreamContext,
        kv: KeyValue,
        config: FleetConfig,
        started_at: float,
        registry: KeyValue | None = None,
        transcripts: KeyValue | None = None,
        claims: bool = False,
        tools: KeyValue | None = None,
    ) -> None:
        self.config = config
        self.node = config.node
        self.nc = nc
        self.js = js
        self.registry = registry
        """The ``sage_sessions`` bucket: ``<node>.<sid>`` -> that node's entry
        (sage/fleet/routes.py)."""
        self.claims = Claims(js, self.node) if claims else None
        """Failover's claims in the ``sage_claims`` bucket: ``<node>.<sid>`` -> that
        node's claim, each write a compare-and-set over all of a session's keys
        (sage/fleet/claims.py)."""
        self.transcripts = None if transcripts is None else TranscriptStore(transcripts, self.node)
        """The ``sage_transcripts`` bucket: each node's copies of its sessions'
        conversations under its own name (sage/fleet/transcript_store.py)."""
        self.tools = tools
        """The ``sage_tools`` bucket: each node's tool catalogue under its name."""
        self._nc = nc
        self._js = js
        self._kv = kv
        self._started_at = started_at
        self.membership = Machine(
            f"node {self.node}", MEMBERSHIP_TRANSITIONS, MembershipState.JOINING
        )
        """This node in the fleet (sage/fleet/states.py): joining, live, failing, leaving, left."""
        self._last_beat = time.monotonic()
        self.beats = 0
        self.returned = anyio.Event()
        """Set when this node may have been judged lost and is back (a heartbeat after a
        gap or after failures): the router looks for sessions taken meanwhile
        (sage/fleet/fencing.py) and makes a new event."""
        self.load_source: Callable[[], Awaitable[NodeLoad | None]] | None = None
        """What the node's load is now (set by the supervisor); None: not said."""
        self.principals: Callable[[], list[str]] | None = None
        """The principals the node's config names now; None: not said."""
        self.renewed: list[Callable[[float], None]] = []
        """Told of each acknowledged heartbeat, with the monotonic time its write began
        (the supervisor grants its runner the lease: sage/lease.py)."""
        self.spend_source: Callable[[], SpendReport] | None = None
        """What the node spent this period (set by the fleet's router from the usage
        service: sage/fleet/spend.py); None: not said (no ledger)."""

    @property
    def nats(self) -> Nats:
        """The node's NATS connection (its own user's permissions)."""
        return self._nc

    @property
    def jetstream(self) -> JetStreamContext:
        return self._js

    @property
    def connected(self) -> bool:
        """Whether the NATS connection is up now (nats-py reconnects on its own)."""
        return bool(self._nc.is_connected)

    def record(self, *, stopped: bool = False, load: NodeLoad | None = None) -> NodeRecord:
        return NodeRecord(
            node=self.node,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self._started_at,
            heartbeat_at=time.time(),
            heartbeat=self.config.heartbeat,
            stopped=stopped,
            load=load,
            principals=None if self.principals is None else self.principals(),
            spend=None if self.spend_source is None else self.spend_source(),
        )

    async def load(self) -> NodeLoad | None:
        """The node's load now, from ``load_source``; None when it cannot say in time."""
        source = self.load_source
        if source is None:
            return None
        try:
            with anyio.fail_after(min(LOAD_WAIT, self.config.heartbeat / 2)):
                return await source()
        except (TimeoutError, SageError) as exc:
            log.debug("fleet.load_unknown", node=self.node, code=code_of(exc), error=describe(exc))
            return None

    async def beat(self) -> None:
        """Write this node's record once (a FleetError when it could not be); once NATS
        acknowledged it, tell :attr:`renewed` when the write began (the lease runs from
        there: sage/lease.py)."""
        load = await self.load()
        began = time.monotonic()  # before the record's heartbeat_at: the lease ends early
        record = self.record(load=load).encode()
        with nats_errors(f"the {BUCKET} bucket"):
            await self._kv.put(self.node, record)
        self.beats += 1
        for renewed in self.renewed:
            renewed(began)

    async def first_beat(self, within: float) -> None:
        """The first heartbeat, retried for ``within`` seconds: a bucket just created
        answers once its stream has a leader.  The last failure is raised."""
        deadline = anyio.current_time() + within
        while True:
            try:
                with (
                    nats_errors("the first heartbeat"),
                    anyio.fail_after(max(0.1, deadline - anyio.current_time())),
                ):
                    await self.beat()
                self.membership.move(MembershipState.LIVE)
                return
            except FleetError:
                if anyio.current_time() + 0.2 >= deadline:
                    raise
            await anyio.sleep(0.2)

    async def beat_every(self) -> None:
        """Heartbeat for ever; a failure is logged once, and its end once.  A beat after a
        gap or after failures sets :attr:`returned`."""
        self._last_beat = time.monotonic()
        every = beat_interval(self.config.heartbeat, self.config.lease)
        while True:
            await anyio.sleep(every)
            try:
                with nats_errors("a heartbeat"), anyio.fail_after(max(self.config.heartbeat, 1.0)):
                    await self.beat()
            except Exception as exc:  # the heartbeats outlive any error: logged, beaten again
                if self.membership.state is not MembershipState.FAILING:
                    log.warning(
                        "fleet.heartbeat_failed",
                        node=self.node,
                        code=code_of(exc),
                        error=describe(exc),
                    )
                self.membership.move(MembershipState.FAILING)
                continue
            failing = self.membership.state is MembershipState.FAILING
            now = time.monotonic()
            if may_have_been_lost(self._last_beat, now, self.config.lost_after, failing=failing):
                log.warning(
                    "fleet.may_have_been_lost",
                    node=self.node,
                    seconds=round(now - self._last_beat, 3),
                )
                self.returned.set()
            self._last_beat = now
            if failing:
                log.info("fleet.heartbeat_resumed", node=self.node)
            self.membership.move(MembershipState.LIVE)

    async def record_of(self, node: str) -> NodeRecord | None:
        """``node``'s current heartbeat record (None: none, or unusable); a FleetError when
        the bucket cannot be read."""
        entry = await _get(self._kv, node, f"the {BUCKET} bucket")
        if entry is None:
            return None
        try:
            return decode_record(node, entry.value or b"")
        except FleetRecordError:
            return None

    async def nodes(self, now: float | None = None) -> list[NodeView]:
        """Every node of the bucket, judged now; unusable records are logged and left out."""
        prefix = f"$KV.{BUCKET}."
        with nats_errors(f"the {BUCKET} bucket"):
            info = await self._js.stream_info(STREAM, subjects_filter=f"{prefix}>")
        table = NodeTable(self.config.lost_after)
        for subject in sorted(info.state.subjects or {}):
            key = subject.removeprefix(prefix)
            entry = await _get(self._kv, key, f"the {BUCKET} bucket")
            if entry is None:  # deleted (a delete marker)
                continue
            table.observe(key, entry.value or b"")
        for key, why in sorted(table.ignored.items()):
            log.warning("fleet.record_ignored", key=key, reason=why)
        for key, why in sorted(table.unknown_load.items()):
            log.warning("fleet.load_ignored", key=key, reason=why)
        return table.verdicts(time.time() if now is None else now)

    async def session_entries(self) -> list[tuple[str, SessionEntry, int]]:
        """Every entry of the registry: ``(sid, entry, revision)``, the entry naming the
        node whose key holds it; unusable ones are left out."""
        return await self._registry_read(f"$KV.{REGISTRY}.>")

    async def registry_revision(self) -> int:
        """The registry stream's last sequence: the revision of its latest put or delete
        (what a watch that delivered it has seen everything up to)."""
        with nats_errors(f"the {REGISTRY} bucket"):
            info = await self._js.stream_info(REGISTRY_STREAM)
        return int(info.state.last_seq or 0)

    async def entries_of(self, sid: str) -> dict[str, SessionEntry]:
        """Each node's registry entry for ``sid`` (node -> entry): the ``sage_sessions``
        keys ``*.<sid>`` (its ``sage_claims`` value is :meth:`claim_of`'s)."""
        found = await self._registry_read(f"$KV.{REGISTRY}.*.{check_name(sid, 'session id')}")
        return {entry.node: entry for _, entry, _ in found}

    async def _registry_read(self, subjects: str) -> list[tuple[str, SessionEntry, int]]:
        registry = self.registry
        if registry is None:
            return []
        prefix = f"$KV.{REGISTRY}."
        with nats_errors(f"the {REGISTRY} bucket"):
            info = await self._js.stream_info(REGISTRY_STREAM, subjects_filter=subjects)
        out: list[tuple[str, SessionEntry, int]] = []
        for subject in sorted(info.state.subjects or {}):
            key = subject.removeprefix(prefix)
            value = await _get(registry, key, f"the {REGISTRY} bucket")
            if value is None:  # deleted (a delete marker)
                continue
            keyed = decode_keyed(key, value.value or b"")
            if keyed is not None and value.revision is not None:
                out.append((keyed[0], keyed[1], value.revision))
        return out

    async def claim_of(self, principal: str, sid: str) -> tuple[Claim | None, int]:
        """The claim of ``principal``'s session ``sid``: the latest of its ``sage_claims``
        keys (its registry entries are :meth:`entries_of`'s) and the revision a write names
        to replace it (0: never written)."""
        claims = self.claims
        assert claims is not None
        return await claims.latest(principal, check_name(sid, "session id"))

    async def leave(self) -> None:
        """Say this node stopped (best effort, NATS may be gone), then close the connection;
        each step within LEAVE_STEP seconds."""
        self.membership.move(MembershipState.LEAVING)
        last = self.record(stopped=True).encode()
        with (
            anyio.move_on_after(LEAVE_STEP),
            contextlib.suppress(FleetError),
            nats_errors("the last record"),
        ):
            await self._kv.put(self.node, last)
        with (
            anyio.move_on_after(LEAVE_STEP),
            contextlib.suppress(FleetError),
            nats_errors("the connection's close"),
        ):
            await self._nc.close()
        self.membership.move(MembershipState.LEFT)


async def _get(kv: KeyValue, key: str, what: str) -> Any:
    """``key``'s entry in ``kv``; None when there is none (never written, or deleted)."""
    try:
        with nats_errors(what):
            return await kv.get(key)
    except FleetNotFound:
        return None


async def runner_load(bus: Bus, identity: Identity, deadline: float) -> NodeLoad | None:
    """The local session runner's load (``sage.v1.request.slots``, as an admin); None
    when no runner answers, or its answer is not a load."""
    try:
        answer = await bus.request(identity, request_topic(Verb.SLOTS), {}, deadline=deadline)
        data = msgspec.json.decode(answer.payload)
        if not isinstance(data, dict) or data.get("ok") is not True:
            return None
        slots = msgspec.convert(data, SlotsReply)
        return msgspec.convert(
            {
                "live": slots.live,
                "max_live": slots.max_live,
                "idle": slots.idle,
                "hibernated": slots.hibernated,
            },
            NodeLoad,
        )
    except (BusError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def sign_in_options(config: FleetConfig, path_of: Callable[[str], Path]) -> dict[str, Any]:
    """nats-py's ``connect`` options that sign the node in (its user and password, its
    NKey seed or its JWT; its TLS context; its inbox prefix, the only one its permissions
    allow), each secret read and checked from its file: a FleetError naming the file if
    one cannot be used, :class:`~sage.errors.FleetNoAuth` if none is named (and
    ``insecure_no_auth`` is not set).  Shared by the supervisor and ``astrid doctor``."""
    method = auth_method(config)
    options: dict[str, Any] = {
        "name": f"sage:{config.node}",
        "inbox_prefix": inbox_prefix(config.node),
    }
    if method is AuthMethod.PASSWORD:
        options["user"] = config.user_name
        options["password"] = _read_secret(path_of(config.password_file), "password file")
    elif method is AuthMethod.NKEY:
        options["nkeys_seed_str"] = _nkey_seed(path_of(config.nkey_seed))
    elif method is AuthMethod.CREDS:
        options.update(_creds_options(_user_creds(path_of(config.creds))))
    tls = _tls_context(config, path_of)
    if tls is not None:
        options["tls"] = tls
    return options


class PlainTextRefused(FleetTlsFailed, ssl.SSLError):
    """The server answered without TLS where the node wants it: nothing was sent.  An
    ``ssl.SSLError`` too, so nats-py and the connect loop count it as a TLS failure."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "no TLS"


def new_client(config: FleetConfig) -> Nats:
    """A nats-py client for ``config``'s node that, when it wants TLS (:func:`tls_on`),
    sends its CONNECT (the password, the JWT) only over TLS.

    nats-py upgrades a connection to TLS only when the server's INFO says
    ``tls_required``, whatever ``tls=`` or a ``tls://`` URL says: a server (or a
    man in the middle) that does not ask for TLS would get the credentials in clear.
    This client checks the transport right before the CONNECT is written, and refuses
    a plain one (an ``ssl.SSLError``: a TLS failure, ``fleet_tls_failed``).  It reads
    nats-py's private transport: a nats-py that changes it makes every TLS connection
    fail, never one succeed in clear (tests/integration/test_fleet_tls.py)."""
    from nats.aio.client import Client

    if not tls_on(config):
        return Client()

    class TlsOnlyClient(Client):
        def _connect_command(self) -> bytes:
            writer = getattr(self._transport, "_io_writer", None)
            ssl_object = writer.get_extra_info("ssl_object") if writer is not None else None
            if ssl_object is None:
                raise PlainTextRefused(
                    "the server answered without TLS, which [fleet] wants: the credentials"
                    " were not sent (does the server have a tls block, without allow_non_tls?)"
                )
            command: bytes = super()._connect_command()
            return command

    return TlsOnlyClient()


def refused_who(config: FleetConfig) -> str:
    """Whom the servers refused, and the likely why, for :class:`FleetAuthFailed`."""
    method = auth_method(config)
    if method is AuthMethod.CREDS:
        return (
            f"the user JWT of {config.creds}: a user its operator and accounts"
            " do not trust (or one revoked or without permission to connect)"
        )
    if method is AuthMethod.NKEY:
        return f"the NKey of {config.nkey_seed}: a key its servers do not know"
    if method is AuthMethod.NONE:
        return "a client without credentials (insecure_no_auth): the servers want a user"
    return f"user {config.user_name!r}: wrong user or password"


async def _connect(config: FleetConfig, path_of: Callable[[str], Path]) -> Nats:
    sign_in = sign_in_options(config, path_of)
    urls = ", ".join(config.urls)
    connecting = True
    refused: list[BaseException] = []
    last: list[BaseException] = []
    tls_failed: list[ssl.SSLError] = []  # any TLS failure while connecting: what to report
    auth_refused = anyio.Event()
    down = False  # each failed reconnect attempt is an error: one warning per outage

    async def on_error(exc: Exception) -> None:
        if connecting:
            last[:] = [exc]
            if isinstance(exc, ssl.SSLError):
                tls_failed[:] = [exc]
            if is_auth_refusal(exc):
                refused.append(exc)
                auth_refused.set()
            return
        (log.debug if down else log.warning)(
            "fleet.nats_error", node=config.node, error=describe(exc)
        )

    async def on_disconnected() -> None:
        nonlocal down
        if not connecting and not down:
            log.warning("fleet.disconnected", node=config.node)
        down = not connecting

    async def on_reconnected() -> None:
        nonlocal down
        down = False
        where = nc.connected_url
        log.info("fleet.reconnected", node=config.node, server=where.netloc if where else "")

    nc = new_client(config)
    options: dict[str, Any] = {
        **sign_in,
        "servers": config.urls,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.5,
        "connect_timeout": max(1, min(5, int(config.connect_timeout))),
    }
    async with anyio.create_task_group() as tg:

        async def stop_on_refusal() -> None:
            await auth_refused.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(stop_on_refusal)
        with anyio.move_on_after(config.connect_timeout):
            await nc.connect(**options)
        tg.cancel_scope.cancel()
    connecting = False
    if nc.is_connected and not refused:
        log.info("fleet.connected", node=config.node, server=_netloc(nc))
        return nc
    with (
        anyio.move_on_after(1.0, shield=True),
        contextlib.suppress(FleetError),
        nats_errors("the connection's close"),
    ):
        await nc.close()
    if refused:
        who = refused_who(config)
        raise FleetAuthFailed(f"fleet: NATS at {urls} refused {who} ({describe(refused[0])})")
    # a server that wants a client certificate may close the link after the handshake:
    # a later attempt then sees a broken pipe, but the TLS failure is the cause
    if tls_failed:
        raise FleetTlsFailed(f"fleet: TLS with NATS at {urls} failed: {describe(tls_failed[0])}")
    why = f": {describe(last[0])}" if last else ""
    raise FleetUnreachable(
        f"fleet: cannot reach NATS at {urls} within {config.connect_timeout:g} s{why}"
    )


def _netloc(nc: Nats) -> str:
    where = nc.connected_url
    return where.netloc if where else ""


async def _when_ready(config: FleetConfig, what: str, open_it: Callable[[], Awaitable[T]]) -> T:
    """``open_it()`` once JetStream serves it.  JetStream that is not ready yet (a cluster
    that just started or lost its leader: a timeout, no responders, unavailable, no peers
    yet for the replicas) is asked again for up to :data:`BUCKET_WAIT` x
    ``connect_timeout``; a refusal fails at once.  Either way a failure is a
    ``fleet_bucket_failed`` naming ``what``."""
    waited = False
    try:
        with nats_errors(f"the {what}"), anyio.fail_after(BUCKET_WAIT * config.connect_timeout):
            while True:
                try:
                    with nats_errors(f"the {what}"):
                        return await open_it()
                except FleetUnavailable as exc:
                    if not (exc.not_ready or exc.timed_out):
                        raise
                    if not waited:
                        log.warning(
                            "fleet.jetstream_not_ready", what=what, code=exc.code, error=str(exc)
                        )
                        waited = True
                    await anyio.sleep(0.5)
    except FleetError as exc:
        raise FleetError(
            f"fleet: cannot open the {what} (JetStream on, and the node's"
            f" permissions from `astrid fleet permissions --node {config.node}`?):"
            f" {describe(exc)}",
            code="fleet_bucket_failed",
        ) from exc


MIN_SERVER = (2, 11)
"""The oldest NATS server the fleet runs on: a claim's compare-and-set names a subject
filter (``Nats-Expected-Last-Subject-Sequence-Subject``), which older servers ignore."""


def _check_server(nc: Nats) -> None:
    """Refuse a server older than :data:`MIN_SERVER` (``fleet_server_unsupported``)."""
    version = nc.connected_server_version
    if (version.major, version.minor) < MIN_SERVER:
        raise FleetError(
            f"fleet: NATS at {_netloc(nc)} is version {version}; the fleet needs"
            f" {MIN_SERVER[0]}.{MIN_SERVER[1]} or newer on every server (a claim's"
            " compare-and-set names a subject filter, which older servers ignore)",
            code="fleet_server_unsupported",
        )


async def open_stream(js: JetStreamContext, config: FleetConfig, spec: StreamSpec) -> Any:
    """``spec``'s stream, made with the fleet's safe configuration when it is not there,
    once JetStream serves it; its info.  A stream found weaker than ``spec`` wants
    (sage/fleet/streams.py) is :class:`~sage.errors.FleetStreamUnsafe` naming each
    setting and the fix; one that cannot be read or made is ``fleet_bucket_failed``."""
    what = f"{spec.bucket} bucket" if spec.bucket else f"{spec.name} stream"

    async def open_it() -> Any:
        try:
            with nats_errors(f"the {what}"):
                return await js.stream_info(spec.name)
        except FleetNotFound:
            pass
        try:
            with nats_errors(f"the {what}"):
                info = await js.add_stream(stream_config(spec, config.replicas))
            log.info(
                "fleet.bucket_created", bucket=spec.bucket or spec.name, replicas=config.replicas
            )
            return info
        except FleetUnavailable as exc:
            if exc.not_ready or exc.timed_out:
                raise
            # another node made it meanwhile (or one that differs): what is there is checked
            with nats_errors(f"the {what}"):
                return await js.stream_info(spec.name)

    info = await _when_ready(config, what, open_it)
    found = unsafe(spec, info.config, config.replicas)
    if found:
        raise FleetStreamUnsafe(f"fleet: {describe_unsafe(spec, found)}")
    return info


async def _open_streams(nc: Nats, config: FleetConfig) -> JetStreamContext:
    """Every stream of the fleet (sage/fleet/streams.py), made or checked."""
    js = nc.jetstream(timeout=max(1.0, min(5.0, config.connect_timeout)))
    for spec in STREAMS:
        await open_stream(js, config, spec)
    return js


async def _bucket(js: JetStreamContext, bucket: str) -> KeyValue:
    with nats_errors(f"the {bucket} bucket"):
        return await js.key_value(bucket)


@contextlib.asynccontextmanager
async def join(
    config: FleetConfig,
    path_of: Callable[[str], Path],
    *,
    started_at: float,
    principals: Callable[[], list[str]] | None = None,
) -> AsyncIterator[FleetMember]:
    """Be a node of the fleet for the ``async with`` block (raises a FleetError if not).

    ``principals``: the names of the principals the node authenticates, as its config
    says now (each heartbeat record declares them).  A ``[fleet]`` without credentials is
    refused before any connection (:class:`~sage.errors.FleetNoAuth`), unless it says
    ``insecure_no_auth = true``: then this start logs ``fleet.insecure_no_auth``."""
    if auth_method(config) is AuthMethod.NONE:
        log.warning(
            "fleet.insecure_no_auth",
            node=config.node,
            hint="[fleet] insecure_no_auth = true: this node signs in to NATS with no"
            " credentials, so any client of the servers may act as any node; give it"
            " password_file, nkey_seed or creds and remove insecure_no_auth",
        )
    nc = await _connect(config, path_of)
    try:
        _check_server(nc)
        js = await _open_streams(nc, config)
        try:
            kv, registry, transcripts, tools = [
                await _bucket(js, bucket)
                for bucket in (BUCKET, REGISTRY, TRANSCRIPTS, TOOLS_BUCKET)
            ]
        except FleetError as exc:
            raise FleetError(
                f"fleet: cannot open the buckets: {describe(exc)}", code="fleet_bucket_failed"
            ) from exc
        member = FleetMember(
            nc, js, kv, config, started_at, registry, transcripts, claims=True, tools=tools
        )
        member.principals = principals
        try:
            await member.first_beat(max(1.0, config.connect_timeout))
        except FleetError as exc:
            raise FleetError(
                f"fleet: the first heartbeat of node {config.node!r} was not stored"
                f" (may its user put $KV.{BUCKET}.{config.node}?): {describe(exc)}",
                code="fleet_heartbeat_failed",
            ) from exc
    except BaseException:  # not handled: the connection closed, re-raised
        with (
            anyio.move_on_after(1.0, shield=True),
            contextlib.suppress(FleetError),
            nats_errors("the connection's close"),
        ):
            await nc.close()
        raise
    log.info("fleet.joined", node=config.node, bucket=BUCKET, heartbeat=config.heartbeat)
    try:
        yield member
    finally:
        with anyio.CancelScope(shield=True):  # a stop cancels the node: it still says so
            await member.leave()
        log.info("fleet.left", node=config.node)


async def status_reply(
    member: FleetMember | None, deadline: float = 3.0, *, principal: str | None = None
) -> dict[str, Any]:
    """The answer to ``sage.v1.request.fleet.status`` for a caller acting for
    ``principal`` (None: an admin).  A principal sees its own name among a node's
    principals, never the others' (as the runner's principals listing)."""
    if member is None:
        return replies.from_error(
            NotInFleet("this supervisor is not in a fleet (its config has no [fleet])")
        )
    if not member.connected:
        return replies.error(
            ErrorCode.FLEET_UNAVAILABLE,
            f"cannot read the {BUCKET} bucket now: NATS is not connected",
        )
    try:
        with nats_errors(f"the {BUCKET} bucket"), anyio.fail_after(deadline):
            nodes = await member.nodes()
            sessions = await member.session_entries()
    except FleetError as exc:
        return replies.error(
            ErrorCode.FLEET_UNAVAILABLE, f"cannot read the {BUCKET} bucket now: {describe(exc)}"
        )
    per_node: dict[str, int] = {}
    for _, entry, _ in sessions:
        per_node[entry.node] = per_node.get(entry.node, 0) + 1
    rows = [{**view.to_builtins(), "sessions": per_node.get(view.node, 0)} for view in nodes]
    if principal is not None:
        for row in rows:
            if row["principals"] is not None:
                row["principals"] = [name for name in row["principals"] if name == principal]
    return replies.ok(node=member.node, lost_after=member.config.lost_after, nodes=rows)
