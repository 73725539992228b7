"""Configuration: ``supervisor.toml`` decoded into frozen msgspec Structs.

Every default lives here, next to its field, and the repository's
``supervisor.toml`` spells out the same values (a test keeps them equal).
The config is validated once, at start, and passed explicitly; nothing reads
it from a global.  A bad file ends start-up with one line naming the field
and the problem (:class:`sage.errors.ConfigError`).

Relative paths in a file resolve against the directory holding the file; the
embedded defaults resolve against the current directory, which is what
``make run`` wants (state in ``./.state``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args, get_origin

import msgspec

from bus.errors import BusError
from bus.topics import split_pattern
from sage.errors import ConfigError
from sage.lease import FENCE_TIME, lease_term

__all__ = (
    "AuditConfig",
    "BusConfig",
    "CapsulesConfig",
    "ClaudeConfig",
    "Config",
    "FleetConfig",
    "FleetPeerConfig",
    "ForgeConfig",
    "LimitsConfig",
    "LlmConfig",
    "MetricsConfig",
    "PrincipalConfig",
    "SecretsConfig",
    "SessionsConfig",
    "SocketConfig",
    "SupervisorConfig",
    "UsageConfig",
    "decode_config",
    "load_config",
)

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}\Z"
_NAME = re.compile(NAME_PATTERN)

PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
Uid = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class SupervisorConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    state_dir: str = ".state"
    """Folder for the audit log, state store, keys and (by default) the socket."""
    socket: str = ""
    """Path of the control socket; empty means ``<state_dir>/run/astrid.sock``."""
    admins: list[Uid] = []
    """Uids that may act for every principal (the supervisor's own uid always may)."""
    shutdown_grace: PositiveFloat = 5.0
    """Seconds a graceful stop may take before remaining work is cancelled."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written to the JSON log on stderr."""
    capsules: list[str] = msgspec.field(
        default_factory=lambda: [
            "echo",
            "runner",
            "tools",
            "greeter",
            "hooks",
            "forge",
            "installer",
            "llm",
        ]
    )
    """Capsules to start: built-in names (folders of the ``capsules`` package) or paths."""


class BusConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_payload: Annotated[int, msgspec.Meta(gt=0, le=64 * 1024 * 1024)] = 1024 * 1024
    """Largest encoded payload a publisher may send, in bytes (NATS: 1 MiB)."""
    queue_size: Annotated[int, msgspec.Meta(gt=0, le=1_000_000)] = 1024
    """Envelopes a subscription may hold before new ones are dropped."""
    request_timeout: PositiveFloat = 5.0
    """Default deadline of a request/reply, in seconds."""
    slow_consumer_timeout: PositiveFloat = 2.0
    """A remote subscriber whose queue stays full this long is disconnected."""
    user_publish: list[str] = msgspec.field(
        default_factory=lambda: [
            "sage.v1.request.>",
            "sage.v1.hook.>",
            "llm.v1.request.>",
            "demo.>",
        ]
    )
    """What a non-admin user (a uid mapped to a principal) may publish to."""
    user_subscribe: list[str] = msgspec.field(
        default_factory=lambda: [
            "sage.v1.event.>",
            "sage.v1.approver.>",
            "hook.v1.event.>",
            "llm.v1.stream.>",
            "demo.>",
        ]
    )
    """What a non-admin user may subscribe to."""

    def __post_init__(self) -> None:
        for pattern in (*self.user_publish, *self.user_subscribe):
            try:
                split_pattern(pattern)
            except BusError as exc:
                raise ValueError(str(exc)) from None


PRIVILEGED_GROUPS: Final = frozenset(
    {
        "root", "wheel", "sudo", "admin", "adm", "disk", "shadow", "docker", "lxd", "lxc",
        "kvm", "libvirt", "systemd-journal", "kmem", "sys", "staff", "video", "input", "tty",
        "podman", "incus", "incus-admin",
    }
)  # fmt: skip
"""Groups whose members hold power over the host (read its logs or disks, start root
containers, use sudo): never the socket's group, which every user of sage joins."""
GROUP_ADVICE: Final = (
    "make a group of its own for sage's users (groupadd astrid) and name it in [socket] group"
)


class SocketConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    hello_timeout: PositiveFloat = 5.0
    """Seconds a new connection has to send its hello."""
    idle_timeout: PositiveFloat = 600.0
    """A connection with no subscription that sends nothing for this long is closed."""
    max_connections_per_uid: Annotated[int, msgspec.Meta(gt=0, le=10_000)] = 64
    """Concurrent connections one local uid may hold."""
    group: str = ""
    """A group whose members may connect: socket 0660, directory 0750. Empty: owner only.
    Never a privileged group (:data:`PRIVILEGED_GROUPS`), never given to ``claude`` children."""

    def __post_init__(self) -> None:
        if self.group in PRIVILEGED_GROUPS:
            raise ValueError(
                f"group: {self.group!r} is a privileged group (its members hold power over"
                f" the host, and every user of the socket would join it); {GROUP_ADVICE}"
            )


class AuditConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    checkpoint_every: PositiveInt = 1000
    """Write a signed checkpoint after this many entries ..."""
    checkpoint_seconds: PositiveFloat = 60.0
    """... or after this many seconds with unsigned entries, whichever is first."""
    batch_max: Annotated[int, msgspec.Meta(gt=0, le=100_000)] = 1024
    """Most entries one group commit writes."""
    rate_per_source: PositiveFloat = 500.0
    """Audit entries per second one publisher (source and principal) may add, on average ..."""
    burst_per_source: PositiveInt = 2000
    """... and at most this many at once; the rest are dropped, counted and reported
    (``sage.v1.audit.audit_rate_limited``)."""


class ClaudeConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    binary: str = ""
    """Path of the ``claude`` binary; empty means the one ``make setup`` installed, else PATH."""
    version: str = ""
    """Ignored, kept so older configs load: the supported Claude Code range is built
    into sage (``sage/claude/binary.py``); ``astrid doctor`` warns when it is set."""
    env: dict[str, str] = {}
    """Extra environment for every ``claude`` child (e.g. ANTHROPIC_BASE_URL)."""
    api_key_file: str = ""
    """File holding the Anthropic API key for ``api_key`` principals.

    Empty: ``$CREDENTIALS_DIRECTORY/anthropic-api-key`` (systemd
    ``LoadCredential=``), else the supervisor's own ``ANTHROPIC_API_KEY``.
    The key reaches the child in its environment only, never in argv, logs
    or events."""


class LimitsConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    max_sessions_per_principal: Annotated[int, msgspec.Meta(gt=0, le=1000)] = 4
    """Live sessions one principal may have: sessions with a ``claude`` child (or about
    to have one); a hibernated session does not count (``max_logical_sessions_per_principal``)."""
    max_logical_sessions_per_principal: Annotated[int, msgspec.Meta(gt=0, le=1_000_000)] = 1000
    """Sessions one principal may have in all, hibernated ones included."""
    max_repl_tokens_per_principal: Annotated[int, msgspec.Meta(gt=0, le=1000)] = 16
    """Live REPL hook tokens (``astrid sage repl`` runs) one principal may have."""
    max_line_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    """Longest stdout line accepted from ``claude``; longer ends the session."""
    init_timeout: PositiveFloat = 60.0
    """Seconds ``claude`` has to answer ``initialize``."""
    stop_grace: PositiveFloat = 5.0
    """Seconds between closing a session's input and SIGTERM, and SIGTERM and SIGKILL."""
    approval_timeout: PositiveFloat = 60.0
    """Seconds a ``can_use_tool`` prompt waits for an answer on the bus; then: deny."""
    tool_timeout: PositiveFloat = 60.0
    """Seconds an MCP ``tools/call`` waits for ``sage.v1.tool.result.<cid>``."""
    execute_deadline: PositiveFloat = 50.0
    """Seconds the tool bridge waits for a capsule's ``tool.v1.execute.<name>.result``;
    below ``tool_timeout``, so the bridge's error answer reaches the session first."""

    def __post_init__(self) -> None:
        if self.execute_deadline >= self.tool_timeout:
            raise ValueError("limits.execute_deadline must be below limits.tool_timeout")

    stdin_quota: Annotated[int, msgspec.Meta(ge=1024)] = 1024 * 1024
    """Largest encoded user line a ``send`` may write to a session (1 MiB)."""
    self_allow_rules: Literal["exact", "prefix", "any"] = "exact"
    """What allow rules a principal may give itself (``settings --allow``, ``approve
    --always --rule``, the "always" answer): ``exact`` tool names only; ``prefix`` also
    every tool of one MCP server (``mcp__sage__*``); ``any`` any pattern (``*``).  An
    admin's rules are not bound by it (capsules/runner/approvals.py)."""


class SessionsConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    resume: bool = False
    """After a supervisor restart, respawn interrupted sessions with ``--resume``;
    false: they end with reason ``supervisor_restart``."""
    homes: str = "homes"
    """Folder of principals' homes (a principal's ``home`` overrides); relative to state_dir."""
    max_respawns: Annotated[int, msgspec.Meta(ge=0, le=100)] = 5
    """Respawn attempts (identity refresh) per session before giving up."""
    history: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 200
    """Ended sessions kept per principal (``astrid sage sessions --all``); older go."""
    spares: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    """Warm spares: ``claude`` children started and initialized ahead of need, per
    installed headless principal, so a spawn without a session id takes one instead of
    starting cold (capsules/runner/spares.py).  Each holds about 200 MiB; 0: none."""
    spare_max_age: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 600.0
    """Seconds a spare may wait; an older one is stopped and replaced, never handed out."""
    hibernate_after: Annotated[float, msgspec.Meta(ge=0, le=30 * 86_400)] = 0.0
    """Seconds a session may sit idle (no turn, nothing pending) before its ``claude``
    is stopped and the session hibernates; the next send wakes it with ``--resume``.
    0: never on a timer (``max_live`` may still hibernate the least recently used)."""
    max_live: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 0
    """Live ``claude`` children of sessions on this host (spares not counted); past it
    the least recently used idle session hibernates to make room.  0: no bound."""
    wake_wait: Annotated[float, msgspec.Meta(ge=0, le=60)] = 30.0
    """Seconds a spawn or a wake waits for a live slot while the host is full and no
    session is idle; then it fails ``host_full``."""
    wake_queue: Annotated[int, msgspec.Meta(ge=0, le=100_000)] = 256
    """Spawns and wakes that may wait for a live slot at once; past it: ``host_full`` at once."""
    uid_base: Annotated[int, msgspec.Meta(ge=1000, le=2**31 - 1)] = 91000
    """Supervisor root only: the gid of the sessions' group (the socket and the folders
    a ``claude`` child must pass through), and the first of the uids principals without
    ``run_as`` get, one each, from ``uid_base + 1`` (sage/security/runas.py)."""
    uid_count: Annotated[int, msgspec.Meta(ge=2, le=65536)] = 1000
    """How many ids the range holds (the group's included)."""

    def __post_init__(self) -> None:
        _check_uid_range(self.uid_base, self.uid_count)

    @property
    def hibernation(self) -> bool:
        """Whether sessions hibernate (on a timer, or to make room)."""
        return self.hibernate_after > 0 or self.max_live > 0


def _check_uid_range(base: int, count: int) -> None:
    """A range of sage's own uids: never ``nobody`` (shared with other daemons)."""
    last = base + count - 1
    if base <= 65534 <= last:
        raise ValueError("uid_base: the range holds 65534 (nobody), shared by others")
    if last > 2**32 - 2:
        raise ValueError("uid_base + uid_count: past the last valid uid")


class SecretsConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    key_file: str = ""
    """The 32-byte AES-GCM key that encrypts the secret store (principals' API keys,
    forge vault). Empty: ``$CREDENTIALS_DIRECTORY/sage-secrets-key`` when systemd
    provides it, else ``<state_dir>/keys/secrets.key`` (0600, made on first use)."""


class LlmConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    base_url: str = ""
    """Messages API base URL; empty: the SDK's default (api.anthropic.com)."""
    model: str = "claude-sonnet-4-5"
    """Model when a request names none."""
    models: list[str] = msgspec.field(
        default_factory=lambda: ["claude-opus-4-1", "claude-sonnet-4-5", "claude-haiku-4-5"]
    )
    """Models the provider offers; a request for another is refused."""
    max_tokens: Annotated[int, msgspec.Meta(gt=0, le=1_000_000)] = 4096
    """``max_tokens`` when a request gives none."""
    context_window: PositiveInt = 200_000
    """Advertised in ``llm.v1.request.describe``."""
    timeout: PositiveFloat = 120.0
    """Seconds one HTTP attempt may take (the SDK's timeout)."""
    max_retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 2
    """Retries the SDK makes on 408/409/429/5xx and connection errors."""
    max_concurrent: Annotated[int, msgspec.Meta(gt=0, le=1000)] = 8
    """Generations running at once; more wait their turn."""


class UsageConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The usage ledger and the budgets it enforces (docs/operations.md, "Budgets and
    metrics")."""

    ledger: bool = True
    """Record every model call and generation in ``<state_dir>/usage.db``; off: nothing is
    recorded and no budget can be set (the config refuses a principal's budget then)."""


class MetricsConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The Prometheus exporter: ``GET /metrics`` (docs/operations.md, docs/security.md)."""

    listen: str = ""
    """``HOST:PORT`` to serve ``/metrics`` on (``[::1]:PORT`` for IPv6); empty: off.  The
    page names principals and what they spent: keep it on loopback unless the network
    it reaches may read that."""

    def __post_init__(self) -> None:
        if self.listen:
            listen_address(self.listen)


def listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT`` as a host (an IP address or ``localhost``) and a port; ValueError."""
    import ipaddress

    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"metrics.listen: {value!r} is not HOST:PORT (e.g. 127.0.0.1:9464)")
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"metrics.listen: {host!r} is not an IP address or localhost"
            ) from None
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (of :func:`listen_address`) is reached from this host only."""
    import ipaddress

    return host == "localhost" or ipaddress.ip_address(host).is_loopback


class ForgeConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    root: str = "forge"
    """Registry, runs, cache and policy of forged tools; relative to state_dir."""
    python: str = "/usr/bin/python3"
    """Interpreter for ``python`` tools (inside the sandbox, from the read-only /usr)."""
    bash: str = "/bin/bash"
    """Interpreter for ``bash`` tools."""
    sandbox_uid_base: Annotated[int, msgspec.Meta(ge=1000, le=2**31 - 1)] = 90000
    """First uid of the sandbox uids (supervisor root only): one per principal, see
    sage/security/uids.py; none of them may be a user of the host."""
    sandbox_uid_count: Annotated[int, msgspec.Meta(ge=2, le=65536)] = 1000
    """How many uids the range holds (calls without a principal take the first)."""
    sandbox_uid: int | None = None
    """Gone (one uid for every principal, 65534 by default); refused with a pointer."""
    wall_clock: PositiveFloat = 30.0
    """Seconds a call may run before its whole sandbox is killed."""
    cpu_seconds: PositiveInt = 10
    """RLIMIT_CPU of a call."""
    memory_bytes: Annotated[int, msgspec.Meta(ge=64 * 1024 * 1024)] = 1024 * 1024 * 1024
    """RLIMIT_AS of a call."""
    file_bytes: Annotated[int, msgspec.Meta(ge=1024 * 1024)] = 64 * 1024 * 1024
    """RLIMIT_FSIZE of a call."""
    open_files: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 256
    """RLIMIT_NOFILE of a call."""
    max_processes: Annotated[int, msgspec.Meta(ge=4, le=4096)] = 64
    """Processes one call's sandbox may hold at once."""
    output_cap: Annotated[int, msgspec.Meta(ge=4096)] = 4 * 1024 * 1024
    """Bytes of stdout returned to Claude (a policy may lower it); the rest is spilled."""
    spare_sandboxes: Annotated[int, msgspec.Meta(ge=0, le=16)] = 2
    """Python sandboxes started ahead of the calls that will use them; 0: none."""
    runs_max_bytes: Annotated[int, msgspec.Meta(ge=1024 * 1024)] = 2 * 1024 * 1024 * 1024
    """Bytes the runs folder (manifests and spilled stdout) may hold; past it the
    oldest runs of the principal holding the most are pruned (sage/forge/runs.py)."""
    runs_max_bytes_per_principal: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Bytes one principal's runs may hold; past it its own oldest runs are pruned.
    0: a quarter of ``runs_max_bytes``; at most ``runs_max_bytes``."""

    @property
    def runs_quota(self) -> int:
        """``runs_max_bytes_per_principal``, its default filled in."""
        return self.runs_max_bytes_per_principal or self.runs_max_bytes // 4

    def __post_init__(self) -> None:
        if self.sandbox_uid is not None:
            raise ValueError(
                "sandbox_uid is gone: each principal's tools now run under a uid of their own"
                " from sandbox_uid_base (default 90000) to sandbox_uid_base + sandbox_uid_count"
                " - 1, never nobody (65534); remove sandbox_uid (firewall rules keyed on it:"
                " match the range, e.g. `-m owner --uid-owner 90000-90999`; rw x-bind"
                " folders: chown them to the principal's uid, see docs/forge-sandbox.md)"
            )
        last = self.sandbox_uid_base + self.sandbox_uid_count - 1
        if self.sandbox_uid_base <= 65534 <= last:
            raise ValueError("sandbox_uid_base: the range holds 65534 (nobody), shared by others")
        if last > 2**32 - 2:
            raise ValueError("sandbox_uid_base + sandbox_uid_count: past the last valid uid")
        if self.runs_max_bytes_per_principal > self.runs_max_bytes:
            raise ValueError(
                "runs_max_bytes_per_principal: larger than runs_max_bytes"
                f" ({self.runs_max_bytes_per_principal} > {self.runs_max_bytes})"
            )
        if 0 < self.runs_max_bytes_per_principal < 64 * 1024:
            raise ValueError("runs_max_bytes_per_principal: below 65536 (0: the default)")


class CapsulesConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Installed capsules (``astrid capsule install``): their workers' sandbox."""

    uid_base: Annotated[int, msgspec.Meta(ge=1000, le=2**31 - 1)] = 92000
    """First uid of the installed capsules' uids (supervisor root only): one per capsule
    name, persisted in ``<state_dir>/capsule_uids.json``; none may be a user of the host."""
    uid_count: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 1000
    """How many uids the range holds (one per installed capsule name, never reused)."""
    tmp_bytes: Annotated[int, msgspec.Meta(ge=1024 * 1024)] = 64 * 1024 * 1024
    """Size of a worker's private /tmp tmpfs (its only writable place besides /dev/shm)."""
    max_processes: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 256
    """RLIMIT_NPROC of a capsule's uid (processes and threads; supervisor root only)."""

    def __post_init__(self) -> None:
        _check_uid_range(self.uid_base, self.uid_count)


class FleetPeerConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``[fleet.peers.<node>]``: what this node takes from node ``<node>``'s word
    (docs/security.md, "Fleet trust model")."""

    principals: list[Name] | None = None
    """The only principals that node may forward requests and tool calls for (besides
    declaring them in its heartbeat record).  Unset: whatever its record declares. This
    pin is what a compromised peer cannot widen: its record is its own to write."""
    admins: bool = False
    """Whether that node's admins (callers with no principal) are admins here too.
    Off: a forwarded admin request or tool call is refused ``principal_not_authenticated``
    (an admin there acts for a principal with ``--principal``)."""


class FleetConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Several hosts as one sage, over NATS with JetStream (docs/fleet.md).

    Without a ``[fleet]`` table nothing of it runs: one host, the in-process bus.
    Secrets are read from files, never written here: a URL with a user or a
    password in it is refused."""

    url: str | list[str]
    """NATS server URL, or several for a cluster: ``nats://host:4222`` (``tls://`` too)."""
    node: Name
    """This supervisor's node name in the fleet, ``[A-Za-z0-9_-]{1,64}``, unique per node."""
    user: str = ""
    """The node's NATS user; empty: the node name."""
    password_file: str = ""
    """File holding the node user's password (0600, ours; one line). One of
    ``password_file``, ``nkey_seed``, ``creds`` is required, unless ``insecure_no_auth``."""
    nkey_seed: str = ""
    """Instead of a password: file holding the node's NKey seed (``SU...``, 0600, ours);
    the server's entry names its public key (``astrid fleet permissions --nkey``)."""
    creds: str = ""
    """Instead of a password or a seed: the node's NATS user credentials file (``.creds``,
    0600, ours: the user JWT and its NKey seed), for servers in operator mode
    (decentralized JWT auth; the JWT carries the user's permissions)."""
    insecure_no_auth: bool = False
    """Join with no credentials at all, on a NATS server without authorization (any of
    its clients may then act as any node): for trying a fleet on one machine only.
    Without it, a ``[fleet]`` that names no credentials does not start
    (``fleet_no_credentials``, sage/fleet/auth.py); with it, every start logs
    ``fleet.insecure_no_auth`` and ``astrid doctor`` fails. Not with credentials."""
    ca: str = ""
    """CA bundle that signs the servers' TLS certificates; set: TLS is required."""
    cert: str = ""
    """The node's TLS client certificate (with ``key``), for servers that verify clients."""
    key: str = ""
    """The private key of ``cert`` (0600, ours)."""
    heartbeat: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 2.0
    """Seconds between two heartbeats of this node (its record in the ``sage_nodes`` bucket)."""
    lost_after: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 6.0
    """A node whose last heartbeat is older than this many seconds is shown ``lost``."""
    max_clock_skew: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 1.0
    """The most two nodes' clocks may differ, in seconds: a node's lease lasts
    ``lost_after - max_clock_skew - 0.25`` after each acknowledged heartbeat
    (sage/lease.py), so its children are gone before another node may judge it lost.
    ``astrid doctor`` checks each host's clock against it."""
    connect_timeout: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    """Seconds the supervisor tries to reach NATS at start; then it refuses to start."""
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    """Replicas of the ``sage_nodes`` bucket when this node creates it (3 in a 3-server
    cluster, so it survives the loss of a server); an existing bucket is used as it is."""
    peers: dict[Name, FleetPeerConfig] = {}
    """``[fleet.peers.<node>]``: what this node takes from that node (none named: every
    node may vouch for the principals its heartbeat record declares, and no node's admins
    are admins here)."""
    placement: Literal["local", "least_loaded"] = "local"
    """Where a spawn without ``--node`` goes: ``local``, the node asked (as on one host);
    ``least_loaded``, the live node with the smallest share of its live slots in use that
    serves the principal (as ``--node any``; docs/fleet.md, "Placement")."""
    transcript_max_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 32 << 20
    """Failover: a session's transcript larger than this is not replicated to the
    ``sage_transcripts`` object store (logged ``fleet.transcript_refused``); 0: none is."""
    adopt: bool = True
    """Failover: this node takes over sessions of lost nodes (those whose node has
    ``[sessions] resume = true``), for the principals it is configured for."""

    @property
    def urls(self) -> list[str]:
        return [self.url] if isinstance(self.url, str) else list(self.url)

    @property
    def user_name(self) -> str:
        return self.user or self.node

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("fleet.url: name at least one NATS server")
        for url in self.urls:
            _check_nats_url(url)
        if self.user and not re.match(r"^[A-Za-z0-9_.@-]{1,128}\Z", self.user):
            raise ValueError(f"fleet.user: {self.user!r} is not a NATS user name")
        secrets = [k for k in ("password_file", "nkey_seed", "creds") if getattr(self, k)]
        if len(secrets) > 1:
            raise ValueError(
                f"fleet: {' and '.join(secrets)}: give one of password_file, nkey_seed, creds"
            )
        if self.insecure_no_auth and secrets:
            # a leftover flag would make a later edit that drops the credentials start
            # without any, with no refusal: the two are refused together instead
            raise ValueError(
                f"fleet.insecure_no_auth: set together with {secrets[0]}, which the node"
                " signs in with; remove insecure_no_auth = true from [fleet]"
            )
        if self.nkey_seed and self.user:
            raise ValueError("fleet.nkey_seed: an NKey names the node by its key; drop user")
        if self.creds and self.user:
            raise ValueError("fleet.creds: the user JWT names the node's user; drop user")
        if bool(self.cert) != bool(self.key):
            raise ValueError("fleet.cert and fleet.key: give both or neither")
        if self.node == "any":
            raise ValueError("fleet.node: 'any' is reserved (spawn --node any places a session)")
        if self.lost_after <= self.heartbeat:
            raise ValueError(
                f"fleet.lost_after: {self.lost_after} s is not longer than fleet.heartbeat"
                f" ({self.heartbeat} s): every node would be shown lost between two beats"
            )
        term = self.lease
        if term < self.heartbeat:
            raise ValueError(
                f"fleet.lost_after: {self.lost_after} s leaves a lease of {term:g} s once"
                f" max_clock_skew ({self.max_clock_skew} s) and the {FENCE_TIME} s to fence"
                f" are taken off: less than one heartbeat ({self.heartbeat} s); raise"
                " lost_after, or lower heartbeat or max_clock_skew"
            )

    @property
    def lease(self) -> float:
        """Seconds one acknowledged heartbeat lets the node run its children
        (sage/lease.py, :func:`~sage.lease.lease_term`)."""
        return lease_term(self.lost_after, self.max_clock_skew)


