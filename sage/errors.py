"""The one error hierarchy of sage.

Every error sage and its capsules raise on purpose derives from
:class:`SageError` and carries one machine-readable reason, ``code``
(a class default each family names, overridable per instance); the CLI and
the supervisor turn it into one clear line for the user, and a capsule turns
it into the one failure reply (:func:`sage.replies.from_error`).  Families
name the part that failed:

- :class:`ConfigError` (and the tool bridge's ``PolicyError``, a policy file
  that cannot be used), :class:`ProtocolError`, :class:`ProcessError`,
  :class:`AuditError`, :class:`StateError`: the daemon's parts;
- :class:`IllegalTransition`: a state machine was asked for a change its
  transition table does not allow (a capsule's, a session's, a claim's: every
  table raises this one class);
- :class:`ForgeError` and :class:`SandboxError`: the forge;
- :class:`FleetError`: the fleet (sage/fleet/), with a class for each reason
  another part acts on: the fleet could not be joined (:class:`FleetUnreachable`,
  :class:`FleetAuthFailed`, :class:`FleetNoAuth`), cannot be asked now (:class:`FleetUnavailable`), a
  race in a bucket was lost (:class:`FleetRaceLost`), a key is not there
  (:class:`FleetNotFound`), a peer floods (:class:`FleetBusy`), two nodes claim a
  session (:class:`SessionConflict`), a node may not act for a principal
  (:class:`NotVouched`), a name must not be routed (:class:`BadRoute`), a node
  record cannot be used (:class:`FleetRecordError`); :class:`NotInFleet` on a
  single host.  nats-py's own exceptions become these at one boundary,
  sage/fleet/nats_errors.py;
- :class:`RequestError`: a capsule refused what it was sent (a forged hook
  envelope, a schema that does not compile, an unknown model); the capsules
  subclass it (``HookRejected``, ``SchemaError``, ``UnknownModel``);
- :class:`UpstreamError`: a service sage calls failed (the Messages API's
  stream broke off: ``IncompleteStream``).

Others derive from :class:`SageError` directly, each with its own ``code``
(``SecretError``, ``ToolError``, ``InstallFailed``, ``AlreadyRunning``,
:class:`sage.replies.ReplyError`).

Third-party errors are translated at the boundary (``raise AuditError(...)
from exc``).  The bus library (``bus/``) is independent of sage and has its
own root, :class:`bus.BusError`.
"""

from __future__ import annotations

__all__ = (
    "AuditError",
    "BadRoute",
    "ConfigError",
    "FleetAuthFailed",
    "FleetBusy",
    "FleetError",
    "FleetNoAuth",
    "FleetNotFound",
    "FleetRaceLost",
    "FleetRecordError",
    "FleetStreamUnsafe",
    "FleetTlsFailed",
    "FleetUnavailable",
    "FleetUnreachable",
    "ForgeError",
    "IllegalTransition",
    "NotInFleet",
    "NotVouched",
    "ProcessError",
    "ProtocolError",
    "RequestError",
    "SageError",
    "SandboxError",
    "SessionConflict",
    "StateError",
    "UpstreamError",
)


class SageError(Exception):
    """Root of every error sage raises on purpose.

    ``code`` is the one machine-readable reason (snake_case, stable: replies on the
    bus and the CLI's ``--json`` carry it); each class names its default and an
    instance may be more precise (``SageError("...", code="name_taken")``).
    """

    code: str = "error"

    def __init__(self, message: str = "", *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class ConfigError(SageError):
    """The configuration is invalid; the message names the field."""

    code = "config_invalid"


class ProtocolError(SageError):
    """A peer sent something the protocol does not allow."""

    code = "protocol_error"


class ProcessError(SageError):
    """A child process could not be started or supervised."""

    code = "process_failed"


class AuditError(SageError):
    """The audit log could not be written or read."""

    code = "audit_failed"


class StateError(SageError):
    """The state store could not be opened, read or written."""

    code = "state_failed"


class IllegalTransition(SageError):
    """A state machine was asked for a change its transition table does not allow: a
    bug in its caller, never a user's mistake.  ``machine`` names which one (``capsule
    echo``, ``session s1``, ``claim s1``); ``old`` and ``new`` are the states."""

    code = "illegal_transition"

    def __init__(self, machine: str, old: str, new: str) -> None:
        super().__init__(f"{machine}: {old} -> {new} is not a legal transition")
        self.machine = machine
        self.old = old
        self.new = new


class RequestError(SageError):
    """A capsule refused a request: ``code`` says why (``bad_request``, ...)."""

    code = "bad_request"


class UpstreamError(SageError):
    """A service sage relies on (an API, its response stream) failed."""

    code = "upstream_failed"


class ForgeError(SageError):
    """A forge operation was refused; ``code`` is the reason (``name_taken``,
    ``static_check_failed``, ``validation_failed``, ...).

    Raised as ``ForgeError(code, message)``: every forge refusal names its code.
    """

    code = "forge_failed"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)


