"""The runner's principal administration, with no process: an in-process bus and state store."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import Bus, Envelope, Identity
from capsules.runner import principals
from capsules.runner.admin import Admin
from capsules.runner.claude_process import SessionError
from capsules.runner.principals import PrincipalSettings
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import load_manifest
from sage.config import Config, PrincipalConfig, SupervisorConfig
from sage.state import StateStore

pytestmark = pytest.mark.anyio

RUNNER = Path(__file__).resolve().parents[2] / "capsules" / "runner"
INSTALLER = Identity("capsule:installer")


class Rig:
    """An Admin on a real in-process bus and state store; what it says is recorded."""

    def __init__(self, bus: Bus, ctx: CapsuleContext) -> None:
        self.bus, self.ctx = bus, ctx
        self.published: list[tuple[str, dict[str, Any], str | None]] = []
        self.audits: list[tuple[str, dict[str, Any]]] = []
        self.refreshed: list[str] = []
        self.sessions: dict[str, int] = {}
        self.admin = Admin(
            ctx,
            publish=self.publish,
            audit=lambda kind, payload: self.audits.append((kind, payload)),
            sessions_of=lambda name: self.sessions.get(name, 0),
            refresh_identity=self.refreshed.append,
        )

    def publish(
        self, topic: str, payload: dict[str, Any], principal: str | None = None
    ) -> Envelope | None:
        self.published.append((topic, payload, principal))
        return self.ctx.publish(topic, payload, on_behalf_of=principal)

    @property
    def state_dir(self) -> Path:
        return self.ctx.config.state_dir

    def audited(self, kind: str) -> list[dict[str, Any]]:
        return [payload for k, payload in self.audits if k == kind]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    config = Config(
        supervisor=SupervisorConfig(state_dir=str(tmp_path / "state")),
        principals=[PrincipalConfig(name="alice"), PrincipalConfig(name="bob")],
    )
    config.state_dir.mkdir(mode=0o700)
    bus = Bus()
    async with StateStore.open(config.state_dir / "state.db") as store:
        ctx = CapsuleContext(
            bus,
            Identity("capsule:runner"),
            load_manifest(RUNNER),
            config_of=lambda: config,
            state_of=lambda: store,
        )
        yield Rig(bus, ctx)


def _request(topic: str, payload: dict[str, Any], principal: str | None = None) -> Envelope:
    return Envelope(
        id=1, topic=topic, payload=msgspec.json.encode(payload), source="t", principal=principal
    )


def _settings(payload: dict[str, Any], principal: str | None = None) -> Envelope:
    return _request("sage.v1.request.settings.set", payload, principal)


@pytest.mark.parametrize(
    ("payload", "caller", "code"),
    [
        ({"principal_id": "alice", "allow_add": ["Bash(rm)"]}, None, "bad_request"),
        ({"principal_id": "alice"}, None, "bad_request"),  # changes nothing
        ({"principal_id": "alice", "model": "m"}, "bob", "not_authorized"),
        ({"principal_id": "no such", "model": "m"}, None, "invalid_principal"),
        ({"principal_id": "carol", "model": "m"}, None, "unknown_principal"),
    ],
)
async def test_a_settings_patch_is_checked_before_anything_changes(
    rig: Rig, payload: dict[str, Any], caller: str | None, code: str
) -> None:
    with pytest.raises(SessionError) as info:
        await rig.admin.set_settings(_settings(payload, caller))
    assert info.value.code == code
    assert rig.audits == []
    assert rig.published == []
    assert principals.load(rig.state_dir, "alice") is None


async def test_allow_rules_alone_are_saved_and_audited_without_a_relink(rig: Rig) -> None:
    reply = await rig.admin.set_settings(
        _settings({"principal_id": "alice", "allow_add": ["mcp__sage__greet", "Read"]}, "alice")
    )
    assert reply == {
        "ok": True,
        "principal_id": "alice",
        "config": principals.view(PrincipalConfig(name="alice")),
        "allow_rules": ["mcp__sage__greet", "Read"],
        "relinked": False,
        "changed": [],
    }
    assert rig.admin.allow_rules("alice") == ["mcp__sage__greet", "Read"]
    rules = await rig.admin.change_rules(
        "alice", add=["Read", "Write"], remove=["mcp__sage__greet"], requester=None
    )
    assert rules == ["Read", "Write"]
    assert rig.audited("allow_rules_changed") == [
        {"principal_id": "alice", "before": [], "after": ["mcp__sage__greet", "Read"]},
        {
            "principal_id": "alice",
            "before": ["mcp__sage__greet", "Read"],
            "after": ["Read", "Write"],
        },
    ]
    assert rig.audited("settings_changed") == []


async def test_a_setting_changed_with_no_installer_is_saved_announced_and_audited(
    rig: Rig,
) -> None:
    reply = await rig.admin.set_settings(_settings({"principal_id": "alice", "max_turns": 7}))
    assert (reply["config"]["max_turns"], reply["relinked"]) == (7, False)
    stored = principals.load(rig.state_dir, "alice")
    assert stored is not None
    assert stored.max_turns == 7
    alice = rig.admin.principal("alice")
    assert alice is not None
    assert alice.max_turns == 7
    (changed,) = [
        (p, who) for topic, p, who in rig.published if topic == "sage.v1.settings.changed"
    ]
    assert changed[0]["config"]["max_turns"] == 7
    assert changed[0]["schema_version"] == principals.SCHEMA_VERSION
    (audit,) = rig.audited("settings_changed")
    assert (audit["previous_config"]["max_turns"], audit["new_config"]["max_turns"]) == (0, 7)
    # the same value again changes nothing: no second announcement
    await rig.admin.set_settings(_settings({"principal_id": "alice", "max_turns": 7}))
    assert len(rig.audited("settings_changed")) == 1


async def _installer(rig: Rig, topic: str, answer: dict[str, Any]) -> None:
    """A stand-in installer: one step, then ``answer`` as the request's completion."""
    with rig.bus.subscribe(topic, INSTALLER) as asks:
        async for ask in asks:
            request = ask.data()
            assert request["config"]["model"] == "opus"
            rid = request["request_id"]
            step = {"principal_id": "alice", "request_id": rid, "step": "linked"}
            rig.bus.publish(INSTALLER, "sage.v1.install.status", step)
            done = {"principal_id": "alice", "request_id": rid, **answer}
            rig.bus.publish(INSTALLER, "sage.v1.install.complete", done)
            return


