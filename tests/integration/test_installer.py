"""Installing principals: astrid sage install -> runner -> installer capsule -> files on disk.

A real supervisor runs the runner, the installer and the hooks capsule, with
the CLI test double as ``claude``; the CLI is the real ``astrid``.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from capsules.installer import files
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

FAKE = FAKE_CLAUDE
KEY = "sk-ant-installed-key-77e1b2"


def _config() -> str:
    limits = "[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\n"
    return sage_config(FAKE, {}, extra=limits, capsules='["runner", "installer", "hooks"]')


def _home(root: Path) -> Path:
    return root / "state" / "homes" / "alice"


def _settings(root: Path) -> dict[str, Any]:
    data: dict[str, Any] = msgspec.json.decode(
        (_home(root) / ".claude" / "settings.local.json").read_bytes()
    )
    return data


async def _completes(sage: Sage) -> Any:
    return await sage.client.subscribe("sage.v1.install.complete")


async def test_a_key_too_short_to_redact_is_refused_before_anything_is_written() -> None:
    """A 5-character key: one clear line, no installer steps shown, no home written."""
    root = short_dir()
    async with running_sage(_config(), root=root) as sage:
        code, out, err = await sage.astrid(
            "sage", "install", "alice", "--api-key-stdin", stdin=b"short\n"
        )
        assert (code, out) == (1, "")
        assert err == (
            "astrid: bad_request: secret 'anthropic_api_key': shorter than 8 characters"
            " (too short to redact)\n"
        )
        assert not (_home(root) / ".claude").exists()


async def test_install_writes_the_home_stores_the_key_and_is_idempotent() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root) as sage:
        completes = await _completes(sage)
        code, out, err = await sage.astrid(
            "sage",
            "install",
            "alice",
            "--interaction-mode",
            "headless",
            "--auth-mode",
            "api_key",
            "--api-key-stdin",
            stdin=KEY.encode(),
        )
        assert code == 0, err
        assert "api key           stored" in out
        settings = _settings(root)
        assert "Bash" in settings["permissions"]["deny"]
        assert set(files.BUILT_IN_TOOLS) <= set(settings["permissions"]["deny"])
        assert settings["apiKeyHelper"] == "/bin/false"
        assert settings["hooks"] == {}  # headless: every hook comes in-band
        home = _home(root)
        assert (home / "CLAUDE.md").read_text().startswith("# alice")
        marker = msgspec.json.decode((home / ".astrid" / "install.json").read_bytes())
        assert marker["artifact_version"] == files.ARTIFACT_VERSION
        assert (home.stat().st_mode & 0o777) == 0o700
        with anyio.fail_after(5):
            first = msgspec.json.decode((await completes.get()).payload)
        assert first["success"] is True
        listing = await sage.request("sage.v1.request.principals", {})
        (row,) = listing["principals"]
        assert (row["installed"], row["key_stored"]) == (True, True)
        # the same again: nothing rewritten; --force: everything
        again = await sage.request("sage.v1.request.install", {"principal_id": "alice"})
        assert again["ok"], again
        assert again["changed"] == []
        forced = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "force": True}
        )
        written = [".astrid/install.json", ".claude/settings.local.json", ".mcp.json", "CLAUDE.md"]
        # a root supervisor whose Python its children's uid cannot run: their launcher
        if await anyio.Path(home / ".astrid" / "astrid-emit").exists():
            written.insert(0, ".astrid/astrid-emit")
        assert sorted(forced["changed"]) == written
        if os.geteuid() == 0:  # all of it the uid alice's children run as, never root's
            owners = {(home / name).stat().st_uid for name in (".", *written)}
            assert len(owners) == 1
            assert 0 not in owners
        servers = msgspec.json.decode((home / ".mcp.json").read_bytes())["mcpServers"]
        assert servers["sage"]["args"] == ["mcp", "serve", "--principal", "alice"]
        assert servers["forge"]["args"] == [
            "mcp",
            "serve",
            "--server",
            "forge",
            "--principal",
            "alice",
        ]
        for mcp in servers.values():
            assert mcp["env"]["ASTRID_SOCKET"] == str(sage.daemon.socket)
        await anyio.sleep(0.2)
        seen = 1
        while True:
            with anyio.move_on_after(0.2):
                await completes.get()
                seen += 1
                continue
            break
        assert seen == 3  # exactly one complete per request
        # the key went into the child's environment, and nowhere else in clear
        events, reply = await sage.spawn("k1")
        assert reply["ok"], reply
        await events.until("init")
        environ = await anyio.Path(f"/proc/{reply['pid']}/environ").read_bytes()
        assert f"ANTHROPIC_API_KEY={KEY}".encode() in environ.split(b"\0")
        await sage.request("sage.v1.request.stop.k1", {})
    for path in root.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    kinds = [r[0] for r in db.execute("SELECT kind FROM entries")]
    db.close()
    assert kinds.count("sage.v1.audit.install_choices") == 3


async def test_switching_modes_rewrites_the_files_and_changes_what_spawn_does() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root, env={"ANTHROPIC_API_KEY": "sk-op"}) as sage:
        reply = await sage.request("sage.v1.request.install", {"principal_id": "alice"})
        assert reply["ok"], reply
        changes = await sage.client.subscribe("sage.v1.settings.changed")
        code, _, err = await sage.astrid("sage", "settings", "alice", "--interaction-mode", "repl")
        assert code == 0, err
        settings = _settings(root)
        assert settings["permissions"]["deny"] == []
        # no control channel in a terminal: hooks reach sage through astrid-emit
        pre = settings["hooks"]["PreToolUse"][0]
        assert pre["matcher"] == "*"
        assert pre["hooks"][0]["command"].endswith("astrid-emit PreToolUse")
        assert await anyio.Path(pre["hooks"][0]["command"].split()[0]).exists()
        assert "matcher" not in settings["hooks"]["Stop"][0]
        assert set(settings["hooks"]) == set(files.HOOK_EVENTS)
        changed = msgspec.json.decode((await changes.get()).payload)
        assert changed["config"]["interaction_mode"] == "repl"
        _, spawn = await sage.spawn("r1")
        assert spawn["error"] == "interaction_mode_is_repl"
        back = await sage.request(
            "sage.v1.request.settings.set",
            {"principal_id": "alice", "interaction_mode": "headless", "auth_mode": "subscription"},
        )
        assert back["ok"], back
        assert back["relinked"] is True
        assert back["changed"] == [
            ".claude/settings.local.json",
            "CLAUDE.md",
            ".astrid/install.json",
        ]
        settings = _settings(root)
        assert "Bash" in settings["permissions"]["deny"]
        assert settings["hooks"] == {}  # headless again: the command hooks are gone
        assert "apiKeyHelper" not in settings  # subscription: the CLI's own login
        events, spawn = await sage.spawn("h1")
        assert spawn["ok"], spawn
        await events.until("init")
        environ = await anyio.Path(f"/proc/{spawn['pid']}/environ").read_bytes()
        assert not any(v.startswith(b"ANTHROPIC_API_KEY=") for v in environ.split(b"\0"))
        await sage.request("sage.v1.request.stop.h1", {})
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    rows = db.execute(
        "SELECT payload FROM entries WHERE kind = 'sage.v1.audit.settings_changed'"
    ).fetchall()
    db.close()
    audits = [msgspec.json.decode(r[0])["payload"] for r in rows]
    assert [a["new_config"]["interaction_mode"] for a in audits] == ["repl", "headless"]
    assert audits[0]["previous_config"]["interaction_mode"] == "headless"


async def test_a_bad_home_fails_the_install_and_keeps_the_settings() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root) as sage:
        home = _home(root)
        home.parent.mkdir(parents=True, exist_ok=True)
        home.symlink_to("/etc")
        reply = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert reply["error"] == "install_failed", reply
        assert "symbolic link" in reply["message"]
        assert not (root / "state" / "principals" / "alice.json").exists()


async def test_install_of_an_unknown_principal_refuses_before_asking_for_a_key() -> None:
    """On a terminal, `sage install bob` (no such principal) says so at once: no hidden
    prompt asks for a key that would go nowhere."""
    from tests.support.terminal import Terminal

    async with running_sage(_config()) as sage:
        term = Terminal.astrid(sage, "sage", "install", "bob")
        code, out = await term.finish()
        assert code == 1
        assert b"API key" not in term.screen
        assert "unknown_principal: no principal 'bob'" in term.screen.decode() + out
        assert b"yours: alice" in term.screen