class SandboxError(ForgeError):
    """The sandbox could not be set up or run (bwrap missing or refused, a bad mount)."""

    code = "sandbox_failed"


# -- the fleet ---------------------------------------------------------------------


class FleetError(SageError):
    """The fleet could not be joined, read or written (sage/fleet/)."""

    code = "fleet_failed"
    what: str = ""
    """What was being done (``the sage_claims bucket``), when nats-py's error was mapped."""


class FleetUnreachable(FleetError):
    """No NATS server of ``[fleet] url`` answered within ``connect_timeout``."""

    code = "fleet_unreachable"


class FleetAuthFailed(FleetError):
    """The NATS servers refused the node's user or password."""

    code = "fleet_auth_failed"


class FleetTlsFailed(FleetError):
    """TLS with the NATS servers failed, or a server answered without TLS where
    ``[fleet]`` wants it (nothing secret was sent)."""

    code = "fleet_tls_failed"


class FleetNoAuth(FleetError):
    """``[fleet]`` names no credentials (no ``password_file``, ``nkey_seed`` or ``creds``)
    and does not say ``insecure_no_auth = true``: the supervisor does not start, since on
    a server without authorization any client may act as any node (sage/fleet/auth.py)."""

    code = "fleet_no_credentials"


class NotInFleet(FleetError):
    """This supervisor has no ``[fleet]``: a single host."""

    code = "not_in_fleet"


class FleetUnavailable(FleetError):
    """The fleet cannot be asked now: NATS is not connected, nobody answered (no
    responders, or not in time), or a server refused for a reason of its own."""

    code = "fleet_unavailable"
    no_responders: bool = False
    """Nobody answered at once: no responders (is the node running?)."""
    timed_out: bool = False
    """No answer within the deadline."""
    not_ready: bool = False
    """JetStream is not ready yet (no responders, unavailable, no peers yet for the
    replicas): asked again, it may answer."""


class FleetRaceLost(FleetError):
    """A write that named the revision it read found the key written meanwhile: another
    node won the race (``sage_claims``)."""

    code = "fleet_race_lost"


class FleetNotFound(FleetError):
    """A key, bucket or object that is not there; ``revision``: a deleted key's delete
    marker's (what a write that replaces it names), else 0."""

    code = "fleet_not_found"

    def __init__(self, message: str = "", *, revision: int = 0) -> None:
        super().__init__(message)
        self.revision = revision


class FleetStreamUnsafe(FleetError):
    """A stream the fleet uses was found with settings weaker than it needs (rollups,
    purges or deletes allowed, limits, memory storage...): the message names each
    setting and the fix (sage/fleet/streams.py)."""

    code = "fleet_stream_unsafe"


class FleetBusy(FleetError):
    """A peer has too many requests or tool calls in flight on this node."""

    code = "fleet_busy"


class SessionConflict(FleetError):
    """Two live nodes claim one session: a request for it is forwarded to neither."""

    code = "session_conflict"


class NotVouched(FleetError):
    """A node forwarded a request or tool call for a principal it may not vouch for."""

    code = "principal_not_authenticated"


class BadRoute(FleetError):
    """A node name, session id or subject that must not be routed."""

    code = "bad_request"


class FleetRecordError(FleetError):
    """A node's heartbeat record that cannot be used (the message says why)."""

    code = "fleet_record_invalid"