def _check_nats_url(url: str) -> None:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"fleet.url: {url!r} is not a URL") from None
    if parts.scheme not in ("nats", "tls") or not parts.hostname:
        raise ValueError(f"fleet.url: {url!r} is not a nats://HOST[:PORT] URL")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "fleet.url: a user or password in the URL; secrets go in a file"
            " (fleet.password_file), never in the config"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or port == 0:
        raise ValueError(f"fleet.url: {url!r}: only nats://HOST[:PORT]")


MODEL_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._:\[\]-]{0,99}\Z"


class SpareKind(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One more kind of warm spare for a principal: a spawn asking for this working
    folder and model (``astrid sage spawn --cwd DIR --model NAME``) may take one."""

    cwd: str = ""
    """Absolute folder, inside the home or a ``work_roots``; empty: the home."""
    model: str = ""
    """One of the principal's ``model`` / ``models``; empty: its ``model``."""

    def __post_init__(self) -> None:
        if self.cwd and (not self.cwd.startswith("/") or "\0" in self.cwd):
            raise ValueError(f"spare_kinds: cwd {self.cwd!r} is not an absolute path")
        if self.model and not re.match(MODEL_PATTERN, self.model):
            raise ValueError(f"spare_kinds: {self.model!r} is not a model name")


class PrincipalConfig(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Name
    """The principal's id, ``[A-Za-z0-9_-]{1,64}``."""
    uids: list[Uid] = []
    """Local uids that may act for this principal."""
    home: str = ""
    """HOME and working folder of the principal's sessions; empty: ``<homes>/<name>``."""
    model: str = ""
    """``--model`` for the principal's sessions; empty: the CLI's default."""
    max_turns: Annotated[int, msgspec.Meta(ge=0)] = 0
    """``--max-turns`` per user turn; 0: no limit given."""
    interaction_mode: Literal["headless", "repl"] = "headless"
    """``headless`` sessions run under the runner; ``repl`` principals use a terminal."""
    auth_mode: Literal["api_key", "subscription"] = "api_key"
    """``api_key``: the child gets ANTHROPIC_API_KEY; ``subscription``: the CLI's own login."""
    identity: str = ""
    """Text appended to the system prompt; empty: a short default (audited as a fallback)."""
    allowed_tools: list[str] = []
    """Tools pre-allowed for the principal (``--allowedTools``): no approval prompt for
    them. Names as Claude sees them, e.g. ``mcp__sage__greet``."""
    operator_key: bool = False
    """``api_key`` mode with no key of its own stored: run on the operator's key
    (``claude.api_key_file``, ``$CREDENTIALS_DIRECTORY`` or the supervisor's
    ``ANTHROPIC_API_KEY``), sharing its account and bill. Off: such a spawn is refused
    (``api_key_missing``), so no principal shares the operator's key unless said here."""
    work_roots: list[str] = []
    """Folders (absolute) a spawn may name as its working folder with ``astrid sage spawn
    --cwd``, with everything below them; the home is always allowed."""
    models: list[str] = []
    """Models a spawn may pick with ``astrid sage spawn --model``, besides ``model``."""
    spare_kinds: Annotated[list[SpareKind], msgspec.Meta(max_length=8)] = []
    """Working folder and model pairs to keep ``[sessions] spares`` warm spares of, besides
    the default one (the home and ``model``): each kind costs its own spares."""
    run_as: str | Annotated[int, msgspec.Meta(ge=1, le=2**32 - 2)] = ""
    """Supervisor root only: the user (name or uid) the principal's ``claude`` children
    run as; empty: a uid of sage's own from ``[sessions] uid_base`` (sage/security/runas.py)."""
    budget_tokens_per_day: Annotated[int, msgspec.Meta(ge=0)] | None = None
    """Tokens (input, output, cache read and write) its model calls may use a UTC day, on
    every node of a fleet together; unset: no such budget (sage/usage/budget.py)."""
    budget_usd_per_day: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """US dollars (sage's estimate) its model calls may cost a UTC day; unset: none."""
    budget_usd_per_month: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """US dollars its model calls may cost a UTC month; unset: none."""

    def __post_init__(self) -> None:
        for name in self.allowed_tools:
            if not re.match(r"^[A-Za-z0-9_*:-]{1,128}\Z", name):
                raise ValueError(f"allowed_tools: {name!r} is not a tool name")
        for root in self.work_roots:
            if not root.startswith("/") or "\0" in root:
                raise ValueError(f"work_roots: {root!r} is not an absolute path")
        for model in self.models:
            if not re.match(MODEL_PATTERN, model):
                raise ValueError(f"models: {model!r} is not a model name")
        if isinstance(self.run_as, str) and self.run_as:
            import pwd

            try:
                if pwd.getpwnam(self.run_as).pw_uid == 0:
                    raise ValueError(f"run_as: {self.run_as!r} is root")
            except KeyError:
                raise ValueError(f"run_as: no user named {self.run_as!r}") from None

    @property
    def run_as_uid(self) -> int | None:
        """The uid ``run_as`` names, or None when it is empty (a user removed since: None)."""
        if isinstance(self.run_as, int):
            return self.run_as
        if not self.run_as:
            return None
        import pwd

        try:
            return pwd.getpwnam(self.run_as).pw_uid
        except KeyError:
            return None


class Config(_Section, frozen=True, kw_only=True, forbid_unknown_fields=True):
    supervisor: SupervisorConfig = SupervisorConfig()
    bus: BusConfig = BusConfig()
    socket: SocketConfig = SocketConfig()
    audit: AuditConfig = AuditConfig()
    claude: ClaudeConfig = ClaudeConfig()
    limits: LimitsConfig = LimitsConfig()
    sessions: SessionsConfig = SessionsConfig()
    secrets: SecretsConfig = SecretsConfig()
    llm: LlmConfig = LlmConfig()
    forge: ForgeConfig = ForgeConfig()
    capsules: CapsulesConfig = CapsulesConfig()
    usage: UsageConfig = UsageConfig()
    metrics: MetricsConfig = MetricsConfig()
    fleet: FleetConfig | None = None
    """``[fleet]``: this supervisor is a node of a fleet; absent: a single host."""
    principals: list[PrincipalConfig] = []
    base_dir: str = ""
    """Where relative paths resolve; set by the loader, not written in files."""

    def __post_init__(self) -> None:
        forge, caps = self.forge, self.capsules
        if (
            caps.uid_base < forge.sandbox_uid_base + forge.sandbox_uid_count
            and forge.sandbox_uid_base < caps.uid_base + caps.uid_count
        ):
            raise ValueError(
                "capsules.uid_base: the capsules' uid range overlaps [forge] sandbox_uid_base's"
                " (each sandbox needs uids nobody else has)"
            )
        seen: set[str] = set()
        for principal in self.principals:
            if principal.name in seen:
                raise ValueError(f"principal {principal.name!r} is declared twice")
            seen.add(principal.name)
            budgets = (
                principal.budget_tokens_per_day,
                principal.budget_usd_per_day,
                principal.budget_usd_per_month,
            )
            if not self.usage.ledger and any(b is not None for b in budgets):
                raise ValueError(
                    f"principal {principal.name!r}: a budget needs the usage ledger"
                    " ([usage] ledger = true)"
                )
        self._check_run_as()
        if len(os.fsencode(self.socket_path)) > 107:
            raise ValueError(
                f"supervisor.socket: {self.socket_path} is longer than 107 bytes"
                " (set a shorter socket or state_dir)"
            )
        if self.socket.group:
            import grp

            try:
                grp.getgrnam(self.socket.group)
            except KeyError:
                raise ValueError(f"socket.group: no group named {self.socket.group!r}") from None

    def _check_run_as(self) -> None:
        """Each ``run_as`` uid is one principal's children's, and nothing else of sage's."""
        sessions, forge = self.sessions, self.forge
        if not (
            sessions.uid_base + sessions.uid_count <= forge.sandbox_uid_base
            or forge.sandbox_uid_base + forge.sandbox_uid_count <= sessions.uid_base
        ):
            raise ValueError(
                "sessions.uid_base: the sessions' uid range overlaps [forge] sandbox_uid_base's"
            )
        owners: dict[int, str] = {}
        for principal in self.principals:
            uid = principal.run_as_uid
            if uid is None:
                continue
            where = f"principal {principal.name!r}: run_as uid {uid}"
            if uid in owners:
                raise ValueError(f"{where} is also principal {owners[uid]!r}'s")
            owners[uid] = principal.name
            if uid in self.supervisor.admins:
                raise ValueError(f"{where} is an admin (its children would be admins too)")
            for other in self.principals:
                if other is not principal and uid in other.uids:
                    raise ValueError(f"{where} acts for principal {other.name!r} (uids)")
            for base, count, name in (
                (sessions.uid_base, sessions.uid_count, "[sessions] uid_base"),
                (forge.sandbox_uid_base, forge.sandbox_uid_count, "[forge] sandbox_uid_base"),
            ):
                if base <= uid < base + count:
                    raise ValueError(f"{where} is in the range of {name}")

    def path_of(self, value: str) -> Path:
        """``value`` as a path: relative ones resolve against the config file's folder."""
        return self._resolve(value)

    def _resolve(self, value: str) -> Path:
        path = Path(value).expanduser()
        if not path.is_absolute():
            path = Path(self.base_dir or os.getcwd()) / path
        return path

    @property
    def state_dir(self) -> Path:
        return self._resolve(self.supervisor.state_dir)

    @property
    def messages_api(self) -> str:
        """The Messages API base URL of ``astrid llm generate`` (the ``llm`` capsule):
        ``[llm] base_url``, else the gateway sessions use (``[claude] env``
        ``ANTHROPIC_BASE_URL``), so one setting serves both; "" = the SDK's default."""
        return self.llm.base_url or self.claude.env.get("ANTHROPIC_BASE_URL", "")

    @property
    def socket_path(self) -> Path:
        if self.supervisor.socket:
            return self._resolve(self.supervisor.socket)
        return self.state_dir / "run" / "astrid.sock"

    @property
    def audit_path(self) -> Path:
        return self.state_dir / "audit.db"

    @property
    def state_db_path(self) -> Path:
        return self.state_dir / "state.db"

    @property
    def keys_dir(self) -> Path:
        return self.state_dir / "keys"

    @property
    def forge_dir(self) -> Path:
        root = Path(self.forge.root).expanduser()
        return root if root.is_absolute() else self.state_dir / root

    @property
    def secrets_path(self) -> Path:
        return self.state_dir / "secrets.db"

    @property
    def usage_path(self) -> Path:
        return self.state_dir / "usage.db"

    def principal(self, name: str) -> PrincipalConfig | None:
        for principal in self.principals:
            if principal.name == name:
                return principal
        return None

    @property
    def homes_dir(self) -> Path | None:
        """The folder of the default homes when it is sage's own (in the state folder)."""
        homes = Path(os.path.normpath(self.state_dir / Path(self.sessions.homes).expanduser()))
        return homes if homes.is_relative_to(self.state_dir) and homes != self.state_dir else None

    def home_of(self, principal: PrincipalConfig) -> Path:
        if principal.home:
            return self._resolve(principal.home)
        homes = Path(self.sessions.homes).expanduser()
        base = homes if homes.is_absolute() else self.state_dir / homes
        return base / principal.name

    def principals_for_uid(self, uid: int) -> frozenset[str]:
        """Names of the principals ``uid`` may act for (admins: all of them)."""
        if self.is_admin(uid):
            return frozenset(p.name for p in self.principals)
        return frozenset(p.name for p in self.principals if uid in p.uids)

    def is_admin(self, uid: int) -> bool:
        return uid in self.supervisor.admins or uid == os.getuid()


def _path_of(message: str) -> str:
    match = re.search(r"at `\$\.?([^`]*)`", message)
    return match.group(1) if match else ""


def _section_type(field: str) -> type[msgspec.Struct] | None:
    """The Struct a path such as ``claude`` or ``principals[0]`` names."""
    cls: Any = Config
    for part in filter(None, re.split(r"\.|\[\d+\]", field)):
        match = next((f for f in msgspec.structs.fields(cls) if f.encode_name == part), None)
        if match is None:
            return None
        kind = match.type
        args = get_args(kind)
        cls = args[0] if args and isinstance(args[0], type) else kind
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            return None
    return cls if isinstance(cls, type) and issubclass(cls, msgspec.Struct) else None


def _valid_values(field: str, reason: str) -> str:
    """``; one of: a, b, c`` for a value outside a key's fixed set (a Literal)."""
    if not reason.startswith("Invalid enum value") or "." not in field:
        return ""
    section, _, key = field.rpartition(".")
    owner = _section_type(section)
    if owner is None:
        return ""
    match = next((f for f in msgspec.structs.fields(owner) if f.encode_name == key), None)
    values = _literal_values(match.type) if match is not None else []
    return f"; one of: {', '.join(map(str, values))}" if values else ""


def _literal_values(kind: Any) -> list[Any]:
    """The values a ``Literal`` (inside a list or an Optional too) allows."""
    if get_origin(kind) is Literal:
        return list(get_args(kind))
    for inner in get_args(kind):
        found = _literal_values(inner)
        if found:
            return found
    return []


def _nearest_key(field: str, unknown: str) -> str:
    """`` (did you mean `x`?)`` for a misspelt key: in its own section, else in another."""
    import difflib  # only for a config that has a misspelt key

    own = _section_type(field)
    if own is not None:
        names = [f.encode_name for f in msgspec.structs.fields(own)]
        close = difflib.get_close_matches(unknown, names, n=1, cutoff=0.6)
        if close:
            return f" (did you mean `{close[0]}`?)"
    for section in msgspec.structs.fields(Config):
        cls = _section_type(section.encode_name)
        if cls is None or cls is own:
            continue
        names = [f.encode_name for f in msgspec.structs.fields(cls)]
        close = difflib.get_close_matches(unknown, names, n=1, cutoff=0.8)
        if close:
            table = (
                f"[[{section.encode_name}]]"
                if section.encode_name == "principals"
                else (f"[{section.encode_name}]")
            )
            return f" (did you mean `{close[0]}` under {table}?)"
    return ""


def decode_config(data: bytes | str, *, source: str = "<config>", base_dir: str = "") -> Config:
    """Decode TOML text into a :class:`Config`, or raise one clear ConfigError."""
    try:
        config = msgspec.toml.decode(data, type=Config)
    except msgspec.ValidationError as exc:
        text = str(exc)
        field = _path_of(text)
        reason = re.sub(r"\s*-\s*at `[^`]*`$", "", text)
        where = f"{field}: " if field else ""
        unknown = re.search(r"unknown field `([^`]+)`", reason)
        hint = _nearest_key(field, unknown.group(1)) if unknown else _valid_values(field, reason)
        raise ConfigError(f"{source}: {where}{reason}{hint}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    if config.base_dir:
        raise ConfigError(f"{source}: base_dir: set by the loader, not allowed in a file")
    return msgspec.structs.replace(config, base_dir=base_dir)


def load_config(path: str | os.PathLike[str] | None = None) -> Config:
    """Load ``path``, or ``$ASTRID_CONFIG``, or the embedded defaults."""
    chosen = os.fspath(path) if path is not None else os.environ.get("ASTRID_CONFIG", "")
    if not chosen:
        return Config()
    file = Path(chosen)
    try:
        data = file.read_bytes()
    except OSError as exc:
        hint = ""
        if path is None and not file.is_absolute():  # set once, read from wherever we are
            hint = (
                f" (ASTRID_CONFIG={chosen} is relative, so it is read from the current"
                f" folder, {os.getcwd()}; export it absolute: export"
                f" ASTRID_CONFIG=$PWD/{chosen} in the folder that holds it)"
            )
        raise ConfigError(f"{chosen}: cannot read: {exc.strerror}{hint}") from exc
    return decode_config(data, source=chosen, base_dir=str(file.resolve().parent))
