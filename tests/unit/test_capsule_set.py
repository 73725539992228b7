"""The capsule set's requests without a supervisor: fake runners, real decisions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from bus import Envelope
from sage.daemon.capsule_set import CapsuleSet, Source
from sage.errors import ConfigError

pytestmark = pytest.mark.anyio


@dataclass
class _State:
    value: str = "running"


@dataclass
class _Package:
    version: str = "1.0"


@dataclass
class _Manifest:
    name: str
    package: _Package = field(default_factory=_Package)


class _Runner:
    """Runs until cancelled, as a capsule does; counts its runs."""

    def __init__(self, name: str) -> None:
        self.manifest = _Manifest(name)
        self.state = _State()
        self.started = anyio.Event()
        self.ready = anyio.Event()
        self.stopped = False

    async def run(self) -> None:
        self.started.set()
        self.ready.set()
        try:
            await anyio.sleep_forever()
        finally:
            self.stopped = True
            self.state.value = "stopped"

    def describe(self) -> dict[str, Any]:
        return {"name": self.manifest.name, "state": self.state.value}


class _World:
    def __init__(self, tmp_path: Path) -> None:
        self.built: list[_Runner] = []
        self.audits: list[tuple[str, dict[str, Any]]] = []
        self.broken: set[str] = set()
        self.state_dir = tmp_path

    def build(self, source: Source) -> Any:
        name = Path(source.entry).name
        if name in self.broken:
            raise ConfigError(f"capsule {name}: cannot load")
        runner = _Runner(name)
        self.built.append(runner)
        return runner

    def audit(self, topic: str, payload: dict[str, Any]) -> None:
        self.audits.append((topic, payload))


def _request(
    verb: str, payload: object, principal: str | None = None, source: str = "cli:0"
) -> Envelope:
    return Envelope(
        id=1,
        topic=f"sage.v1.request.capsule.{verb}",
        payload=json.dumps(payload).encode(),
        source=source,
        principal=principal,
    )


async def test_restart_builds_first_then_swaps_and_a_broken_source_keeps_the_old(
    tmp_path: Path,
) -> None:
    world = _World(tmp_path)
    capsules = CapsuleSet(world.build, world.audit, lambda: world.state_dir)
    capsules.add(Source("echo"))
    async with anyio.create_task_group() as tg:
        capsules.start_all(tg)
        first = world.built[0]
        await first.started.wait()
        reply = await capsules.answer(_request("restart", {"name": "echo"}))
        assert reply == {"ok": True, "capsule": "echo", "ready": True}
        second = world.built[1]
        await second.started.wait()
        assert first.stopped
        assert not second.stopped
        (only,) = capsules.runners
        assert only is second  # type: ignore[comparison-overlap]
        world.broken.add("echo")
        refused = await capsules.answer(_request("restart", {"name": "echo"}))
        assert refused["error"] == "bad_capsule"
        assert not second.stopped  # the running one is left running
        tg.cancel_scope.cancel()
    assert [topic for topic, _ in world.audits] == ["sage.v1.audit.capsule_restarted"]


@pytest.mark.parametrize(
    ("verb", "payload", "principal", "code"),
    [
        ("restart", {"name": "echo"}, "alice", "not_authorized"),
        ("restart", {"nam": "echo"}, None, "bad_request"),
        ("restart", ["echo"], None, "bad_request"),
        ("restart", {"name": "nope"}, None, "unknown_capsule"),
        ("remove", {"name": "echo"}, None, "builtin"),
        ("load", {"name": "echo"}, None, "running"),
        ("load", {"name": "echo", "replace": True}, None, "name_taken"),
        ("load", {"name": "nope"}, None, "not_installed"),
        ("explode", {"name": "echo"}, None, "unknown_request"),
    ],
)
async def test_refusals_say_why(
    tmp_path: Path, verb: str, payload: object, principal: str | None, code: str
) -> None:
    world = _World(tmp_path)
    capsules = CapsuleSet(world.build, world.audit, lambda: world.state_dir)
    capsules.add(Source("echo"))
    async with anyio.create_task_group() as tg:
        capsules.start_all(tg)
        reply = await capsules.answer(_request(verb, payload, principal))
        assert reply["ok"] is False
        assert reply["error"] == code, reply
        assert reply["message"]
        assert not world.built[0].stopped  # a refusal touches nothing
        tg.cancel_scope.cancel()
    assert world.audits == []


@pytest.mark.parametrize("verb", ["load", "restart", "remove"])
async def test_a_capsule_is_no_admin_whatever_its_acl(tmp_path: Path, verb: str) -> None:
    """Principal-less, but not an operator's connection: refused (a manifest may declare
    ``sage.v1.request.>``; the bus would deliver it)."""
    world = _World(tmp_path)
    capsules = CapsuleSet(world.build, world.audit, lambda: world.state_dir)
    capsules.add(Source("echo"))
    async with anyio.create_task_group() as tg:
        capsules.start_all(tg)
        reply = await capsules.answer(_request(verb, {"name": "echo"}, source="capsule:evil"))
        assert reply["error"] == "not_authorized"
        assert not world.built[0].stopped
        tg.cancel_scope.cancel()


class _Stubborn(_Runner):
    async def run(self) -> None:
        self.started.set()
        with anyio.CancelScope(shield=True):
            await anyio.sleep(1.0)  # ignores the stop for a while


async def test_one_that_will_not_stop_is_left_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sage.daemon.capsule_set.STOP_WITHIN", 0.1)
    world = _World(tmp_path)

    def build(source: Source) -> Any:
        runner = _Stubborn(Path(source.entry).name)
        world.built.append(runner)
        return runner

    capsules = CapsuleSet(build, world.audit, lambda: world.state_dir)
    capsules.add(Source("echo"))
    async with anyio.create_task_group() as tg:
        capsules.start_all(tg)
        await world.built[0].started.wait()
        reply = await capsules.answer(_request("restart", {"name": "echo"}))
        assert reply["error"] == "stop_timeout"
        (only,) = capsules.runners
        assert only is world.built[0]  # type: ignore[comparison-overlap]
        assert len(world.built) == 2  # built, never started
        assert not world.built[1].started.is_set()
        tg.cancel_scope.cancel()
    assert world.audits == []


async def test_a_bug_is_answered_not_raised(tmp_path: Path) -> None:
    world = _World(tmp_path)

    def state_dir() -> Path:
        raise RuntimeError("a bug")

    capsules = CapsuleSet(world.build, world.audit, state_dir)
    reply = await capsules.answer(_request("load", {"name": "x"}))
    assert reply["error"] == "internal_error"
    assert "RuntimeError" in reply["message"]


async def test_a_name_twice_is_refused(tmp_path: Path) -> None:
    world = _World(tmp_path)
    capsules = CapsuleSet(world.build, world.audit, lambda: world.state_dir)
    capsules.add(Source("echo"))
    with pytest.raises(ConfigError, match="named twice"):
        capsules.add(Source("other/echo"))


def _installed(root: Path, folder: str, name: str) -> Path:
    path = root / "capsules" / folder
    path.mkdir(parents=True)
    (path / "Capsule.toml").write_text(
        f'[package]\nname = "{name}"\nversion = "1"\nentry = "{folder}"\n'
    )
    return path


async def test_uninstall_deletes_every_copy_of_the_name_and_staging_is_no_capsule(
    tmp_path: Path,
) -> None:
    from sage.daemon.install import installed_folders, uninstall

    running = _installed(tmp_path, "mine_v2", "mine")
    older = _installed(tmp_path, "mine_v1", "mine")
    staging = _installed(tmp_path, ".mine_v2.new", "mine")
    other = _installed(tmp_path, "other", "other")
    assert installed_folders(tmp_path) == [older, running, other]
    assert uninstall(tmp_path, "mine", running) == running
    assert not running.exists()
    assert not older.exists()
    assert staging.exists()  # not a capsule: an interrupted install's, left to the next
    assert installed_folders(tmp_path) == [other]
    assert uninstall(tmp_path, "mine") is None
