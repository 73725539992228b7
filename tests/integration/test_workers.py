"""Out-of-process capsule workers: a real supervisor, real child processes, one socketpair each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import sys
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest

from bus import (
    Acl,
    AclDenied,
    Bus,
    BusClient,
    BusServer,
    Identity,
    NoResponders,
    NotAuthorized,
    RemoteSubscription,
)
from sage.capsule.manifest import WorkerSpec, load_manifest
from sage.daemon.capsule_host import STATE_TOPIC, CapsuleRunner, RestartPolicy
from sage.daemon.workers import LineSplitter, worker_argv, worker_env
from sage.errors import ConfigError
from tests.support.sage_harness import Sage, running_sage

ECHO_WORKER = """
import os

async def run(ctx):
    requests = await ctx.open("wtest.v1.echo")
    ctx.ready()
    async for request in requests:
        data = request.data()
        if data.get("forbidden"):
            ctx.publish("wtest.v1.forbidden", {})
            try:
                await ctx.flush()
            except Exception as exc:
                ctx.reply(request, {"error": type(exc).__name__})
            continue
        ctx.publish("wtest.v1.echoed", {"echo": data})
        ctx.reply(
            request,
            {"echo": data, "pid": os.getpid(), "source": ctx.source, "name": ctx.manifest.name},
        )
"""

CRASHING_WORKER = """
async def run(ctx):
    raise RuntimeError("crashes on purpose")
"""


def write_capsule(root: Path, name: str, module: str, source: str) -> Path:
    """A worker capsule folder ``root/name`` whose code is ``root/module.py`` (on PYTHONPATH)."""
    (root / f"{module}.py").write_text(source)
    folder = root / name
    folder.mkdir()
    (folder / "Capsule.toml").write_text(
        f'[package]\nname = "{name}"\nversion = "0.1.0"\n'
        '[publish]\npatterns = ["wtest.v1.echoed"]\n'
        '[subscribe]\npatterns = ["wtest.v1.echo"]\n'
        f'[worker]\ncommand = ["python3", "-m", "sage.capsule.worker", "{module}:run"]\n'
        f"env = {{ PYTHONPATH = {json.dumps(str(root))} }}\n"
    )
    return folder


def config_for(*folders: Path) -> str:
    return f"capsules = {json.dumps([str(f) for f in folders])}\n"


async def capsule_status(sage: Sage, name: str) -> dict[str, Any]:
    """The capsule's entry in ``astrid status --json``."""
    code, out, err = await sage.astrid("status", "--json")
    assert code == 0, err
    (found,) = [c for c in json.loads(out)["capsules"] if c["name"] == name]
    return dict(found)


def audit_entries(sage: Sage, kind: str) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT payload FROM entries WHERE kind = ?", (kind,)).fetchall()
    finally:
        db.close()
    return [json.loads(payload) for (payload,) in rows]


async def echo_when_serving(sage: Sage, payload: dict[str, Any]) -> dict[str, Any]:
    """Request ``wtest.v1.echo`` until a (re)started worker answers it."""
    with anyio.fail_after(30):
        while True:
            with contextlib.suppress(NoResponders):  # while the worker (re)starts
                return await sage.request("wtest.v1.echo", payload, within=10)
            await anyio.sleep(0.05)


async def states_until(
    events: RemoteSubscription, name: str, last: str, within: float = 40
) -> list[str]:
    """The states ``name`` went through on sage.v1.capsules.changed, up to ``last``."""
    seen: list[str] = []
    with anyio.fail_after(within):
        while not seen or seen[-1] != last:
            data = msgspec.json.decode((await events.get()).payload)
            if data["capsule"] == name:
                seen.append(data["state"])
    return seen


