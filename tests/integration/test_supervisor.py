"""The supervisor as a real process: readiness, CLI over the socket, signals, audit."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import ASTRID, Daemon, short_dir


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(short_dir()).start()
    yield d
    d.stop()


def test_ready_quickly_with_safe_permissions(daemon: Daemon) -> None:
    """The supervisor is ready fast; state 0700, socket 0600 in a 0700 directory; as
    root the claude children's access group (gid 91000, no host group) gets the way to
    the socket: state and run folders 0750, socket 0660, and nothing else there."""
    assert daemon.startup_s < 10
    state = daemon.root / "state"
    grouped = os.geteuid() == 0
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == (0o660 if grouped else 0o600)
    assert stat.S_IMODE(daemon.socket.parent.stat().st_mode) == (0o750 if grouped else 0o700)
    assert stat.S_IMODE(state.stat().st_mode) == (0o750 if grouped else 0o700)
    if grouped:
        for path in (state, daemon.socket.parent, daemon.socket):
            assert path.stat().st_gid == 91000, path
        for path in state.rglob("*"):  # the group's way goes to the socket only
            if path not in (daemon.socket.parent, daemon.socket):
                assert path.stat().st_gid != 91000, path


def test_status_shows_uptime_capsules_and_bus(daemon: Daemon) -> None:
    """astrid status --json reports pid, uptime, the echo capsule and bus statistics."""
    assert daemon.proc is not None
    data = daemon.status()
    assert data["pid"] == daemon.proc.pid
    assert data["uptime_s"] >= 0
    assert [c["name"] for c in data["capsules"]] == [
        "echo",
        "runner",
        "tools",
        "greeter",
        "hooks",
        "forge",
        "installer",
        "llm",
    ]
    assert data["capsules"][0]["state"] == "running"
    assert data["bus"]["subscriptions"] >= 2
    assert data["state_store"] == str(daemon.root / "state" / "state.db")
    assert (daemon.root / "state" / "state.db").exists()
    text = daemon.astrid("status")
    assert text.returncode == 0
    assert "capsules   8" in text.stdout


def test_sub_prints_what_pub_publishes(daemon: Daemon) -> None:
    """astrid bus sub prints each matching envelope as one JSON line, set by the bus."""
    sub = subprocess.Popen(
        [*ASTRID, "bus", "sub", "demo.>", "--count", "2", "--config", str(daemon.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 10
        while daemon.status()["bus"]["subscriptions"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert daemon.astrid("bus", "pub", "demo.hello", '{"n": 1}').returncode == 0
        assert daemon.astrid("bus", "pub", "demo.other.deep", "[1, 2]").returncode == 0
        assert daemon.astrid("bus", "pub", "nomatch.x", "{}").returncode == 0
        out, _err = sub.communicate(timeout=10)
    finally:
        sub.kill()
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["topic"] for line in lines] == ["demo.hello", "demo.other.deep"]
    assert lines[0]["payload"] == {"n": 1}
    assert lines[1]["payload"] == [1, 2]
    assert lines[0]["source"] == f"cli:{os.getuid()}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("bus", "pub", "demo.*", "{}"), "cannot publish to wildcard"),
        (("bus", "pub", "demo..x", "{}"), "empty token"),
        (("bus", "pub", "demo.x", "{not json"), "not valid JSON"),
        (("bus", "sub", "a.>.b"), "last token"),
        (("bus", "request", "nobody.listens", "{}"), "no responders"),
    ],
)
def test_bad_input_is_one_clear_line(daemon: Daemon, args: tuple[str, ...], message: str) -> None:
    """Malformed topics, payloads and requests fail with exit 1 and one line on stderr."""
    result = daemon.astrid(*args)
    assert result.returncode == 1
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert daemon.status()["pid"]  # the daemon is still serving


def test_oversized_payload_refused(daemon: Daemon) -> None:
    """A payload over bus.max_payload is refused with a clear error."""
    big = json.dumps({"x": "a" * (1024 * 1024 + 10)}).encode()
    result = daemon.astrid("bus", "pub", "demo.big", "-", input=big)
    assert result.returncode == 1
    assert "over the supervisor's limit of 1048576 ([bus] max_payload)" in result.stderr


def test_request_reply_through_echo_capsule(daemon: Daemon) -> None:
    """astrid bus request reaches the echo capsule and prints its reply."""
    result = daemon.astrid("bus", "request", "demo.v1.echo", '{"hi": 1}')
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"echo": {"hi": 1}}


def test_sigterm_stops_gracefully_and_removes_socket() -> None:
    """SIGTERM ends the supervisor with exit 0 within the grace and removes the socket."""
    d = Daemon(short_dir()).start()
    assert d.socket.exists()
    t0 = time.monotonic()
    code = d.stop()
    assert code == 0
    assert time.monotonic() - t0 < 6
    assert not d.socket.exists()


def test_sd_notify_ready_and_stopping() -> None:
    """Under NOTIFY_SOCKET the supervisor sends READY=1, then STOPPING=1 on SIGTERM."""
    root = short_dir()
    path = str(root / "notify")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(10)
    try:
        d = Daemon(root, env={"NOTIFY_SOCKET": path}).start()
        assert b"READY=1" in receiver.recv(1024)
        d.signal(signal.SIGTERM)
        assert b"STOPPING=1" in receiver.recv(1024)
        assert d.stop() == 0
    finally:
        receiver.close()


def test_sighup_reloads_principals() -> None:
    """SIGHUP re-reads the file: a principal added is visible; a bad edit keeps the old config."""
    d = Daemon(short_dir()).start()
    try:
        assert d.status()["principals"] == []
        d.config.write_text(
            d.config.read_text() + '[[principals]]\nname = "alice"\nuids = [1000]\n'
        )
        d.signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while d.status()["principals"] != ["alice"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert d.status()["principals"] == ["alice"]
        good = d.config.read_text()
        d.config.write_text(good + "[bus]\nqueue_size = 'many'\n")
        d.signal(signal.SIGHUP)
        time.sleep(0.5)
        (d.root / "good.toml").write_text(good)
        result = subprocess.run(
            [*ASTRID, "status", "--json", "--config", str(d.root / "good.toml")],
            capture_output=True,
            text=True,
            timeout=20,
        )
        status = json.loads(result.stdout)
        assert status["principals"] == ["alice"]
        assert status["reloads"] == 1
    finally:
        assert d.stop() == 0


def test_second_supervisor_on_same_socket_refused(daemon: Daemon) -> None:
    """A second supervisor on the same state folder fails with one line about the lock."""
    result = subprocess.run(
        [*ASTRID, "supervisor", "run", "--config", str(daemon.config)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 1
    pid = daemon.status()["pid"]
    assert result.stderr.strip().splitlines()[-1] == (
        f"astrid: already running (pid {pid}, socket {daemon.socket});"
        f" state folder {daemon.root / 'state'}"
    )


def test_other_uid_cannot_reach_owner_only_socket(daemon: Daemon) -> None:
    """With the default owner-only socket, another uid cannot even connect."""
    if os.getuid() != 0:
        pytest.skip("needs root to run a client under another uid")
    pid = os.fork()
    if pid == 0:  # child: drop to nobody and try to connect
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            probe = socket.socket(socket.AF_UNIX)
            try:
                probe.connect(str(daemon.socket))
            except PermissionError:
                code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3


def test_bad_config_ends_startup_with_one_line() -> None:
    """A bad supervisor.toml ends start-up with exit 1 and one line naming the field."""
    root = short_dir()
    config = root / "bad.toml"
    config.write_text("[bus]\nqueue_size = -3\n")
    result = subprocess.run(
        [*ASTRID, "supervisor", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"astrid: {config}: bus.queue_size: Expected `int` >= 1"
    ]
    check = subprocess.run(
        [*ASTRID, "config", "check", str(config)], capture_output=True, text=True
    )
    assert check.returncode == 1
    assert "bus.queue_size" in check.stderr
    ok = subprocess.run(
        [*ASTRID, "config", "check", str(Path(__file__).resolve().parents[2] / "supervisor.toml")],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr


def test_audit_records_supervisor_events_and_verifies(daemon: Daemon) -> None:
    """The audit sink appends *.v1.audit.> envelopes; astrid audit verify passes, then catches tampering."""
    assert (
        daemon.astrid(
            "bus", "pub", "demo.v1.audit.thing", '{"session_id": "s1", "x": 1}'
        ).returncode
        == 0
    )
    deadline = time.monotonic() + 10
    kinds: list[str] = []
    while "demo.v1.audit.thing" not in kinds and time.monotonic() < deadline:
        tail = daemon.astrid("audit", "tail", "--json", "-n", "50")
        kinds = [json.loads(line)["kind"] for line in tail.stdout.splitlines()]
        time.sleep(0.05)
    assert "sage.v1.audit.supervisor_started" in kinds
    assert "demo.v1.audit.thing" in kinds
    assert daemon.astrid("audit", "verify").returncode == 0
    daemon.stop()
    db = sqlite3.connect(daemon.root / "state" / "audit.db")
    db.execute("DROP TRIGGER IF EXISTS entries_no_update")
    for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='trigger'").fetchall():
        db.execute(f"DROP TRIGGER {name}")
    db.execute("UPDATE entries SET payload = CAST('{\"forged\":1}' AS BLOB) WHERE seq = 1")
    db.commit()
    db.close()
    broken = daemon.astrid("audit", "verify")
    assert broken.returncode != 0
    assert "tampered" in broken.stdout + broken.stderr


_ACKING_CLIENT = """
import sys, anyio
from bus import BusClient

