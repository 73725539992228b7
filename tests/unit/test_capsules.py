"""In-process capsules: manifest checks, restart backoff, ACLs from the manifest."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest

from bus import AclDenied, Bus, BusError, Envelope, Identity
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import CapsuleManifest, load_manifest
from sage.daemon.capsule_host import CapsuleRunner, CapsuleState, RestartPolicy, capsule_folder
from sage.errors import ConfigError, IllegalTransition, SageError


def _write(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "Capsule.toml").write_text(text)
    return folder


def test_builtin_echo_manifest_loads() -> None:
    """The example capsule's manifest is valid and names its entry point."""
    manifest = load_manifest(capsule_folder("echo"))
    assert manifest.name == "echo"
    assert manifest.subscribe.patterns == ["demo.v1.echo"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[package]\nname = "../x"\nentry = "m:f"\n', "package.name"),
        ('[package]\nname = "x"\nentry = "a:b:c"\n', "'module' or 'module:function'"),
        ('[package]\nname = "x"\nentry = "m:f"\n[publish]\npatterns = ["a.>.b"]\n', "last token"),
        ('[package]\nname = "x"\nentry = "m:f"\n[wat]\n', "unknown field"),
    ],
)
def test_bad_manifest_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    """A manifest with a bad name, entry, pattern or section is a ConfigError naming it."""
    with pytest.raises(ConfigError, match=expected):
        load_manifest(_write(tmp_path / "c", text))


def test_missing_manifest_is_refused(tmp_path: Path) -> None:
    """A folder without Capsule.toml is a ConfigError, not a traceback."""
    with pytest.raises(ConfigError, match="cannot read"):
        load_manifest(tmp_path)


def test_restart_policy_backs_off_then_gives_up() -> None:
    """Delays double per crash inside the window; one crash too many gives up."""
    policy = RestartPolicy(max_restarts=3, window=10.0, base_delay=0.5, max_delay=1.5)
    assert policy.on_crash(0.0) == 0.5
    assert policy.on_crash(1.0) == 1.0
    assert policy.on_crash(2.0) == 1.5
    assert policy.on_crash(3.0) is None


def test_restart_policy_forgets_old_crashes() -> None:
    """Crashes older than the window no longer count."""
    policy = RestartPolicy(max_restarts=1, window=10.0, base_delay=1.0)
    assert policy.on_crash(0.0) == 1.0
    assert policy.on_crash(20.0) == 1.0


@pytest.mark.anyio
async def test_capsule_acl_comes_from_manifest() -> None:
    """A capsule may subscribe only to what its manifest declares."""
    bus = Bus()
    runner = CapsuleRunner(bus, load_manifest(capsule_folder("echo")), lambda t, p: None)
    with pytest.raises(AclDenied):
        bus.subscribe("demo.other", runner.identity)
    with pytest.raises(AclDenied):
        bus.publish(runner.identity, "sage.v1.audit.fake", {})


def test_illegal_transition_is_a_capsule_error() -> None:
    """A change the transition table does not allow raises a SageError with its code."""
    runner = CapsuleRunner(Bus(), load_manifest(capsule_folder("echo")), lambda t, p: None)
    assert runner.state is CapsuleState.STARTING
    with pytest.raises(IllegalTransition, match="starting -> failed") as caught:
        runner._set_state(CapsuleState.FAILED)
    assert isinstance(caught.value, SageError)
    assert caught.value.code == "illegal_transition"
    assert runner.state is CapsuleState.STARTING


