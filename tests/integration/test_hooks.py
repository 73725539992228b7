"""The hooks capsule: token-checked hooks in-process, then through a real supervisor.

In-process: the capsule on a real :class:`bus.Bus` with a real state store,
publishers with the identities the supervisor gives an ``emit`` connection.
Through the supervisor: the session runner mints the token for a session of
the CLI test double, the real ``astrid-emit`` sends hooks with it (or with
a wrong one, or with the token of a session that has ended), and the audit
log records what was refused.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import Acl, Bus, Envelope, Identity, Subscription
from bus.client import BusClient
from capsules.hooks.capsule import REPL_TOKEN_TTL, HookGate
from capsules.hooks.validate import PAYLOAD_LIMIT
from capsules.runner.command import hash_token, mint_token
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import load_manifest
from sage.config import Config, LimitsConfig, PrincipalConfig, UsageConfig
from sage.daemon.capsule_host import capsule_folder
from sage.state import StateStore
from tests.support import FAKE_CLAUDE
from tests.support.as_uid import Say, fork_as
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

FAKE = FAKE_CLAUDE
EMIT = Path(sys.executable).parent / "astrid-emit"
SPOOF = "sage.v1.audit.hook_spoof_attempt"


# -- in-process ------------------------------------------------------------------


class Rig:
    """The capsule on a bus, an emit-like publisher and an observer that sees all."""

    def __init__(self, bus: Bus, store: StateStore, gate: HookGate, clock: list[float]) -> None:
        self.bus = bus
        self.store = store
        self.gate = gate
        self.clock = clock
        observer = Identity("observer")
        self.everything = bus.subscribe(">", observer)
        self.hooks = bus.subscribe("hook.v1.event.>", observer)
        self.notifications = bus.subscribe("sage.v1.notification", observer)
        self.audits = bus.subscribe(SPOOF, observer)
        self.floods = bus.subscribe("sage.v1.audit.hook_flood", observer)

    def emit(
        self,
        hook: str = "PreToolUse",
        *,
        principal: str | None = "alice",
        source: str = "emit:1000",
        topic: str | None = None,
        raw: bytes | None = None,
        **fields: Any,
    ) -> None:
        """Publish as an ``emit`` connection of a uid that maps to ``principal``."""
        identity = Identity(source, principal, Acl(publish=["sage.v1.hook.>"], subscribe=[]))
        envelope = {
            "hook": hook,
            "payload": {"hook_event_name": hook, "tool_name": "mcp__sage__greet"},
            "correlation_id": None,
            "principal_id": "alice",
            "session_id": "s1",
            "token": "",
            **fields,
        }
        data = raw if raw is not None else msgspec.json.encode(envelope)
        self.bus.publish_raw(identity, topic or f"sage.v1.hook.{hook}", data)

    async def next(self, sub: Subscription) -> Envelope:
        with anyio.fail_after(5):
            return await sub.get()

    def published(self) -> list[Envelope]:
        return self.everything.drain()


async def _wait(predicate: Callable[[], bool], within: float = 5) -> None:
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - the capsule offers no event for this
            await anyio.sleep(0.005)


@asynccontextmanager
async def _rig(tmp_path: Path, config: Config | None = None) -> AsyncIterator[Rig]:
    bus = Bus()
    manifest = load_manifest(capsule_folder("hooks"))
    identity = Identity(
        f"capsule:{manifest.name}", acl=Acl(manifest.publish.patterns, manifest.subscribe.patterns)
    )
    async with StateStore.open(tmp_path / "state.db") as store:
        ready = anyio.Event()
        ctx = CapsuleContext(
            bus,
            identity,
            manifest,
            config_of=lambda: config or Config(),
            state_of=lambda: store,
            ready=ready,
        )
        clock = [0.0]
        gate = HookGate(ctx, clock=lambda: clock[0])
        rig = Rig(bus, store, gate, clock)
        async with anyio.create_task_group() as tg:
            tg.start_soon(gate.run)
            with anyio.fail_after(5):
                await ready.wait()
            try:
                yield rig
            finally:
                tg.cancel_scope.cancel()
                ctx.close()


def _out(rig: Rig) -> list[Envelope]:
    """Everything the capsule published so far."""
    return [e for e in rig.published() if e.source == "capsule:hooks"]


async def _session(store: StateStore, sid: str = "s1", principal: str = "alice") -> str:
    """A token record as the runner writes it at spawn; the token itself."""
    token = mint_token()
    await store.put("hook_tokens", sid, {"sha256": hash_token(token), "principal_id": principal})
    return token


async def _handled(rig: Rig, count: int) -> None:
    await _wait(lambda: rig.gate.republished + rig.gate.rejected >= count)


async def test_a_valid_hook_is_republished_for_its_principal(tmp_path: Path) -> None:
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        rig.emit(token=token, payload={"hook_event_name": "PreToolUse", "tool_use_id": "tu_1"})
        event = await rig.next(rig.hooks)
        assert event.topic == "hook.v1.event.before_tool_call"
        assert event.principal == "alice"  # on behalf of the token's principal
        assert event.source == "capsule:hooks"
        assert event.data() == {
            "hook": "PreToolUse",
            "payload": {"hook_event_name": "PreToolUse", "tool_use_id": "tu_1"},
            "correlation_id": "tu_1",
            "principal_id": "alice",
            "session_id": "s1",
            "decision_source": "token",
        }
        # an admin's emit connection has no verified principal: the token alone decides
        rig.emit("Stop", principal=None, source="emit:0", token=token)
        assert (await rig.next(rig.hooks)).topic == "hook.v1.event.session_end"
        assert len(rig.audits) == 0
        assert all(token.encode() not in e.payload for e in _out(rig))


async def test_notifications_also_go_to_sage_notification(tmp_path: Path) -> None:
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        rig.emit("Notification", token=token, payload={"message": "needs you"})
        event = await rig.next(rig.hooks)
        note = await rig.next(rig.notifications)
        assert event.topic == "hook.v1.event.notification"
        assert note.principal == "alice"
        assert note.data() == event.data()
        assert note.data()["payload"] == {"message": "needs you"}


async def test_a_large_hook_input_is_republished_without_it(tmp_path: Path) -> None:
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        rig.emit(token=token, payload={"blob": "x" * (PAYLOAD_LIMIT + 1)})
        data = (await rig.next(rig.hooks)).data()
        assert data["payload"] is None
        assert data["truncated"] is True


SPOOFS: list[tuple[str, dict[str, Any], str]] = [
    ("wrong token", {"token": "W" * 43}, "bad_token"),
    ("no token", {"token": ""}, "missing_token"),
    ("claims bob", {"principal_id": "bob"}, "principal_mismatch"),
    ("connection is bob's", {"principal": "bob"}, "principal_mismatch"),
    ("unknown session", {"session_id": "never"}, "unknown_or_ended_session"),
    ("bad session id", {"session_id": "../../etc"}, "bad_session_id"),
    ("unknown hook", {"hook": "Bogus"}, "unknown_hook"),
    ("topic disagrees", {"topic": "sage.v1.hook.PostToolUse"}, "unknown_hook"),
    ("malformed", {"raw": b"[1, 2, 3]"}, "malformed"),
]


@pytest.mark.parametrize(("case", "fields", "reason"), SPOOFS, ids=[c for c, _, _ in SPOOFS])
async def test_spoofs_are_audited_and_not_republished(
    tmp_path: Path, case: str, fields: dict[str, Any], reason: str
) -> None:
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        fields = {"token": token, **fields}
        rig.emit(fields.pop("hook", "PreToolUse"), **fields)
        audit = await rig.next(rig.audits)
        report = audit.data()
        assert report["reason"] == reason
        assert report["source"] == "emit:1000"
        assert set(report) == {
            "claimed_principal",
            "claimed_session",
            "hook",
            "reason",
            "source",
            "suppressed_before",
        }
        assert audit.principal is None  # the claims are not vouched for
        assert len(rig.hooks) == 0
        assert len(rig.notifications) == 0
        assert all(token.encode() not in e.payload for e in _out(rig))


async def test_an_ended_sessions_token_is_refused(tmp_path: Path) -> None:
    """The runner scrubs the record at the end; the same token then is a replay."""
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        rig.emit(token=token)
        await rig.next(rig.hooks)
        await rig.store.delete("hook_tokens", "s1")
        rig.emit(token=token)
        assert (await rig.next(rig.audits)).data()["reason"] == "unknown_or_ended_session"
        # a respawn mints a new token: the old one does not work for the new child
        await _session(rig.store)
        rig.emit(token=token)
        assert (await rig.next(rig.audits)).data()["reason"] == "bad_token"
        assert len(rig.hooks) == 0


async def test_spoof_audits_are_rate_limited_per_source(tmp_path: Path) -> None:
    async with _rig(tmp_path) as rig:
        for _ in range(25):
            rig.emit(token="W" * 43)
        rig.emit(token="W" * 43, source="emit:2000")
        await _handled(rig, 26)
        audits = rig.audits.drain()
        sources = [a.data()["source"] for a in audits]
        assert sources.count("emit:1000") == 20
        assert sources.count("emit:2000") == 1
        rig.clock[0] = 61.0  # a minute later the source may be audited again
        rig.emit(token="W" * 43)
        report = (await rig.next(rig.audits)).data()
        assert report["suppressed_before"] == 5
        assert rig.gate.rejected == 27


async def test_a_flooding_source_fills_only_its_own_lane(tmp_path: Path) -> None:
    """5000 spoofs from uid 1001 at once (over any queue) and then alice's genuine
    hook from uid 1000: hers is validated; bob's drops are audited with their
    count, at once and then at most once a minute per source."""
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        for _ in range(5000):  # no await: the capsule cannot drain meanwhile
            rig.emit(token="W" * 43, source="emit:1001", principal="bob")
        rig.emit(token=token)
        assert (await rig.next(rig.hooks)).principal == "alice"
        dropped = 5000 - Config().bus.queue_size
        report = (await rig.next(rig.floods)).data()
        assert report == {"source": "uid:1001", "dropped": dropped, "window": 60.0}
        assert rig.gate.flood_dropped == dropped
        # later drops of the same source wait for the window, then come as one count
        rig.gate.report_floods({"uid:1001": 3})
        rig.clock[0] = 30.0
        rig.gate.report_floods({"uid:1001": 4, "uid:1002": 1})  # another source: at once
        assert (await rig.next(rig.floods)).data()["source"] == "uid:1002"
        assert len(rig.floods) == 0
        rig.clock[0] = 61.0
        rig.gate.report_floods({})
        assert (await rig.next(rig.floods)).data() == {
            "source": "uid:1001",
            "dropped": 7,
            "window": 60.0,
        }


async def _repl(rig: Rig, verb: str, **payload: Any) -> dict[str, Any]:
    """A ``repl.open`` / ``repl.close`` request from an admin's connection."""
    admin = Identity("cli:0", None, None, uid=0)
    reply = await rig.bus.request(admin, f"sage.v1.request.repl.{verb}", payload, deadline=5)
    data: dict[str, Any] = reply.data()
    return data


