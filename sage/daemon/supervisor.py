"""The supervisor: boots the parts of sage, serves until told to stop, stops them in order.

Start-up order: state folder (0700), with ``[fleet]`` joining the fleet (sage/fleet:
a node that cannot join does not start), state store, audit log (with ``[fleet]`` streamed
to JetStream: sage/fleet/audit_stream.py), bus, socket server, the
audit sink (every envelope on ``*.v1.audit.>`` is appended), the status
responder, in a fleet the session router (sage/fleet/router.py), capsules (in-process, or child processes for ``[worker]``
manifests: sage.daemon.workers).  Readiness is reported through ``task_status.started()``
and sd_notify ``READY=1``.  SIGTERM or SIGINT stops everything within
``shutdown_grace`` seconds (``STOPPING=1``), removing the socket; SIGHUP
reloads what can be reloaded (principals, admins, user ACLs, log level) and
keeps the running config when the new file is bad.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from bus import (
    Acl,
    Bus,
    BusError,
    BusServer,
    Envelope,
    FrameError,
    Identity,
    NotAuthorized,
    PeerCred,
)
from bus.unix import ensure_private_dir
from bus.wire import Hello
from sage import replies
from sage.audit import AuditLog, AuditReceipt, load_signing_key, max_unsigned_for
from sage.capsule.manifest import load_manifest
from sage.capsule.privileges import check_granted
from sage.config import Config, load_config
from sage.contract.sessions import LEASE_TOPIC, SUPERVISOR_SOURCE, LeaseGrant
from sage.daemon.capsule_host import CapsuleRunner, capsule_folder, missing_capsule
from sage.daemon.capsule_set import CAPSULE_REQUESTS, CapsuleSet, Source
from sage.daemon.install import installed_folders, worker_manifest
from sage.daemon.instance import InstanceLock
from sage.daemon.sdnotify import Notifier, watchdog_interval
from sage.daemon.workers import WorkerRunner, WorkerSandbox, capsule_uids
from sage.errors import AuditError, ConfigError, SageError
from sage.fleet import STATUS_TOPIC as FLEET_STATUS_TOPIC
from sage.fleet import FleetMember, join, status_reply
from sage.fleet.audit_stream import VERIFY_FLEET_TOPIC, FleetAudit, verify_fleet_reply
from sage.fleet.fence_keeper import FenceKeeper
from sage.fleet.member import LOAD_WAIT, runner_load
from sage.fleet.nodes import NodeLoad
from sage.fleet.router import Router
from sage.fleet.tools import FleetTools
from sage.logs import configure_logging, log_loop_errors
from sage.security.denials import DenialLimiter
from sage.security.runas import SessionUids, access_group, socket_group
from sage.security.runas import enabled as runs_children_as_principals
from sage.state import StateStore
from sage.usage.spending import Spending, spending

__all__ = ("ROLES", "AuditLimiter", "Supervisor")

log = structlog.get_logger("sage.daemon.supervisor")

ROLES = ("cli", "capsule", "emit")
STATUS_TOPIC = "sage.v1.request.status"
AUDIT_PATTERN = "*.v1.audit.>"
SEALED_TOPICS = ("sage.v1.request.install",)
"""Requests that may carry a secret (an API key): never delivered off the process."""
VERSION = "0.1.0"
CAPSULE_READY_TIMEOUT = 10.0  # seconds READY waits for capsules to say they serve


RATE_LIMITED_TOPIC = "sage.v1.audit.audit_rate_limited"
"""The sink's own entry for audit envelopes it dropped over a publisher's rate."""


class _AuditSink:
    """A bus subscriber that hands every audit envelope to the audit log.

    Who may publish on an audit topic at all is the bus's rule
    (``Bus(protected=...)``: the supervisor, admins, capsules whose manifest
    names an audit pattern).  Here each publisher (source and principal) is
    held to ``rate`` entries a second with bursts of ``burst``
    (:class:`AuditLimiter`); the envelopes over it are dropped, counted, and
    reported by an entry of the sink's own (:data:`RATE_LIMITED_TOPIC`),
    itself limited.  Nothing else is ever dropped.
    """

    def __init__(self, audit: AuditLog, rate: float = 500.0, burst: int = 2000) -> None:
        self.pattern = AUDIT_PATTERN
        self.owner = Identity("audit")
        self.delivered = 0
        self.dropped = 0
        self.rate_limited = 0
        self._audit = audit
        self._last: AuditReceipt | None = None
        self.limiter = AuditLimiter(rate, burst)

    def deliver(self, envelope: Envelope) -> bool:
        now = time.monotonic()
        principal = envelope.principal or ""
        admitted = self.limiter.admit((envelope.source, principal), now)
        self.report(now)
        if not admitted:
            self.rate_limited += 1
            return False
        try:
            data: Any = msgspec.json.decode(envelope.payload)
        except (msgspec.DecodeError, RecursionError):
            data = envelope.payload.decode(errors="replace")
        session = data.get("session_id", "") if isinstance(data, dict) else ""
        return self._submit(
            envelope.topic,
            principal,
            session if isinstance(session, str) else "",
            {"source": envelope.source, "payload": data},
        )

    def report(self, now: float) -> None:
        """Write the rate-limit reports that are due (also called once a second)."""
        for (source, principal), dropped in self.limiter.reports(now):
            self._submit(
                RATE_LIMITED_TOPIC,
                principal,
                "",
                {
                    "source": self.owner.source,
                    "payload": {
                        "source": source,
                        "principal": principal or None,
                        "dropped": dropped,
                        "rate": self.limiter.rate,
                        "burst": self.limiter.burst,
                    },
                },
            )

    async def report_every_second(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self.report(time.monotonic())

    def _submit(self, kind: str, principal: str, session: str, payload: Any) -> bool:
        try:
            self._last = self._audit.submit(kind, principal, session, payload)
        except AuditError as exc:
            self.dropped += 1
            log.error("audit.not_recorded", topic=kind, error=str(exc))
            return False
        self.delivered += 1
        return True

    async def settled(self) -> None:
        """Wait until every entry handed over so far is committed (entries commit in order)."""
        last = self._last
        if last is not None and not last.done():
            try:
                await last.wait()
            except AuditError as exc:
                raise BusError(f"audit log failed: {exc}") from exc


class AuditLimiter:
    """A token bucket per publisher for audit entries (pure: the caller's clock).

    Each key holds up to ``burst`` tokens, refilled at ``rate`` a second; an
    entry takes one or is dropped.  Drops are counted per key and handed out
    by :meth:`reports` at most once per key per ``report_every`` seconds, and
    at most ``report_burst`` reports (refilled at ``report_rate`` a second)
    over all keys: a report that is not due yet stays counted for the next.
    """

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        report_every: float = 1.0,
        report_rate: float = 5.0,
        report_burst: int = 20,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.report_every = report_every
        self.report_rate = report_rate
        self.report_burst = report_burst
        self._buckets: dict[tuple[str, str], list[float]] = {}
        """key -> [tokens, refilled at, dropped not yet reported, last report at]"""
        self._report_tokens = float(report_burst)
        self._report_at = 0.0
        self._unreported = 0

    def admit(self, key: tuple[str, str], now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) > 10_000:
                self._prune()
            bucket = self._buckets[key] = [float(self.burst), now, 0.0, -self.report_every]
        tokens = min(float(self.burst), bucket[0] + (now - bucket[1]) * self.rate)
        bucket[1] = now
        if tokens >= 1.0:
            bucket[0] = tokens - 1.0
            return True
        bucket[0] = tokens
        bucket[2] += 1
        self._unreported += 1
        return False

    def reports(self, now: float) -> list[tuple[tuple[str, str], int]]:
        """``(key, dropped)`` for each key whose drops are due to be reported now."""
        if not self._unreported:
            return []
        self._report_tokens = min(
            float(self.report_burst),
            self._report_tokens + (now - self._report_at) * self.report_rate,
        )
        self._report_at = now
        due: list[tuple[tuple[str, str], int]] = []
        for key, bucket in self._buckets.items():
            if self._report_tokens < 1.0:
                break
            if bucket[2] and now - bucket[3] >= self.report_every:
                due.append((key, int(bucket[2])))
                self._unreported -= int(bucket[2])
                bucket[2] = 0.0
                bucket[3] = now
                self._report_tokens -= 1.0
        return due

    def pending(self) -> int:
        """Drops not reported yet."""
        return self._unreported

    def _prune(self) -> None:
        """Forget full buckets with nothing to report (their state is the default)."""
        for key in [k for k, b in self._buckets.items() if not b[2] and b[0] >= self.burst - 1]:
            del self._buckets[key]


class Supervisor:
    """One running sage daemon."""

    def __init__(self, config: Config, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.identity = Identity(SUPERVISOR_SOURCE)
        self.bus = Bus(
            max_payload=config.bus.max_payload,
            queue_size=config.bus.queue_size,
            request_timeout=config.bus.request_timeout,
            sealed=SEALED_TOPICS,
            protected=(AUDIT_PATTERN,),
        )
        self.server: BusServer | None = None
        self.sink: _AuditSink | None = None
        self.audit: AuditLog | None = None
        self.state: StateStore | None = None
        """Records that outlive the supervisor (sessions, settings, tokens: later issues)."""
        self.started_at = 0.0
        self.fleet: FleetMember | None = None
        """This node's membership of a fleet (``[fleet]``), once joined; None: a single host."""
        self.fleet_audit: FleetAudit | None = None
        self.spending: Spending | None = None
        self.fence = FenceKeeper()
        """The fence process of a fleet node (sage/fence.py), started once joined."""
        """With a fleet: the audit log streamed to JetStream, and the fleet's verify."""
        self.notifier = Notifier()
        self.reloads = 0
        self.session_uids = SessionUids(config)
        """Whose children run as which uid (supervisor root): their ``emit`` access."""
        self._outer: anyio.CancelScope | None = None
        self._denials = DenialLimiter()
        self._capsule_uids = capsule_uids(config)
        self.capsules = CapsuleSet(
            self._capsule, self._publish_audit, lambda: self.config.state_dir
        )
        for name in config.supervisor.capsules:
            missing = missing_capsule(name)  # as config check says it, with the nearest name
            if missing is not None:
                raise ConfigError(missing)
            try:
                self.capsules.add(Source(name))
            except ConfigError as exc:
                if "named twice" not in str(exc):
                    raise
                raise ConfigError("supervisor.capsules: a capsule is named twice") from None
        for folder in installed_folders(config.state_dir):
            try:
                self.capsules.add(Source(str(folder), installed=True))
            except ConfigError as exc:  # one broken install does not stop the supervisor
                log.error(
                    "supervisor.installed_capsule_skipped", folder=str(folder), error=str(exc)
                )

    def _capsule(self, source: Source) -> CapsuleRunner:
        """The runner of one capsule: in-process, or a worker process (installed ones always)."""
        installed = source.installed
        folder = capsule_folder(source.entry)
        manifest = load_manifest(folder)
        if installed:
            # third-party code: its ACL may reach beyond its tools only as an admin granted
            check_granted(
                self.config.state_dir,
                manifest.name,
                manifest.publish.patterns,
                manifest.subscribe.patterns,
            )
            manifest = worker_manifest(manifest, folder)
        if manifest.worker is not None:
            sandbox = None
            if installed:  # third-party code: confined, under a uid of its own (as root)
                caps = self.config.capsules
                sandbox = WorkerSandbox(
                    uids=self._capsule_uids,
                    network=manifest.sandbox.network,
                    tmp_bytes=caps.tmp_bytes,
                    max_processes=caps.max_processes,
                )
            return WorkerRunner(
                self.bus,
                manifest,
                self._publish_audit,
                folder=folder,
                server_of=lambda: self.server,
                config_of=lambda: self.config,
                state_of=lambda: self.state,
                publish=self._publish_audit,
                sandbox=sandbox,
            )
        return CapsuleRunner(
            self.bus,
            manifest,
            self._publish_audit,
            config_of=lambda: self.config,
            state_of=lambda: self.state,
            publish=self._publish_audit,
        )

    # -- identity -----------------------------------------------------------

    def authorize(self, peer: PeerCred, hello: Hello) -> Identity:
        """Map a verified peer uid and its hello to what it may do on the bus."""
        config = self.config
        if hello.role not in ROLES:
            raise FrameError(f"unknown role {hello.role!r} (expected one of {', '.join(ROLES)})")
        admin = config.is_admin(peer.uid)
        allowed = config.principals_for_uid(peer.uid)
        if not admin and not allowed:
            # a principal's claude child (supervisor root): its hooks' astrid-emit only
            session_of = self.session_uids.principal_of(peer.uid)
            if session_of is None:
                raise NotAuthorized(f"uid {peer.uid} may not act for any principal")
            if hello.role != "emit":
                raise NotAuthorized(
                    f"uid {peer.uid} runs principal {session_of!r}'s sessions: role emit only"
                )
            if hello.principal not in (None, session_of):
                raise NotAuthorized(f"uid {peer.uid} may not act for principal {hello.principal!r}")
            return Identity(
                source=f"emit:{peer.uid}",
                principal=session_of,
                acl=Acl(publish=["sage.v1.hook.>"], subscribe=[]),
                uid=peer.uid,
            )
        principal = hello.principal
        if principal is not None and principal not in allowed:
            names = ", ".join(sorted(allowed)) or "none"
            if admin:  # an admin may see every name: say it is not there
                raise NotAuthorized(f"unknown principal {principal!r} (configured: {names})")
            # the same answer whether it exists or not: no probing for other principals
            raise NotAuthorized(
                f"uid {peer.uid} may not act for principal {principal!r} (it may for: {names})"
            )
        if principal is None and not admin:
            if len(allowed) != 1:
                names = ", ".join(sorted(allowed))
                raise NotAuthorized(
                    f"uid {peer.uid} acts for several principals; name one of: {names}"
                )
            (principal,) = allowed
        source = f"{hello.role}:{peer.uid}"
        if hello.role == "emit":
            acl: Acl | None = Acl(publish=["sage.v1.hook.>"], subscribe=[])
        elif hello.role == "capsule" and not admin:
            raise NotAuthorized("only an admin uid may connect a capsule over the socket")
        elif admin:
            acl = None
        else:
            acl = Acl(config.bus.user_publish, config.bus.user_subscribe)
        return Identity(source=source, principal=principal, acl=acl, uid=peer.uid)

    # -- running ------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        config = self.config
        try:
            # group members must pass through the state folder to reach a socket inside
            # it; children of a root supervisor, to reach their homes and identity files
            inside = config.socket_path.is_relative_to(config.state_dir)
            people, children = socket_group(config), access_group(config)
            if children is not None:  # children pass through to their homes, people to it
                ensure_private_dir(
                    config.state_dir, group=children, extra_group=people if inside else None
                )
            else:
                ensure_private_dir(config.state_dir, group=people if inside else None)
        except BusError as exc:
            raise SageError(f"state folder: {exc}") from exc
        instance = InstanceLock(config.state_dir, config.socket_path)
        instance.acquire()
        try:
            await self._run_locked(task_status)
        finally:
            instance.release()

    async def _run_locked(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        config = self.config
        if runs_children_as_principals():
            _close_state_entries(config)
        try:
            self.session_uids.allocate()
        except SageError as exc:
            raise SageError(f"sessions' uids: {exc}") from exc
        _raise_open_file_limit()
        log_loop_errors()
        key = load_signing_key(config.keys_dir)
        self.started_at = time.time()
        try:
            with anyio.CancelScope() as self._outer:
                async with contextlib.AsyncExitStack() as fleet:
                    if config.fleet is not None:  # refused (FleetError): no start
                        self.fleet = await fleet.enter_async_context(
                            join(
                                config.fleet,
                                config.path_of,
                                started_at=self.started_at,
                                principals=self._principal_names,
                            )
                        )
                    await self._open_and_serve(key, task_status)
        finally:
            self.bus.close()
            self.notifier.close()
            log.info("supervisor.stopped")

    async def _open_and_serve(
        self, key: Ed25519PrivateKey, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        config = self.config
        async with (
            StateStore.open(config.state_db_path) as state,
            AuditLog.open(config.audit_path, key, config.audit) as audit,
            spending(
                self.bus,
                self.identity,
                lambda: self.config,
                audit_stats=lambda: {"appended": audit.stats()["head_seq"]},
                capsules=self.capsules.describe,
            ) as spent,
        ):
            self.state = state
            self.audit = audit
            self.spending = spent  # the usage ledger, budgets and /metrics (sage/usage)
            spent.fleet_nodes = self._fleet_nodes if self.fleet is not None else None
            if self.fleet is not None:
                self.fleet_audit = FleetAudit(
                    self.fleet, config.audit_path, key.public_key(), max_unsigned_for(config.audit)
                )
                audit.on_commit = self.fleet_audit.streamer.offer_rows
                audit.on_checkpoint = self.fleet_audit.streamer.offer_checkpoint
            await self._serve(audit, task_status)

    async def _serve(self, audit: AuditLog, task_status: anyio.abc.TaskStatus[None]) -> None:
        config = self.config
        people, children = socket_group(config), access_group(config)
        sink = self.sink = _AuditSink(
            audit, config.audit.rate_per_source, config.audit.burst_per_source
        )
        self.server = BusServer(
            self.bus,
            config.socket_path,
            self.authorize,
            principals_of=lambda uid: self.config.principals_for_uid(uid),
            group=people if people is not None else children,
            extra_group=children if people is not None else None,
            hello_timeout=config.socket.hello_timeout,
            idle_timeout=config.socket.idle_timeout,
            slow_consumer_timeout=config.bus.slow_consumer_timeout,
            max_connections_per_uid=config.socket.max_connections_per_uid,
        )
        self.server.before_pong = sink.settled
        self.bus.add(sink)
        self.bus.on_denied(self._audit_denied)
        # the signal handler outlives the serving task group, so a second SIGTERM
        # during the graceful stop is noted instead of killing the process
        async with anyio.create_task_group() as signals:
            stop = anyio.CancelScope()
            await signals.start(self._handle_signals, stop)
            with stop:
                async with anyio.create_task_group() as tg:
                    await tg.start(self.server.serve)
                    tg.start_soon(sink.report_every_second)
                    status = self.bus.subscribe(STATUS_TOPIC, self.identity)
                    tg.start_soon(self._answer_status, status)
                    changes = self.bus.subscribe(CAPSULE_REQUESTS, self.identity)
                    tg.start_soon(self._answer_capsule_requests, changes)
                    fleet_status = self.bus.subscribe(FLEET_STATUS_TOPIC, self.identity)
                    tg.start_soon(self._answer_fleet_status, fleet_status)
                    verify_fleet = self.bus.subscribe(VERIFY_FLEET_TOPIC, self.identity)
                    tg.start_soon(self._answer_verify_fleet, verify_fleet)
                    if self.fleet is not None:
                        self.fleet.load_source = self._node_load  # each heartbeat carries it
                        # and renews the lease: the runner's, and the fence's, which a
                        # frozen supervisor does not freeze (sage/lease.py)
                        await tg.start(self.fence.run)
                        self.fleet.renewed.append(self._grant_lease)
                        tg.start_soon(self.fleet.beat_every)
                        # sessions anywhere: the registry, forwarded requests, relayed events
                        usage = self.spending.usage if self.spending is not None else None
                        router = Router(self.bus, self.fleet, lambda: self.config, usage=usage)
                        await tg.start(router.run)
                        # tools anywhere: the catalogues, forwarded tool calls
                        await tg.start(self._fleet_tools(self.fleet).run)
                    if self.fleet_audit is not None:
                        tg.start_soon(self.fleet_audit.run)
                    if self.spending is not None:  # admits before the first capsule asks
                        await self.spending.start(tg)
                    self.capsules.start_all(tg)
                    with anyio.move_on_after(CAPSULE_READY_TIMEOUT):
                        for capsule in self.capsules.runners:
                            await capsule.ready.wait()
                    late = [c.manifest.name for c in self.capsules.runners if not c.ready.is_set()]
                    if late:
                        log.warning("supervisor.capsules_not_ready", capsules=late)
                    interval = watchdog_interval()
                    if interval:
                        tg.start_soon(self._watchdog, interval)
                    started: dict[str, Any] = {
                        "pid": os.getpid(),
                        "version": VERSION,
                        "socket": str(config.socket_path),
                    }
                    if config.fleet is not None:  # the node joined: its chain says so
                        started["fleet"] = {"node": config.fleet.node, "urls": config.fleet.urls}
                    self.bus.publish(self.identity, "sage.v1.audit.supervisor_started", started)
                    self.notifier.notify("READY=1", f"STATUS=serving on {config.socket_path}")
                    log.info(
                        "supervisor.ready",
                        pid=os.getpid(),
                        socket=str(config.socket_path),
                        state_dir=str(config.state_dir),
                        startup_ms=round((time.time() - self.started_at) * 1000, 1),
                    )
                    task_status.started()
            signals.cancel_scope.cancel()
        # reached when a stop signal cancelled the task group
        sink.limiter.report_every = 0.0  # the last drops are reported, whenever the last report was
        sink.report(time.monotonic())
        stopped: dict[str, Any] = {"pid": os.getpid()}
        if config.fleet is not None:  # and it leaves the fleet
            stopped["fleet"] = {"node": config.fleet.node}
        self.bus.publish(self.identity, "sage.v1.audit.supervisor_stopped", stopped)

    async def _handle_signals(
        self, scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]
    ) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    self.reload()
                    continue
                if scope.cancel_called:
                    log.info("supervisor.already_stopping", signal=signal.Signals(signum).name)
                    continue
                log.info("supervisor.stopping", signal=signal.Signals(signum).name)
                self.notifier.notify("STOPPING=1")
                # whatever is still running after the grace is cut off
                if self._outer is not None:
                    self._outer.deadline = (
                        anyio.current_time() + self.config.supervisor.shutdown_grace
                    )
                scope.cancel()

    async def _watchdog(self, interval: float) -> None:
        while True:
            self.notifier.notify("WATCHDOG=1")
            await anyio.sleep(interval)

    def reload(self) -> None:
        """Re-read the config file; apply the parts that can change while running."""
        if self.config_path is None and not os.environ.get("ASTRID_CONFIG"):
            log.info("supervisor.reload", result="nothing to reload (embedded defaults)")
            return
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("supervisor.reload_failed", error=str(exc))
            self.bus.publish(
                self.identity, "sage.v1.audit.config_reload_failed", {"error": str(exc)}
            )
            return
        old = self.config
        fixed = sorted(
            name
            for name, before, after in (
                ("bus (except user ACLs)", _bus_without_acl(old), _bus_without_acl(new)),
                ("socket", old.socket, new.socket),
                ("audit", old.audit, new.audit),
                ("supervisor.state_dir", old.supervisor.state_dir, new.supervisor.state_dir),
                ("supervisor.socket", old.supervisor.socket, new.supervisor.socket),
                ("supervisor.capsules", old.supervisor.capsules, new.supervisor.capsules),
                ("claude.binary", old.claude.binary, new.claude.binary),
                ("fleet", old.fleet, new.fleet),
                (
                    "sessions.uid_base / uid_count",
                    (old.sessions.uid_base, old.sessions.uid_count),
                    (new.sessions.uid_base, new.sessions.uid_count),
                ),
                (
                    "supervisor.shutdown_grace",
                    old.supervisor.shutdown_grace,
                    new.supervisor.shutdown_grace,
                ),
            )
            if before != after
        )
        # what cannot change while running keeps its running value
        new = msgspec.structs.replace(
            new,
            base_dir=old.base_dir,
            fleet=old.fleet,
            socket=old.socket,
            audit=old.audit,
            sessions=msgspec.structs.replace(
                new.sessions, uid_base=old.sessions.uid_base, uid_count=old.sessions.uid_count
            ),
            bus=msgspec.structs.replace(
                old.bus, user_publish=new.bus.user_publish, user_subscribe=new.bus.user_subscribe
            ),
            supervisor=msgspec.structs.replace(
                old.supervisor,
                admins=new.supervisor.admins,
                log_level=new.supervisor.log_level,
            ),
        )
        uids = SessionUids(new)
        try:
            uids.allocate()  # principals added: their children's uids, before any re-check
        except SageError as exc:
            log.error("supervisor.session_uids_failed", error=str(exc))
        self.session_uids = uids
        self.config = new
        configure_logging(new.supervisor.log_level)
        self.reloads += 1
        cut = self.server.reauthorize() if self.server is not None else 0
        log.info("supervisor.reloaded", restart_needed_for=fixed, connections_cut=cut)
        self.bus.publish(
            self.identity,
            "sage.v1.audit.config_reloaded",
            {
                "principals": [p.name for p in new.principals],
                "restart_needed_for": fixed,
                "connections_cut": cut,
            },
        )

    def _publish_audit(self, topic: str, payload: dict[str, Any]) -> None:
        """Publish as the supervisor (audit events, capsule state changes)."""
        self.bus.publish(self.identity, topic, payload)

    def _audit_denied(self, action: str, identity: Identity, details: dict[str, Any]) -> None:
        """Audit an ACL refusal; past a rate per source, count instead of writing each one."""
        suppressed = self._denials.admit(identity.source, time.monotonic())
        if suppressed is None:
            return
        self.bus.publish(
            self.identity,
            "sage.v1.audit.acl_denied",
            {
                "action": action,
                "source": identity.source,
                "principal": identity.principal,
                "suppressed_before": suppressed,
                **details,
            },
        )

    # -- status -------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        audit = self.audit
        return {
            "version": VERSION,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started_at, 3),
            "started_at": self.started_at,
            "socket": str(self.config.socket_path),
            "state_dir": str(self.config.state_dir),
            "config": self.config_path or os.environ.get("ASTRID_CONFIG") or "<embedded defaults>",
            "principals": [p.name for p in self.config.principals],
            "capsules": self.capsules.describe(),
            "bus": msgspec.to_builtins(self.bus.stats()),
            "connections": self.server.stats() if self.server else {},
            "audit": {
                **(audit.stats() if audit is not None else {}),
                "rate_limited": self.sink.rate_limited if self.sink is not None else 0,
                **(
                    {"stream": self.fleet_audit.streamer.stats()}
                    if self.fleet_audit is not None
                    else {}
                ),
            },
            "state_store": str(self.state.path) if self.state is not None else "",
            "reloads": self.reloads,
        }

    async def _answer_capsule_requests(self, requests: Any) -> None:
        """``sage.v1.request.capsule.{load,restart,remove}`` (admins): see capsule_set.py."""
        async for request in requests:
            reply = await self.capsules.answer(request)
            if request.reply_to:
                self.bus.reply(self.identity, request.reply_to, reply)

    def _fleet_tools(self, member: FleetMember) -> FleetTools:
        """Tools anywhere (sage/fleet/tools.py): this node's catalogue out, others' in."""
        return FleetTools(
            member, self.bus, self.identity, lambda: self.config.limits.execute_deadline
        )

    def _principal_names(self) -> list[str]:
        """The principals the config names now (a fleet heartbeat carries them)."""
        return [principal.name for principal in self.config.principals]

    async def _fleet_nodes(self) -> dict[str, int] | None:
        """The fleet's nodes by state, for ``/metrics`` (None: the bucket did not answer)."""
        assert self.fleet is not None
        try:
            views = await self.fleet.nodes()
        except SageError:
            return None
        states: dict[str, int] = {}
        for view in views:
            states[view.state.value] = states.get(view.state.value, 0) + 1
        return states

    def _grant_lease(self, began: float) -> None:
        """An acknowledged heartbeat that began at ``began`` (monotonic): the runner may
        run its children until ``began`` plus the lease's term (sage/lease.py)."""
        fleet = self.config.fleet
        if fleet is None:
            return
        term = fleet.lease
        grant = LeaseGrant(until=began + term, term=term)
        self.fence.grant(grant.until)
        try:
            self.bus.publish(self.identity, LEASE_TOPIC, msgspec.to_builtins(grant))
        except BusError as exc:
            log.warning("fleet.lease_grant_failed", error=str(exc))

    async def _node_load(self) -> NodeLoad | None:
        """The session runner's load, for this node's heartbeat (None: no runner answers)."""
        return await runner_load(self.bus, self.identity, deadline=LOAD_WAIT)

    async def _answer_fleet_status(self, requests: Any) -> None:
        """``sage.v1.request.fleet.status``: the nodes of the fleet (sage/fleet/)."""
        async for request in requests:
            if request.reply_to:
                reply = await status_reply(self.fleet, principal=request.principal)
                self.bus.reply(self.identity, request.reply_to, reply)

    async def _answer_verify_fleet(self, requests: Any) -> None:
        """``sage.v1.request.audit.verify_fleet`` (admins): every node's audit, from the
        stream and from each live node (sage/fleet/audit_stream.py)."""
        async for request in requests:
            if not request.reply_to:
                continue
            if request.principal is not None or not request.source.startswith("cli:"):
                reply = replies.error(
                    "not_authorized", "only an admin may verify the fleet's audit"
                )
            else:
                reply = await verify_fleet_reply(self.fleet)
            self.bus.reply(self.identity, request.reply_to, reply)

    async def _answer_status(self, requests: Any) -> None:
        async for request in requests:
            if request.reply_to:
                self.bus.reply(self.identity, request.reply_to, replies.ok(**self.status()))


def _raise_open_file_limit() -> None:
    """Each session holds four descriptors (three pipes and a pidfd): take the hard limit."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = max(soft, 1 << 20)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("supervisor.nofile_limit", soft=soft, hard=hard, error=str(exc))


def _bus_without_acl(config: Config) -> object:
    return msgspec.structs.replace(config.bus, user_publish=[], user_subscribe=[])


def _close_state_entries(config: Config) -> None:
    """Take group and other bits off what is directly in the state folder (supervisor root).

    The state folder is the children's access group's (0750) so that they can
    pass through it; an entry left open to others (a ``tools-policy.json``
    written 0644, a folder made 0755 by hand) would then be theirs to read.
    The socket's folder keeps its group; the homes' and sessions' folders are
    0711 (passable, not listable).  Links are not followed."""
    passable = {config.state_dir / "sessions"}
    if config.homes_dir is not None:
        passable.add(config.homes_dir)
    grouped = config.socket_path.parent
    try:
        entries = list(os.scandir(config.state_dir))
    except OSError as exc:
        raise SageError(f"state folder: cannot list {config.state_dir}: {exc.strerror}") from exc
    for entry in entries:
        path = Path(entry.path)
        if path == grouped or entry.is_symlink():
            continue
        mode = entry.stat(follow_symlinks=False).st_mode & 0o7777
        want = 0o711 if path in passable and entry.is_dir() else mode & 0o700
        if mode != want:
            os.chmod(path, want, follow_symlinks=False)
            log.warning("supervisor.state_entry_closed", path=str(path), mode=f"{mode:o}")
