"""Which hook events a Claude Code release knows, and what the installer writes for it."""

from __future__ import annotations

import json

import pytest

from capsules.installer.files import HOOK_EVENTS, UNHOOKED, settings_local
from sage.claude.binary import FLOOR, NEWEST_TESTED, PINNED
from sage.claude.hooks import HOOK_EVENTS_SINCE, KNOWN_HOOKS, hooks_known_by


def test_every_known_event_has_a_first_release() -> None:
    assert set(HOOK_EVENTS_SINCE) == KNOWN_HOOKS


def test_releases_know_more_events_as_they_grow() -> None:
    old, mid, new = hooks_known_by("2.1.0"), hooks_known_by("2.1.150"), hooks_known_by(PINNED)
    assert {"PreToolUse", "PostToolUse", "UserPromptSubmit", "Stop"} <= old
    assert "PermissionDenied" not in old
    assert "PermissionDenied" in mid
    assert "DirectoryAdded" not in mid
    assert old < mid < new == KNOWN_HOOKS


@pytest.mark.parametrize("version", [FLOOR, PINNED, NEWEST_TESTED])
def test_inside_the_range_every_hooked_event_is_written(version: str) -> None:
    settings = json.loads(settings_local({}, "/venv/bin/astrid-emit", version))
    assert set(settings["hooks"]) == set(HOOK_EVENTS)
    assert not set(settings["hooks"]) & UNHOOKED


def test_an_older_release_gets_only_the_events_it_knows() -> None:
    """2.1.0 drops a whole settings.local.json that names an event it does not know."""
    settings = json.loads(settings_local({}, "/venv/bin/astrid-emit", "2.1.0"))
    assert set(settings["hooks"]) == hooks_known_by("2.1.0") - UNHOOKED
    assert "PermissionDenied" not in settings["hooks"]
    assert settings["permissions"]["deny"]  # the deny rules are still there
    assert settings["apiKeyHelper"] == "/bin/false"
