"""The runner's errors: a request a session cannot carry out, a state change its
table forbids.  Both are :class:`~sage.errors.SageError` with a ``code``."""

from __future__ import annotations

from sage.errors import SageError

__all__ = ("IllegalTransition", "SessionError")


class SessionError(SageError):
    """A request the session cannot carry out; ``code`` is the reason on the wire."""

    code = "session_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)


class IllegalTransition(SageError):
    """A state machine was asked for a change its transition table does not allow:
    a bug in the runner, never a user's mistake."""

    code = "illegal_transition"

    def __init__(self, machine: str, old: str, new: str) -> None:
        super().__init__(f"{machine}: {old} -> {new} is not a legal transition")
        self.old = old
        self.new = new
