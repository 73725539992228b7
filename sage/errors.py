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
    """Root of every error sage raises on purpose."""


class ConfigError(SageError):
    """The configuration is invalid; the message names the field."""


class ProtocolError(SageError):
    """A peer sent something the protocol does not allow."""


class ProcessError(SageError):
    """A child process could not be started or supervised."""


class AuditError(SageError):
    """The audit log could not be written or read."""


class StateError(SageError):
    """The state store could not be opened, read or written."""


class ForgeError(SageError):
    """A forge operation was refused; ``kind`` is the machine-readable reason
    (``name_taken``, ``static_check_failed``, ``validation_failed``, ...)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class SandboxError(ForgeError):
    """The sandbox could not be set up or run (bwrap missing or refused, a bad mount)."""
