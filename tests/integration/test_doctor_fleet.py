"""astrid doctor's fleet rows against a real nats-server: credentials accepted or refused,
a server that is not there, insecure_no_auth failing, a stream weaker than the fleet
needs, TLS off over a network, and the clock against the server's.

Real processes: the pinned nats-server (one server, JetStream), a real supervisor (a node,
which makes the fleet's streams), ``astrid doctor --json`` as a command.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sage.fleet.streams import STREAMS
from tests.support.daemon import ASTRID, Daemon, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, free_port
from tests.support.refusing_api import refusing_api


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    with refusing_api() as url:
        yield url


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    """One server with node users (a's and b's passwords, their permissions)."""
    with NatsCluster(["a", "b"], size=1) as running:
        yield running


@pytest.fixture(scope="module")
def node_a(cluster: NatsCluster, api_url: str) -> Iterator[Daemon]:
    """Node a, running: it made every stream of the fleet."""
    daemon = Daemon(short_dir(), config_text(cluster, api_url, "a", daemon=True)).start()
    try:
        yield daemon
    finally:
        daemon.stop()


def config_text(
    cluster: NatsCluster,
    api_url: str,
    node: str,
    *,
    secret: str | None = None,
    urls: list[str] | None = None,
    daemon: bool = False,
) -> str:
    """A config of ``node`` (``daemon``: without the ``[supervisor]`` head Daemon writes)."""
    fleet = cluster.fleet_section(node, replicas=1, secret=secret)
    if urls is not None:
        quoted = ", ".join(f'"{url}"' for url in urls)
        fleet = "\n".join(
            f"url = [{quoted}]" if line.startswith("url = ") else line
            for line in fleet.splitlines()
        )
    head = "" if daemon else '[supervisor]\nstate_dir = "state"\n'
    api = f'[claude]\nenv = {{ ANTHROPIC_BASE_URL = "{api_url}" }}\n'
    return f'{head}capsules = ["echo"]\n{api}{fleet}\n'


def doctor(config: Path) -> tuple[int, list[dict[str, Any]], str]:
    """``astrid doctor --json`` as a process: its exit code, its rows, all it printed."""
    result = subprocess.run(
        [*ASTRID, "doctor", "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stderr == "", result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is (result.returncode == 0)
    return result.returncode, report["checks"], result.stdout


def fleet_rows(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(row["name"], row["status"]) for row in rows if row["name"].startswith("fleet-")]


def row(rows: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [r for r in rows if r["name"] == name]
    return found


def test_a_node_of_a_running_fleet_is_all_ok(node_a: Daemon) -> None:
    """The running node's own config: every row ok, exit 0; the streams it made are safe
    and the clock is measured against the server's."""
    code, rows, _ = doctor(node_a.config)
    assert code == 0, rows
    assert {r["name"]: r["status"] for r in rows if r["status"] != "ok"} == {}
    assert fleet_rows(rows) == [
        ("fleet-auth", "ok"),
        ("fleet-tls", "ok"),
        ("fleet-server", "ok"),
        ("fleet-streams", "ok"),
        ("fleet-clock", "ok"),
    ]
    auth = row(rows, "fleet-auth")
    assert auth["method"] == "password_file"
    assert "0600, yours" in auth["detail"]
    assert row(rows, "fleet-tls")["detail"] == "TLS off, every server on loopback"
    assert "signs the node in (nats-server 2." in row(rows, "fleet-server")["detail"]
    streams = row(rows, "fleet-streams")
    assert streams["detail"] == f"{len(STREAMS)} safe"
    assert sorted(streams["found"]) == sorted(spec.name for spec in STREAMS)
    clock = row(rows, "fleet-clock")
    assert abs(clock["offset_s"]) < 1.0, clock  # one host: the same clock
    assert clock["budget_s"] == 0.05 / 2  # the fleet's max_clock_skew, halved
    assert "JetStream stream info answer" in clock["detail"]


def test_a_wrong_password_fails_the_servers_row(
    cluster: NatsCluster, node_a: Daemon, api_url: str
) -> None:
    root = short_dir()
    wrong = root / "wrong.password"
    wrong.write_text("not-the-password-0451\n")
    wrong.chmod(0o600)
    config = root / "supervisor.toml"
    secret = f'password_file = "{wrong}"'
    config.write_text(config_text(cluster, api_url, "b", secret=secret))
    code, rows, out = doctor(config)
    assert code == 1
    assert row(rows, "fleet-auth")["status"] == "ok"  # the file is fine; the server says no
    server = row(rows, "fleet-server")
    assert server["status"] == "fail"
    assert server["refused"] is True
    assert "refused user 'b': wrong user or password" in server["detail"]
    assert row(rows, "fleet-streams")["status"] == "warn"
    assert "not-the-password-0451" not in out


