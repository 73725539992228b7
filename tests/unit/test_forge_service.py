"""The forge call path with a fake sandbox: real files, real policy, real races."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sage.config import Config, PrincipalConfig, SupervisorConfig
from sage.errors import ForgeError, SandboxError
from sage.forge.breakers import BreakerBoard, State
from sage.forge.cache import cache_key
from sage.forge.policy import Breakers
from sage.forge.runs import mask_input
from sage.forge.sandbox import SandboxResult, SandboxSpec
from sage.forge.service import Caller, Forge, mcp_result
from sage.forge.static_check import check_impl, imported_modules

pytestmark = pytest.mark.anyio

FIB = (
    "import sys, json\n"
    "n = json.loads(sys.stdin.read())['n']\n"
    "a, b = 0, 1\n"
    "for _ in range(n): a, b = b, a + b\n"
    "print(json.dumps({'ok': True, 'data': {'value': a}}))\n"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0},
        "key": {"type": "string", "x-redact": True},
    },
    "required": ["n"],
}


class FakeExecutor:
    """Runs nothing: answers with a programmable stdout, records the specs."""

    def __init__(self) -> None:
        self.specs: list[SandboxSpec] = []
        self.stdout: Callable[[SandboxSpec], bytes] = lambda spec: _fib_out(spec)
        self.stderr = b""
        self.gate: anyio.Event | None = None
        self.started = anyio.Event()
        self.unavailable = False

    async def ensure(self) -> None:
        if self.unavailable:
            raise SandboxError("sandbox_unavailable", "no bwrap here")

    async def run(self, spec: SandboxSpec) -> SandboxResult:
        self.specs.append(spec)
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        out = self.stdout(spec)
        return SandboxResult(0, None, out, len(out), False, None, self.stderr, False, 0.01, "bwrap")

    async def aclose(self) -> None:
        pass


def _fib_out(spec: SandboxSpec) -> bytes:
    n = json.loads(spec.stdin).get("n", 0)
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return json.dumps({"ok": True, "data": {"value": a}}).encode()


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.config = Config(
            supervisor=SupervisorConfig(state_dir=str(tmp / "state")),
            principals=[PrincipalConfig(name="alice"), PrincipalConfig(name="bob")],
        )
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.changes: list[tuple[str | None, list[str]]] = []
        self.vault: dict[str, str] = {}
        self.executor = FakeExecutor()
        self.now = [1000.0]
        self.forge = Forge(
            self.config,
            lambda e, p: self.events.append((e, p)),
            changed=lambda s, n: self.changes.append((s, n)),
            executor=self.executor,
            secrets=self.vault.get,
            clock=lambda: self.now[0],
        )

    def names(self) -> list[str]:
        return [e for e, _ in self.events]

    def policy(self, **fields: Any) -> None:
        path = self.config.forge_dir / "policy.json"
        self.forge.policy_file.current()  # make sure defaults exist
        data = json.loads(path.read_text())
        data.update(fields)
        tmp = path.with_suffix(".new")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)

    async def fib(self, caller: Caller, name: str = "fib", **extra: Any) -> Any:
        args = {
            "name": name,
            "description": "fib",
            "input_schema": SCHEMA,
            "impl": FIB,
            "runtime": "python3.11",
            **extra,
        }
        return await self.forge.forge(caller, args)


ALICE = Caller("alice", "s1")


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    return Rig(tmp_path)


async def test_forge_list_call_audit(rig: Rig) -> None:
    record = await rig.fib(ALICE, meta={"deterministic": True})
    path = rig.config.forge_dir / "sessions" / "s1" / "tools" / "fib.json"
    assert json.loads(path.read_text())["impl_sha256"] == record.impl_sha256
    assert rig.changes == [("s1", ["fib"])]
    created = dict(rig.events)["created"]
    assert created["scope"] == "session"
    assert "impl" not in created
    names = [t["name"] for t in rig.forge.descriptors(ALICE)]
    assert names == ["forge_tool", "forge_list", "forge_promote", "read_artifact", "fib"]
    assert [t["name"] for t in rig.forge.descriptors(Caller("alice", "s2"))] == names[:4]
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 10, "key": "hunter2"})
    assert out == {"ok": True, "data": {"value": 55}}
    result = mcp_result(out)
    assert result["isError"] is False
    assert json.loads(result["content"][0]["text"]) == out
    called = [p for e, p in rig.events if e == "called"]
    assert called[-1]["ok"] is True
    assert called[-1]["cache"] == "seed"
    manifest = json.loads(
        (rig.config.forge_dir / "runs" / called[-1]["run_id"] / "run_manifest.json").read_text()
    )
    assert manifest["input"] == {"n": 10, "key": "<redacted>"}
    assert manifest["kind"] == "cache_seed"
    assert manifest["stdout"] == out
    assert "hunter2" not in json.dumps(rig.events)
    # the identical call is a cache hit pointing at the seed
    assert await rig.forge.dispatch(ALICE, "fib", {"n": 10, "key": "hunter2"}) == out
    assert len(rig.executor.specs) == 1
    hit = [p for e, p in rig.events if e == "called"][-1]
    hit_manifest = rig.forge.runs.read(hit["run_id"])
    assert hit_manifest is not None
    assert hit_manifest["kind"] == "cache_hit"
    assert hit_manifest["cache"]["seed_run_id"] == called[-1]["run_id"]
    # the audit entry, the hit's durable record, names the seed too
    assert hit["cache"] == "hit"
    assert hit["seed_run_id"] == called[-1]["run_id"]
    assert "seed_run_id" not in called[-1]
    listed = await rig.forge.dispatch(ALICE, "forge_list", {})
    assert listed["data"]["tools"] == [
        {"name": "fib", "description": "fib", "scope": "session", "call_count": 2}
    ]


async def test_spec_runtime_argv_and_stdin(rig: Rig) -> None:
    await rig.fib(ALICE)
    await rig.forge.dispatch(ALICE, "fib", {"n": 3})
    spec = rig.executor.specs[0]
    assert spec.argv == [rig.config.forge.python, "/forge/tool.py"]
    assert spec.impl == FIB.encode()
    assert json.loads(spec.stdin) == {"n": 3}
    assert spec.network is False
    assert rig.config.state_dir in spec.forbidden
    await rig.forge.forge(
        ALICE,
        {
            "name": "sh",
            "description": "",
            "impl": "echo '{\"ok\":true}'",
            "runtime": "bash",
            "input_schema": {"type": "object"},
        },
    )
    assert (await rig.forge.dispatch(ALICE, "sh", {}))["ok"] is True
    assert rig.executor.specs[1].argv == [rig.config.forge.bash, "/forge/tool.sh"]


@pytest.mark.parametrize(
    ("args", "kind"),
    [
        ({"name": "a.b"}, "bad_name"),
        ({"name": "forge_tool"}, "bad_name"),
        ({"runtime": "ruby"}, "bad_runtime"),
        ({"impl": "def (:"}, "static_check_failed"),
        ({"impl": "import ctypes"}, "static_check_failed"),
        ({"impl": "import socket"}, "static_check_failed"),
        ({"impl": "__import__('urllib.request')"}, "static_check_failed"),
        ({"input_schema": {"type": "string"}}, "bad_schema"),
        ({"name": "rm_all"}, "name_forbidden"),
        ({"meta": {"secrets": ["lower"]}}, "bad_arguments"),
        ({"scope": "user"}, "bad_scope"),
    ],
)
async def test_forge_refusals(rig: Rig, args: dict[str, Any], kind: str) -> None:
    with pytest.raises(ForgeError) as caught:
        await rig.fib(ALICE, **args)
    assert caught.value.code == kind
    if kind in ("static_check_failed", "name_forbidden"):
        assert kind in rig.names()


def test_static_check() -> None:
    assert imported_modules(
        "import os.path\nfrom http import client\nimportlib.import_module('ssl')"
    ) == {"os", "http", "ssl"}
    check_impl("python", "import socket", network=True)
    with pytest.raises(ForgeError):
        check_impl("python", "import ctypes", network=True)
    with pytest.raises(ForgeError):
        check_impl("bash", "  \n", network=False)
    check_impl("bash", "curl x", network=False)


async def test_namespaces_and_network_override(rig: Rig) -> None:
    rig.policy(
        persona_namespaces={"alice": "code"},
        persona_sandbox_overrides={"alice": {"network": "allow"}},
    )
    with pytest.raises(ForgeError) as caught:
        await rig.fib(ALICE)
    assert caught.value.code == "namespace_denied"
    assert "namespace_denied" in rig.names()
    await rig.fib(ALICE, name="code_fib", impl=FIB + "import socket\n")  # network: socket ok
    await rig.forge.dispatch(ALICE, "code_fib", {"n": 1})
    assert rig.executor.specs[0].network is True
    assert rig.executor.specs[0].loopback is False


async def test_two_forges_of_one_name_race(rig: Rig) -> None:
    outcomes: list[str] = []

    async def one() -> None:
        try:
            await rig.fib(ALICE)
            outcomes.append("ok")
        except ForgeError as exc:
            outcomes.append(exc.code)

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(anyio.to_thread.run_sync, lambda: anyio.from_thread.run(one))
    assert sorted(outcomes) == ["name_taken"] * 7 + ["ok"]
    assert rig.names().count("created") == 1


async def test_forge_then_immediate_call(rig: Rig) -> None:
    await rig.fib(ALICE)
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 5}))["data"] == {"value": 5}


async def test_scopes_shadowing_and_promote(rig: Rig) -> None:
    await rig.fib(ALICE, scope="project")
    home = rig.config.home_of(rig.config.principals[0])
    assert (home / ".astrid" / "forge" / "tools" / "fib.json").exists()
    assert rig.changes[-1] == (None, ["fib"])
    other = Caller("alice", "s9")
    assert [t["scope"] for t in rig.forge.list_tools(other)] == ["project"]
    assert rig.forge.list_tools(Caller("bob", "s3")) == []
    await rig.fib(ALICE)  # a session tool shadows the project one
    assert [t["scope"] for t in rig.forge.list_tools(ALICE)] == ["session"]
    promoted = await rig.forge.promote(ALICE, "fib")
    assert promoted.version == 1
    assert promoted.promoted_from == {
        "scope": "session",
        "principal_id": "alice",
        "session_id": "s1",
    }
    assert [t["scope"] for t in rig.forge.list_tools(Caller("bob", "s3"))] == ["user"]
    assert (await rig.forge.promote(ALICE, "fib")).version == 2  # same impl: no conflict
    await rig.forge.forge(
        Caller("bob", "s3"),
        {
            "name": "fib2",
            "description": "",
            "impl": "x=1",
            "runtime": "python",
            "input_schema": {"type": "object"},
        },
    )
    # bob's own different fib in his session, promoted over alice's: conflict
    await rig.fib(Caller("bob", "s4"), impl=FIB + "# other\n")
    with pytest.raises(ForgeError) as caught:
        await rig.forge.promote(Caller("bob", "s4"), "fib")
    assert caught.value.code == "promote_conflict"
    assert (await rig.forge.promote(Caller("bob", "s4"), "fib", force=True)).version == 3
    assert "promoted" in rig.names()
    await rig.forge.remove(Caller(None, None), "user", "fib")
    assert "removed" in rig.names()


async def test_acl_and_forbidden_name_at_call_time(rig: Rig) -> None:
    await rig.fib(ALICE, name="deploy_x")
    rig.policy(persona_allowed_tools={"alice": ["other"]})
    out = await rig.forge.dispatch(ALICE, "deploy_x", {"n": 1})
    assert out["error"] == "acl_denied"
    assert "acl_denied" in rig.names()
    rig.policy(persona_allowed_tools={}, forbidden_tool_names=["deploy_*"])
    out = await rig.forge.dispatch(ALICE, "deploy_x", {"n": 1})
    assert out["error"] == "name_forbidden"
    assert "policy_reloaded" in rig.names()
    assert rig.executor.specs == []


async def test_malformed_policy_keeps_the_last_good(rig: Rig) -> None:
    await rig.fib(ALICE)
    rig.policy(forbidden_tool_names=["fib"])
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["error"] == "name_forbidden"
    path = rig.config.forge_dir / "policy.json"
    path.write_text('{"forbidden_tool_names": [}')
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert out["error"] == "name_forbidden"  # the good policy still holds
    failed = [p for e, p in rig.events if e == "policy_reload_failed"]
    assert len(failed) == 1
    assert failed[0]["path"] == str(path)
    await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert rig.names().count("policy_reload_failed") == 1  # once per file version
    path.write_text('{"unknown_field": 1}')
    await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert rig.names().count("policy_reload_failed") == 2


async def test_policy_edited_mid_call_keeps_the_snapshot(rig: Rig) -> None:
    await rig.fib(ALICE)
    rig.executor.gate = anyio.Event()
    results: list[Any] = []

    async def call() -> None:
        results.append(await rig.forge.dispatch(ALICE, "fib", {"n": 4}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await rig.executor.started.wait()
        rig.policy(forbidden_tool_names=["fib"])
        rig.executor.gate.set()
    assert results[0]["ok"] is True  # the in-flight call kept its policy
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 4}))["error"] == "name_forbidden"


async def test_cache_hit_during_a_running_call(rig: Rig) -> None:
    await rig.fib(ALICE, meta={"deterministic": True})
    rig.executor.gate = anyio.Event()
    results: list[Any] = []

    async def call() -> None:
        results.append(await rig.forge.dispatch(ALICE, "fib", {"n": 7}))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await rig.executor.started.wait()
        tg.start_soon(call)  # a second identical call while the first runs
        await anyio.sleep(0.05)
        rig.executor.gate.set()
    await rig.forge.dispatch(ALICE, "fib", {"n": 7})  # after: served from the cache
    assert all(r == {"ok": True, "data": {"value": 13}} for r in results)
    calls = [p for e, p in rig.events if e == "called"]
    assert len(calls) == 3
    kinds = sorted(rig.forge.runs.read(c["run_id"])["kind"] for c in calls)  # type: ignore[index]
    assert kinds.count("cache_hit") >= 1
    assert "cache_seed" in kinds


async def test_corrupted_registry_file_is_hidden_and_audited(rig: Rig) -> None:
    await rig.fib(ALICE)
    await rig.fib(ALICE, name="fib2")
    path = rig.config.forge_dir / "sessions" / "s1" / "tools" / "fib.json"
    path.write_text("{not json")
    assert [t["name"] for t in rig.forge.list_tools(ALICE)] == ["fib2"]
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["error"] == "unknown_tool"
    failed = [p for e, p in rig.events if e == "registry_load_failed"]
    assert len(failed) == 1
    assert failed[0]["path"] == str(path)
    # a record whose impl was edited no longer matches its hash: hidden too
    other = path.with_name("fib2.json")
    data = json.loads(other.read_text())
    data["impl"] = "print('tampered')"
    other.write_text(json.dumps(data))
    assert rig.forge.list_tools(ALICE) == []
    assert rig.names().count("registry_load_failed") == 2


async def test_output_contract(rig: Rig) -> None:
    await rig.fib(ALICE)
    rig.executor.stdout = lambda spec: b"not json"
    rig.executor.stderr = b"Traceback: boom"
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert out["error"] == "bad_output"
    assert "boom" in out["message"]
    rig.executor.stdout = lambda spec: b'{"ok": false, "error": {"kind": "mine", "message": "m"}}'
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert out == {"ok": False, "error": "mine", "message": "m"}  # the bus's flat shape
    assert mcp_result(out)["isError"] is True
    rig.executor.stdout = lambda spec: b'{"ok": false, "error": "gone", "meta": {"n": 1}}'
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert out == {"ok": False, "error": "tool_error", "message": "gone", "meta": {"n": 1}}
    out = await rig.forge.dispatch(ALICE, "fib", {"n": -1})
    assert out["error"] == "validation_failed"
    rig.executor.unavailable = True
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 2})
    assert out["error"] == "sandbox_unavailable"


async def test_secrets_fail_closed_injected_and_redacted(rig: Rig) -> None:
    secret = "sk-live-0123456789abcdef"
    await rig.fib(ALICE, name="keyed", meta={"secrets": ["API_KEY"]})
    out = await rig.forge.dispatch(ALICE, "keyed", {"n": 1})
    assert out["error"] == "secret_denied"
    assert "secret_denied" in rig.names()
    rig.policy(persona_secret_allow={"alice": ["API_KEY"]})
    out = await rig.forge.dispatch(ALICE, "keyed", {"n": 1})
    assert out["error"] == "secret_missing"
    assert "secret_missing" in rig.names()
    rig.vault["API_KEY"] = secret
    import base64

    leak = {
        "ok": True,
        "data": {
            "raw": secret,
            "b64": base64.b64encode(secret.encode()).decode(),
            "hex": secret.encode().hex(),
            "deep": [[{"x": f"k={secret}"}]],
        },
    }
    rig.executor.stdout = lambda spec: json.dumps(leak).encode()
    rig.executor.stderr = f"oops {secret}".encode()
    out = await rig.forge.dispatch(ALICE, "keyed", {"n": 1})
    assert out["ok"] is True
    assert rig.executor.specs[-1].env == {"API_KEY": secret}
    assert secret not in rig.executor.specs[-1].stdin.decode()
    run_id = [p for e, p in rig.events if e == "called"][-1]["run_id"]
    manifest = (rig.config.forge_dir / "runs" / run_id / "run_manifest.json").read_text()
    everything = json.dumps(out) + manifest + json.dumps(rig.events)
    for form in (secret, base64.b64encode(secret.encode()).decode(), secret.encode().hex()):
        assert form not in everything
    assert json.loads(manifest)["secrets_injected"] == ["API_KEY"]


async def test_breakers(rig: Rig) -> None:
    rig.policy(
        breakers={
            "per_tool_rpm": 3,
            "per_session_forge_count": 2,
            "failure_threshold": 2,
            "failure_cooldown_seconds": 30,
        }
    )
    await rig.fib(ALICE)
    await rig.fib(ALICE, name="fib2")
    with pytest.raises(ForgeError) as caught:
        await rig.fib(ALICE, name="fib3")
    assert caught.value.code == "breaker_open"
    for _ in range(3):
        assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["ok"]
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert out["error"] == "breaker_open"
    opened = [p for e, p in rig.events if e == "breaker_open"]
    assert {o["breaker"] for o in opened} == {"forge_count", "rate"}
    rig.now[0] += 61
    rig.executor.stdout = lambda spec: b"garbage"
    for _ in range(2):
        assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["error"] == "bad_output"
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["error"] == "breaker_open"
    rig.now[0] += 31
    rig.executor.stdout = _fib_out
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["ok"]  # the half-open probe
    closed = [p["breaker"] for e, p in rig.events if e == "breaker_closed"]
    assert "failure" in closed
    assert "rate" in closed


def _restarted(rig: Rig, now: float) -> Forge:
    """A second Forge on the same folder, as after a supervisor restart (a new clock)."""
    return Forge(
        rig.config,
        lambda e, p: rig.events.append((e, p)),
        executor=rig.executor,
        clock=lambda: now,
    )


async def test_call_counts_breakers_and_forge_counts_survive_a_restart(rig: Rig) -> None:
    """stats.json: call_count, an open failure breaker (its cooldown left) and forge counts."""
    rig.policy(
        breakers={
            "per_tool_rpm": 0,
            "per_session_forge_count": 2,
            "failure_threshold": 2,
            "failure_cooldown_seconds": 30,
        }
    )
    await rig.fib(ALICE)
    await rig.fib(ALICE, name="fib2")
    for n in range(3):
        assert (await rig.forge.dispatch(ALICE, "fib2", {"n": n}))["ok"]
    rig.executor.stdout = lambda spec: b"garbage"
    for _ in range(2):
        assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["error"] == "bad_output"
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 1}))["error"] == "breaker_open"
    rig.now[0] += 10  # 20 s of the cooldown left
    await rig.forge.aclose()

    again = _restarted(rig, now=5.0)
    listed = {t["name"]: t["call_count"] for t in again.list_tools(ALICE, None)}
    assert listed == {"fib": 2, "fib2": 3}
    out = await again.dispatch(ALICE, "fib", {"n": 1})
    assert out["error"] == "breaker_open", out
    assert "resets in 20s" in out["message"]
    with pytest.raises(ForgeError) as caught:  # the session's forge allowance is used up too
        await again.forge(
            ALICE,
            {
                "name": "fib3",
                "description": "",
                "input_schema": SCHEMA,
                "impl": FIB,
                "runtime": "python",
            },
        )
    assert caught.value.code == "breaker_open"
    await again.aclose()

    later = _restarted(rig, now=100.0)  # a clock that starts anywhere: the cooldown is relative
    rig.executor.stdout = _fib_out
    out = await later.dispatch(ALICE, "fib", {"n": 1})
    assert out["error"] == "breaker_open"  # still 20 s: no time passed while stopped
    await later.aclose()


async def test_a_bad_stats_file_is_reported_and_the_forge_starts_from_zero(rig: Rig) -> None:
    await rig.fib(ALICE)
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 3}))["ok"]
    await rig.forge.aclose()
    stats = rig.config.forge_dir / "stats.json"
    saved = json.loads(stats.read_text())
    assert saved["schema"] == 1
    assert saved["calls"] == {"session:fib": 1}
    for bad in (b"{not json", b'{"schema": 99}', b"[]"):
        stats.write_bytes(bad)
        before = len(rig.events)
        again = _restarted(rig, now=0.0)
        failed = [p for e, p in rig.events[before:] if e == "stats_load_failed"]
        assert len(failed) == 1
        assert failed[0]["path"] == str(stats)
        assert [t["call_count"] for t in again.list_tools(ALICE, None)] == [0]
        await again.aclose()  # and it writes a good file again
        assert json.loads(stats.read_text())["schema"] == 1


async def test_removing_a_tool_drops_its_count(rig: Rig) -> None:
    await rig.fib(ALICE)
    assert (await rig.forge.dispatch(ALICE, "fib", {"n": 3}))["ok"]
    await rig.forge.remove(ALICE, "session", "fib")
    await rig.fib(ALICE)
    assert [t["call_count"] for t in rig.forge.list_tools(ALICE, None)] == [0]


def test_breaker_state_machine() -> None:
    changes: list[tuple[str, State]] = []
    now = [0.0]
    board = BreakerBoard(lambda: now[0], lambda b, n, s, r: changes.append((b, s)))
    policy = Breakers(per_tool_rpm=0, failure_threshold=1, failure_cooldown_seconds=10)
    assert board.admit_call("t", policy) is None
    board.record("t", False, policy)
    assert board.admit_call("t", policy) is not None
    now[0] = 11
    assert board.admit_call("t", policy) is None  # half-open: one probe
    assert board.admit_call("t", policy) is not None  # a second one waits
    board.record("t", False, policy)  # the probe failed: open again
    assert changes == [
        ("failure", State.OPEN),
        ("failure", State.HALF_OPEN),
        ("failure", State.OPEN),
    ]


def test_cache_key_and_mask() -> None:
    k = cache_key("t", "i", "s", {"a": 1, "b": 2})
    assert (
        k
        == cache_key("t", "i", "s", {"b": 2, "a": 1})
        != cache_key("t", "j", "s", {"a": 1, "b": 2})
    )
    schema = {
        "type": "object",
        "properties": {
            "o": {"type": "object", "properties": {"pw": {"x-redact": True}}},
            "l": {"type": "array", "items": {"x-redact": True}},
        },
    }
    assert mask_input(schema, {"o": {"pw": "x", "y": 1}, "l": ["a"], "z": 2}) == {
        "o": {"pw": "<redacted>", "y": 1},
        "l": ["<redacted>"],
        "z": 2,
    }


async def test_x_bind(rig: Rig, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {
            "src": {"type": "string", "x-bind": "ro"},
            "out": {"type": "string", "x-bind": "rw"},
        },
    }
    await rig.fib(ALICE, input_schema=schema)
    rig.executor.stdout = lambda spec: b'{"ok": true}'
    (tmp_path / "d").mkdir()
    await rig.forge.dispatch(
        ALICE, "fib", {"src": str(tmp_path / "x.csv"), "out": str(tmp_path / "d" / "o.csv")}
    )
    binds = {(str(b.path), b.mode) for b in rig.executor.specs[0].binds}
    assert binds == {(str(tmp_path / "x.csv"), "ro"), (str(tmp_path / "d"), "rw")}


def test_threads_do_not_break_the_registry(rig: Rig) -> None:
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            anyio.run(rig.fib, Caller("alice", f"t{i}"))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(rig.forge.all_tools()) == 4
    assert msgspec.json.decode((rig.config.forge_dir / "policy.json").read_bytes())["breakers"]


async def test_a_record_whose_schema_was_broken_by_hand(rig: Rig) -> None:
    await rig.fib(ALICE)
    path = rig.config.forge_dir / "sessions" / "s1" / "tools" / "fib.json"
    data = json.loads(path.read_text())
    data["input_schema"] = {"type": "object", "properties": {"n": {"type": 7}}}
    path.write_text(json.dumps(data))
    out = await rig.forge.dispatch(ALICE, "fib", {"n": 1})
    assert out["error"] == "bad_schema"


async def test_hostile_session_ids_and_relative_binds(rig: Rig) -> None:
    for sid in ("..", ".", "a/b", ""):
        with pytest.raises(ForgeError) as caught:
            await rig.fib(Caller("alice", sid))
        assert caught.value.code == "bad_scope"
    schema = {"type": "object", "properties": {"src": {"type": "string", "x-bind": "ro"}}}
    await rig.fib(ALICE, input_schema=schema)
    out = await rig.forge.dispatch(ALICE, "fib", {"src": "relative/x.csv"})
    assert out["error"] == "validation_failed"
    assert rig.executor.specs == []


async def test_a_session_tool_is_its_principals_only(rig: Rig) -> None:
    await rig.fib(ALICE)
    mallory = Caller("bob", "s1")  # bob names alice's session in his payload
    assert rig.forge.list_tools(mallory) == []
    assert (await rig.forge.dispatch(mallory, "fib", {"n": 1}))["error"] == "unknown_tool"
    assert [t["name"] for t in rig.forge.list_tools(Caller(None, "s1"))] == ["fib"]
