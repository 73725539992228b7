"""Hook envelope validation: pure functions, no bus and no state store.

The capsule (capsule.py) hands each envelope from ``sage.v1.hook.<event>``
to :func:`parse`, looks up the session's token record, and hands both to
:func:`verify`.  Either raises :class:`HookRejected` with one of
:data:`REASONS`; the checks run in this order, the first failure wins:

1. ``malformed``: the payload is not a JSON object of the envelope's shape
   (``{hook, payload, correlation_id?, principal_id, session_id, token, truncated?}``,
   each a string where one is expected, ``truncated`` a boolean).
2. ``bad_session_id``: ``session_id`` does not match ``[A-Za-z0-9_-]{1,64}``.
3. ``unknown_hook``: ``hook`` is not a Claude Code hook event
   (:data:`KNOWN_HOOKS`, the CamelCase form astrid-emit sends, e.g.
   ``PreToolUse``), or differs from the topic's last token, or from the
   hook payload's own ``hook_event_name`` when it has one.
4. ``missing_token``: ``token`` is empty or absent.
5. ``unknown_or_ended_session``: no ``hook_tokens`` record for the session
   (never spawned, or ended: the runner scrubs the record when a session
   ends, so this is also what replaying an ended session's token gets).
6. ``bad_token``: SHA-256 of the token is not the stored hex digest
   (compared with :func:`hmac.compare_digest`, constant time).
7. ``principal_mismatch``: the claimed ``principal_id`` is not the record's,
   or the bus verified a principal for the publisher's connection
   (``envelope.principal``) and it is not the record's.

:func:`republished` builds the canonical payload for
``hook.v1.event.<mapped>`` (:func:`event_name`); :func:`spoof_report` the
audit payload of ``sage.v1.audit.hook_spoof_attempt``.  Both live in
:mod:`sage.claude.hooks`, shared with the runner's in-band hooks, so a hook
reads the same on the bus whichever way it came.  Neither ever holds
the token: a report field that contains the claimed token (when it is at
least :data:`~sage.claude.hooks.TOKEN_MIN` characters, as a minted one is) becomes
``<redacted>`` (:data:`sage.redaction.REDACTED`), and in a republished hook
payload (a ``PostToolUse`` tool response could echo the child's environment)
each occurrence of the token is replaced by it too.

Payload limit: the bus caps the whole envelope (``[bus] max_payload``); on
top of that the republished ``payload`` field (Claude's hook input) is kept
only if its JSON is at most :data:`PAYLOAD_LIMIT` bytes.  A larger one is
dropped, not cut: the event is still republished, with ``payload: null``
and ``truncated: true``, so subscribers learn the hook fired without
receiving half a JSON document.  astrid-emit drops such an input itself
(and one it could not read whole) and says so with ``truncated: true`` in
the envelope, which is honoured the same way.  ``truncated`` is absent
otherwise.
"""

from __future__ import annotations

import hmac
import re
from typing import Any

import msgspec

from sage.claude.hooks import (
    CANONICAL_NAMES,
    FIELD_LIMIT,
    KNOWN_HOOKS,
    PAYLOAD_LIMIT,
    HookRejected,
    event_name,
    hash_token,
    hook_event,
    spoof_report,
)

__all__ = (
    "CANONICAL_NAMES",
    "FIELD_LIMIT",
    "KNOWN_HOOKS",
    "PAYLOAD_LIMIT",
    "REASONS",
    "TOPIC_PREFIX",
    "HookEnvelope",
    "HookRejected",
    "event_name",
    "parse",
    "republished",
    "spoof_report",
    "verify",
)

TOPIC_PREFIX = "sage.v1.hook."
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

REASONS = (
    "malformed",
    "bad_session_id",
    "unknown_hook",
    "missing_token",
    "unknown_or_ended_session",
    "bad_token",
    "principal_mismatch",
)


class HookEnvelope(msgspec.Struct, frozen=True):
    """What astrid-emit publishes on ``sage.v1.hook.<event>``; every field a claim."""

    hook: str = ""
    payload: Any = None
    correlation_id: str | None = None
    principal_id: str = ""
    session_id: str = ""
    token: str = ""
    truncated: bool = False
    """astrid-emit left the hook input out (over :data:`PAYLOAD_LIMIT`, or cut)."""


def _claims(raw: bytes) -> dict[str, str]:
    """The string fields a malformed envelope still has, for the report."""
    try:
        data: Any = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return {}
    if not isinstance(data, dict):
        return {}
    keys = ("principal_id", "session_id", "hook", "token")
    return {key: data[key] for key in keys if isinstance(data.get(key), str)}


def parse(topic: str, raw: bytes) -> HookEnvelope:
    """Decode and check the envelope on ``topic``; raise HookRejected (checks 1-4)."""
    try:
        envelope = msgspec.json.decode(raw, type=HookEnvelope)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        claims = _claims(raw)
        raise HookRejected(
            "malformed",
            claims.get("principal_id", ""),
            claims.get("session_id", ""),
            claims.get("hook", ""),
            claims.get("token", ""),
        ) from None

    def rejected(reason: str) -> HookRejected:
        return HookRejected(
            reason, envelope.principal_id, envelope.session_id, envelope.hook, envelope.token
        )

    if not SESSION_ID.fullmatch(envelope.session_id):
        raise rejected("bad_session_id")
    hook = envelope.hook
    named = envelope.payload.get("hook_event_name") if isinstance(envelope.payload, dict) else None
    if (
        hook not in KNOWN_HOOKS
        or topic != TOPIC_PREFIX + hook
        or (named is not None and named != hook)
    ):
        raise rejected("unknown_hook")
    if not envelope.token:
        raise rejected("missing_token")
    return envelope


def verify(envelope: HookEnvelope, record: Any, verified_principal: str | None) -> str:
    """Check the token and principal against the session's ``hook_tokens`` record
    (``{"sha256": hex, "principal_id": name}`` or None); return the principal
    or raise HookRejected (checks 5-7)."""

    def rejected(reason: str) -> HookRejected:
        return HookRejected(
            reason, envelope.principal_id, envelope.session_id, envelope.hook, envelope.token
        )

    if not isinstance(record, dict):
        raise rejected("unknown_or_ended_session")
    stored, principal = record.get("sha256"), record.get("principal_id")
    if not isinstance(stored, str) or not isinstance(principal, str) or not principal:
        raise rejected("unknown_or_ended_session")
    digest = hash_token(envelope.token).encode()
    if not hmac.compare_digest(digest, stored.encode()):
        raise rejected("bad_token")
    if envelope.principal_id != principal:
        raise rejected("principal_mismatch")
    if verified_principal is not None and verified_principal != principal:
        raise rejected("principal_mismatch")
    return principal


def republished(envelope: HookEnvelope, principal: str) -> dict[str, Any]:
    """The canonical payload for ``hook.v1.event.<mapped>`` of a validated envelope."""
    return hook_event(
        envelope.hook,
        envelope.payload,
        correlation_id=envelope.correlation_id,
        principal_id=principal,
        session_id=envelope.session_id,
        decision_source="token",
        token=envelope.token,
        truncated=envelope.truncated,
    )
