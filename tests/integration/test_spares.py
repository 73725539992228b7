"""Warm spares against the CLI test double: taken, replaced, discarded, never outliving.

With ``[sessions] spares = 1`` the runner keeps one initialized ``claude``
child for alice.  A spawn that names no session id takes it (the reply comes
at once, the session answers a turn), and the next spare starts; a spawn
whose launch would differ (settings changed) or that names its own id
starts cold; hooks from an untaken spare are refused; no spare outlives the
supervisor.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus.client import RemoteSubscription
from sage.claude.hooks import mint_token
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.sage_harness import running_sage, sage_config
from tests.support.spares import claude_children, environ, listed, ready_spares

pytestmark = pytest.mark.anyio

ENV = {"ANTHROPIC_API_KEY": "sk-double"}
EMIT = Path(sys.executable).parent / "astrid-emit"


def _config(*, spares: int = 1, capsules: str = '["runner"]', mode: str = "") -> str:
    extra = (
        "[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\n"
        f"[sessions]\nspares = {spares}\nspare_max_age = 600.0\n"
    )
    return sage_config(FAKE_CLAUDE, {"FAKE_CLAUDE_MODE": mode}, extra=extra, capsules=capsules)


async def _spawn_audit(audits: RemoteSubscription, sid: str) -> dict[str, Any]:
    """The ``spawn`` audit of session ``sid``."""
    with anyio.fail_after(10):
        while True:
            data: dict[str, Any] = msgspec.json.decode((await audits.get()).payload)
            if data["session_id"] == sid:
                return data


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


async def _gone(pid: int, within: float = 10.0) -> None:
    for _ in range(int(within / 0.05)):
        if not _alive(pid):
            return
        await anyio.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


async def test_a_spawn_takes_the_spare_and_the_next_one_starts() -> None:
    """No session id: the spawn takes the waiting spare (its ids, its pid), is
    answered at once, the session answers a turn, and a new spare starts."""
    async with running_sage(_config(), env=ENV) as sage:
        (sid, pid), *_ = (await ready_spares(sage)).items()
        events = await sage.client.subscribe(f"sage.v1.event.{sid}.>")
        audits = await sage.client.subscribe("sage.v1.audit.spawn")
        started = time.monotonic()
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        took = time.monotonic() - started
        assert reply == {"ok": True, "session_id": sid, "pid": pid}, reply
        assert took < 1.0, took  # no cold start (the double takes about 50 ms for one)
        names = []
        with anyio.fail_after(10):
            while "init" not in names:
                names.append((await events.get()).topic.rsplit(".", 1)[1])
        assert names == ["spawned", "init"], names  # nothing from before it was taken
        assert [row["session_id"] for row in await listed(sage)] == [sid]
        assert (await sage.send(sid, "hello"))["ok"]
        text = ""
        with anyio.fail_after(10):
            while True:
                envelope = await events.get()
                name = envelope.topic.rsplit(".", 1)[1]
                data = msgspec.json.decode(envelope.payload)
                if name == "text":
                    text += data["delta"]
                if name == "done":
                    break
        assert text == "echo: hello"
        spawn = await _spawn_audit(audits, sid)
        assert spawn["spare"] is True
        assert spawn["pid"] == pid

        # the next spare starts in the background; it is no listed session
        nxt = await ready_spares(sage)
        assert sid not in nxt
        assert [row["session_id"] for row in await listed(sage)] == [sid]


async def test_spares_count_against_no_cap_and_no_listing() -> None:
    """A spare is not listed and leaves the per-principal cap to the user's sessions."""
    config = _config().replace("[limits]\n", "[limits]\nmax_sessions_per_principal = 1\n")
    async with running_sage(config, env=ENV) as sage:
        await ready_spares(sage)
        assert await listed(sage) == []
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["ok"], reply
        refused = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert refused["error"] == "principal_limit", refused


