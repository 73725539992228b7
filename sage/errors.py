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
- :class:`CapsuleError`: a capsule's lifecycle (an illegal transition);
- :class:`ForgeError` and :class:`SandboxError`: the forge;
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
    "CapsuleError",
    "ConfigError",
    "ForgeError",
    "ProcessError",
    "ProtocolError",
    "RequestError",
    "SageError",
    "SandboxError",
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


class CapsuleError(SageError):
    """A capsule was asked to do what its lifecycle does not allow."""

    code = "illegal_transition"


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
