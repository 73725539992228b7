"""Which hook events a Claude Code release knows, and what the installer writes for it."""

from __future__ import annotations

import json

import pytest

from capsules.installer.files import HOOK_EVENTS, settings_local
from sage.claude.binary import FLOOR, NEWEST_TESTED, PINNED
from sage.claude.hooks import HOOK_EVENTS_SINCE, KNOWN_HOOKS, UNHOOKED, hooks_known_by

REPL = {"interaction_mode": "repl"}


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
    """A REPL principal's settings hook every event sage hooks, by command."""
    settings = json.loads(settings_local(REPL, "/venv/bin/astrid-emit", version))
    assert set(settings["hooks"]) == set(HOOK_EVENTS)
    assert not set(settings["hooks"]) & UNHOOKED


def test_an_older_release_gets_only_the_events_it_knows() -> None:
    """2.1.0 drops a whole settings.local.json that names an event it does not know."""
    settings = json.loads(settings_local(REPL, "/venv/bin/astrid-emit", "2.1.0"))
    assert set(settings["hooks"]) == hooks_known_by("2.1.0") - UNHOOKED
    assert "PermissionDenied" not in settings["hooks"]
    assert settings["apiKeyHelper"] == "/bin/false"


@pytest.mark.parametrize("version", [FLOOR, PINNED, NEWEST_TESTED])
def test_a_headless_principal_gets_no_command_hook(version: str) -> None:
    """Its hooks come in-band: no process per hook; its deny rules stay."""
    for config in ({}, {"interaction_mode": "headless"}):
        settings = json.loads(settings_local(config, "/venv/bin/astrid-emit", version))
        assert settings["hooks"] == {}
        assert "astrid-emit" not in json.dumps(settings)
        assert "Bash" in settings["permissions"]["deny"]
        assert settings["apiKeyHelper"] == "/bin/false"