async def test_a_named_session_id_starts_cold() -> None:
    """A spawn that names its own session id cannot take a spare: it starts cold,
    the spare stays."""
    async with running_sage(_config(), env=ENV) as sage:
        spares = await ready_spares(sage)
        audits = await sage.client.subscribe("sage.v1.audit.spawn")
        events, reply = await sage.spawn("mine")
        assert reply["ok"], reply
        assert reply["pid"] not in spares.values()
        await events.until("init")
        assert (await _spawn_audit(audits, "mine"))["spare"] is False
        assert all(_alive(pid) for pid in spares.values())
        assert set(await ready_spares(sage)) == set(spares)


async def test_a_stale_spare_is_discarded_and_the_spawn_goes_cold() -> None:
    """Settings changed after the spare started: the spawn's launch differs, so the
    spare is stopped, never handed out, and the session starts cold."""
    async with running_sage(_config(), env=ENV) as sage:
        (sid, pid), *_ = (await ready_spares(sage)).items()
        changed = await sage.request(
            "sage.v1.request.settings.set",
            {"principal_id": "alice", "max_turns": 7},
        )
        assert changed["ok"], changed
        audits = await sage.client.subscribe("sage.v1.audit.spawn")
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["ok"], reply
        assert reply["pid"] != pid
        assert reply["session_id"] == sid  # the id was chosen; the child is a new one
        await _gone(pid)
        assert '"reason": "stale"' in sage.daemon.log()
        spawn = await _spawn_audit(audits, reply["session_id"])
        assert spawn["spare"] is False
        events = await sage.events(reply["session_id"])
        assert (await sage.send(reply["session_id"], "hi"))["ok"]
        text, _ = await events.text_until_done()
        assert text == "echo: hi"
        # the next spare is started with the new settings, and is taken
        (nsid, npid), *_ = (await ready_spares(sage)).items()
        again = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert again == {"ok": True, "session_id": nsid, "pid": npid}, again


async def test_no_spare_outlives_the_supervisor() -> None:
    """The supervisor's stop stops its spares (and a taken one) too."""
    async with running_sage(_config(spares=2), env=ENV) as sage:
        spares = await ready_spares(sage, 2)
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["ok"], reply
        pids = [*spares.values(), *(await ready_spares(sage, 2)).values()]
    for pid in pids:
        await _gone(pid, within=5)


async def test_spares_off_start_nothing() -> None:
    """``spares = 0``: no child runs before a spawn."""
    async with running_sage(_config(spares=0), env=ENV) as sage:
        await anyio.sleep(0.5)
        assert claude_children(sage) == {}


@pytest.mark.skipif(not EMIT.exists(), reason="astrid-emit is not installed in this venv")
async def test_a_hook_from_an_untaken_spare_is_refused() -> None:
    """An untaken spare's token is not stored: its hooks are refused as from no session;
    once taken, the same token is accepted."""
    async with running_sage(_config(capsules='["runner", "hooks"]'), env=ENV) as sage:
        (sid, pid), *_ = (await ready_spares(sage)).items()
        child = environ(pid)
        spoofs = await sage.client.subscribe("sage.v1.audit.hook_spoof_attempt")
        hooks = await sage.client.subscribe("hook.v1.event.>")
        env = {
            key: child[key] for key in ("ASTRID_PRINCIPAL_ID", "ASTRID_SESSION_ID", "ASTRID_SOCKET")
        }
        hook_input = {"session_id": "x", "hook_event_name": "SessionStart", "source": "startup"}
        code, err = await _emit(
            {**env, "ASTRID_HOOK_TOKEN": child["ASTRID_HOOK_TOKEN"]}, hook_input
        )
        assert code == 0, err
        with anyio.fail_after(10):
            report = msgspec.json.decode((await spoofs.get()).payload)
        assert report["reason"] == "unknown_or_ended_session"
        assert report["claimed_session"] == sid

        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["session_id"] == sid, reply
        code, err = await _emit(
            {**env, "ASTRID_HOOK_TOKEN": child["ASTRID_HOOK_TOKEN"]}, hook_input
        )
        assert code == 0, err
        with anyio.fail_after(10):
            event = await hooks.get()
        assert msgspec.json.decode(event.payload)["session_id"] == sid
        # and a made-up token for the taken session is still refused
        code, err = await _emit({**env, "ASTRID_HOOK_TOKEN": mint_token()}, hook_input)
        with anyio.fail_after(10):
            report = msgspec.json.decode((await spoofs.get()).payload)
        assert report["reason"] == "bad_token"