async def test_repl_tokens_are_capped_per_principal_freed_by_close_and_expiry(
    tmp_path: Path,
) -> None:
    """At most ``limits.max_repl_tokens_per_principal`` live REPL tokens per
    principal: past it ``repl.open`` is refused; a close or an expired token
    frees a place, and an expired token validates no hook."""
    config = Config(
        principals=[
            PrincipalConfig(name="alice", uids=[1000]),
            PrincipalConfig(name="bob", uids=[1001]),
        ],
        limits=LimitsConfig(max_repl_tokens_per_principal=2),
        # the rig runs no usage ledger, which a repl.open asks first (tested with a
        # supervisor: test_mcp_serve.py, a REPL over its budget)
        usage=UsageConfig(ledger=False),
    )
    async with _rig(tmp_path, config) as rig:
        first = await _repl(rig, "open", principal_id="alice")
        second = await _repl(rig, "open", principal_id="alice")
        assert first["ok"], first
        assert second["ok"], second
        refused = await _repl(rig, "open", principal_id="alice")
        assert refused["ok"] is False
        assert refused["error"] == "too_many_repl_sessions"
        assert "max_repl_tokens_per_principal" in refused["message"]
        assert "token" not in refused
        assert (await _repl(rig, "open", principal_id="bob"))["ok"]  # per principal
        # a close frees a place
        assert (await _repl(rig, "close", session_id=first["session_id"]))["ok"]
        third = await _repl(rig, "open", principal_id="alice")
        assert third["ok"]
        assert (await _repl(rig, "open", principal_id="alice"))["error"] == "too_many_repl_sessions"
        # a token past its lifetime: no longer counted, and worthless
        old = await rig.store.get("hook_tokens", second["session_id"])
        old["created_at"] = time.time() - REPL_TOKEN_TTL - 1
        await rig.store.put("hook_tokens", second["session_id"], old)
        rig.emit(token=second["token"], session_id=second["session_id"])
        report = (await rig.next(rig.audits)).data()
        assert report["reason"] == "unknown_or_ended_session"
        assert await rig.store.get("hook_tokens", second["session_id"]) is None
        fourth = await _repl(rig, "open", principal_id="alice")
        assert fourth["ok"], fourth
        rig.emit(token=fourth["token"], session_id=fourth["session_id"])
        assert (await rig.next(rig.hooks)).principal == "alice"


