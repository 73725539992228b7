"""astrid capsule install: a checked folder becomes a running worker capsule whose tool is called."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.daemon import ASTRID, Daemon, descendants, short_dir

MANIFEST = """[package]
name = "{name}"
version = "1.2.0"
entry = "{entry}"

[publish]
patterns = [{publish}]

[subscribe]
patterns = ["tool.v1.request.describe", "tool.v1.execute.hello"]
"""
GOOD_PUBLISH = '"tool.v1.response.describe.{name}", "tool.v1.execute.hello.result"'
CODE = '''
import msgspec
from sage.capsule.sdk import tool


class HelloArgs(msgspec.Struct):
    who: str


@tool("hello")
async def hello(args: HelloArgs) -> str:
    """Say hello."""
    return f"hello {args.who}, from a worker"
'''


def _capsule(root: Path, folder: str = "my_capsule", *, name: str = "mine", **kw: str) -> Path:
    path = root / folder
    path.mkdir(parents=True)
    entry = kw.get("entry", folder)
    publish = kw.get("publish", GOOD_PUBLISH.format(name=name))
    (path / "Capsule.toml").write_text(MANIFEST.format(name=name, entry=entry, publish=publish))
    (path / "__init__.py").write_text(kw.get("code", CODE))
    return path


def _wait_for_tool(d: Daemon, name: str) -> list[dict[str, str]]:
    for _ in range(200):
        result = d.astrid("tools", "list", "--json")
        tools: list[dict[str, str]] = json.loads(result.stdout) if result.returncode == 0 else []
        if any(t["name"] == name for t in tools):
            return tools
        time.sleep(0.05)
    raise AssertionError(f"{name} never appeared; log:\n{d.log()[-3000:]}")


def test_install_starts_a_worker_whose_tool_answers(tmp_path: Path) -> None:
    d = Daemon(short_dir(), 'capsules = ["tools"]\n').start()
    try:
        folder = _capsule(tmp_path)
        result = d.astrid("capsule", "install", str(folder))
        assert result.returncode == 0, result.stderr
        assert "installed mine" in result.stdout
        assert "started mine" in result.stdout
        tools = _wait_for_tool(d, "mcp__sage__hello")
        assert {"name": "mcp__sage__hello", "capsule": "mine"}.items() <= next(
            t for t in tools if t["name"] == "mcp__sage__hello"
        ).items()
        rows = json.loads(d.astrid("capsule", "list", "--json").stdout)
        mine = next(r for r in rows if r["name"] == "mine")
        assert mine["state"] == "running"
        assert mine["version"] == "1.2.0"
        assert mine["pid"]  # a worker process, not imported into the supervisor
        # a tool call through the bridge reaches the worker and its answer comes back
        listener = subprocess.Popen(
            [*ASTRID, "bus", "sub", "sage.v1.tool.result.>", "-n", "1", "--config", str(d.config)],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)  # let the subscription reach the supervisor
        call = {
            "session_id": "s",
            "principal_id": None,
            "tool_name": "hello",
            "arguments": {"who": "Ada"},
            "tool_use_id": None,
        }
        assert d.astrid("bus", "pub", "sage.v1.tool.call.c1", json.dumps(call)).returncode == 0
        out, _ = listener.communicate(timeout=20)
        envelope = json.loads(out)
        assert envelope["topic"] == "sage.v1.tool.result.c1"
        assert "hello Ada, from a worker" in json.dumps(envelope["payload"])
        again = d.astrid("capsule", "install", str(folder))
        assert again.returncode == 1
        assert "--force" in again.stderr
        forced = d.astrid("capsule", "install", str(folder), "--force")
        assert forced.returncode == 0, forced.stderr
        assert "restarted mine" in forced.stdout  # the running one was replaced live
    finally:
        d.stop()
    # installed capsules start with the supervisor
    again_d = Daemon(d.root, 'capsules = ["tools"]\n')
    again_d.config = d.config
    again_d.start()
    try:
        _wait_for_tool(again_d, "mcp__sage__hello")
    finally:
        again_d.stop()


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {"publish": '"tool.v1.execute.hello.result"'},
            "[publish] patterns must include 'tool.v1.response.describe.mine'",
        ),
        (
            {"code": "import nonexistent_module_x\n"},
            "cannot load 'my_capsule': ModuleNotFoundError",
        ),
        ({"entry": "my_capsule.missing"}, "cannot load 'my_capsule.missing': ModuleNotFoundError"),
        ({"name": "greeter"}, "taken by a built-in capsule"),
        ({"name": "../x"}, "package.name"),
        ({"code": "x = 1\n"}, "has no @tool or @subscribe functions"),
    ],
)
def test_bad_capsules_are_refused_with_the_reason(
    tmp_path: Path, kw: dict[str, str], expected: str
) -> None:
    name = kw.pop("name", "mine")
    folder = _capsule(tmp_path, name=name, **kw)
    d = Daemon(short_dir())  # not started: the check needs no supervisor
    result = d.astrid("capsule", "install", str(folder))
    assert result.returncode == 1
    assert expected in result.stderr, result.stderr
    assert not (d.root / "state" / "capsules").exists()


def test_a_folder_whose_name_is_not_a_module_installs_under_its_package(tmp_path: Path) -> None:
    """The issue's ./my-capsule: the folder is installed as the entry's package."""
    d = Daemon(short_dir())
    folder = _capsule(tmp_path, "my-capsule", entry="my_capsule")
    result = d.astrid("capsule", "install", str(folder))
    assert result.returncode == 0, result.stderr
    assert (d.root / "state" / "capsules" / "my_capsule" / "__init__.py").is_file()


def test_install_without_a_running_supervisor(tmp_path: Path) -> None:
    d = Daemon(short_dir())
    result = d.astrid("capsule", "install", str(_capsule(tmp_path)), "--check")
    assert result.returncode == 0, result.stderr
    assert "mine: good (1 tools)" in result.stdout
    result = d.astrid("capsule", "install", str(_capsule(tmp_path / "b")))
    assert result.returncode == 0, result.stderr
    assert "it starts with the supervisor" in result.stdout
    assert (d.root / "state" / "capsules" / "my_capsule" / "Capsule.toml").is_file()
    # rm with no supervisor deletes the copy; a second rm says there is none
    removed = d.astrid("capsule", "rm", "mine")
    assert removed.returncode == 0, removed.stderr
    assert "removed mine" in removed.stdout
    assert not (d.root / "state" / "capsules" / "my_capsule").exists()
    again = d.astrid("capsule", "rm", "mine")
    assert again.returncode == 1
    assert "no installed capsule 'mine'" in again.stderr


# -- the sandbox of installed workers ------------------------------------------------

PROBE_CODE = '''
import json, os, socket
import msgspec
from sage.capsule.sdk import tool


class ProbeArgs(msgspec.Struct):
    audit: str
    keys: str
    home: str
    control: str
    port: int


def _try(action):
    try:
        action()
    except OSError as exc:
        return type(exc).__name__
    return "ok"


def _loopback():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        socket.create_connection(server.getsockname(), timeout=2).close()


def _unix(path):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)


@tool("{tool}")
async def probe(args: ProbeArgs) -> str:
    """What this worker can reach."""
    found = {{
        "uid": os.getuid(),
        "audit": _try(lambda: open(args.audit, "rb").read(1)),
        "keys": _try(lambda: os.listdir(args.keys)),
        "home": _try(lambda: os.listdir(args.home)),
        "control": _try(lambda: _unix(args.control)),
        "own_folder": _try(lambda: open("written-by-worker", "w").close()),
        "tmp": _try(lambda: open("/tmp/scratch", "w").write("x")),
        "loopback": _try(_loopback),
        "memfd": _try(lambda: os.close(os.memfd_create("x"))),
        "host_listener": _try(
            lambda: socket.create_connection(("127.0.0.1", args.port), timeout=2).close()
        ),
    }}
    return "PROBE" + json.dumps(found) + "EBORP"
'''


def _probe_capsule(root: Path, name: str, *, network: bool | None = None) -> Path:
    tool = f"probe_{name}"
    publish = f'"tool.v1.response.describe.{name}", "tool.v1.execute.{tool}.result"'
    path = _capsule(
        root, f"{name}_cap", name=name, publish=publish, code=PROBE_CODE.format(tool=tool)
    )
    manifest = (
        (path / "Capsule.toml")
        .read_text()
        .replace("tool.v1.execute.hello", f"tool.v1.execute.{tool}")
    )
    if network is not None:
        manifest += f"\n[sandbox]\nnetwork = {str(network).lower()}\n"
    (path / "Capsule.toml").write_text(manifest)
    return path


def _call(d: Daemon, tool: str, arguments: dict[str, object], cid: str) -> dict[str, object]:
    """A tool call through the bridge; what the probe found."""
    listener = subprocess.Popen(
        [*ASTRID, "bus", "sub", f"sage.v1.tool.result.{cid}", "-n", "1", "--config", str(d.config)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(0.5)  # let the subscription reach the supervisor
    call = {
        "session_id": "s",
        "principal_id": None,
        "tool_name": tool,
        "arguments": arguments,
        "tool_use_id": None,
    }
    assert d.astrid("bus", "pub", f"sage.v1.tool.call.{cid}", json.dumps(call)).returncode == 0
    out, _ = listener.communicate(timeout=30)
    text = json.dumps(json.loads(out)["payload"])
    assert "PROBE" in text, text
    found: dict[str, object] = json.loads(
        json.loads(f'"{text.split("PROBE")[1].split("EBORP")[0]}"')
    )
    return found


def _worker_pids(d: Daemon, name: str) -> list[int]:
    """The host pids of the capsule's Python worker (under its bwrap)."""
    rows = json.loads(d.astrid("capsule", "list", "--json").stdout)
    pid = next(r for r in rows if r["name"] == name)["pid"]
    assert pid
    return [
        p
        for p in descendants(pid)
        if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:3]
        == [b"-m", b"sage.capsule.worker"]
    ]