async def _emit(env: dict[str, str], payload: dict[str, Any]) -> tuple[int, str]:
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    result = await anyio.run_process(
        [str(EMIT)], input=msgspec.json.encode(payload), env=full, check=False
    )
    return result.returncode, result.stderr.decode()


async def test_an_identity_change_replaces_the_spares_at_once() -> None:
    """A new identity: the spare started with the old one is stopped without waiting for
    a spawn; the next one has the new identity, and is the one taken."""
    async with running_sage(_config(), env=ENV) as sage:
        (sid, pid), *_ = (await ready_spares(sage)).items()
        changed = await sage.request(
            "sage.v1.request.settings.set", {"principal_id": "alice", "identity": "You are Ada."}
        )
        assert changed["ok"], changed
        await _gone(pid)
        (nsid, npid), *_ = (await ready_spares(sage)).items()
        assert nsid != sid
        identity = sage.daemon.root / "state" / "sessions" / nsid / "identity.md"
        assert identity.read_text() == "You are Ada."
        assert not (sage.daemon.root / "state" / "sessions" / sid).exists()  # scrubbed
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply == {"ok": True, "session_id": nsid, "pid": npid}, reply


async def test_a_spare_past_its_max_age_is_replaced() -> None:
    """Older than ``spare_max_age``: stopped and replaced, never handed out."""
    config = _config().replace("spare_max_age = 600.0", "spare_max_age = 1.0")
    async with running_sage(config, env=ENV) as sage:
        (sid, pid), *_ = (await ready_spares(sage)).items()
        await _gone(pid, within=10)
        (nsid, _), *_ = (await ready_spares(sage)).items()
        assert nsid != sid
        assert '"reason": "too_old"' in sage.daemon.log()


async def test_a_spare_in_another_permission_mode_is_never_handed_out() -> None:
    """A CLI that answers ``initialize`` in another mode ends before it is ready; nothing
    is published for it, its start is retried after a pause, and a spawn starts cold."""
    async with running_sage(_config(mode="permission_mode=auto"), env=ENV) as sage:
        events = await sage.client.subscribe("sage.v1.event.>")
        audits = await sage.client.subscribe("sage.v1.audit.>")
        for _ in range(100):  # the first failure, then the retry after 1 s
            if sage.daemon.log().count("spare.start_failed") >= 2:
                break
            await anyio.sleep(0.05)
        log = sage.daemon.log()
        assert log.count("spare.start_failed") >= 2, log
        assert "spare.ready" not in log
        for published in (events, audits):
            with anyio.move_on_after(0.1):
                envelope = await published.get()
                raise AssertionError(f"published for a spare: {envelope.topic}")
        await events.close()
        await audits.close()
        audits = await sage.client.subscribe("sage.v1.audit.spawn")
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["ok"], reply
        assert (await _spawn_audit(audits, reply["session_id"]))["spare"] is False


async def test_with_an_installer_only_installed_principals_get_spares() -> None:
    """An ``installer`` capsule is configured: alice gets a spare once installed, not
    before (a spare never installs: its first spawn would)."""
    config = _config(capsules='["runner", "installer"]')
    async with running_sage(config, env=ENV) as sage:
        await anyio.sleep(1.0)  # the keeper has looked (the binary's version is read)
        assert claude_children(sage) == {}
        assert "spare." not in sage.daemon.log()
        reply = await sage.request("sage.v1.request.install", {"principal_id": "alice"})
        assert reply["ok"], reply
        (sid, pid), *_ = (await ready_spares(sage, within=10)).items()
        spawned = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert spawned == {"ok": True, "session_id": sid, "pid": pid}, spawned