async def test_the_capsule_survives_bad_envelopes_and_a_closed_store(tmp_path: Path) -> None:
    """Deeply nested garbage is malformed; without a state store nothing passes."""
    async with _rig(tmp_path) as rig:
        token = await _session(rig.store)
        rig.emit(raw=b"[" * 200_000)
        assert (await rig.next(rig.audits)).data()["reason"] == "malformed"
        rig.gate.ctx._state_of = lambda: None  # the store is gone
        rig.emit(token=token)
        await _wait(lambda: len(rig.everything) >= 3)  # the two envelopes in, one audit out
        await anyio.sleep(0.05)
        assert len(rig.hooks) == 0
        rig.gate.ctx._state_of = lambda: rig.store
        rig.emit(token=token)
        assert (await rig.next(rig.hooks)).principal == "alice"


# -- through a real supervisor ---------------------------------------------------


def _config() -> str:
    limits = "[limits]\nstop_grace = 0.5\ninit_timeout = 5.0\n"
    return sage_config(FAKE, {"FAKE_CLAUDE_MODE": ""}, extra=limits, capsules='["runner", "hooks"]')


async def _child_env(pid: int) -> dict[str, str]:
    raw = await anyio.Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)
    return dict(pairs)


async def _emit(
    env: dict[str, str], payload: dict[str, Any], *, event: str | None = None
) -> tuple[int, float, str]:
    """Run the real astrid-emit with a minimal environment; (exit code, seconds, stderr)."""
    args = [str(EMIT)] + (["--event", event] if event else [])
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    start = time.monotonic()
    result = await anyio.run_process(
        args, input=msgspec.json.encode(payload), env=full, check=False
    )
    return result.returncode, time.monotonic() - start, result.stderr.decode()


