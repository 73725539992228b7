"""Claude Code hook events and hook tokens (minted per ``claude`` child, stored only
as their SHA-256): shared by the runner, the hooks capsule and the installer."""

from __future__ import annotations

import hashlib
import secrets

__all__ = ("KNOWN_HOOKS", "PAYLOAD_LIMIT", "hash_token", "mint_token")

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


def mint_token() -> str:
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