def _uids(pid: int) -> list[int]:
    line = next(
        x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:")
    )
    return [int(v) for v in line.split()[1:]]


def _sandbox_daemon(home: Path) -> Daemon:
    home.mkdir(mode=0o700)
    (home / "secret.txt").write_text("alice's")
    extra = f'capsules = ["tools"]\n\n[[principals]]\nname = "alice"\nhome = "{home}"\n'
    return Daemon(short_dir(), extra).start()


def test_an_installed_worker_is_confined_under_a_uid_of_its_own(tmp_path: Path) -> None:
    """As root: the worker runs as its own uid from [capsules] uid_base, reaches no state,
    keys, home or control socket, cannot write its folder, has no network."""
    d = _sandbox_daemon(tmp_path / "alice-home")
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(8)
    try:
        result = d.astrid("capsule", "install", str(_probe_capsule(tmp_path, "boxed")))
        assert result.returncode == 0, result.stderr
        _wait_for_tool(d, "mcp__sage__probe_boxed")
        state = d.root / "state"
        args = {
            "audit": str(state / "audit.db"),
            "keys": str(state / "keys"),
            "home": str(tmp_path / "alice-home"),
            "control": str(d.socket),
            "port": host.getsockname()[1],
        }
        found = _call(d, "probe_boxed", args, "c1")
        assert found["uid"] == 92000, found
        for reach in ("audit", "keys", "home", "control"):
            assert found[reach] in ("FileNotFoundError", "PermissionError"), (reach, found)
        assert found["own_folder"] == "OSError"  # EROFS: its folder is read-only
        assert not (state / "capsules" / "boxed_cap" / "written-by-worker").exists()
        assert found["tmp"] == "ok"
        assert found["loopback"] == "ok"  # a loopback of its own
        assert found["host_listener"] == "ConnectionRefusedError"  # not the host's
        assert found["memfd"] == "PermissionError"  # the forge's seccomp filter
        (pid,) = _worker_pids(d, "boxed")
        assert _uids(pid) == [92000] * 4  # real, effective, saved, filesystem: not root
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert "Max processes             256                  256" in limits, limits
        uids = json.loads((state / "capsule_uids.json").read_text())["uids"]
        assert uids == {"boxed": 92000}
    finally:
        host.close()
        d.stop()