def _audit_rows(sage: Sage, kind: str = SPOOF) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT payload FROM entries WHERE kind = ?", (kind,)).fetchall()
    finally:
        db.close()
    return [msgspec.json.decode(row[0]) for row in rows]


def _files_holding(root: Path, secret: str) -> list[Path]:
    """Regular files under ``root`` (databases with their WAL, logs) that contain ``secret``."""
    needle = secret.encode()
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def _get(sub: Any, within: float = 10.0) -> Envelope:
    with anyio.fail_after(within):
        envelope: Envelope = await sub.get()
        return envelope


@pytest.mark.skipif(not EMIT.exists(), reason="astrid-emit is not installed in this venv")
async def test_astrid_emit_through_the_supervisor() -> None:
    async with running_sage(_config(), env={"ANTHROPIC_API_KEY": "sk-double"}) as sage:
        hooks = await sage.client.subscribe("hook.v1.event.>")
        spoofs = await sage.client.subscribe(SPOOF)
        events, reply = await sage.spawn("hk1")
        assert reply["ok"], reply
        await events.until("init")
        child = await _child_env(reply["pid"])
        token = child["ASTRID_HOOK_TOKEN"]
        assert len(token) >= 43
        env = {
            key: child[key] for key in ("ASTRID_PRINCIPAL_ID", "ASTRID_SESSION_ID", "ASTRID_SOCKET")
        }
        assert env["ASTRID_PRINCIPAL_ID"] == "alice"
        assert env["ASTRID_SESSION_ID"] == "hk1"
        hook_input = {
            "session_id": "claude-own-id",
            "hook_event_name": "PreToolUse",
            "tool_name": "mcp__sage__greet",
            "tool_input": {"name": "Ada"},
            "tool_use_id": "toolu_7",
        }

        # the token the runner minted: republished with alice as the principal
        code, _, err = await _emit({**env, "ASTRID_HOOK_TOKEN": token}, hook_input)
        assert code == 0, err
        event = await _get(hooks)
        assert event.topic == "hook.v1.event.before_tool_call"
        assert event.principal == "alice"
        data = msgspec.json.decode(event.payload)
        assert data["principal_id"] == "alice"
        assert data["session_id"] == "hk1"
        assert data["decision_source"] == "token"
        assert data["correlation_id"] == "toolu_7"
        assert data["payload"] == hook_input

        # an input over the bus's max_payload (a big tool response): still reported
        big = {**hook_input, "hook_event_name": "PostToolUse", "tool_response": "r" * 2_000_000}
        code, _, err = await _emit({**env, "ASTRID_HOOK_TOKEN": token}, big)
        assert code == 0, err
        assert "not delivered" not in err
        event = await _get(hooks)
        assert event.topic == "hook.v1.event.after_tool_call"
        data = msgspec.json.decode(event.payload)
        assert data["truncated"] is True
        assert data["payload"] is None
        assert data["session_id"] == "hk1"

        # a wrong token: audited, not republished
        code, _, err = await _emit({**env, "ASTRID_HOOK_TOKEN": mint_token()}, hook_input)
        assert code == 0, err
        report = msgspec.json.decode((await _get(spoofs)).payload)
        assert report["reason"] == "bad_token"
        assert report["claimed_session"] == "hk1"
        assert report["source"].startswith("emit:")

        # the session ends; its token is scrubbed, a replay is refused
        assert (await sage.request("sage.v1.request.stop.hk1", {}))["ok"]
        await events.until("exited", within=15)
        code, _, err = await _emit({**env, "ASTRID_HOOK_TOKEN": token}, hook_input)
        assert code == 0, err
        report = msgspec.json.decode((await _get(spoofs)).payload)
        assert report["reason"] == "unknown_or_ended_session"
        # the stolen, ended token sent by hand over a user connection: the same
        sage.client.publish(
            "sage.v1.hook.PreToolUse",
            {
                "hook": "PreToolUse",
                "payload": hook_input,
                "principal_id": "alice",
                "session_id": "hk1",
                "token": token,
            },
        )
        await sage.client.flush()
        report = msgspec.json.decode((await _get(spoofs)).payload)
        assert report["reason"] == "unknown_or_ended_session"
        with anyio.move_on_after(0.3):  # nothing but the one valid hook was republished
            extra = await hooks.get()
            raise AssertionError(f"republished: {extra.topic}")

        await _wait(lambda: len(_audit_rows(sage)) >= 3, within=10)
        rows = _audit_rows(sage)
        assert [r["payload"]["reason"] for r in rows] == [
            "bad_token",
            "unknown_or_ended_session",
            "unknown_or_ended_session",
        ]
        assert all(r["source"] == "capsule:hooks" for r in rows)
        # the token is on no disk: not in the audit log, the state store, the logs
        root = sage.daemon.root
        assert await anyio.to_thread.run_sync(_files_holding, root, "unknown_or_ended_session")
        assert not await anyio.to_thread.run_sync(_files_holding, root, token)


