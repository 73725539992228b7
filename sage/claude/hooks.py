"""Claude Code hook events and hook tokens (minted per ``claude`` child, stored only
as their SHA-256): shared by the runner, the hooks capsule and the installer."""

from __future__ import annotations

import hashlib
import secrets

from sage.claude.binary import version_key

__all__ = (
    "HOOK_EVENTS_SINCE",
    "KNOWN_HOOKS",
    "PAYLOAD_LIMIT",
    "hash_token",
    "hooks_known_by",
    "mint_token",
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