async def main(path):
    async with BusClient.connect(path) as client:
        i = 0
        while True:
            client.publish("demo.v1.audit.acked", {"i": i})
            await client.flush()
            print(i, flush=True)
            i += 1

anyio.run(main, sys.argv[1])
"""


def test_sigkill_of_supervisor_loses_no_acknowledged_audit_entry() -> None:
    """An audit publish acknowledged by flush() survives SIGKILL of the supervisor; the chain verifies."""
    d = Daemon(short_dir()).start()
    assert d.proc is not None
    client = subprocess.Popen(
        [sys.executable, "-c", _ACKING_CLIENT, str(d.socket)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert client.stdout is not None
    acked: list[int] = []
    for line in client.stdout:
        acked.append(int(line))
        if len(acked) >= 300:
            break
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    rest, _ = client.communicate(timeout=10)
    acked += [int(line) for line in rest.split()]
    d.stop()
    db = sqlite3.connect(f"file:{d.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    stored = {
        json.loads(payload)["payload"]["i"]
        for (payload,) in db.execute(
            "SELECT payload FROM entries WHERE kind = 'demo.v1.audit.acked'"
        )
    }
    db.close()
    assert set(acked) <= stored
    assert d.astrid("audit", "verify").returncode == 0
    again = Daemon(d.root)  # the stale socket is replaced and the chain resumes
    again.config = d.config
    again.start()
    try:
        result = again.astrid("bus", "pub", "demo.v1.audit.after", "{}")
        assert result.returncode == 0, (result.stderr, again.log()[-3000:])
    finally:
        assert again.stop() == 0
    assert again.astrid("audit", "verify").returncode == 0


def test_config_show_hides_claude_env_values() -> None:
    """config show and config check --json never print [claude] env values (they may be keys)."""
    root = short_dir()
    config = root / "s.toml"
    config.write_text('[claude]\nenv = { ANTHROPIC_API_KEY = "sk-secret-value" }\n')
    for args in (
        ("config", "show", "--config", str(config)),
        ("config", "check", str(config), "--json"),
    ):
        result = subprocess.run([*ASTRID, *args], capture_output=True, text=True, timeout=20)
        assert result.returncode == 0, result.stderr
        assert "sk-secret-value" not in result.stdout
        assert "ANTHROPIC_API_KEY" in result.stdout


def test_socket_group_opens_the_path_to_the_socket_and_nothing_more() -> None:
    """With socket.group, the state folder and run folder are 0750 and the socket 0660."""
    import grp

    # root's own group is privileged (refused): as root, any group will do
    group = "users" if os.geteuid() == 0 else grp.getgrgid(os.getgid()).gr_name
    d = Daemon(short_dir(), f'[socket]\ngroup = "{group}"\n').start()
    try:
        state = d.root / "state"
        assert stat.S_IMODE(state.stat().st_mode) == 0o750
        assert stat.S_IMODE((state / "run").stat().st_mode) == 0o750
        assert stat.S_IMODE(d.socket.stat().st_mode) == 0o660
        assert stat.S_IMODE((state / "keys").stat().st_mode) == 0o700
        assert stat.S_IMODE((state / "audit.db").stat().st_mode) & 0o077 == 0
    finally:
        d.stop()


def test_capsule_list_shows_state_and_restarts() -> None:
    d = Daemon(short_dir()).start()
    try:
        result = d.astrid("capsule", "list")
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0].split()[:4] == [
            "CAPSULE",
            "VERSION",
            "STATE",
            "RESTARTS",
        ]
        assert any(
            line.split()[:3] == ["echo", "0.1.0", "running"] for line in result.stdout.splitlines()
        )
        rows = json.loads(d.astrid("capsule", "list", "--json").stdout)
        assert {r["name"] for r in rows} == {
            "echo",
            "runner",
            "tools",
            "greeter",
            "hooks",
            "forge",
            "installer",
            "llm",
        }
    finally:
        d.stop()


def test_tools_list_shows_the_example_capsules_tools() -> None:
    d = Daemon(short_dir()).start()
    try:
        for _ in range(100):
            result = d.astrid("tools", "list", "--json")
            assert result.returncode == 0, result.stderr
            tools = json.loads(result.stdout)
            if tools:
                break
            time.sleep(0.05)
        names = {t["name"]: t["capsule"] for t in tools}
        assert names == {"mcp__sage__greet": "greeter", "mcp__sage__shout": "greeter"}
        text = d.astrid("tools", "list").stdout
        assert "mcp__sage__greet  greeter      Greet a person by name." in text
    finally:
        d.stop()


def test_a_cli_call_logs_no_connection_line_at_info() -> None:
    """Each CLI call's connection is a debug line, not one more line in the operator's
    terminal; log_level = "debug" still shows it."""
    d = Daemon(short_dir()).start()
    try:
        assert d.astrid("status").returncode == 0
        assert d.log_events("bus.connected") == []
    finally:
        d.stop()
    loud = Daemon(short_dir(), 'log_level = "debug"\n').start()
    try:
        assert loud.astrid("status").returncode == 0
        assert loud.log_events("bus.connected")
    finally:
        loud.stop()


def test_a_misspelt_capsule_gets_the_nearest_name_from_the_start_too() -> None:
    """`supervisor run` says what `config check` says of a misspelt built-in capsule."""
    d = Daemon(short_dir(), 'capsules = ["echo", "greter"]\n')
    refused = d.run_refused()
    assert refused.returncode == 1
    assert "no built-in capsule 'greter' (did you mean 'greeter'?)" in refused.stderr
    assert "cannot read" not in refused.stderr