@pytest.mark.skipif(not EMIT.exists(), reason="astrid-emit is not installed in this venv")
async def test_astrid_emit_exits_0_quickly_when_the_supervisor_is_down(tmp_path: Path) -> None:
    env = {
        "ASTRID_PRINCIPAL_ID": "alice",
        "ASTRID_SESSION_ID": "s1",
        "ASTRID_HOOK_TOKEN": mint_token(),
        "ASTRID_SOCKET": str(tmp_path / "nobody-here.sock"),
    }
    payload = {"hook_event_name": "PreToolUse"}
    code, seconds, err = await _emit(env, payload)
    assert code == 0
    assert seconds < 2.0
    assert "not delivered" in err
    # a socket that accepts but never answers the hello: the 2 s deadline cuts it off
    hung = anyio.Path(f"/tmp/sg-hook-{os.getpid()}.sock")
    await hung.unlink(missing_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(hung))
        listener.listen(8)
        try:
            code, seconds, err = await _emit({**env, "ASTRID_SOCKET": str(hung)}, payload)
        finally:
            await hung.unlink(missing_ok=True)
    assert code == 0
    assert 1.9 < seconds < 4.0  # the deadline plus the interpreter's start
    assert "not delivered" in err


async def test_a_bad_emit_command_line_exits_0_not_2() -> None:
    """Claude reads exit 2 of a hook as "block the action": a mistyped hook command
    in settings must not block a session (argparse would exit 2)."""
    for args in (["--no-such-flag"], ["PreToolUse", "extra"]):
        result = await anyio.run_process(
            [str(EMIT), *args], input=b"{}", env={"PATH": "/usr/bin:/bin"}, check=False
        )
        assert result.returncode == 0, args
        assert b"nothing sent" in result.stderr


