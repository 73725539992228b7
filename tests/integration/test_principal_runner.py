"""The runner's side of principals: settings files, spawn refusals, keys from the store.

The installer's files are tested with the installer (test_installer.py);
here the runner runs alone or with it absent, against the CLI test double.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import anyio
import msgspec
import pytest

from sage.config import load_config
from sage.security.secrets import API_KEY, SecretStore, principal_namespace
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio

FAKE = FAKE_CLAUDE
KEY = "sk-ant-principal-key-4f9a1c"
OPERATOR = {"ANTHROPIC_API_KEY": "sk-operator"}


def _config() -> str:
    limits = "[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\n"
    return sage_config(FAKE, {}, extra=limits)


def _settings_file(root: Path) -> Path:
    return root / "state" / "principals" / "alice.json"


async def test_a_corrupt_or_newer_settings_file_makes_spawn_refuse() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root, env=OPERATOR) as sage:
        rejections = await sage.client.subscribe("sage.v1.event.session_rejected")
        path = _settings_file(root)
        path.parent.mkdir(parents=True, exist_ok=True)
        for data, reason in (
            (b"{half a file", "settings_corrupt"),
            (b'{"schema_version": 9, "principal_id": "alice"}', "schema_version_unsupported"),
        ):
            path.write_bytes(data)
            _, reply = await sage.spawn("s1")
            assert (reply["ok"], reply["error"]) == (False, reason), reply
            event = msgspec.json.decode((await rejections.get()).payload)
            assert event["reason"] == reason
            assert str(path) in event["message"]
            listing = await sage.request("sage.v1.request.principals", {})
            (row,) = listing["principals"]
            assert row["settings"] == reason
            # a settings change does not paper over it, and leaves the file alone
            answer = await sage.request(
                "sage.v1.request.settings.set", {"principal_id": "alice", "model": "m"}
            )
            assert answer["error"] == reason
            assert path.read_bytes() == data
        path.unlink()
        _, reply = await sage.spawn("s2")
        assert reply["ok"], reply


async def test_settings_are_kept_in_a_versioned_file_and_migrated_from_the_store() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root) as sage:
        reply = await sage.request(
            "sage.v1.request.settings.set",
            {"principal_id": "alice", "interaction_mode": "repl"},
        )
        assert reply["ok"], reply
        assert reply["relinked"] is False  # no installer runs here
        stored = msgspec.json.decode(_settings_file(root).read_bytes())
        assert stored["schema_version"] == 1
        assert stored["interaction_mode"] == "repl"
        _, spawn = await sage.spawn("s1")
        assert spawn["error"] == "interaction_mode_is_repl"
        # an earlier release's patch in the state store: moved into the file on start
        _settings_file(root).unlink()
    db = sqlite3.connect(root / "state" / "state.db")
    with db:
        db.execute(
            "INSERT INTO kv (namespace, key, value, updated_ns) VALUES ('settings', 'alice', ?, 1)",
            (b'{"model": "claude-old", "max_turns": 3}',),
        )
    db.close()
    async with running_sage(_config(), root=root) as sage:
        listing = await sage.request("sage.v1.request.principals", {})
        (row,) = listing["principals"]
        assert (row["model"], row["max_turns"], row["settings"]) == ("claude-old", 3, "ok")
        stored = msgspec.json.decode(_settings_file(root).read_bytes())
        assert (stored["schema_version"], stored["model"]) == (1, "claude-old")


async def test_install_without_an_installer_says_so_and_changes_nothing() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root) as sage:
        # an admin watching everything is no installer: the answer comes at once
        await sage.client.subscribe(">")
        started = anyio.current_time()
        reply = await sage.request(
            "sage.v1.request.install",
            {"principal_id": "alice", "auth_mode": "api_key", "api_key": KEY},
        )
        assert reply["error"] == "installer_unavailable", reply
        assert anyio.current_time() - started < 5  # not the 30 s install deadline
        for bad, code in (
            ({"principal_id": "../etc"}, "invalid_principal"),
            ({"principal_id": "mallory"}, "unknown_principal"),
            ({"principal_id": "alice", "auth_mode": "magic"}, "bad_request"),
            ({"principal_id": "alice", "colour": "red"}, "bad_request"),
            (
                {"principal_id": "alice", "auth_mode": "subscription", "api_key": KEY},
                "bad_request",
            ),
        ):
            answer = await sage.request("sage.v1.request.install", bad)
            assert answer["error"] == code, (bad, answer)
    assert not _settings_file(root).exists()
    assert KEY.encode() not in (root / "daemon.log").read_bytes()


async def test_an_api_key_principal_gets_its_own_key_in_its_env_and_nowhere_else() -> None:
    root = short_dir()
    async with running_sage(_config(), root=root) as sage:
        config = load_config(sage.daemon.config)
        SecretStore.open(config).put(principal_namespace("alice"), API_KEY, KEY)
        listing = await sage.request("sage.v1.request.principals", {})
        assert listing["principals"][0]["key_stored"] is True
        events, reply = await sage.spawn("keyed")
        assert reply["ok"], reply
        await events.until("init")
        environ = await anyio.Path(f"/proc/{reply['pid']}/environ").read_bytes()
        assert f"ANTHROPIC_API_KEY={KEY}".encode() in environ.split(b"\0")
        cmdline = await anyio.Path(f"/proc/{reply['pid']}/cmdline").read_bytes()
        assert KEY.encode() not in cmdline
        assert KEY not in str(listing)
        await sage.request("sage.v1.request.stop.keyed", {})
    for path in root.rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


async def test_api_key_mode_with_no_key_anywhere_fails_with_api_key_missing() -> None:
    async with running_sage(_config(), env={"ANTHROPIC_API_KEY": ""}) as sage:
        _, reply = await sage.spawn("nokey")
        assert reply["error"] == "api_key_missing", reply


def _spawn_audits(root: Path) -> list[dict[str, object]]:
    db = sqlite3.connect(f"file:{root / 'state' / 'audit.db'}?mode=ro", uri=True)
    rows = db.execute("SELECT payload FROM entries WHERE kind = 'sage.v1.audit.spawn'").fetchall()
    db.close()
    return [msgspec.json.decode(payload)["payload"] for (payload,) in rows]


async def test_the_operators_key_is_shared_only_when_the_config_says_so() -> None:
    """No key stored and operator_key off: refused, although the operator has a key."""
    config = _config().replace("operator_key = true\n", "")
    async with running_sage(config, env=OPERATOR) as sage:
        _, reply = await sage.spawn("shared")
        assert reply["error"] == "api_key_missing", reply
        assert "operator_key = true" in reply["message"]
        assert "astrid sage install alice" in reply["message"]
        (row,) = (await sage.request("sage.v1.request.principals", {}))["principals"]
        assert row["operator_key"] is False
        assert row["key_stored"] is False


async def test_a_spawn_on_the_operators_key_says_so_in_the_audit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root = short_dir()
    async with running_sage(_config(), env=OPERATOR, root=root) as sage:
        await sage.ready("op")
        (row,) = (await sage.request("sage.v1.request.principals", {}))["principals"]
        assert row["operator_key"] is True
        code, out, _ = await sage.astrid("sage", "principals")
        assert code == 0
        assert out.splitlines()[1].split()[4] == "operator"  # the KEY column
        await sage.request("sage.v1.request.stop.op", {})
    (audit,) = _spawn_audits(root)
    assert audit["key_source"] == "operator"  # where the API key came from
    assert "sk-operator" not in str(audit)