async def test_a_failed_relink_leaves_the_settings_as_they_were(rig: Rig) -> None:
    async with anyio.create_task_group() as tg:
        tg.start_soon(_installer, rig, "sage.v1.install.relink", {"success": False, "error": "x"})
        await anyio.wait_all_tasks_blocked()
        with pytest.raises(SessionError) as info:
            await rig.admin.set_settings(_settings({"principal_id": "alice", "model": "opus"}))
    assert (info.value.code, str(info.value)) == ("relink_failed", "x")
    assert principals.load(rig.state_dir, "alice") is None
    assert rig.audited("settings_changed") == []
    (status,) = [p for t, p, _ in rig.published if t == "sage.v1.event.install.status"]
    assert status["step"] == "linked"


async def test_a_relink_that_succeeds_says_what_it_changed(rig: Rig) -> None:
    answer = {"success": True, "changed": [".claude/settings.json"]}
    async with anyio.create_task_group() as tg:
        tg.start_soon(_installer, rig, "sage.v1.install.relink", answer)
        await anyio.wait_all_tasks_blocked()
        reply = await rig.admin.set_settings(
            _settings({"principal_id": "alice", "model": "opus"}, "alice")
        )
    assert (reply["relinked"], reply["changed"]) == (True, [".claude/settings.json"])
    assert reply["config"]["model"] == "opus"


async def test_install_needs_an_installer_and_a_key_only_with_api_key_auth(rig: Rig) -> None:
    install = "sage.v1.request.install"
    with pytest.raises(SessionError) as info:
        await rig.admin.install(_request(install, {"principal_id": "alice"}))
    assert info.value.code == "installer_unavailable"
    with pytest.raises(SessionError) as info:
        await rig.admin.install(
            _request(
                install, {"principal_id": "alice", "auth_mode": "subscription", "api_key": "k"}
            )
        )
    assert info.value.code == "bad_request"
    assert principals.load(rig.state_dir, "alice") is None


async def test_a_corrupt_settings_file_is_named_and_allows_no_rules(rig: Rig) -> None:
    path = principals.settings_path(rig.state_dir, "alice")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert rig.admin.allow_rules("alice") == []
    with pytest.raises(SessionError) as info:
        await rig.admin.change_rules("alice", add=["Read"], remove=[], requester=None)
    assert info.value.code == "settings_corrupt"
    with pytest.raises(SessionError) as info:
        await rig.admin.set_settings(_settings({"principal_id": "alice", "model": "m"}))
    assert info.value.code == "settings_corrupt"
    with pytest.raises(SessionError) as info:
        await rig.admin.install(_request("sage.v1.request.install", {"principal_id": "alice"}))
    assert info.value.code == "settings_corrupt"
    assert "--force" in str(info.value)
    assert path.read_text() == "{not json"


async def test_an_identity_is_kept_audited_by_digest_and_refreshes_sessions(rig: Rig) -> None:
    await rig.admin.set_settings(_settings({"principal_id": "alice", "identity": "I am Alice"}))
    assert await rig.ctx.state.get("identities", "alice") == "I am Alice"
    await rig.admin.set_identity("alice", "  ")  # blank: back to the config's
    assert await rig.ctx.state.get("identities", "alice") is None
    digest = hashlib.sha256(b"I am Alice").hexdigest()
    assert rig.audited("identity_changed") == [
        {"principal_id": "alice", "before_sha256": None, "after_sha256": digest},
        {"principal_id": "alice", "before_sha256": digest, "after_sha256": None},
    ]
    assert rig.refreshed == ["alice", "alice"]


async def test_the_principals_listing_shows_a_caller_its_own_only(rig: Rig) -> None:
    principals.save(rig.state_dir, PrincipalSettings(principal_id="bob", allow_rules=["Read"]))
    rig.sessions["bob"] = 2
    reply = await rig.admin.list_principals(_request("sage.v1.request.principals", {}, "bob"))
    (row,) = reply["principals"]
    assert (row["principal_id"], row["settings"], row["installed"]) == ("bob", "ok", False)
    assert (row["allow_rules"], row["sessions"]) == (["Read"], 2)
    assert "key_stored" in row
    every = await rig.admin.list_principals(_request("sage.v1.request.principals", {}))
    assert [r["principal_id"] for r in every["principals"]] == ["alice", "bob"]


async def test_settings_patches_of_earlier_releases_become_files(rig: Rig) -> None:
    await rig.ctx.state.put("settings", "alice", {"model": "sonnet"})
    await rig.ctx.state.put("settings", "carol", {"model": "x"})  # not configured: dropped
    await rig.admin.migrate_settings()
    stored = principals.load(rig.state_dir, "alice")
    assert stored is not None
    assert stored.model == "sonnet"
    assert await rig.ctx.state.items("settings") == []
