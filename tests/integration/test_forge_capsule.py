"""Forge end to end: the real bwrap sandbox, and the capsule on a real supervisor.

forge → list → call → audit: a tool is forged over the bus, shows up in the
session's list, runs in bubblewrap, writes a manifest, and its events sit in
the one hash-chained audit log that ``astrid audit verify`` checks.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import sqlite3
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from sage.config import Config, PrincipalConfig, SupervisorConfig
from sage.errors import ForgeError
from sage.forge.service import Caller, Forge
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

FAKE = FAKE_CLAUDE
FIB = (
    "import sys, json\n"
    "n = json.loads(sys.stdin.read())['n']\n"
    "a, b = 0, 1\n"
    "for _ in range(n): a, b = b, a + b\n"
    "print(json.dumps({'ok': True, 'data': {'value': a}}))\n"
)
FIB_ARGS = {
    "name": "fib",
    "description": "nth Fibonacci number",
    "input_schema": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["n"],
    },
    "impl": FIB,
    "runtime": "python3.11",
    "meta": {"deterministic": True},
}


_OPEN: list[Forge] = []


@pytest.fixture(autouse=True)
async def _close_forges() -> AsyncIterator[None]:
    """Every Forge a test makes is closed after it (its spare sandboxes killed)."""
    yield
    while _OPEN:
        await _OPEN.pop().aclose()


def _forge(tmp: Path, vault: dict[str, str] | None = None) -> tuple[Forge, list[Any]]:
    config = Config(
        supervisor=SupervisorConfig(state_dir=str(tmp / "state")),
        principals=[PrincipalConfig(name="alice")],
    )
    events: list[Any] = []
    forge = Forge(config, lambda e, p: events.append((e, p)), secrets=(vault or {}).get)
    _OPEN.append(forge)
    return forge, events


async def test_real_sandbox_call(tmp_path: Path) -> None:
    forge, events = _forge(tmp_path)
    caller = Caller("alice", "s1")
    await forge.forge(caller, FIB_ARGS)
    out = await forge.dispatch(caller, "fib", {"n": 20})
    assert out == {"ok": True, "data": {"value": 6765}}, out
    run_id = [p for e, p in events if e == "called"][-1]["run_id"]
    manifest = forge.runs.read(run_id)
    assert manifest is not None
    assert manifest["exit_code"] == 0
    assert manifest["sandbox"]["label"] == "bwrap"
    assert manifest["kind"] == "cache_seed"


async def test_real_sandbox_secret_is_injected_and_redacted(tmp_path: Path) -> None:
    secret = "sk-test-9f8e7d6c5b4a3210"
    forge, events = _forge(tmp_path, {"API_KEY": secret})
    forge.policy_file.current()
    policy = forge.policy_file.path
    data = json.loads(policy.read_text())
    data["persona_secret_allow"] = {"alice": ["API_KEY"]}
    policy.write_text(json.dumps(data))
    caller = Caller("alice", "s1")
    impl = (
        "import os, json, sys, base64\n"
        "k = os.environ['API_KEY']\n"
        "sys.stderr.write('key=' + k + '\\n')\n"
        "print(json.dumps({'ok': True, 'data': {'k': k, 'b': base64.b64encode(k.encode()).decode(),"
        " 'len': len(k)}}))\n"
    )
    await forge.forge(
        caller,
        {
            "name": "keyed",
            "description": "",
            "input_schema": {"type": "object"},
            "impl": impl,
            "runtime": "python",
            "meta": {"secrets": ["API_KEY"]},
        },
    )
    out = await forge.dispatch(caller, "keyed", {})
    assert out["ok"] is True
    assert out["data"]["len"] == len(secret)
    assert out["data"]["k"] == "<redacted>"
    assert out["data"]["b"] == "<redacted>"
    run_id = [p for e, p in events if e == "called"][-1]["run_id"]
    text = (forge.runs.directory / run_id / "run_manifest.json").read_text()
    assert secret not in text
    assert "key=<redacted>" in text
    assert secret not in json.dumps(events)


async def test_real_sandbox_bad_output_and_no_network(tmp_path: Path) -> None:
    forge, _ = _forge(tmp_path)
    caller = Caller("alice", "s1")
    await forge.forge(
        caller,
        {
            "name": "noisy",
            "description": "",
            "input_schema": {"type": "object"},
            "impl": "echo hello; echo oops >&2",
            "runtime": "bash",
        },
    )
    out = await forge.dispatch(caller, "noisy", {})
    assert out["error"] == "bad_output"
    assert "oops" in out["message"]
    probe = (
        "import json, os\n"
        "print(json.dumps({'ok': True, 'data': sorted(os.listdir('/sys/class/net'))"
        " if os.path.isdir('/sys/class/net') else []}))\n"
    )
    await forge.forge(
        caller,
        {
            "name": "nets",
            "description": "",
            "input_schema": {"type": "object"},
            "impl": probe,
            "runtime": "python",
        },
    )
    out = await forge.dispatch(caller, "nets", {})
    assert out["ok"] is True
    assert set(out["data"]) <= {"lo"}


def _audit_kinds(sage: Sage) -> list[tuple[str, dict[str, Any]]]:
    db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT kind, payload FROM entries WHERE kind LIKE 'forge.v1.audit.%' ORDER BY seq"
        ).fetchall()
    finally:
        db.close()
    out = []
    for kind, raw in rows:
        entry = msgspec.json.decode(raw)
        out.append((kind.rsplit(".", 1)[1], entry.get("payload", entry)))
    return out


async def _audits(sage: Sage, event: str, count: int) -> list[dict[str, Any]]:
    """The ``event`` audit payloads, once there are ``count`` (the sink appends them async)."""
    with anyio.fail_after(10):
        while True:
            found = [p for kind, p in _audit_kinds(sage) if kind == event]
            if len(found) >= count:
                return found
            await anyio.sleep(0.05)


async def test_capsule_forge_list_call_audit() -> None:
    config = sage_config(FAKE, {}, capsules='["forge"]')
    async with running_sage(config) as sage:
        changed = await sage.client.subscribe("sage.v1.tools.changed")
        call = {"session_id": "s1", "tool_name": "forge_tool", "arguments": FIB_ARGS}
        made = await sage.request("forge.v1.request.call", call)
        assert made["isError"] is False, made
        note = msgspec.json.decode((await changed.get()).payload)
        assert note == {"session_id": "s1", "names": ["fib"], "server": "forge"}
        listed = await sage.request("forge.v1.request.list", {"session_id": "s1"})
        names = [t["name"] for t in listed["tools"]]
        assert names == ["forge_tool", "forge_list", "forge_promote", "read_artifact", "fib"]
        assert listed["tools"][4]["inputSchema"] == FIB_ARGS["input_schema"]
        result = await sage.request(
            "forge.v1.request.call",
            {"session_id": "s1", "tool_name": "fib", "arguments": {"n": 30}, "tool_use_id": "t1"},
        )
        assert result["isError"] is False, result
        assert result["structuredContent"] == {"ok": True, "data": {"value": 832040}}
        assert json.loads(result["content"][0]["text"]) == result["structuredContent"]
        bad = await sage.request(
            "forge.v1.request.call",
            {"session_id": "s1", "tool_name": "fib", "arguments": {"n": "x"}},
        )
        assert bad["isError"] is True
        assert bad["structuredContent"]["error"] == "validation_failed"
        taken = await sage.request("forge.v1.request.call", call)
        assert taken["structuredContent"]["error"] == "name_taken"
        # operator requests
        tools = await sage.request("forge.v1.request.admin.list", {})
        assert [t["name"] for t in tools["tools"]] == ["fib"]
        shown = await sage.request(
            "forge.v1.request.admin.show", {"name": "fib", "session_id": "s1"}
        )
        assert shown["tool"]["impl"] == FIB
        promoted = await sage.request(
            "forge.v1.request.admin.promote", {"name": "fib", "session_id": "s1"}
        )
        assert promoted == {"ok": True, "name": "fib", "version": 1}
        ran = await sage.request(
            "forge.v1.request.admin.run",
            {"name": "fib", "arguments": {"n": 30}, "principal_id": "alice"},
        )
        assert ran["structuredContent"]["data"] == {"value": 832040}
        runs = await sage.request("forge.v1.request.admin.runs", {"name": "fib"})
        assert len(runs["runs"]) == 2  # the refused (validation_failed) call ran nothing
        await _audits(sage, "called", 3)
        await _audits(sage, "promoted", 1)
        events = [kind for kind, _ in _audit_kinds(sage)]
        assert events.count("created") == 1
        assert events.count("called") == 3
        assert "promoted" in events
        for _, payload in _audit_kinds(sage):
            assert "impl" not in payload
            assert FIB not in json.dumps(payload)
        created = (await _audits(sage, "created", 1))[0]
        assert created["name"] == "fib"
        assert created["impl_sha256"]
        code, out, err = await sage.astrid("audit", "verify")
        assert code == 0, (out, err)


_TRY_READ = """
import json, os, sys
opened = []
for path in sys.argv[1:]:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").close()
        opened.append(path)
    except OSError:
        pass
