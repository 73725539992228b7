"""A root supervisor runs each principal's ``claude`` children as the principal's own uid.

Through a real supervisor (the tests run as root) with the CLI test double:
the children of two principals run under two different uids of sage's range,
neither root; each home is its child's; from the child's credentials (read
from ``/proc/<pid>/status`` and taken with ``setpriv``) the audit log, the
signing key, the other principal's home and identity file are out of reach,
while the socket takes that uid's ``astrid-emit`` hooks for its own principal
only.  The children still die with the supervisor across the uid change.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(os.geteuid() != 0, reason="children change uid only under root"),
]

ROOT = Path(__file__).resolve().parents[2]
FAKE = FAKE_CLAUDE
BASE = 91000  # [sessions] uid_base by default: the access group; principals from 91001


def _config() -> str:
    return sage_config(
        FAKE,
        {"ANTHROPIC_API_KEY": "sk-double"},
        capsules='["runner", "hooks", "installer"]',
        extra='[[principals]]\nname = "bob"\n',
    )


def _creds(pid: int) -> tuple[list[int], list[int], list[int]]:
    """Uid, Gid (real, effective, saved, fs) and Groups of a live process."""
    fields: dict[str, list[int]] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("Uid", "Gid", "Groups"):
            fields[name] = [int(v) for v in value.split()]
    return fields["Uid"], fields["Gid"], fields["Groups"]


def _as(pid: int, *argv: str, env: dict[str, str] | None = None, stdin: bytes = b"") -> Any:
    """Run ``argv`` with exactly the credentials process ``pid`` has (the child's side)."""
    uids, gids, groups = _creds(pid)
    prefix = ["setpriv", "--reuid", str(uids[0]), "--regid", str(gids[0])]
    prefix += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    return subprocess.run(
        [*prefix, "--", *argv], input=stdin, capture_output=True, env=env, timeout=30
    )


async def _spawn(sage: Sage, principal: str, sid: str) -> int:
    events = await sage.events(sid)
    reply = await sage.request(
        "sage.v1.request.spawn", {"principal_id": principal, "session_id": sid}
    )
    assert reply["ok"], reply
    await events.until("init")
    pid: int = reply["pid"]
    return pid


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


async def test_each_principals_children_run_as_its_own_uid() -> None:
    async with running_sage(_config()) as sage:
        state = sage.daemon.root / "state"
        for name in ("alice", "bob"):  # their homes get the hook commands the CLI runs
            installed = await sage.request("sage.v1.request.install", {"principal_id": name})
            assert installed["ok"], installed
        hooks = await sage.client.subscribe("hook.v1.event.>")
        spoofs = await sage.client.subscribe("sage.v1.audit.hook_spoof_attempt")
        a = await _spawn(sage, "alice", "ra1")
        b = await _spawn(sage, "bob", "rb1")
        (ua, *_), (ga, *_), groups_a = _creds(a)
        (ub, *_), _, _ = _creds(b)
        # every uid field (real, effective, saved, fs) is the principal's, never root
        assert set(_creds(a)[0]) == {ua}
        assert set(_creds(b)[0]) == {ub}
        assert ua != ub
        assert 0 not in (ua, ub)
        assert BASE < ua < BASE + 1000
        assert BASE < ub < BASE + 1000
        assert ga == ua
        assert groups_a == [BASE]  # the access group only: not root's groups
        assert "NoNewPrivs:\t1" in _status(a)
        table = json.loads((state / "session_uids.json").read_text())
        assert table["uids"] == {"alice": ua, "bob": ub}

        # the home is the child's own, 0700; the homes folder can be passed, not listed
        for name, uid in (("alice", ua), ("bob", ub)):
            home = state / "homes" / name
            st = home.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700)
        assert stat.S_IMODE((state / "homes").stat().st_mode) == 0o711
        assert stat.S_IMODE(state.stat().st_mode) == 0o750
        assert state.stat().st_gid == BASE

        # from alice's child's side: its home and identity yes, nothing else
        own_identity = state / "sessions" / "ra1" / "identity.md"
        assert _as(a, "cat", str(own_identity)).returncode == 0
        assert _as(a, "touch", str(state / "homes" / "alice" / "mine")).returncode == 0
        for secret in (
            state / "audit.db",
            state / "state.db",
            state / "secrets.db",
            state / "keys" / "audit_ed25519.pem",
            state / "session_uids.json",
            state / "sessions" / "rb1" / "identity.md",
            state / "homes" / "bob" / ".",
        ):
            denied = _as(a, "cat", str(secret))
            assert denied.returncode != 0, secret
            assert b"Permission denied" in denied.stderr or b"Is a directory" in denied.stderr
        assert _as(a, "ls", str(state / "homes" / "bob")).returncode != 0
        assert _as(a, "ls", str(state / "homes")).returncode != 0
        # bob's child cannot read alice's environment (her token, her API key)
        assert _as(b, "cat", f"/proc/{a}/environ").returncode != 0

        # a headless home has no command hook (its hooks come in-band); alice switched
        # to repl gets them: the PreToolUse one, run as the CLI runs it (a shell of the
        # child's uid and environment), reaches the socket and is validated
        assert (
            json.loads((state / "homes" / "alice" / ".claude" / "settings.local.json").read_text())[
                "hooks"
            ]
            == {}
        )
        switched = await sage.request(
            "sage.v1.request.settings.set", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert switched["ok"], switched
        child = _environ(a)
        env = {k: v for k, v in child.items() if k.startswith("ASTRID_") or k == "PATH"}
        hook = {"hook_event_name": "PreToolUse", "tool_name": "mcp__sage__greet"}
        command = _hook_command(state / "homes" / "alice", "PreToolUse")
        done = _as(a, "/bin/sh", "-c", command, env=env, stdin=json.dumps(hook).encode())
        assert done.returncode == 0, done.stderr
        with anyio.fail_after(10):
            event = await hooks.get()
        assert event.topic == "hook.v1.event.before_tool_call"
        assert event.principal == "alice"
        data = msgspec.json.decode(event.payload)
        assert (data["session_id"], data["decision_source"]) == ("ra1", "token")

        # the same uid claiming bob's session (with bob's token, had it stolen it): the
        # bus makes the envelope alice's, the hooks capsule refuses and audits it
        bob_env = {
            **env,
            "ASTRID_PRINCIPAL_ID": "bob",
            "ASTRID_SESSION_ID": "rb1",
            "ASTRID_HOOK_TOKEN": _environ(b)["ASTRID_HOOK_TOKEN"],
        }
        done = _as(a, "/bin/sh", "-c", command, env=bob_env, stdin=json.dumps(hook).encode())
        assert done.returncode == 0
        with anyio.fail_after(10):
            report = msgspec.json.decode((await spoofs.get()).payload)
        assert report["reason"] == "principal_mismatch"
        assert report["source"] == f"emit:{ua}"
        # ... as anything but astrid-emit (a cli connection), or naming bob: refused
        for role, principal, refusal in (
            ("cli", "None", b"role emit only"),
            ("emit", "'bob'", b"may not act for principal 'bob'"),
        ):
            hello = _as(
                a,
                sys.executable,
                "-c",
                "import anyio, sys\n"
                "from bus import BusClient\n"
                "async def main():\n"
                f"    async with BusClient.connect(sys.argv[1], role={role!r},"
                f" principal={principal}, name='x'):\n"
                "        pass\n"
                "anyio.run(main)\n",
                str(sage.daemon.socket),
                env={"PYTHONPATH": str(ROOT)},
            )
            assert hello.returncode != 0
            assert refusal in hello.stderr, hello.stderr
        with anyio.move_on_after(0.5):
            late = await hooks.get()
            raise AssertionError(f"republished: {late.topic}")

        # the spawn audit names the uid
        await _until_audited(sage, 2)
        audited = _audit(sage, "sage.v1.audit.spawn")
        assert {(r["payload"]["principal_id"], r["payload"]["uid"]) for r in audited} == {
            ("alice", ua),
            ("bob", ub),
        }

        # a stop reaches the other uid's process group; then a SIGKILLed supervisor
        # takes the rest with it (the death signal survives the uid change)
        assert (await sage.request("sage.v1.request.stop.rb1", {}))["ok"]
        with anyio.fail_after(15):
            while not _gone(b):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert sage.daemon.proc is not None
        sage.daemon.proc.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not _gone(a):
            assert time.monotonic() < deadline, "alice's child outlived its supervisor"
            await anyio.sleep(0.05)


def _hook_command(home: Path, event: str) -> str:
    settings = json.loads((home / ".claude" / "settings.local.json").read_text())
    command: str = settings["hooks"][event][0]["hooks"][0]["command"]
    return command


def _status(pid: int) -> str:
    return Path(f"/proc/{pid}/status").read_text()


def _gone(pid: int) -> bool:
    """Exited (reaped, or a zombie waiting for its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _audit(sage: Sage, kind: str) -> list[dict[str, Any]]:
    import sqlite3

    path = sage.daemon.root / "state" / "audit.db"
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT payload FROM entries WHERE kind = ?", (kind,)).fetchall()
    finally:
        db.close()
    return [msgspec.json.decode(row[0]) for row in rows]


async def _until_audited(sage: Sage, spawns: int) -> None:
    with anyio.fail_after(10):
        while len(_audit(sage, "sage.v1.audit.spawn")) < spawns:  # noqa: ASYNC110
            await anyio.sleep(0.05)


def test_what_the_state_folder_holds_is_closed_to_the_childrens_group() -> None:
    """The state folder is the access group's (0750) so children can pass through it;
    whatever sits in it open to others (a policy file written 0644, a folder made
    0755) is closed at start, so a child's uid reads none of it."""
    from tests.support.daemon import Daemon

    root = short_dir()
    state = root / "state"
    state.mkdir(mode=0o700)
    policy = state / "tools-policy.json"
    policy.write_text('{"rules": []}')
    policy.chmod(0o644)
    extra = state / "notes"
    extra.mkdir()
    extra.chmod(0o755)
    (extra / "n.txt").write_text("operator's")
    (extra / "n.txt").chmod(0o644)
    d = Daemon(root).start()
    try:
        child = ["setpriv", "--reuid", "91001", "--regid", "91001", "--groups", "91000", "--"]
        for path in (policy, extra / "n.txt"):
            done = subprocess.run([*child, "cat", str(path)], capture_output=True, timeout=30)
            assert done.returncode != 0, path
            assert b"Permission denied" in done.stderr
        assert stat.S_IMODE(policy.stat().st_mode) == 0o600
        assert stat.S_IMODE(extra.stat().st_mode) == 0o700
        assert "supervisor.state_entry_closed" in d.log()
        # the way to the socket stays open to the group
        assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o750
    finally:
        d.stop()


_CONNECT = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_UNIX)\n"
    "try:\n"
    "    s.connect(sys.argv[1])\n"
    "    print('connected')\n"
    "except OSError as exc:\n"
    "    print(type(exc).__name__)\n"
)