@pytest.mark.anyio
async def test_echo_capsule_answers_requests() -> None:
    """The echo capsule replies to a request with the payload it got."""
    bus = Bus()
    runner = CapsuleRunner(bus, load_manifest(capsule_folder("echo")), lambda t, p: None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await anyio.wait_all_tasks_blocked()
        reply = await bus.request(Identity("test"), "demo.v1.echo", {"hi": 1}, deadline=2)
        assert reply.data() == {"echo": {"hi": 1}}
        assert reply.source == "capsule:echo"
        assert runner.state is CapsuleState.RUNNING
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_crashing_capsule_is_restarted_then_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A capsule that keeps raising is restarted, then marked failed and audited."""
    module = tmp_path / "crashy_capsule.py"
    module.write_text("async def run(ctx):\n    raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = _write(
        tmp_path / "crashy", '[package]\nname = "crashy"\nentry = "crashy_capsule:run"\n'
    )
    audited: list[tuple[str, dict[str, object]]] = []
    runner = CapsuleRunner(Bus(), load_manifest(folder), lambda t, p: audited.append((t, p)))
    runner.policy = RestartPolicy(max_restarts=2, base_delay=0.01)
    with anyio.fail_after(5):
        await runner.run()
    assert runner.state is CapsuleState.FAILED
    assert runner.restarts == 2
    assert "boom" in runner.last_error
    assert audited[0][0] == "sage.v1.audit.capsule_failed"


def test_unloadable_entry_fails_at_construction(tmp_path: Path) -> None:
    """An entry that does not import is refused before anything runs."""
    folder = _write(tmp_path / "x", '[package]\nname = "x"\nentry = "no_such_module_here:run"\n')
    with pytest.raises(ConfigError, match="cannot load"):
        CapsuleRunner(Bus(), load_manifest(folder), lambda t, p: None)


@pytest.mark.anyio
async def test_echo_survives_a_reply_over_the_limit() -> None:
    """A request whose echo would be too large gets an error reply; the capsule keeps running."""
    bus = Bus(max_payload=100)
    runner = CapsuleRunner(bus, load_manifest(capsule_folder("echo")), lambda t, p: None)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runner.run)
        await anyio.wait_all_tasks_blocked()
        big = {"x": "a" * 90}
        reply = await bus.request(Identity("test"), "demo.v1.echo", big, deadline=2)
        assert "over the limit" in reply.data()["error"]
        again = await bus.request(Identity("test"), "demo.v1.echo", {"ok": 1}, deadline=2)
        assert again.data() == {"echo": {"ok": 1}}
        assert runner.restarts == 0
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_crashed_run_leaves_no_subscription(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Subscriptions a crashed run opened are closed before the restart."""
    module = tmp_path / "leaky_capsule.py"
    module.write_text(
        "async def run(ctx):\n    ctx.subscribe('demo.v1.echo')\n    raise RuntimeError('x')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = _write(
        tmp_path / "leaky",
        '[package]\nname = "leaky"\nentry = "leaky_capsule:run"\n[subscribe]\npatterns = ["demo.v1.echo"]\n',
    )
    bus = Bus()
    runner = CapsuleRunner(bus, load_manifest(folder), lambda t, p: None)
    runner.policy = RestartPolicy(max_restarts=3, base_delay=0.01)
    with anyio.fail_after(5):
        await runner.run()
    assert bus.stats().subscriptions == 0


def test_sandbox_network_is_declared_in_the_manifest(tmp_path: Path) -> None:
    """``[sandbox] network``: false unless declared; a wrong type or key is refused."""
    base = '[package]\nname = "x"\nentry = "m:f"\n'
    assert load_manifest(_write(tmp_path / "a", base)).sandbox.network is False
    on = load_manifest(_write(tmp_path / "b", base + "[sandbox]\nnetwork = true\n"))
    assert on.sandbox.network is True
    with pytest.raises(ConfigError, match="Expected `bool`"):
        load_manifest(_write(tmp_path / "c", base + '[sandbox]\nnetwork = "yes"\n'))
    with pytest.raises(ConfigError, match="unknown field `filesystem`"):
        load_manifest(_write(tmp_path / "d", base + "[sandbox]\nfilesystem = true\n"))


def _options(argv: list[str]) -> list[str]:
    """The bwrap options of a sandbox command (they travel in the ``--args`` memfd)."""
    fd = int(argv[argv.index("--args") + 1])
    with open(f"/proc/self/fd/{fd}", "rb") as file:
        return file.read().decode().split("\0")[:-1]


@pytest.mark.parametrize("uid", [None, 92000])
def test_worker_sandbox_command(tmp_path: Path, uid: int | None) -> None:
    """Root: bwrap (as root) mounts, then setpriv inside drops to the capsule's uid;
    otherwise setpriv then bwrap in a user namespace.  Either way the folder is a
    read-only bind and the working folder, the network is unshared, /tmp capped."""
    import os
    import sys

    from sage.daemon.workers import WorkerSandbox, python_paths, sandbox_command
    from sage.security.bwrap import BwrapProbe
    from sage.security.uids import SandboxUids

    tools = BwrapProbe(ok=True, path="/usr/bin/bwrap", setpriv="/usr/bin/setpriv", prlimit="/p")
    sandbox = WorkerSandbox(uids=SandboxUids(tmp_path, 92000, 10), tmp_bytes=1 << 20)
    folder = tmp_path / "cap"
    folder.mkdir()
    argv, fds = sandbox_command(
        tools, sandbox, argv=[sys.executable, "-m", "x"], env={"A": "b"}, folder=folder, uid=uid
    )
    try:
        options = _options(argv)
    finally:
        for fd in fds:
            os.close(fd)
    assert argv[-4:] == ["--", sys.executable, "-m", "x"]
    if uid is None:
        assert argv[0] == "/usr/bin/setpriv"
        assert "--reuid" not in argv
        assert argv[argv.index("--args") - 1] == "/usr/bin/bwrap"
        assert {"--unshare-all", "--unshare-user", "--disable-userns"} <= set(options)
    else:
        assert argv[:4] == ["/usr/bin/bwrap", "--args", argv[2], "--"]
        inner = argv[4:]
        setpriv = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--reuid", "92000"]
        assert inner[:7] == [*setpriv, "--regid", "92000"]
        assert "--clear-groups" in inner
        assert "--unshare-user" not in options
        assert {"--unshare-net", "--unshare-pid", "--unshare-ipc"} <= set(options)
        caps = [options[i + 1] for i, o in enumerate(options) if o == "--cap-add"]
        assert caps == ["CAP_SETUID", "CAP_SETGID"]
    assert "--share-net" not in options
    assert options[options.index("--chdir") + 1] == str(folder.resolve())
    binds = [options[i + 2] for i, o in enumerate(options) if o == "--ro-bind-fd"]
    assert str(folder.resolve()) in binds
    assert "--bind-fd" not in options  # nothing of the host is writable
    assert set(python_paths()[0]) <= set(binds)
    at = options.index("/tmp")
    assert options[at - 3 : at] == ["--size", str(1 << 20), "--tmpfs"]
    at = options.index("A")
    assert options[at - 1 : at + 2] == ["--setenv", "A", "b"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[capsules]\nuid_base = 90500\n", "overlaps \\[forge\\] sandbox_uid_base"),
        ("[forge]\nsandbox_uid_base = 92500\n", "overlaps \\[forge\\] sandbox_uid_base"),
        ("[capsules]\nuid_base = 65000\n", "65534"),
        ("[capsules]\nuid_count = 0\n", "uid_count"),
    ],
)
def test_capsule_uid_range_is_checked(text: str, expected: str) -> None:
    """[capsules] uid_base..+uid_count: not the forge's uids, not nobody's."""
    from sage.config import decode_config

    assert decode_config("").capsules.uid_base == 92000
    with pytest.raises(ConfigError, match=expected):
        decode_config(text)


