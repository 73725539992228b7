"""A fleet needs credentials: a real supervisor without any refuses to start, one with
``insecure_no_auth = true`` starts on a NATS server without authorization and says so
in its log at every start.

Real processes: the pinned nats-server (one, JetStream, no authorization) and
``astrid supervisor run``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import NatsCluster, free_port


@pytest.fixture(scope="module")
def open_server() -> Iterator[NatsCluster]:
    """One server that lets any client do anything."""
    with NatsCluster(["a"], size=1, open_to_all=True) as running:
        yield running


def section(url: str, secret: str = "") -> str:
    return (
        'capsules = ["echo"]\n[fleet]\n'
        f'url = "{url}"\nnode = "a"\n{secret}\n'
        "heartbeat = 0.5\nlost_after = 10.0\nconnect_timeout = 2\nreplicas = 1\n"
    )


def test_a_fleet_without_credentials_does_not_start() -> None:
    """No password_file, nkey_seed or creds: one line naming them and the flag, exit 1,
    before any connection (nothing listens at the URL: that is not what it reports)."""
    url = f"nats://127.0.0.1:{free_port()}"
    result = Daemon(short_dir(), section(url)).run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("astrid: fleet: no credentials: [fleet] names none of"), last
    for words in ("password_file", "nkey_seed", "creds", "insecure_no_auth = true"):
        assert words in last, last
    assert "cannot reach NATS" not in result.stderr
    assert "Traceback" not in result.stderr


def test_credentials_and_insecure_no_auth_together_do_not_start() -> None:
    root = short_dir()
    password = root / "p"
    password.write_text("x\n")
    password.chmod(0o600)
    secret = f'password_file = "{password}"\ninsecure_no_auth = true'
    result = Daemon(root, section(f"nats://127.0.0.1:{free_port()}", secret)).run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "fleet.insecure_no_auth: set together with password_file" in last, last
    assert "remove insecure_no_auth = true" in last
    assert "Traceback" not in result.stderr


def test_insecure_no_auth_starts_and_warns_at_every_start(open_server: NatsCluster) -> None:
    daemon = Daemon(short_dir(), section(open_server.urls[0], "insecure_no_auth = true"))
    daemon.start()
    try:
        warnings = daemon.log_events("fleet.insecure_no_auth")
        assert len(warnings) == 1, daemon.log()[-3000:]
        assert warnings[0]["level"] == "warning", warnings
        assert warnings[0]["node"] == "a"
        result = daemon.astrid("fleet", "status", "--json")
        assert result.returncode == 0, result.stderr
        nodes = {n["node"]: n for n in json.loads(result.stdout)["nodes"]}
        assert nodes["a"]["state"] == "live", nodes
    finally:
        assert daemon.stop() == 0
    daemon.start()  # the same log, appended: a second start warns again
    try:
        assert len(daemon.log_events("fleet.insecure_no_auth")) == 2
    finally:
        assert daemon.stop() == 0