def _run_emit_raw(stdin: Any, env: dict[str, str], *args: str) -> tuple[int, float, bytes]:
    """Run the real astrid-emit with ``stdin`` (bytes, a file descriptor, or None for a
    closed fd 0); (exit code, seconds, stderr).  Blocking: call it in a thread."""
    import subprocess

    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env}
    start = time.monotonic()
    if isinstance(stdin, bytes):
        result = subprocess.run(
            [str(EMIT), *args], input=stdin, env=full, capture_output=True, timeout=20
        )
    elif stdin is None:  # fd 0 closed in the child: sys.stdin is None
        result = subprocess.run(
            [str(EMIT), *args],
            stdin=subprocess.DEVNULL,
            env=full,
            capture_output=True,
            timeout=20,
            preexec_fn=lambda: os.close(0),
        )
    else:
        result = subprocess.run(
            [str(EMIT), *args], stdin=stdin, env=full, capture_output=True, timeout=20
        )
    return result.returncode, time.monotonic() - start, result.stderr


async def test_astrid_emit_exits_0_on_any_input(tmp_path: Path) -> None:
    """Claude reads a hook's exit 2 as "block" and any other non-zero as an error:
    whatever is on stdin, astrid-emit exits 0, quickly, and says why on stderr."""
    env = {
        "ASTRID_PRINCIPAL_ID": "alice",
        "ASTRID_SESSION_ID": "s1",
        "ASTRID_HOOK_TOKEN": mint_token(),
        "ASTRID_SOCKET": str(tmp_path / "nobody-here.sock"),
    }
    inputs = {
        "deeply nested": b"[" * 100_000,
        "deeply nested, valid": b"[" * 100_000 + b"]" * 100_000,
        "nested objects": b'{"a":' * 50_000,
        "binary garbage": os.urandom(64 * 1024),
        "huge": b'{"hook_event_name": "PreToolUse", "x": "' + b"y" * (8 * 1024 * 1024) + b'"}',
        "empty": b"",
        "invalid utf-8": b'{"hook_event_name": "\xff\xfe"}',
    }
    for name, data in inputs.items():
        code, seconds, err = await anyio.to_thread.run_sync(_run_emit_raw, data, env, "PreToolUse")
        assert code == 0, (name, err[-400:])
        assert b"Traceback" not in err, (name, err[-400:])
        assert seconds < 5.0, name
    # fd 0 closed: no stdin at all
    code, seconds, err = await anyio.to_thread.run_sync(_run_emit_raw, None, env, "PreToolUse")
    assert code == 0, err[-400:]
    assert b"Traceback" not in err
    assert seconds < 5.0


