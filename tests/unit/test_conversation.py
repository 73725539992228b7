"""Where the CLI keeps a conversation, and whether a child resumes it or starts it afresh."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sage.claude.conversation import (
    ConversationStart,
    conversation_start,
    has_transcript,
    transcript_rel,
)

CS = "0b6f1c2e-3d4a-4b5c-8d9e-0f1a2b3c4d5e"


@pytest.mark.parametrize(
    ("transcript", "spoken", "start"),
    [
        (True, True, ConversationStart.RESUME),
        (True, False, ConversationStart.RESUME),
        (False, True, ConversationStart.RESUME),  # lost: the CLI's own words end it
        (False, False, ConversationStart.FRESH),  # never spoke: nothing to resume
    ],
)
def test_resume_only_what_the_cli_has_or_must_have(
    transcript: bool, spoken: bool, start: ConversationStart
) -> None:
    """A child resumes a conversation on disk or one that spoke; else it starts afresh."""
    assert conversation_start(transcript=transcript, spoken=spoken) is start


def test_a_transcript_is_found_where_the_cli_writes_it(tmp_path: Path) -> None:
    """The home's projects folder, by the working folder's real path, by conversation."""
    home = tmp_path / "home"
    work = tmp_path / "work"
    work.mkdir()
    assert not has_transcript(home, work, CS)
    path = home / transcript_rel(os.path.realpath(work), CS)
    path.parent.mkdir(parents=True)
    path.write_text("{}\n")
    assert has_transcript(home, work, CS)
    assert not has_transcript(home, None, CS)  # another folder: another conversation
    link = tmp_path / "link"
    link.symlink_to(work)
    assert has_transcript(home, link, CS)  # the CLI resolves the folder it runs in


def test_a_link_or_a_folder_is_no_transcript(tmp_path: Path) -> None:
    """What stands where the transcript should is a regular file, never followed."""
    home = tmp_path / "home"
    path = home / transcript_rel(os.path.realpath(home), CS)
    path.parent.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text("{}\n")
    path.symlink_to(elsewhere)
    assert not has_transcript(home, None, CS)
    path.unlink()
    path.mkdir()
    assert not has_transcript(home, None, CS)


def test_an_id_that_is_no_uuid_has_no_transcript(tmp_path: Path) -> None:
    """An id no transcript path can be made of has none (and nothing is touched)."""
    assert not has_transcript(tmp_path, None, "../../etc/passwd")
