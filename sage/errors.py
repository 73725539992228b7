"""The one error hierarchy of sage.

Every error sage raises on purpose derives from :class:`SageError`; the CLI
and the supervisor turn it into one clear line for the user.  Families name
the part that failed.  Third-party errors are translated at the boundary
(``raise AuditError(...) from exc``).  The bus library (``bus/``) is
independent of sage and has its own root, :class:`bus.BusError`.
"""

from __future__ import annotations

__all__ = (
    "AuditError",
    "ConfigError",
    "ForgeError",
    "ProcessError",
    "ProtocolError",
    "SageError",
    "SandboxError",
    "StateError",
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


class ForgeError(SageError):
    """A forge operation was refused; ``kind`` is the machine-readable reason
    (``name_taken``, ``static_check_failed``, ``validation_failed``, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class SandboxError(ForgeError):
    """The sandbox could not be set up or run (bwrap missing or refused, a bad mount)."""