def test_a_server_that_is_not_there_fails_its_own_row(
    cluster: NatsCluster, node_a: Daemon, api_url: str
) -> None:
    """Each URL is asked alone: the live one is ok (and the streams are read from it),
    the dead one fails, and the exit code says so."""
    dead = f"nats://127.0.0.1:{free_port()}"
    config = short_dir() / "supervisor.toml"
    config.write_text(config_text(cluster, api_url, "b", urls=[dead, cluster.urls[0]]))
    code, rows, _ = doctor(config)
    assert code == 1
    servers = [r for r in rows if r["name"] == "fleet-server"]
    assert [(r["url"], r["status"]) for r in servers] == [(dead, "fail"), (cluster.urls[0], "ok")]
    assert f"{dead}: unreachable" in servers[0]["detail"]
    assert servers[0]["refused"] is False
    assert row(rows, "fleet-streams")["status"] == "ok"
    assert row(rows, "fleet-streams")["server"] == cluster.urls[0]


def test_a_password_file_open_to_others_fails_and_is_not_used(
    cluster: NatsCluster, api_url: str
) -> None:
    root = short_dir()
    open_file = root / "open.password"
    open_file.write_text(cluster.passwords["b"] + "\n")
    open_file.chmod(0o644)
    config = root / "supervisor.toml"
    config.write_text(config_text(cluster, api_url, "b", secret=f'password_file = "{open_file}"'))
    code, rows, out = doctor(config)
    assert code == 1
    auth = row(rows, "fleet-auth")
    assert auth["status"] == "fail"
    assert f"run `chmod 600 {open_file}`" in auth["detail"]
    assert row(rows, "fleet-server")["detail"].startswith("not asked")
    assert cluster.passwords["b"] not in out


def test_no_credentials_fails_naming_the_fix(cluster: NatsCluster, api_url: str) -> None:
    config = short_dir() / "supervisor.toml"
    config.write_text(config_text(cluster, api_url, "b", secret="# no credentials"))
    code, rows, _ = doctor(config)
    assert code == 1
    auth = row(rows, "fleet-auth")
    assert auth["status"] == "fail"
    assert auth["detail"].startswith("fleet: no credentials:")
    assert "insecure_no_auth = true" in auth["detail"]


def test_off_loopback_without_tls_fails(cluster: NatsCluster, api_url: str) -> None:
    """A server on a network (192.0.2.1, TEST-NET-1: nobody answers) without TLS."""
    remote = "nats://192.0.2.1:4222"
    config = short_dir() / "supervisor.toml"
    config.write_text(config_text(cluster, api_url, "b", urls=[cluster.urls[0], remote]))
    code, rows, _ = doctor(config)
    assert code == 1
    tls = row(rows, "fleet-tls")
    assert tls["status"] == "fail"
    assert tls["plaintext"] == [remote]
    assert tls["detail"].startswith(f"{remote} not on loopback and TLS is off")
    assert "set [fleet] ca" in tls["detail"]


def test_insecure_no_auth_is_a_failing_line(api_url: str) -> None:
    """On a server without authorization the node signs in, and doctor fails anyway:
    the human table's line says fail, and the exit code is 1."""
    with NatsCluster(["a"], size=1, open_to_all=True) as open_server:
        config = short_dir() / "supervisor.toml"
        config.write_text(config_text(open_server, api_url, "a"))
        assert "insecure_no_auth = true" in config.read_text()
        code, rows, _ = doctor(config)
        assert code == 1
        auth = row(rows, "fleet-auth")
        assert (auth["status"], auth["method"]) == ("fail", "insecure_no_auth")
        assert "any client of the servers may act as any node" in auth["detail"]
        assert row(rows, "fleet-server")["status"] == "ok"
        human = subprocess.run(
            [*ASTRID, "doctor", "--config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert human.returncode == 1
        lines = [line for line in human.stdout.splitlines() if "fleet-auth" in line]
        assert len(lines) == 1
        assert lines[0].startswith("fail  fleet-auth"), lines


def test_a_stream_weaker_than_the_fleet_needs_fails(api_url: str) -> None:
    """A rogue client made sage_nodes' stream with rollups and purges allowed: the row
    names each setting and the fix, as the supervisor's start-up check does."""
    with NatsCluster(["a"], size=1) as cluster:

        async def make_weak_stream() -> None:
            async with cluster.client() as admin:
                js = admin.jetstream(timeout=JS_TIMEOUT)
                await js.add_stream(
                    name="KV_sage_nodes",
                    subjects=["$KV.sage_nodes.>"],
                    allow_rollup_hdrs=True,
                    max_msgs_per_subject=1,
                )

        anyio.run(make_weak_stream)
        config = short_dir() / "supervisor.toml"
        config.write_text(config_text(cluster, api_url, "a"))
        code, rows, _ = doctor(config)
        assert code == 1
        streams = row(rows, "fleet-streams")
        assert streams["status"] == "fail"
        assert streams["found"] == ["KV_sage_nodes"]
        assert "stream KV_sage_nodes is weaker than the fleet needs" in streams["detail"]
        assert "allow_rollup_hdrs is True" in streams["detail"]
        assert "nats stream edit KV_sage_nodes --no-allow-rollup" in streams["detail"]
        clock = row(rows, "fleet-clock")  # the stream's answer carried the server's time
        assert clock["status"] == "ok"
