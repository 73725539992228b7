"""The runner's error: a request a session cannot carry out, a
:class:`~sage.errors.SageError` whose ``code`` is the reason on the wire (a state
change a table forbids is :class:`sage.errors.IllegalTransition`, as for every table)."""

from __future__ import annotations

from sage.errors import SageError

__all__ = ("SessionError",)


class SessionError(SageError):
    """A request the session cannot carry out; ``code`` is the reason on the wire."""

    code = "session_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code=code)
