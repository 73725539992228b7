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
audit payload of ``sage.v1.audit.hook_spoof_attempt``.  Neither ever holds
the token: a report field that contains the claimed token (when it is at
least :data:`TOKEN_MIN` characters, as a minted one is) becomes
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

from sage.claude.hooks import KNOWN_HOOKS, PAYLOAD_LIMIT, hash_token
from sage.errors import RequestError
from sage.redaction import REDACTED

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
FIELD_LIMIT = 128
"""Characters kept of each field of a spoof report."""
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOKEN_MIN = 16
"""Claimed tokens at least this long are redacted wherever they appear."""

REASONS = (
    "malformed",
    "bad_session_id",
    "unknown_hook",
    "missing_token",
    "unknown_or_ended_session",
    "bad_token",
    "principal_mismatch",
)


CANONICAL_NAMES = {
    "PreToolUse": "before_tool_call",
    "PostToolUse": "after_tool_call",
    "UserPromptSubmit": "message_received",
    "Stop": "session_end",
    "SubagentStop": "subagent_stop",
    # snake_case would be session_end, which Stop already names
    "SessionEnd": "claude_session_end",
}
"""The last token of ``hook.v1.event.<mapped>`` where it is not the hook's snake_case."""


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


class HookRejected(RequestError):
    """An envelope that is dropped and audited, with what it claimed; ``code``
    is one of :data:`REASONS`."""

    def __init__(
        self,
        code: str,
        claimed_principal: str = "",
        claimed_session: str = "",
        hook: str = "",
        token: str = "",
    ) -> None:
        super().__init__(code, code=code)  # the message is the reason alone, never a claim
        self.claimed_principal = claimed_principal
        self.claimed_session = claimed_session
        self.hook = hook
        self.token = token
        """Only so the report can redact it; never reported."""


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def event_name(hook: str) -> str:
    """The ``<mapped>`` token of ``hook.v1.event.<mapped>`` for a known hook."""
    return CANONICAL_NAMES.get(hook) or _snake(hook)


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


def _without_token(value: Any, data: bytes, token: str) -> Any:
    """``value`` (encoded: ``data``) with every occurrence of ``token`` replaced."""
    needle = token.encode()
    if not _secret_like(token) or needle not in data:
        return value
    # minted tokens are urlsafe base64: JSON never escapes their characters, so
    # a byte replace inside the encoded text stays valid JSON
    return msgspec.json.decode(data.replace(needle, REDACTED.encode()))


def _secret_like(token: str) -> bool:
    """Long enough to be a minted token (43 characters); a forged "a" must not
    redact every claim that has an "a" in it."""
    return len(token) >= TOKEN_MIN


def republished(envelope: HookEnvelope, principal: str) -> dict[str, Any]:
    """The canonical payload for ``hook.v1.event.<mapped>`` of a validated envelope."""
    correlation = envelope.correlation_id
    payload = envelope.payload
    if correlation is None and isinstance(payload, dict):  # as the in-band path does
        tool_use = payload.get("tool_use_id")
        if isinstance(tool_use, str) and 0 < len(tool_use) <= FIELD_LIMIT:
            correlation = tool_use
    out: dict[str, Any] = {
        "hook": envelope.hook,
        "payload": None,
        "correlation_id": correlation,
        "principal_id": principal,
        "session_id": envelope.session_id,
        "decision_source": "token",
    }
    data = msgspec.json.encode(payload)
    if envelope.truncated or len(data) > PAYLOAD_LIMIT:
        out["truncated"] = True
    else:
        out["payload"] = _without_token(payload, data, envelope.token)
    return out


def _field(value: str, token: str) -> str:
    if _secret_like(token) and token in value:
        return REDACTED
    return value[:FIELD_LIMIT]


def spoof_report(rejection: HookRejected, source: str) -> dict[str, Any]:
    """The ``sage.v1.audit.hook_spoof_attempt`` payload: claims cut to 128 characters."""
    token = rejection.token
    return {
        "claimed_principal": _field(rejection.claimed_principal, token),
        "claimed_session": _field(rejection.claimed_session, token),
        "hook": _field(rejection.hook, token),
        "reason": rejection.code,
        "source": _field(source, token),
    }