async def test_an_initial_message_is_sent_to_a_taken_spare() -> None:
    """``initial_message`` reaches the spare's child as its first turn."""
    async with running_sage(_config(), env=ENV) as sage:
        (sid, _), *_ = (await ready_spares(sage)).items()
        events = await sage.events(sid)
        reply = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "initial_message": "first"}
        )
        assert reply["session_id"] == sid, reply
        text, done = await events.text_until_done()
        assert text == "echo: first"
        assert done["turn"] == 1


async def test_a_spare_left_by_a_dead_supervisor_leaves_no_files() -> None:
    """SIGKILL to the supervisor: its spare dies with it (death signal), and the next
    supervisor removes the identity folder nobody owns."""
    root = short_dir()
    try:
        async with running_sage(_config(), env=ENV, root=root) as sage:
            (sid, pid), *_ = (await ready_spares(sage)).items()
            folder = root / "state" / "sessions" / sid
            assert (folder / "identity.md").is_file()
            sage.daemon.signal(signal.SIGKILL)
            await _gone(pid)
        assert folder.exists()
        async with running_sage(_config(spares=0), env=ENV, root=root) as sage:
            assert not folder.exists()
            assert await listed(sage) == []
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_spare_of_a_replaced_binary_is_discarded(tmp_path: Path) -> None:
    """The binary was replaced (an upgrade renames a new file over it): the spare runs
    the old one, so the spawn stops it and starts cold."""
    binary = tmp_path / "claude"
    shutil.copy2(FAKE_CLAUDE, binary)
    config = _config().replace(json.dumps(str(FAKE_CLAUDE)), json.dumps(str(binary)))
    assert str(binary) in config
    async with running_sage(config, env=ENV) as sage:
        (sid, pid), *_ = (await ready_spares(sage)).items()
        fresh = tmp_path / "claude.new"
        shutil.copy2(FAKE_CLAUDE, fresh)
        fresh.replace(binary)
        reply = await sage.request("sage.v1.request.spawn", {"principal_id": "alice"})
        assert reply["ok"], reply
        assert reply["session_id"] == sid
        assert reply["pid"] != pid
        await _gone(pid)
        assert '"reason": "stale"' in sage.daemon.log()


async def test_a_spare_kind_serves_a_spawn_with_that_folder_and_model(tmp_path: Path) -> None:
    """`spare_kinds` keep spares for another working folder and model; a spawn asking for
    them takes one, a spawn asking for another pair starts cold; a kind the spawn would
    refuse gets no spare (logged)."""
    work = tmp_path / "work"
    work.mkdir()
    kinds = (
        f'work_roots = ["{tmp_path}"]\nmodels = ["claude-opus"]\n'
        f'spare_kinds = [{{ cwd = "{work}", model = "claude-opus" }},'
        ' { cwd = "/nowhere" }]\n'
    )
    extra = (
        "[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\n"
        "[sessions]\nspares = 1\nspare_max_age = 600.0\n"
    )
    config = sage_config(FAKE_CLAUDE, {}, extra=extra, principal_extra=kinds)
    async with running_sage(config, env=ENV) as sage:
        spares = await ready_spares(sage, count=2)
        assert len(spares) == 2  # the default kind and the work kind; not /nowhere
        cwds = {sid: os.readlink(f"/proc/{pid}/cwd") for sid, pid in spares.items()}
        (work_sid,) = [sid for sid, cwd in cwds.items() if cwd == str(work)]
        (home,) = [cwd for sid, cwd in cwds.items() if sid != work_sid]
        assert home.endswith("/homes/alice")  # the default kind: the home
        reply = await sage.request(
            "sage.v1.request.spawn",
            {"principal_id": "alice", "cwd": str(work), "model": "claude-opus"},
        )
        assert reply["ok"], reply
        assert reply["session_id"] == work_sid  # the kind's spare
        again = await ready_spares(sage, count=2)  # a look later: the kind's next spare
        assert work_sid not in again
        reply = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "cwd": str(work)}
        )
        assert reply["ok"], reply
        assert reply["session_id"] not in spares  # no spare of that pair: cold
        assert "spare.kind_refused" in sage.daemon.log()
        assert sage.daemon.log().count("spare.kind_refused") == 1  # once, not every look