def test_network_only_when_the_manifest_declares_it(tmp_path: Path) -> None:
    """[sandbox] network = true: the host's network (a host listener answers); each
    capsule its own uid, kept across restarts of the supervisor."""
    d = _sandbox_daemon(tmp_path / "alice-home")
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(8)
    try:
        for name, network in (("closed", False), ("netted", True)):
            folder = _probe_capsule(tmp_path, name, network=network)
            result = d.astrid("capsule", "install", str(folder))
            assert result.returncode == 0, result.stderr
            _wait_for_tool(d, f"mcp__sage__probe_{name}")
        state = d.root / "state"
        args = {
            "audit": str(state / "audit.db"),
            "keys": str(state / "keys"),
            "home": str(tmp_path / "alice-home"),
            "control": str(d.socket),
            "port": host.getsockname()[1],
        }
        closed = _call(d, "probe_closed", args, "c1")
        netted = _call(d, "probe_netted", args, "c2")
        assert closed["host_listener"] == "ConnectionRefusedError"
        assert netted["host_listener"] == "ok"
        assert netted["loopback"] == "ok"
        assert (closed["uid"], netted["uid"]) == (92000, 92001)
        assert netted["audit"] in ("FileNotFoundError", "PermissionError")
        assert netted["control"] in ("FileNotFoundError", "PermissionError")
    finally:
        host.close()
        d.stop()
    again = Daemon(d.root, "")
    again.config = d.config
    again.start()
    try:
        _wait_for_tool(again, "mcp__sage__probe_netted")
        (pid,) = _worker_pids(again, "netted")
        assert _uids(pid)[0] == 92001
    finally:
        again.stop()