async def test_astrid_emit_exits_0_in_bounded_time_whatever_hangs(tmp_path: Path) -> None:
    """A stdin that never ends and a socket whose backlog is full (connect never
    completes) both hit the deadline: exit 0, well before Claude's own hook timeout."""
    env = {
        "ASTRID_PRINCIPAL_ID": "alice",
        "ASTRID_SESSION_ID": "s1",
        "ASTRID_HOOK_TOKEN": mint_token(),
        "ASTRID_SOCKET": str(tmp_path / "nobody-here.sock"),
    }
    # stdin a pipe whose writer stays open and silent
    reader, writer = os.pipe()
    try:
        code, seconds, err = await anyio.to_thread.run_sync(
            _run_emit_raw, reader, env, "PreToolUse"
        )
    finally:
        os.close(reader)
        os.close(writer)
    assert code == 0, err[-400:]
    assert seconds < 8.0
    assert b"gave up" in err
    # a listener that never accepts, its backlog filled: connect() itself waits
    path = f"/tmp/sg-full-{os.getpid()}.sock"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(0)
        fillers = []
        try:
            for _ in range(4):
                filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                filler.setblocking(False)
                fillers.append(filler)
                try:
                    filler.connect(path)
                except BlockingIOError:
                    break
            code, seconds, err = await anyio.to_thread.run_sync(
                _run_emit_raw, b'{"hook_event_name": "Stop"}', {**env, "ASTRID_SOCKET": path}
            )
        finally:
            for filler in fillers:
                filler.close()
            os.unlink(path)
    assert code == 0, err[-400:]
    assert seconds < 8.0
    assert b"not delivered" in err or b"gave up" in err


async def test_astrid_emit_watchdog_ends_any_other_hang(tmp_path: Path) -> None:
    """Whatever else blocks (here: the config file is a FIFO nobody writes, read
    outside the bus deadline), the watchdog ends astrid-emit with status 0."""
    fifo = tmp_path / "supervisor.toml"
    os.mkfifo(fifo)
    env = {
        "ASTRID_PRINCIPAL_ID": "alice",
        "ASTRID_SESSION_ID": "s1",
        "ASTRID_HOOK_TOKEN": mint_token(),
    }
    code, seconds, err = await anyio.to_thread.run_sync(
        _run_emit_raw, b'{"hook_event_name": "Stop"}', env, "--config", str(fifo)
    )
    assert code == 0, err[-400:]
    assert 5.5 < seconds < 9.0
    assert b"gave up after 6 s" in err