def gone(pid: int) -> bool:
    """No process ``pid`` (or only its zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


# -- a worker serving requests --------------------------------------------------


@pytest.mark.anyio
async def test_request_reaches_worker_under_its_fixed_identity(tmp_path: Path) -> None:
    """A request through the socket reaches the worker; its envelopes carry capsule:<name>."""
    folder = write_capsule(tmp_path, "wecho", "wecho_worker", ECHO_WORKER)
    async with running_sage(config_for(folder)) as sage:
        echoed = await sage.client.subscribe("wtest.v1.echoed")
        reply = await sage.client.request("wtest.v1.echo", {"n": 1}, deadline=20)
        data = reply.data()
        assert data["echo"] == {"n": 1}
        assert data["name"] == "wecho"
        assert data["source"] == "capsule:wecho"
        assert reply.source == "capsule:wecho"
        assert reply.principal is None
        with anyio.fail_after(10):
            published = await echoed.get()
        assert published.source == "capsule:wecho"
        status = await capsule_status(sage, "wecho")
        assert status["state"] == "running"
        assert status["pid"] == data["pid"] != sage.daemon.proc.pid  # type: ignore[union-attr]


@pytest.mark.anyio
async def test_publish_outside_the_manifest_is_refused_and_audited(tmp_path: Path) -> None:
    """A worker's publish outside its manifest raises AclDenied in it and is audited."""
    folder = write_capsule(tmp_path, "wecho", "wecho_worker", ECHO_WORKER)
    async with running_sage(config_for(folder)) as sage:
        reply = await sage.request("wtest.v1.echo", {"forbidden": True}, within=20)
        assert reply == {"error": "AclDenied"}
        denied = [
            e["payload"]
            for e in audit_entries(sage, "sage.v1.audit.acl_denied")
            if e["payload"]["source"] == "capsule:wecho"
        ]
        assert denied, "the refusal was not audited"
        assert denied[0]["action"] == "publish"
        assert (await capsule_status(sage, "wecho"))["restarts"] == 0


# -- restarts, giving up, stopping ------------------------------------------------


@pytest.mark.anyio
async def test_killed_worker_is_restarted(tmp_path: Path) -> None:
    """SIGKILL to the worker: state running -> backoff -> running, a new pid that serves."""
    folder = write_capsule(tmp_path, "wecho", "wecho_worker", ECHO_WORKER)
    async with running_sage(config_for(folder)) as sage:
        first = (await echo_when_serving(sage, {"n": 1}))["pid"]
        events = await sage.client.subscribe("sage.v1.capsules.changed")
        os.kill(first, signal.SIGKILL)
        assert await states_until(events, "wecho", "running") == ["backoff", "running"]
        second = (await echo_when_serving(sage, {"n": 2}))["pid"]
        assert second != first
        status = await capsule_status(sage, "wecho")
        assert (status["state"], status["restarts"]) == ("running", 1)
        assert "SIGKILL" in status["last_error"]


@pytest.mark.anyio
async def test_always_crashing_worker_is_given_up_and_audited(tmp_path: Path) -> None:
    """A worker that always crashes is restarted, then failed; capsule_failed is audited."""
    folder = write_capsule(tmp_path, "wcrash", "wcrash_worker", CRASHING_WORKER)
    async with running_sage(config_for(folder)) as sage:
        events = await sage.client.subscribe("sage.v1.capsules.changed")
        if (await capsule_status(sage, "wcrash"))["state"] != "failed":
            states = await states_until(events, "wcrash", "failed", within=50)
            assert set(states) <= {"running", "backoff", "failed"}
        status = await capsule_status(sage, "wcrash")
        assert status["state"] == "failed"
        assert status["restarts"] == 5
        assert "crashes on purpose" in status["last_error"]
        assert status["pid"] is None
        await sage.client.flush()
        (failed,) = audit_entries(sage, "sage.v1.audit.capsule_failed")
        assert failed["payload"]["capsule"] == "wcrash"
        assert failed["source"] == "supervisor"


@pytest.mark.anyio
async def test_worker_that_cannot_start_is_given_up(tmp_path: Path) -> None:
    """A command that does not exist is a crash like any other: restarted, then failed."""
    folder = write_capsule(tmp_path, "wmissing", "wmissing_worker", CRASHING_WORKER)
    manifest = folder / "Capsule.toml"
    manifest.write_text(
        manifest.read_text().replace(
            '"python3", "-m", "sage.capsule.worker"', '"./no-such-program"'
        )
    )
    async with running_sage(config_for(folder)) as sage:
        events = await sage.client.subscribe("sage.v1.capsules.changed")
        if (await capsule_status(sage, "wmissing"))["state"] != "failed":
            await states_until(events, "wmissing", "failed", within=50)
        status = await capsule_status(sage, "wmissing")
        assert "cannot start" in status["last_error"]
        assert "no-such-program" in status["last_error"]