def test_a_killed_sandboxed_worker_is_restarted(tmp_path: Path) -> None:
    """SIGKILL to the sandboxed worker: restarted (restarts 1), under the same uid, serving."""
    d = _sandbox_daemon(tmp_path / "alice-home")
    try:
        result = d.astrid("capsule", "install", str(_probe_capsule(tmp_path, "boxed")))
        assert result.returncode == 0, result.stderr
        _wait_for_tool(d, "mcp__sage__probe_boxed")
        (first,) = _worker_pids(d, "boxed")
        os.kill(first, signal.SIGKILL)
        for _ in range(200):
            rows = json.loads(d.astrid("capsule", "list", "--json").stdout)
            row = next(r for r in rows if r["name"] == "boxed")
            if row["restarts"] == 1 and row["state"] == "running":
                pids = _worker_pids(d, "boxed")
                if pids and pids != [first]:
                    break
            time.sleep(0.05)
        else:
            raise AssertionError(f"never restarted; log:\n{d.log()[-3000:]}")
        (second,) = pids
        assert _uids(second)[0] == 92000
        args = {"audit": "/x", "keys": "/x", "home": "/x", "control": "/x", "port": 1}
        assert _call(d, "probe_boxed", args, "c3")["uid"] == 92000
    finally:
        d.stop()
    # the supervisor's stop ends the sandboxed worker cleanly (end of input, exit 0)
    exits = [
        json.loads(line)
        for line in d.log().splitlines()
        if '"capsule.worker_exited"' in line and '"boxed"' in line
    ]
    assert exits[-1]["status"] == "exit code 0"
    assert not Path(f"/proc/{second}").exists()