def _flood_as(uid: int, socket_path: str, seconds: float) -> tuple[int, int]:
    """Fork a client that runs as ``uid`` and floods ``sage.v1.hook.PreToolUse`` with
    spoofs for ``seconds`` (an emit connection); it writes "flooding" when it starts
    and the count it sent at the end.  Returns (pid, read end of its pipe)."""

    async def flood(say: Say) -> None:
        spoof = {
            "hook": "PreToolUse",
            "payload": {"hook_event_name": "PreToolUse"},
            "principal_id": "alice",
            "session_id": "s-forged",
            "token": "W" * 43,
        }
        sent = 0
        async with BusClient.connect(socket_path, role="emit", name="flood") as client:
            say("flooding")
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                for _ in range(500):
                    client.publish("sage.v1.hook.PreToolUse", spoof)
                sent += 500
                await client.flush()
        say(str(sent))

    return fork_as(uid, flood)


def _flood_config() -> str:
    """The hooks capsule alone; alice is the test's uid, bob is 65534, who may
    connect (socket group nogroup)."""
    return sage_config(
        FAKE,
        {},
        extra='[socket]\ngroup = "nogroup"\n',
        capsules='["hooks"]',
        principal_extra='[[principals]]\nname = "bob"\nuids = [65534]\n',
    )


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to flood as another uid")
async def test_a_hook_flood_from_one_uid_does_not_drop_anothers_hooks() -> None:
    """bob (uid 65534) floods sage.v1.hook.> with spoofs over the real socket while
    alice's astrid-emit sends genuine hooks: every genuine hook is validated and
    republished; bob's dropped envelopes are audited once, with their count."""
    from tests.support.daemon import short_dir

    root = short_dir()
    root.chmod(0o755)  # uid 65534 must reach the socket's folder (0750, group nogroup)
    async with running_sage(_flood_config(), root=root, env={"ANTHROPIC_API_KEY": ""}) as sage:
        hooks = await sage.client.subscribe("hook.v1.event.before_tool_call")
        floods = await sage.client.subscribe("sage.v1.audit.hook_flood")
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert opened["ok"], opened
        env = {
            "ASTRID_SOCKET": str(sage.daemon.socket),
            "ASTRID_PRINCIPAL_ID": "alice",
            "ASTRID_SESSION_ID": opened["session_id"],
            "ASTRID_HOOK_TOKEN": opened["token"],
        }
        # forked from a worker thread: the loop's thread has asyncio running
        pid, fd = await anyio.to_thread.run_sync(_flood_as, 65534, str(sage.daemon.socket), 12.0)
        lines = os.fdopen(fd)
        try:
            first = await anyio.to_thread.run_sync(lines.readline)
            assert first == "flooding\n", first
            await anyio.sleep(1.0)  # the capsule's queue is full by now
            genuine = 24
            codes = []
            for i in range(genuine):
                payload = {"hook_event_name": "PreToolUse", "tool_use_id": f"tu_{i}"}
                code, _, err = await _emit(env, payload)
                assert "not delivered" not in err, err
                codes.append(code)
            assert codes == [0] * genuine
            last = await anyio.to_thread.run_sync(lines.readline)
        finally:
            await anyio.to_thread.run_sync(os.waitpid, pid, 0)
            lines.close()
        assert not last.startswith("error"), last
        sent = int(last)
        seen: set[str] = set()
        with anyio.move_on_after(10):
            while len(seen) < genuine:
                event = msgspec.json.decode((await hooks.get()).payload)
                assert event["decision_source"] == "token"
                seen.add(event["correlation_id"])
        assert seen == {f"tu_{i}" for i in range(genuine)}, f"lost {genuine - len(seen)}"
        report = msgspec.json.decode((await _get(floods, within=10)).payload)
        assert report["source"] == "uid:65534"
        assert 0 < report["dropped"] <= sent
        with anyio.move_on_after(1.5):  # one summary per source per interval
            extra = await floods.get()
            raise AssertionError(f"a second flood report: {extra.payload!r}")
        flood = "sage.v1.audit.hook_flood"
        await _wait(lambda: len(_audit_rows(sage, flood)) >= 1, within=10)
        [row] = _audit_rows(sage, flood)
        assert row["payload"] == report
        assert row["source"] == "capsule:hooks"