@pytest.mark.anyio
async def test_supervisor_stop_ends_the_worker_cleanly(tmp_path: Path) -> None:
    """SIGTERM to the supervisor: the worker is stopped (end of input, exit 0) and gone."""
    folder = write_capsule(tmp_path, "wecho", "wecho_worker", ECHO_WORKER)
    async with running_sage(config_for(folder)) as sage:
        pid = (await echo_when_serving(sage, {"n": 1}))["pid"]
        daemon = sage.daemon
        assert await anyio.to_thread.run_sync(daemon.stop) == 0
        assert gone(pid)
        exits = [
            json.loads(line)
            for line in daemon.log().splitlines()
            if '"capsule.worker_exited"' in line
        ]
        assert [(e["pid"], e["status"]) for e in exits] == [(pid, "exit code 0")]


# -- the adopted connection --------------------------------------------------------


@pytest.mark.anyio
async def test_adopted_connection_keeps_the_identity_its_owner_fixed(tmp_path: Path) -> None:
    """Over BusServer.adopt, the hello's role and principal change nothing; the ACL holds."""

    def refuse(*_: object) -> Identity:
        raise NotAuthorized("authorize must not be called for an adopted socket")

    bus = Bus()
    server = BusServer(bus, tmp_path / "unused.sock", refuse)
    identity = Identity("capsule:adopted", acl=Acl(["demo.v1.ok"], ["demo.v1.>"]))
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    seen = bus.subscribe("demo.>", Identity("test"))
    ended = anyio.Event()

    async def serve_adopted() -> None:
        await server.adopt(ours, identity)
        ended.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_adopted)
        theirs.setblocking(False)
        stream = await anyio.abc.UNIXSocketStream.from_socket(theirs)
        async with BusClient.attach(stream, role="cli", principal="alice") as client:
            assert client.welcome is not None
            assert (client.welcome.source, client.welcome.principal) == ("capsule:adopted", None)
            client.publish("demo.v1.ok", {"x": 1})
            await client.flush()
            with anyio.fail_after(5):
                envelope = await seen.get()
            assert (envelope.source, envelope.principal) == ("capsule:adopted", None)
            client.publish("demo.v1.not_mine", {})
            with pytest.raises(AclDenied):
                await client.flush()
            with pytest.raises(AclDenied):
                await client.subscribe("sage.>")
        with anyio.fail_after(5):  # the peer closed: the adopted connection ends
            await ended.wait()
        assert not server.connections


# -- state events of in-process capsules ----------------------------------------------


@pytest.mark.anyio
async def test_in_process_capsule_publishes_every_state_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CapsuleRunner publishes sage.v1.capsules.changed: running, backoff, ..., failed."""
    (tmp_path / "flaky_capsule.py").write_text(CRASHING_WORKER)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "flaky").mkdir()
    (tmp_path / "flaky" / "Capsule.toml").write_text(
        '[package]\nname = "flaky"\nentry = "flaky_capsule:run"\n'
    )
    published: list[tuple[str, dict[str, Any]]] = []
    runner = CapsuleRunner(
        Bus(),
        load_manifest(tmp_path / "flaky"),
        lambda topic, payload: None,
        publish=lambda topic, payload: published.append((topic, payload)),
    )
    runner.policy = RestartPolicy(max_restarts=1, base_delay=0.01)
    with anyio.fail_after(10):
        await runner.run()
    assert {topic for topic, _ in published} == {STATE_TOPIC}
    assert [p["state"] for _, p in published] == ["running", "backoff", "running", "failed"]
    assert all(p["capsule"] == "flaky" for _, p in published)


# -- pure parts ------------------------------------------------------------------


def test_line_splitter_cuts_long_lines_and_keeps_the_rest() -> None:
    """Lines come out whole; one over the limit is cut once and its remainder dropped."""
    lines = LineSplitter(limit=8)
    assert lines.feed(b"ab\ncd") == ["ab"]
    assert lines.feed(b"e\r\n0123456789") == ["cde", "01234567 [cut]"]
    assert lines.feed(b"more\nlast") == []
    assert lines.end() == ["last"]
    assert lines.end() == []


def test_worker_command_and_environment() -> None:
    """python3 is the supervisor's interpreter, ./x is in the folder; the env is minimal."""
    spec = WorkerSpec(command=["python3", "-m", "m"], env={"PYTHONPATH": "/x"})
    assert worker_argv(spec, Path("/caps/c")) == [sys.executable, "-m", "m"]
    assert worker_argv(WorkerSpec(["bin/run"]), Path("/caps/c")) == ["/caps/c/bin/run"]
    assert worker_argv(WorkerSpec(["node", "a.js"]), Path("/caps/c")) == ["node", "a.js"]
    env = worker_env(
        spec,
        "c",
        bus_fd=5,
        ready_fd=6,
        log_level="info",
        base={"PATH": "/bin", "HOME": "/h", "ANTHROPIC_API_KEY": "sk-secret"},
    )
    assert env == {
        "PATH": "/bin",
        "HOME": "/h",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": "/x",
        "ASTRID_CAPSULE": "c",
        "ASTRID_BUS_FD": "5",
        "ASTRID_READY_FD": "6",
        "ASTRID_LOG_LEVEL": "info",
    }


