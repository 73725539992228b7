"""Claude Code hook events, hook tokens (minted per ``claude`` child, stored only as
their SHA-256) and what a hook becomes on the bus: shared by the runner (hooks in-band,
answered over the control protocol), the hooks capsule (astrid-emit's envelopes) and
the installer (command hooks for REPL principals).

A hook reaches sage one of two ways, and both end as the same
``hook.v1.event.<mapped>`` payload (:func:`hook_event`) or the same
``sage.v1.audit.hook_spoof_attempt`` report (:class:`HookRejected`,
:func:`spoof_report`):

- **in-band**: a headless session's ``initialize`` registers one callback per
  event of :data:`IN_BAND_HOOKS` (id ``hook_<Event>``, :func:`callback_id`); the
  CLI sends each as a ``hook_callback`` control request on its stdout, which the
  runner checks with :func:`in_band_hook` (``decision_source: "in_band"``);
- **command hooks**: a REPL session has no control channel, so the installer
  writes ``astrid-emit <Event>`` command hooks; the hooks capsule checks each
  envelope's token (``decision_source: "token"``).
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping
from typing import Any

import msgspec

from sage.claude.binary import version_key
from sage.errors import RequestError
from sage.redaction import REDACTED

__all__ = (
    "CANONICAL_NAMES",
    "FIELD_LIMIT",
    "HOOK_EVENTS_SINCE",
    "IN_BAND_HOOKS",
    "IN_BAND_REASONS",
    "KNOWN_HOOKS",
    "NOTIFICATION_TOPIC",
    "PAYLOAD_LIMIT",
    "SPOOF_TOPIC",
    "TOKEN_MIN",
    "UNHOOKED",
    "HookRejected",
    "callback_id",
    "event_name",
    "hash_token",
    "hook_event",
    "hooks_known_by",
    "in_band_hook",
    "mint_token",
    "spoof_report",
)

PAYLOAD_LIMIT = 64 * 1024
"""Bytes of JSON a republished hook input may have; a larger one is dropped
(``payload: null, truncated: true``), by astrid-emit already."""

KNOWN_HOOKS = frozenset(
    {
        # the events of the original contract
        "PreToolUse",
        "PostToolUse",
        "UserPromptSubmit",
        "Notification",
        "Stop",
        "SubagentStop",
        "PreCompact",
        "SessionStart",
        "SessionEnd",
        # later additions of the Claude Code hooks reference
        "PermissionRequest",
        "PermissionDenied",
        "PostToolUseFailure",
        "StopFailure",
        "SubagentStart",
        "PostCompact",
        "TeammateIdle",
        "TaskCreated",
        "TaskCompleted",
        "InstructionsLoaded",
        "ConfigChange",
        "CwdChanged",
        "FileChanged",
        "WorktreeCreate",
        "WorktreeRemove",
        "Elicitation",
        "ElicitationResult",
        # accepted by the 2.1.328 CLI too (its settings validator lists them)
        "PostToolBatch",
        "UserPromptExpansion",
        "PreModelSwitch",
        "PostModelSwitch",
        "Setup",
        "DirectoryAdded",
        "MessageDisplay",
    }
)
"""Claude Code hook event names, as ``hook_event_name`` spells them."""

_BASE = "2.1.0"
HOOK_EVENTS_SINCE: dict[str, str] = {
    **dict.fromkeys(
        (
            "PreToolUse",
            "PostToolUse",
            "PostToolUseFailure",
            "UserPromptSubmit",
            "Notification",
            "Stop",
            "SubagentStart",
            "SubagentStop",
            "PreCompact",
            "SessionStart",
            "SessionEnd",
            "PermissionRequest",
        ),
        _BASE,
    ),
    **dict.fromkeys(
        (
            "ConfigChange",
            "CwdChanged",
            "Elicitation",
            "ElicitationResult",
            "FileChanged",
            "InstructionsLoaded",
            "PermissionDenied",
            "PostCompact",
            "Setup",
            "StopFailure",
            "TaskCompleted",
            "TaskCreated",
            "TeammateIdle",
            "WorktreeCreate",
            "WorktreeRemove",
        ),
        "2.1.100",
    ),
    **dict.fromkeys(("MessageDisplay", "PostToolBatch", "UserPromptExpansion"), "2.1.200"),
    "DirectoryAdded": "2.1.250",
    **dict.fromkeys(("PreModelSwitch", "PostModelSwitch"), "2.1.275"),
}
"""The first release known to accept each hook event in its settings.

Read off the released binaries of 2.1.0, 2.1.100, 2.1.200, 2.1.250 and 2.1.275
(an event is known when the CLI names it), so a release between two of those
gets only the events of the older one: leaving a hook out is safe, naming one
the CLI does not know is not (2.1.0 drops the whole ``settings.local.json``,
deny rules and ``apiKeyHelper`` included, without a word)."""


def hooks_known_by(version: str) -> frozenset[str]:
    """The hook events Claude Code ``version`` knows (see :data:`HOOK_EVENTS_SINCE`)."""
    key = version_key(version)
    return frozenset(e for e, since in HOOK_EVENTS_SINCE.items() if version_key(since) <= key)


def mint_token() -> str:
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# -- which events are hooked, and how --------------------------------------------

UNHOOKED = frozenset(
    {"UserPromptExpansion", "MessageDisplay", "PreModelSwitch", "PostModelSwitch", "Setup"}
)
"""Events sage accepts but never hooks itself (neither command hooks nor in-band): a hook
on them alters what the CLI does (an expansion or display hook that answers nothing)."""

IN_BAND_HOOKS: tuple[str, ...] = tuple(sorted(KNOWN_HOOKS - UNHOOKED))
"""The events a headless session registers at ``initialize``, one callback each.