print(json.dumps(opened))
"""


async def test_forge_state_is_owner_only_with_a_socket_group() -> None:
    """With ``[socket] group``, group members reach the socket and read nothing else.

    Under umask 022 (systemd's default) a forge and calls leave tool
    sources, run manifests (input, output, stderr), policy, stats and the
    cache in the state folder: every one of them 0600 in 0700 folders, and a
    real group member (uid 65534, the socket's group) can open none of them.
    """
    group = grp.getgrnam("users")
    root = short_dir()
    root.chmod(0o755)
    config = sage_config(FAKE, {}, capsules='["forge"]', extra='[socket]\ngroup = "users"\n')
    old = os.umask(0o022)
    try:
        async with running_sage(config, root=root) as sage:
            os.umask(old)
            call = {"session_id": "s1", "tool_name": "forge_tool", "arguments": FIB_ARGS}
            assert (await sage.request("forge.v1.request.call", call))["isError"] is False
            fib = {"session_id": "s1", "tool_name": "fib", "arguments": {"n": 30}}
            for _ in range(2):  # the second from the cache
                assert (await sage.request("forge.v1.request.call", fib))["isError"] is False
            promoted = await sage.request(
                "forge.v1.request.admin.promote", {"name": "fib", "session_id": "s1"}
            )
            assert promoted["ok"] is True
            ran = await sage.request(
                "forge.v1.request.admin.run",
                {"name": "fib", "arguments": {"n": 31}, "principal_id": "alice"},
            )
            assert ran["isError"] is False
            big = {**FIB_ARGS, "name": "big", "impl": "print('x' * (5 << 20))\n"}
            make = {"session_id": "s1", "tool_name": "forge_tool", "arguments": big}
            assert (await sage.request("forge.v1.request.call", make))["isError"] is False
            await sage.request("forge.v1.request.call", {**fib, "tool_name": "big"})
        state = root / "state"
        socket_dir = state / "run"
        paths = [p for p in state.rglob("*") if not p.is_symlink()]
        names = {p.name for p in paths}
        for expected in ("fib.json", "run_manifest.json", "policy.json", "stats.json"):
            assert expected in names, sorted(names)
        assert "full_stdout.bin" in names, sorted(names)
        loose = {
            str(p.relative_to(state)): oct(p.stat().st_mode & 0o777)
            for p in paths
            if p != socket_dir and p.parent != socket_dir and p.stat().st_mode & 0o077
        }
        # public by design (verifiers without the private key), in the 0700 keys folder
        assert loose.pop("keys/audit_ed25519.pub", None) in (None, "0o644")
        assert (state / "keys").stat().st_mode & 0o077 == 0
        assert loose == {}, "\n".join(f"{m} {p}" for p, m in sorted(loose.items()))
        member = await anyio.run_process(
            [
                "setpriv",
                "--reuid",
                "65534",
                "--regid",
                str(group.gr_gid),
                "--clear-groups",
                "--",
                sys.executable,
                "-I",
                "-c",
                _TRY_READ,
                *map(str, paths),
            ],
            check=True,
        )
        opened = set(json.loads(member.stdout))
        assert str(socket_dir) in opened  # the group passes through the state folder to it
        opened -= {str(socket_dir), str(socket_dir / "astrid.sock")}
        assert opened == set(), sorted(opened)
    finally:
        os.umask(old)
        shutil.rmtree(root, ignore_errors=True)


async def test_project_tools_and_an_old_forge_tree_are_owner_only(tmp_path: Path) -> None:
    """Under umask 022: a project-scope tool in the principal's home is 0600 in 0700
    folders, and a forge tree an older version left 0644/0755 is tightened at start."""
    (tmp_path / "state").mkdir(mode=0o700)  # as the supervisor makes it
    old_tree = tmp_path / "state" / "forge" / "runs" / "20250101T000000Z_00000000"
    old_tree.mkdir(parents=True, mode=0o755)
    (old_tree / "run_manifest.json").write_text("{}")
    for path in (old_tree, *old_tree.parents):
        if path == tmp_path / "state":  # the supervisor's to keep 0700 (or 0750)
            break
        path.chmod(0o755)
    (old_tree / "run_manifest.json").chmod(0o644)
    old = os.umask(0o022)
    try:
        forge, _ = _forge(tmp_path)
        caller = Caller("alice", "s1")
        await forge.forge(caller, {**FIB_ARGS, "scope": "project"})
        assert await forge.dispatch(caller, "fib", {"n": 5}) == {"ok": True, "data": {"value": 5}}
    finally:
        os.umask(old)
    state = tmp_path / "state"
    tool = state / "homes" / "alice" / ".astrid" / "forge" / "tools" / "fib.json"
    assert tool.is_file()
    loose = {
        str(p.relative_to(state)): oct(p.stat().st_mode & 0o777)
        for p in [state, *state.rglob("*")]
        if not p.is_symlink() and p.stat().st_mode & 0o077
    }
    assert loose == {}, loose


UID_TOOL = {
    **FIB_ARGS,
    "name": "whoami",
    "input_schema": {"type": "object"},
    "impl": "import json, os\nprint(json.dumps({'ok': True, 'data': os.getuid()}))\n",
    "meta": {},
}


async def test_each_principal_s_tools_run_under_a_uid_of_its_own(tmp_path: Path) -> None:
    """Not nobody (65534, shared with host daemons), not a host user, not another's."""
    config = Config(
        supervisor=SupervisorConfig(state_dir=str(tmp_path / "state")),
        principals=[PrincipalConfig(name="alice"), PrincipalConfig(name="bob")],
    )

    async def uids_of(forge: Forge) -> dict[str | None, int]:
        seen: dict[str | None, int] = {}
        for who in ("alice", "bob", None):
            out = await forge.dispatch(Caller(who, "s1"), "whoami", {})
            assert out["ok"] is True, out
            seen[who] = out["data"]
        return seen

    forge = Forge(config, lambda e, p: None)
    _OPEN.append(forge)
    await forge.forge(Caller("alice", "s1"), UID_TOOL)
    await forge.promote(Caller("alice", "s1"), "whoami")  # user scope: everyone's
    seen = await uids_of(forge)
    assert len(set(seen.values())) == 3, seen
    for uid in seen.values():
        assert uid != 65534
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)  # no user of this host shares it
    # the same uids for a new forge on the same state, even with the principals reordered
    again = Forge(
        msgspec.structs.replace(config, principals=list(reversed(config.principals))),
        lambda e, p: None,
    )
    _OPEN.append(again)
    assert await uids_of(again) == seen


async def test_real_sandbox_output_over_the_cap_is_spilled(tmp_path: Path) -> None:
    forge, events = _forge(tmp_path)
    forge.policy_file.current()
    data = json.loads(forge.policy_file.path.read_text())
    data["output_cap"] = 4096  # clamps [forge] output_cap down
    forge.policy_file.path.write_text(json.dumps(data))
    caller = Caller("alice", "s1")
    impl = "import json\nprint(json.dumps({'ok': True, 'data': 'x' * 20000}))\n"
    await forge.forge(
        caller,
        {
            "name": "big",
            "description": "",
            "input_schema": {"type": "object"},
            "impl": impl,
            "runtime": "python",
        },
    )
    out = await forge.dispatch(caller, "big", {})
    assert out["error"] == "output_truncated"
    meta = out["meta"]
    assert meta["stdout_truncated"] is True
    assert meta["stdout_total_bytes"] > 20000
    spilled = await anyio.Path(meta["stdout_full_artifact"]).read_bytes()
    assert spilled.startswith(b'{"ok": true')
    run_id = [p for e, p in events if e == "called"][-1]["run_id"]
    manifest = forge.runs.read(run_id)
    assert manifest is not None
    assert manifest["stdout"]["truncated"] is True


async def test_capsule_races_on_a_real_supervisor() -> None:
    config = sage_config(FAKE, {}, capsules='["forge"]')
    async with running_sage(config) as sage:
        call = {"session_id": "r1", "tool_name": "forge_tool", "arguments": FIB_ARGS}
        results: list[dict[str, Any]] = []

        async def one(payload: dict[str, Any]) -> None:
            results.append(await sage.request("forge.v1.request.call", payload))

        async with anyio.create_task_group() as tg:  # two forges of one name
            for _ in range(4):
                tg.start_soon(one, call)
        kinds = sorted(
            "ok" if not r["isError"] else r["structuredContent"]["error"] for r in results
        )
        assert kinds == ["name_taken", "name_taken", "name_taken", "ok"]
        results.clear()
        fib = {"session_id": "r1", "tool_name": "fib", "arguments": {"n": 90}}
        async with anyio.create_task_group() as tg:  # identical deterministic calls at once
            for _ in range(3):
                tg.start_soon(one, fib)
        await one(fib)  # and one after: served from the cache
        assert all(
            r["structuredContent"]["data"] == {"value": 2880067194370816120} for r in results
        )
        called = await _audits(sage, "called", 4)
        assert len(called) == 4
        assert {c["principal"] for c in called} == {None}
        runs = await sage.request("forge.v1.request.admin.runs", {"name": "fib"})
        hits = [r["cache"].get("seed_run_id") is not None for r in runs["runs"]]
        assert len(runs["runs"]) == 4
        assert any(hits)  # at least the last call was a cache hit
        code, out, err = await sage.astrid("audit", "verify")
        assert code == 0, (out, err)


async def test_real_sandbox_wall_clock(tmp_path: Path) -> None:
    from sage.config import ForgeConfig

    config = Config(
        supervisor=SupervisorConfig(state_dir=str(tmp_path / "state")),
        principals=[PrincipalConfig(name="alice")],
        forge=ForgeConfig(wall_clock=1.0),
    )
    events: list[Any] = []
    forge = Forge(config, lambda e, p: events.append((e, p)))
    _OPEN.append(forge)
    caller = Caller("alice", "s1")
    await forge.forge(
        caller,
        {
            "name": "spin",
            "description": "",
            "input_schema": {"type": "object"},
            "impl": "while True:\n    pass\n",
            "runtime": "python",
        },
    )
    out = await forge.dispatch(caller, "spin", {})
    assert out["error"] == "timeout"
    manifest = forge.runs.read([p for e, p in events if e == "called"][-1]["run_id"])
    assert manifest is not None
    assert manifest["timed_out"] is True


def _host_address() -> str | None:
    """This host's address on its default route (no packet is sent), or None."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 9))
        address: str = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


CONNECT = (
    "import json, socket, sys\n"
    "args = json.load(sys.stdin)\n"
    "out = {}\n"
    "for host in args['hosts']:\n"
    "    try:\n"
    "        socket.create_connection((host, args['port']), timeout=3).close()\n"
    "        out[host] = 'connected'\n"
    "    except OSError as exc:\n"
    "        out[host] = type(exc).__name__\n"
    "print(json.dumps({'ok': True, 'data': out}))\n"
)


async def test_real_sandbox_network_follows_the_persona_policy(tmp_path: Path) -> None:
    """Through the forge: no network by default; allowed, the host is reachable, loopback not."""
    host = _host_address()
    assert host is not None, "the test needs an address other than loopback"
    forge, events = _forge(tmp_path)
    caller = Caller("alice", "s1")
    args = {
        "name": "dial",
        "description": "",
        "input_schema": {
            "type": "object",
            "properties": {"hosts": {"type": "array"}, "port": {"type": "integer"}},
        },
        "impl": CONNECT,
        "runtime": "python",
    }
    with pytest.raises(ForgeError) as refused:  # the static check: socket needs the network
        await forge.forge(caller, args)
    assert refused.value.code == "static_check_failed"

    accepted: list[str] = []
    listener = await anyio.create_tcp_listener(local_host="0.0.0.0", local_port=0)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        accepted.append(str(stream.extra(anyio.abc.SocketAttribute.remote_address)))
        await stream.aclose()

    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    forge.policy_file.current()
    policy = json.loads(forge.policy_file.path.read_text())

    def allow(**override: str) -> None:
        policy["persona_sandbox_overrides"] = {"alice": override}
        tmp = forge.policy_file.path.with_suffix(".new")
        tmp.write_text(json.dumps(policy))
        tmp.replace(forge.policy_file.path)

    async with anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, serve)
        allow(network="allow")
        await forge.forge(caller, args)
        out = await forge.dispatch(caller, "dial", {"hosts": [host, "127.0.0.1"], "port": port})
        assert out["ok"] is True, out
        assert out["data"] == {host: "connected", "127.0.0.1": "PermissionError"}
        manifest = forge.runs.read([p for e, p in events if e == "called"][-1]["run_id"])
        assert manifest is not None
        assert manifest["sandbox"]["network"] is True
        assert manifest["sandbox"]["label"] == "bwrap+net-noloop"

        allow(network="allow", loopback="allow")
        out = await forge.dispatch(caller, "dial", {"hosts": ["127.0.0.1"], "port": port})
        assert out["data"] == {"127.0.0.1": "connected"}, out

        allow(network="deny")  # the next call: no network namespace of the host any more
        out = await forge.dispatch(caller, "dial", {"hosts": [host], "port": port})
        assert out["ok"] is True, out
        assert out["data"][host] != "connected"
        tg.cancel_scope.cancel()
    await listener.aclose()
    assert len(accepted) == 2


async def test_real_sandbox_x_bind_paths_through_the_forge(tmp_path: Path) -> None:
    """x-bind ro/rw fields name what is mounted; nothing else of the host is there."""
    import os
    import shutil
    import time

    base = Path("/tmp") / f"forge-xbind-{os.getpid()}-{time.monotonic_ns()}"
    data, out_dir, hidden = base / "data", base / "out", base / "hidden"
    for folder in (base, data, out_dir, hidden):
        folder.mkdir(mode=0o755)
        folder.chmod(0o755)
    (data / "in.txt").write_text("forty-two")
    (data / "in.txt").chmod(0o644)
    (hidden / "secret.txt").write_text("not for the tool")
    try:
        forge, _ = _forge(tmp_path)
        caller = Caller("alice", "s1")
        if os.geteuid() == 0:  # rw: writable by alice's own sandbox uid
            uid = forge.uids.uid_for("alice")
            os.chown(out_dir, uid, uid)
        else:
            out_dir.chmod(0o777)
        impl = (
            "import json, os, sys\n"
            "a = json.load(sys.stdin)\n"
            "text = open(a['src']).read()\n"
            "open(os.path.join(a['dst'], 'out.txt'), 'w').write(text.upper())\n"
            "try:\n"
            "    open(a['src'], 'a').write('more')\n"
            "    ro = 'writable'\n"
            "except OSError as exc:\n"
            "    ro = type(exc).__name__\n"
            "print(json.dumps({'ok': True, 'data': {'read': text, 'ro': ro,\n"
            "    'hidden': os.path.exists(a['hidden'])}}))\n"
        )
        await forge.forge(
            caller,
            {
                "name": "shout",
                "description": "",
                "input_schema": {
                    "type": "object",
                    "properties": {
                        "src": {"type": "string", "x-bind": "ro"},
                        "dst": {"type": "string", "x-bind": "rw"},
                        "hidden": {"type": "string"},
                    },
                    "required": ["src", "dst", "hidden"],
                },
                "impl": impl,
                "runtime": "python",
            },
        )
        out = await forge.dispatch(
            caller,
            "shout",
            {
                "src": str(data / "in.txt"),
                "dst": str(out_dir),
                "hidden": str(hidden / "secret.txt"),
            },
        )
        assert out["ok"] is True, out
        assert out["data"]["read"] == "forty-two"
        assert out["data"]["hidden"] is False
        assert out["data"]["ro"] != "writable"
        assert (out_dir / "out.txt").read_text() == "FORTY-TWO"
        assert (data / "in.txt").read_text() == "forty-two"
        refused = await forge.dispatch(
            caller,
            "shout",
            {"src": "/etc/passwd", "dst": str(out_dir), "hidden": "/"},
        )
        assert refused["ok"] is False
        assert refused["error"] == "mount_refused", refused
    finally:
        shutil.rmtree(base, ignore_errors=True)