@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        ("command = []", "non-empty strings"),
        ('command = ["x", ""]', "non-empty strings"),
        ('command = ["x"]\nenv = { ASTRID_BUS_FD = "3" }', "reserved"),
        ('command = ["x"]\nenv = { "A-B" = "1" }', "not a variable name"),
        ('command = ["x"]\nuser = "root"', "unknown field"),
    ],
)
def test_bad_worker_table_is_refused(tmp_path: Path, worker: str, expected: str) -> None:
    """A [worker] table with a bad command or env is a ConfigError naming it."""
    (tmp_path / "Capsule.toml").write_text(f'[package]\nname = "w"\n[worker]\n{worker}\n')
    with pytest.raises(ConfigError, match=expected):
        load_manifest(tmp_path)


def test_worker_manifest_needs_no_entry(tmp_path: Path) -> None:
    """With [worker], package.entry may be left out: the command says what runs."""
    (tmp_path / "Capsule.toml").write_text('[package]\nname = "w"\n[worker]\ncommand = ["x"]\n')
    manifest = load_manifest(tmp_path)
    assert manifest.worker == WorkerSpec(command=["x"])


# -- the sandbox shape of a supervisor that is not root ----------------------------


@pytest.mark.anyio
async def test_user_namespace_sandbox_runs_the_worker_runtime(tmp_path: Path) -> None:
    """The shape used when the supervisor is not root (setpriv, then bwrap in a user
    namespace, no uid change), with real bwrap: sage.capsule.worker and the capsule import,
    the folder is read-only, nothing else of the host's folder is there, no network."""
    from sage.daemon.workers import WorkerSandbox, sandbox_command
    from sage.forge.sandbox import ensure_sandbox
    from sage.security.uids import SandboxUids

    folder = tmp_path / "cap"
    folder.mkdir()
    (folder / "capmod.py").write_text("X = 41\n")
    (tmp_path / "secret").write_text("not for the capsule")
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)
    code = (
        "import os, socket, sage.capsule.worker, sage.capsule.sdk, capmod\n"
        f"print(capmod.X + 1, os.path.exists({str(tmp_path / 'secret')!r}))\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {host.getsockname()[1]}), timeout=2)\n"
        "except OSError as exc:\n"
        "    print(type(exc).__name__)\n"
        "open('written', 'w')\n"
    )
    tools = await ensure_sandbox(uid=None)
    sandbox = WorkerSandbox(uids=SandboxUids(tmp_path, 92000, 10))
    argv, fds = sandbox_command(
        tools,
        sandbox,
        argv=[sys.executable, "-c", code],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(folder)},
        folder=folder,
        uid=None,
    )
    try:
        with anyio.fail_after(60):
            result = await anyio.run_process(argv, pass_fds=fds, check=False)
    finally:
        for fd in fds:
            os.close(fd)
        host.close()
    out, err = result.stdout.decode(), result.stderr.decode()
    assert out.split() == ["42", "False", "ConnectionRefusedError"], err
    assert result.returncode == 1
    assert "Read-only file system" in err
    assert not (folder / "written").exists()