def test_python_paths_are_the_runtime_only() -> None:
    """The interpreter's set: no folder holds another, nothing under /usr, never the
    project folder around the sage package, nor the whole venv."""
    import os
    import sys

    import sage
    from sage.daemon.workers import python_paths

    paths, links = python_paths()
    sage_dir = os.path.dirname(os.path.realpath(sage.__file__))
    assert sage_dir in paths
    assert os.path.dirname(sage_dir) not in paths
    assert os.path.realpath(sys.prefix) not in paths
    assert not [p for p in paths if p == "/usr" or p.startswith("/usr/")]
    for path in paths:
        assert not [o for o in paths if o != path and o.startswith(path + "/")], path
    assert os.path.realpath(sys.executable) in paths or sys.executable.startswith("/usr/")
    for target, link in links:
        assert os.path.realpath(link) == target
    # /usr is bound whole, its links with it: none made again over it
    assert python_paths("/usr/bin/python3")[1] == []


@pytest.mark.anyio
async def test_ask_waits_for_the_accepted_answer_subscribed_before_sending() -> None:
    """The answer is subscribed before the question is sent (an answer sent at once is not
    missed); envelopes ``answer`` declines are skipped; no answer in time is None."""
    bus = Bus()
    manifest = msgspec.convert({"package": {"name": "t", "entry": "x"}}, CapsuleManifest)
    ctx = CapsuleContext(bus, Identity("capsule:t"), manifest)
    other = Identity("other")

    def send() -> None:  # answers synchronously, before ask could subscribe after it
        bus.publish(other, "a.1", {"n": 0})  # not the answer: skipped
        bus.publish(other, "a.1", {"n": 7})

    def answer(envelope: Envelope) -> int | None:
        n: int = envelope.data()["n"]
        return n or None

    assert await ctx.ask("a.*", send, answer, deadline=2.0) == 7
    with anyio.fail_after(2):
        assert await ctx.ask("a.*", lambda: None, answer, deadline=0.05) is None

    def refused() -> None:
        raise BusError("over the payload limit")

    with pytest.raises(BusError, match="payload limit"):
        await ctx.ask("a.*", refused, answer, deadline=2.0)
