"""A fleet over TLS: servers that require it and verify the node's client certificate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import NatsCluster
from tests.support.tls_files import TlsFiles, make_tls_files


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[tuple[NatsCluster, TlsFiles]]:
    folder = short_dir()
    files = make_tls_files(folder)
    with NatsCluster(["a"], tls=files) as cluster:
        yield cluster, files


def section(cluster: NatsCluster, **tls: Path) -> str:
    # connect_timeout 5 s: the bucket waits 4x this for JetStream (a loaded host)
    fleet = cluster.fleet_section("a", heartbeat=None, lost_after=None)
    return 'capsules = ["echo"]\n' + fleet + "".join(f'{k} = "{v}"\n' for k, v in tls.items())


def test_a_node_with_the_ca_and_its_certificate_joins(
    tls_cluster: tuple[NatsCluster, TlsFiles],
) -> None:
    """ca, cert and key set: the node connects over TLS and heartbeats."""
    cluster, files = tls_cluster
    daemon = Daemon(
        short_dir(),
        section(cluster, ca=files.ca, cert=files.client_cert, key=files.client_key),
    ).start()
    try:
        result = daemon.astrid("fleet", "status", "--json")
        assert result.returncode == 0, result.stderr
        assert [n["state"] for n in json.loads(result.stdout)["nodes"]] == ["live"]
    finally:
        assert daemon.stop() == 0


@pytest.mark.parametrize(
    ("which", "expected"),
    [
        ("other_ca", "CERTIFICATE_VERIFY_FAILED"),  # the server's certificate is not trusted
        ("no_cert", "CERTIFICATE_REQUIRED"),  # the server wants a client certificate
    ],
)
def test_a_node_that_cannot_complete_tls_does_not_start(
    tls_cluster: tuple[NatsCluster, TlsFiles], which: str, expected: str
) -> None:
    """A CA that did not sign the servers, or no client certificate: refused, one line."""
    cluster, files = tls_cluster
    if which == "other_ca":
        extra = section(cluster, ca=files.other_ca, cert=files.client_cert, key=files.client_key)
    else:
        extra = section(cluster, ca=files.ca)
    result = Daemon(short_dir(), extra).run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("astrid: fleet: TLS with NATS at nats://127.0.0.1:"), last
    assert expected in last
    assert "Traceback" not in result.stderr


def test_a_key_file_open_to_others_is_refused(tls_cluster: tuple[NatsCluster, TlsFiles]) -> None:
    """The client key must be ours and 0600, like the password."""
    cluster, files = tls_cluster
    root = short_dir()
    key = root / "client.key"
    key.write_bytes(files.client_key.read_bytes())
    key.chmod(0o640)
    result = Daemon(
        root, section(cluster, ca=files.ca, cert=files.client_cert, key=key)
    ).run_refused()
    assert result.returncode == 1
    assert "TLS key file is accessible by group or other" in result.stderr


@pytest.mark.parametrize(
    ("which", "status", "words"),
    [
        ("good", "ok", "signs the node in"),
        ("other_ca", "fail", "TLS failed: "),
    ],
)
def test_doctor_signs_in_to_each_server_over_tls(
    tls_cluster: tuple[NatsCluster, TlsFiles], which: str, status: str, words: str
) -> None:
    """astrid doctor asks each server alone with the node's own TLS files: all three sign
    the node in, or none does when the CA is not the servers'."""
    cluster, files = tls_cluster
    ca = files.ca if which == "good" else files.other_ca
    daemon = Daemon(
        short_dir(), section(cluster, ca=ca, cert=files.client_cert, key=files.client_key)
    )
    result = daemon.astrid("doctor", "--json", timeout=60)
    rows = [r for r in json.loads(result.stdout)["checks"] if r["name"].startswith("fleet-")]
    assert [(r["name"], r["status"]) for r in rows if r["name"] == "fleet-tls"] == [
        ("fleet-tls", "ok")
    ]
    servers = [r for r in rows if r["name"] == "fleet-server"]
    assert [r["url"] for r in servers] == cluster.urls
    for server in servers:
        assert server["status"] == status, server
        assert words in server["detail"], server
    if which == "other_ca":
        assert "CERTIFICATE_VERIFY_FAILED" in servers[0]["detail"]
        assert result.returncode == 1


def test_a_server_without_tls_gets_no_credentials_when_the_node_wants_tls(
    tls_cluster: tuple[NatsCluster, TlsFiles],
) -> None:
    """nats-py would go on in clear with a server that does not ask for TLS (or a man in
    the middle that says so): with [fleet] ca set the node refuses before its CONNECT,
    so the password never crosses in clear; the start and doctor both say why."""
    _, files = tls_cluster
    with NatsCluster(["a"], size=1) as plain:
        fleet = plain.fleet_section("a", heartbeat=None, lost_after=None, replicas=1)
        daemon = Daemon(short_dir(), f'capsules = ["echo"]\n{fleet}ca = "{files.ca}"\n')
        result = daemon.run_refused()
        assert result.returncode == 1
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("astrid: fleet: TLS with NATS at nats://127.0.0.1:"), last
        assert "the server answered without TLS" in last
        assert plain.passwords["a"] not in result.stderr
        report = daemon.astrid("doctor", "--json", timeout=60)
        assert report.returncode == 1
        (server,) = [r for r in json.loads(report.stdout)["checks"] if r["name"] == "fleet-server"]
        assert server["status"] == "fail"
        assert "TLS failed: the server answered without TLS" in server["detail"]
