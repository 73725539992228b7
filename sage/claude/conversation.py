"""Where the Claude Code CLI keeps a conversation, and whether it has one yet.

The CLI writes a session's conversation as a JSONL transcript under the HOME it
runs with: ``<home>/.claude/projects/<escaped cwd>/<claude_session>.jsonl``,
where the escaped cwd is the working folder's real path with every character
but ``[A-Za-z0-9]`` made ``-``.  It writes nothing before the first user turn
(seen with 2.1.328): a session that never spoke has no transcript, and
``claude --resume`` of it exits 1 with "No conversation found".  So whoever
starts a child on an existing session (a wake, a restart, an adoption) asks
:func:`has_transcript` whether to ``--resume`` or to start the conversation
afresh under the same ``--session-id`` (:func:`conversation_start`).
"""

from __future__ import annotations

import enum
import os
import re
import stat
from pathlib import Path

from sage.errors import SageError

__all__ = (
    "ConversationStart",
    "TranscriptRefused",
    "conversation_start",
    "escape_cwd",
    "has_transcript",
    "transcript_rel",
)

_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_ESCAPED = re.compile(r"^[A-Za-z0-9-]{1,255}\Z")


class TranscriptRefused(SageError):
    """A transcript that must not be read, replicated or written back (the reason says why)."""

    code = "transcript_refused"


def escape_cwd(cwd: str) -> str:
    """The CLI's folder name for a working folder: each character but [A-Za-z0-9] is ``-``."""
    return re.sub(r"[^A-Za-z0-9]", "-", cwd)


def transcript_rel(cwd: str, claude_session: str) -> Path:
    """``.claude/projects/<escaped cwd>/<claude_session>.jsonl``, relative to the home
    (``cwd`` resolved: the folder the child runs in).  Nothing in it can climb out."""
    if not _UUID.match(claude_session):
        raise TranscriptRefused(f"claude_session {claude_session[:80]!r} is not a uuid")
    folder = escape_cwd(cwd)
    if not _ESCAPED.match(folder):
        raise TranscriptRefused(f"working folder {cwd[:200]!r}: no transcript folder for it")
    return Path(".claude", "projects", folder, f"{claude_session}.jsonl")


def has_transcript(home: Path, cwd: Path | None, claude_session: str) -> bool:
    """Whether the CLI has a transcript of ``claude_session`` for a child run in ``cwd``
    (None: the home) with HOME ``home``: a regular file, not a link (the home is the
    principal's, so the answer must not tell whether some other path exists).  An id or
    folder with no transcript path has none."""
    folder = os.path.realpath(cwd if cwd is not None else home)
    try:
        rel = transcript_rel(folder, claude_session)
        return stat.S_ISREG(os.lstat(home / rel).st_mode)
    except (TranscriptRefused, OSError):
        return False


class ConversationStart(enum.Enum):
    """How a child of an existing session starts its conversation."""

    RESUME = "resume"
    """``--resume``: the transcript is there (or must be: the CLI says if it is not)."""
    FRESH = "fresh"
    """``--session-id`` again: the session never spoke, so there is nothing to resume."""


def conversation_start(*, transcript: bool, spoken: bool) -> ConversationStart:
    """Resume when the transcript is on disk; start afresh when it is not and the
    conversation never had a turn.  One that had turns and lost its transcript is
    resumed all the same, so the CLI's own "No conversation found" ends it
    (``resume_failed``) instead of a session that silently forgot its conversation."""
    if transcript or spoken:
        return ConversationStart.RESUME
    return ConversationStart.FRESH