def test_the_check_imports_the_capsule_in_its_sandbox(tmp_path: Path) -> None:
    """The entry's import-time code runs sandboxed, as the capsule's uid, not as the
    installing root: it cannot write the host's files nor read the state folder."""
    d = Daemon(short_dir())
    marker = tmp_path / "written-at-import"
    (d.root / "state").mkdir(mode=0o700)
    (d.root / "state" / "audit.db").write_bytes(b"private")
    code = (
        "import os\n"
        f"for path in ({str(marker)!r},):\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        f"    open({str(d.root / 'state' / 'audit.db')!r}, 'rb').read()\n"
        "    raise RuntimeError('read the audit log')\n"
        "except OSError:\n"
        "    pass\n"
        "if os.getuid() == 0:\n"
        "    raise RuntimeError('imported as root')\n" + CODE
    )
    result = d.astrid("capsule", "install", str(_capsule(tmp_path, code=code)), "--check")
    assert result.returncode == 0, result.stderr
    assert "mine: good (1 tools)" in result.stdout
    assert not marker.exists()
    uids = json.loads((d.root / "state" / "capsule_uids.json").read_text())["uids"]
    assert uids == {"mine": 92000}  # the uid it will run as, kept for the install


def test_privileged_patterns_are_granted_only_on_purpose(tmp_path: Path) -> None:
    """A manifest reaching sage's requests and events is refused with the patterns named;
    --allow-privileged installs it, `capsule list` and the audit log show the grant, and a
    pattern added to the copy later keeps it from starting."""
    publish = GOOD_PUBLISH.format(name="spy") + ', "sage.v1.request.>"'
    folder = _capsule(tmp_path, "spy_capsule", name="spy", publish=publish)
    toml = folder / "Capsule.toml"
    toml.write_text(
        toml.read_text().replace(
            '"tool.v1.execute.hello"]', '"tool.v1.execute.hello", "sage.v1.event.>"]'
        )
    )
    d = Daemon(short_dir(), 'capsules = ["tools"]\n').start()
    try:
        checked = d.astrid("capsule", "install", str(folder), "--check")
        assert checked.returncode == 0, checked.stderr
        assert "publish   sage.v1.request.>  (privileged)" in checked.stdout
        assert "publish   tool.v1.execute.hello.result\n" in checked.stdout
        refused = d.astrid("capsule", "install", str(folder))
        assert refused.returncode == 1
        assert "[publish] 'sage.v1.request.>' reaches sage's requests" in refused.stderr
        assert "[subscribe] 'sage.v1.event.>'" in refused.stderr
        assert "--allow-privileged" in refused.stderr
        assert not (d.root / "state" / "capsules" / "spy_capsule").exists()

        granted = d.astrid("capsule", "install", str(folder), "--allow-privileged")
        assert granted.returncode == 0, granted.stderr
        assert "subscribe sage.v1.event.>  (privileged)" in granted.stdout
        assert "started spy" in granted.stdout
        listing = d.astrid("capsule", "list")
        assert (
            "privileged: spy holds publish sage.v1.request.>, subscribe sage.v1.event.>"
            " (granted " in listing.stdout
        ), listing.stdout
        assert f"by uid {os.geteuid()})" in listing.stdout
        row = next(
            r
            for r in json.loads(d.astrid("capsule", "list", "--json").stdout)
            if r["name"] == "spy"
        )
        assert row["privileged"]["publish"] == ["sage.v1.request.>"]
        tail = d.astrid("audit", "tail", "-n", "50", "--json")
        entries = [json.loads(line) for line in tail.stdout.splitlines()]
        audited = [e["payload"]["payload"] for e in entries if e["kind"].endswith("privileged")]
        assert audited, tail.stdout
        assert audited[0]["subscribe"] == ["sage.v1.event.>"]

        installed = d.root / "state" / "capsules" / "spy_capsule" / "Capsule.toml"
        installed.write_text(
            installed.read_text().replace(
                '"sage.v1.request.>"', '"sage.v1.request.>", "approval.v1.>"'
            )
        )
        restarted = d.astrid("capsule", "restart", "spy")
        assert restarted.returncode == 1
        assert "[publish] 'approval.v1.>' reaches approval prompts" in restarted.stderr
    finally:
        d.stop()
