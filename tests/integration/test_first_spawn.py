"""A principal never installed is installed by its first spawn (when an installer runs).

Without it a session would run with no ``settings.local.json``: no deny rules, no
hooks.  Against a real supervisor with the installer capsule and the CLI double.
"""

from __future__ import annotations

import json
import sqlite3

import msgspec
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio


def _audited(root: object, kind: str) -> list[dict[str, object]]:
    db = sqlite3.connect(f"file:{root}/state/audit.db?mode=ro", uri=True)
    rows = db.execute("SELECT payload FROM entries WHERE kind = ?", (kind,)).fetchall()
    db.close()
    return [msgspec.json.decode(row[0])["payload"] for row in rows]


async def test_the_first_spawn_installs_and_the_next_does_not() -> None:
    config = sage_config(FAKE_CLAUDE, {}, capsules='["runner", "installer"]')
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as sage:
        home = sage.daemon.root / "state" / "homes" / "alice"
        assert not (home / ".astrid" / "install.json").exists()
        await sage.ready("f1")
        settings = json.loads((home / ".claude" / "settings.local.json").read_text())
        assert settings["permissions"]["deny"], settings  # headless: built-in tools denied
        assert (home / ".astrid" / "install.json").is_file()
        listed = await sage.request("sage.v1.request.principals", {})
        assert listed["principals"][0]["installed"] is True
        await sage.ready("f2")
        installs = _audited(sage.daemon.root, "sage.v1.audit.principal_installed")
        assert [(i["principal_id"], i["session_id"], i["source"]) for i in installs] == [
            ("alice", "f1", "first_spawn")
        ]


async def test_without_an_installer_the_operator_keeps_the_home() -> None:
    config = sage_config(FAKE_CLAUDE, {}, capsules='["runner"]')
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as sage:
        await sage.ready("n1")
        home = sage.daemon.root / "state" / "homes" / "alice"
        assert not (home / ".astrid" / "install.json").exists()
        assert _audited(sage.daemon.root, "sage.v1.audit.principal_installed") == []


async def test_a_home_installed_by_an_older_release_is_installed_again() -> None:
    """A home whose marker names older artifacts (command hooks for a headless
    principal, before hooks moved in-band) is installed again before its next session,
    so an upgrade does not keep a process per hook event."""
    config = sage_config(FAKE_CLAUDE, {}, capsules='["runner", "installer"]')
    async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-test"}) as sage:
        home = sage.daemon.root / "state" / "homes" / "alice"
        await sage.ready("u1")
        marker = home / ".astrid" / "install.json"
        old = json.loads(marker.read_text())
        old["artifact_version"] = 1
        marker.write_text(json.dumps(old))
        settings = home / ".claude" / "settings.local.json"
        stale = json.loads(settings.read_text())
        stale["hooks"] = {"Stop": [{"hooks": [{"type": "command", "command": "astrid-emit Stop"}]}]}
        settings.write_text(json.dumps(stale))
        await sage.ready("u2")
        assert json.loads(settings.read_text())["hooks"] == {}
        assert json.loads(marker.read_text())["artifact_version"] > 1
        installs = _audited(sage.daemon.root, "sage.v1.audit.principal_installed")
        assert [i["session_id"] for i in installs] == ["u1", "u2"]
