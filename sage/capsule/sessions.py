"""Whose session an id names: the check a capsule makes before it acts on a claimed session.

A request's ``session_id`` is the caller's claim; its principal is the one the
bus verified.  The id names the caller's session only if the runner's record
(state namespace ``sessions``) or a REPL session's token record
(``hook_tokens``) of that id belongs to that principal.  The answer is the same
for another principal's session and for none, so the check reveals nothing.
"""

from __future__ import annotations

from sage.state import StateStore

__all__ = ("SESSION_NAMESPACES", "foreign_session", "session_owner")

SESSION_NAMESPACES = ("sessions", "hook_tokens")
"""Where sessions are recorded: the runner's headless ones, then REPL ones."""


async def session_owner(state: StateStore, session_id: str) -> str | None:
    """The principal whose session ``session_id`` is, or None (no such session)."""
    for namespace in SESSION_NAMESPACES:
        record = await state.get(namespace, session_id)
        if isinstance(record, dict):
            owner = record.get("principal_id")
            return owner if isinstance(owner, str) else None
    return None


async def foreign_session(
    state: StateStore, session_id: str | None, principal: str | None
) -> str | None:
    """Why ``session_id`` is not a session of ``principal`` (``unknown_session: ...``), else
    None; no session id at all is fine.  A state store error propagates (a SageError)."""
    if session_id is None:
        return None
    if principal is not None and await session_owner(state, session_id) == principal:
        return None
    who = f"principal {principal!r}" if principal is not None else "a caller without one"
    return f"unknown_session: {session_id!r} is not a session of {who}"