def _connect_as(uid: int, gid: int, sock: str) -> bytes:
    """What a process of ``uid``:``gid`` (no other group) gets connecting to ``sock``."""
    argv = ["setpriv", "--reuid", str(uid), "--regid", str(gid), "--clear-groups", "--"]
    argv += [sys.executable, "-I", "-c", _CONNECT, sock]
    return subprocess.run(argv, capture_output=True, timeout=30, check=False).stdout


async def test_children_get_no_group_of_the_sockets_people() -> None:
    """With [socket] group set, children keep only sage's own access group (not the
    people's), and still reach the socket and their homes; the group's members too."""
    import grp

    users = grp.getgrnam("users").gr_gid
    root = short_dir()
    root.chmod(0o755)
    config = _config() + '\n[socket]\ngroup = "users"\n'
    async with running_sage(config, root=root) as sage:
        state = root / "state"
        pid = await _spawn(sage, "alice", "rg1")
        _, _, groups = _creds(pid)
        assert groups == [BASE]  # not "users": an agent is not one of the people
        sock = str(sage.daemon.socket)
        child = _as(pid, sys.executable, "-I", "-c", _CONNECT, sock)
        assert child.stdout == b"connected\n", child.stderr
        assert _as(pid, "cat", str(state / "sessions" / "rg1" / "identity.md")).returncode == 0
        assert _connect_as(65534, users, sock) == b"connected\n"  # one of the people
        assert _connect_as(65534, 65534, sock) == b"PermissionError\n"  # anyone else
        assert (state / "run").stat().st_gid == users
        assert state.stat().st_gid == BASE


@pytest.mark.parametrize("group", ["docker", "adm", "sudo", "wheel", "disk", "root", "shadow"])
def test_a_privileged_socket_group_is_refused_by_config_check_and_at_start(group: str) -> None:
    """Every user of the socket joins its group: never one with power over the host."""
    from tests.support.daemon import ASTRID, Daemon

    d = Daemon(short_dir(), f'\n[socket]\ngroup = "{group}"\n')
    checked = subprocess.run(
        [*ASTRID, "config", "check", str(d.config)], capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 1
    assert f"socket: group: {group!r} is a privileged group" in checked.stderr
    assert "groupadd" in checked.stderr
    refused = d.run_refused()
    assert refused.returncode != 0
    assert "privileged group" in refused.stderr