Of these, the CLI (2.1.275, 2.1.328 and 2.1.332 alike, offline against the
stand-in) delivers in-band ``UserPromptSubmit``, ``PreToolUse``,
``PermissionRequest``, ``PostToolUse``, ``PostToolBatch`` and ``Stop``; it runs
``SessionStart`` and ``SessionEnd`` only as command hooks (never as
``hook_callback``), so a headless session reports its start and end by the
runner's ``init`` and ``exited`` events instead.  The others fire in-band when
their occasion comes.  Every release of the supported range accepts each name
(2.1.275 is the floor; an event a release does not know is ignored, not refused)."""


def callback_id(hook: str) -> str:
    """The ``hookCallbackIds`` entry the runner registers for ``hook``."""
    return f"hook_{hook}"


_CALLBACKS = {callback_id(hook): hook for hook in IN_BAND_HOOKS}


# -- what a hook becomes on the bus ----------------------------------------------

NOTIFICATION_TOPIC = "sage.v1.notification"
"""A ``Notification`` hook is published here too, with the same payload."""
SPOOF_TOPIC = "sage.v1.audit.hook_spoof_attempt"
FIELD_LIMIT = 128
"""Characters kept of each field of a spoof report."""
TOKEN_MIN = 16
"""Claimed tokens at least this long are redacted wherever they appear."""

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

IN_BAND_REASONS = ("unknown_hook", "session_mismatch")
"""Why an in-band hook is dropped and audited (:func:`in_band_hook`)."""


class HookRejected(RequestError):
    """A hook that is dropped and audited, with what it claimed; ``code`` is one of
    the capsule's reasons (``capsules/hooks/validate.py``) or :data:`IN_BAND_REASONS`."""

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
    return "".join(f"_{c.lower()}" if c.isupper() and i else c.lower() for i, c in enumerate(name))


def event_name(hook: str) -> str:
    """The ``<mapped>`` token of ``hook.v1.event.<mapped>`` for a known hook."""
    return CANONICAL_NAMES.get(hook) or _snake(hook)


def in_band_hook(
    callback: str, hook_input: Mapping[str, Any], claude_session: str, session_id: str
) -> str:
    """The hook a ``hook_callback`` of session ``session_id`` (whose CLI runs Claude
    session ``claude_session``) reports, or HookRejected: ``unknown_hook`` when the
    callback id is not one the runner registered, or the input's ``hook_event_name``
    is not the callback's event; ``session_mismatch`` when the input's
    ``session_id`` names another Claude session than the child's (resumed sessions
    keep theirs)."""
    hook = _CALLBACKS.get(callback)
    named = hook_input.get("hook_event_name")
    claimed = hook_input.get("session_id")

    def rejected(reason: str, what: str) -> HookRejected:
        return HookRejected(reason, "", claimed if isinstance(claimed, str) else "", what)

    if hook is None:
        raise rejected("unknown_hook", named if isinstance(named, str) else callback)
    if named is not None and named != hook:
        raise rejected("unknown_hook", str(named))
    if claimed is not None and claimed != claude_session:
        raise rejected("session_mismatch", hook)
    return hook


def _secret_like(token: str) -> bool:
    """Long enough to be a minted token (43 characters); a forged "a" must not
    redact every claim that has an "a" in it."""
    return len(token) >= TOKEN_MIN


def _without_token(value: Any, data: bytes, token: str) -> Any:
    """``value`` (encoded: ``data``) with every occurrence of ``token`` replaced."""
    needle = token.encode()
    if not _secret_like(token) or needle not in data:
        return value
    # minted tokens are urlsafe base64: JSON never escapes their characters, so
    # a byte replace inside the encoded text stays valid JSON
    return msgspec.json.decode(data.replace(needle, REDACTED.encode()))


def hook_event(
    hook: str,
    hook_input: Any,
    *,
    correlation_id: str | None,
    principal_id: str,
    session_id: str,
    decision_source: str,
    token: str,
    truncated: bool = False,
) -> dict[str, Any]:
    """The payload of ``hook.v1.event.<mapped>`` for a checked hook: the hook input
    left out (``payload: null, truncated: true``) past :data:`PAYLOAD_LIMIT` or when
    ``truncated`` already, the session's ``token`` replaced wherever the input
    echoes it, and the input's ``tool_use_id`` as the correlation when none is given."""
    correlation = correlation_id
    if correlation is None and isinstance(hook_input, dict):
        tool_use = hook_input.get("tool_use_id")
        if isinstance(tool_use, str) and 0 < len(tool_use) <= FIELD_LIMIT:
            correlation = tool_use
    out: dict[str, Any] = {
        "hook": hook,
        "payload": None,
        "correlation_id": correlation,
        "principal_id": principal_id,
        "session_id": session_id,
        "decision_source": decision_source,
    }
    data = msgspec.json.encode(hook_input)
    if truncated or len(data) > PAYLOAD_LIMIT:
        out["truncated"] = True
    else:
        out["payload"] = _without_token(hook_input, data, token)
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
