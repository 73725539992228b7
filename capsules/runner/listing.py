"""The listing rows of sessions: what ``sessions`` and ``session.<sid>`` answer.

A live session's row (:func:`live_row`) is its child's description with the
session's own totals, and the state :func:`listed_state` gives it; the fleet's
slots reply counts sessions by that same state (capsules/runner/fleet_side.py),
so a node's heartbeat and ``astrid sage list`` never disagree.  An ended
session's row (:func:`ended_row`) is its stored record.  Rows are built only for
the page asked for: a host may hold thousands of sessions.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from capsules.runner.errors import SessionError
from capsules.runner.history import EventHistory
from capsules.runner.messages import SessionRequest, SessionsRequest
from capsules.runner.sessions import (
    ASLEEP,
    Session,
    SessionRecord,
    SessionState,
    SessionTable,
    valid_id,
)
from sage.errors import SageError
from sage.state import StateStore

__all__ = (
    "ended_row",
    "ended_text",
    "listed_state",
    "live_row",
    "page",
    "session_reply",
    "sessions_reply",
    "visible_record",
)


def listed_state(session: Session) -> str:
    """The state a session's listing row shows: its child's (``ready``, ``busy``, ...),
    or between children the session's own (``hibernated``, ``waking``, ``respawning``)."""
    if session.state in ASLEEP or session.state in (
        SessionState.WAKING,
        SessionState.RESPAWNING,
    ):
        return session.state.value
    return session.proc.state.value if session.proc is not None else "starting"


def live_row(session: Session, now: float | None = None) -> dict[str, Any]:
    """The row of a session in the table (hibernated ones too)."""
    proc = session.proc
    row: dict[str, Any] = (
        proc.describe()
        if proc is not None
        else {
            "session_id": session.id,
            "principal_id": session.record.principal_id,
            "pid": None,
            "state": "starting",
        }
    )
    row["state"] = listed_state(session)
    # the turns and cost of the whole session, its earlier children's included
    row["turns"], row["cost_usd"] = session.totals()
    row["started_at"] = session.record.started_at
    now = time.time() if now is None else now
    row["age_s"] = round(now - session.record.started_at, 1)  # the session's
    row["hibernated_at"] = session.record.hibernated_at
    row["cwd"] = session.record.cwd
    row["model"] = session.record.model
    return row


def ended_row(record: SessionRecord) -> dict[str, Any]:
    """The row of an ended session: its stored record."""
    return {
        "session_id": record.session_id,
        "principal_id": record.principal_id,
        "state": record.state,
        "reason": record.reason,
        "exit_code": record.exit_code,
        "signal": record.signal,
        "turns": record.turns,
        "cost_usd": record.cost_usd,
        "started_at": record.started_at,
        "ended_at": record.ended_at,
        "pid": None,
        "cwd": record.cwd,
        "model": record.model,
    }


def ended_text(record: SessionRecord) -> str:
    """How an ended session ended, for a ``session_ended`` refusal."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.ended_at or 0.0))
    how = f"exit code {record.exit_code}" if record.exit_code is not None else ""
    if record.signal is not None:
        how = f"signal {record.signal}"
    return f"ended at {when} ({record.reason}{', ' + how if how else ''})"


def page(
    live: list[Session], ended: list[dict[str, Any]], offset: int, limit: int
) -> dict[str, Any]:
    """One page of the live rows then the ended ones (newest first): only its rows are
    built.  ``ended`` holds stored records, as the store gives them."""
    total = len(live) + len(ended)
    start, end = offset, offset + limit
    rows = [live_row(s) for s in live[start:end]]
    rows += [
        ended_row(msgspec.convert(value, SessionRecord))
        for value in ended[max(0, start - len(live)) : max(0, end - len(live))]
    ]
    more = end < total
    return {"ok": True, "sessions": rows, "total": total, "next_offset": end if more else None}


async def sessions_reply(
    state: StateStore, table: SessionTable, principal: str | None, req: SessionsRequest
) -> dict[str, Any]:
    """``sage.v1.request.sessions``: the caller's sessions (``principal`` None: an
    admin's, all of them), the ended ones kept too when ``all``.  The live ones are
    taken before the store is read: a session that ends meanwhile leaves the table
    before its record says ``ended``, and must not fall between the two."""
    live = table.visible_to(principal)
    ended: list[dict[str, Any]] = []
    if req.all:
        try:
            stored = await state.items("sessions")
        except SageError as exc:
            raise SessionError("state_failed", str(exc)) from None
        ended = sorted(
            (
                value
                for _, value in stored
                if isinstance(value, dict)
                and value.get("state") == "ended"
                and principal in (None, value.get("principal_id"))
            ),
            key=lambda value: value.get("ended_at") or 0.0,
            reverse=True,
        )
    return page(live, ended, req.offset, req.limit)


async def session_reply(
    state: StateStore,
    table: SessionTable,
    history: EventHistory,
    principal: str | None,
    sid: str,
    req: SessionRequest,
) -> dict[str, Any]:
    """``sage.v1.request.session.<sid>``: one session, live or ended, and its last
    events (``replay``) for watch."""
    session = table.visible(sid, principal)
    if session is not None:
        row = live_row(session)
    else:
        record = await visible_record(state, principal, sid)
        if record is None:
            raise SessionError("unknown_session", f"no session {sid!r}")
        row = ended_row(record)
    return {"ok": True, "session": row, "events": history.last(sid, req.replay)}


async def visible_record(
    state: StateStore, principal: str | None, sid: str
) -> SessionRecord | None:
    """The stored record of session ``sid`` if ``principal`` may see it (its own, or
    an admin's: None); another principal's looks like none."""
    if not valid_id(sid):
        return None
    try:
        value = await state.get("sessions", sid)
        record = msgspec.convert(value, SessionRecord) if isinstance(value, dict) else None
    except (SageError, msgspec.ValidationError):
        return None
    if record is None or principal not in (None, record.principal_id):
        return None
    return record
