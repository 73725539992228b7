"""`[fleet] creds`: a node signs in with a NATS user credentials file (a user JWT and its
NKey seed) to servers in operator mode, and what they and the node refuse.

Real nats-server processes (the pinned one in the virtualenv) in operator mode, trusting
an operator, its system account and a SAGE account with JetStream, all minted in the test
(tests/support/nats_jwt.py); real supervisors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anyio
import nats
import pytest

from sage.fleet.nodes import NodeRecord
from sage.fleet.permissions import BUCKET, node_permissions
from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, refused_kv, wait_for
from tests.support.nats_jwt import Operator


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster([], operator=Operator()) as running:
        yield running


def section(urls: list[str], node: str, creds: Path) -> str:
    quoted = ", ".join(f'"{url}"' for url in urls)
    return (
        'capsules = ["echo"]\n[fleet]\n'
        f'url = [{quoted}]\nnode = "{node}"\ncreds = "{creds}"\n'
        "heartbeat = 0.5\nlost_after = 2.0\nconnect_timeout = 5\nreplicas = 3\n"
    )


def secrets_of(creds: Path) -> list[str]:
    """The JWT and the seed lines of a ``.creds`` file."""
    return [line for line in creds.read_text().splitlines() if line.startswith(("eyJ", "SU"))]


def _heartbeat_at(daemon: Daemon, node: str) -> float:
    result = daemon.astrid("fleet", "status", "--json")
    assert result.returncode == 0, result.stderr
    nodes = {n["node"]: n for n in json.loads(result.stdout)["nodes"]}
    assert nodes[node]["state"] == "live", nodes
    return float(nodes[node]["heartbeat_at"])


def test_a_node_with_creds_joins_heartbeats_and_its_secrets_are_in_no_log(
    cluster: NatsCluster,
) -> None:
    """The node's user JWT (signed by the account the operator trusts, with the node's
    permissions in it) lets it join and heartbeat; neither the JWT nor the seed is in its
    log or argv."""
    creds = cluster.creds_file("a")
    jwt, seed = secrets_of(creds)
    daemon = Daemon(short_dir(), section(cluster.urls, "a", creds)).start()
    try:
        first = _heartbeat_at(daemon, "a")
        wait_for(lambda: _heartbeat_at(daemon, "a") > first, 15.0, "a later heartbeat of node a")
        assert daemon.proc is not None
        with open(f"/proc/{daemon.proc.pid}/cmdline", "rb") as file:
            argv = file.read()
        assert seed.encode() not in argv
        assert jwt.encode() not in argv
    finally:
        assert daemon.stop() == 0
    log = daemon.log()
    assert '"fleet.joined"' in log
    assert seed not in log
    assert jwt not in log
    assert jwt[:40] not in log


def test_a_user_jwt_of_an_account_the_operator_does_not_trust_is_refused(
    cluster: NatsCluster,
) -> None:
    """Well-formed credentials of another operator's account: fleet_auth_failed's line,
    naming the file, never its content, no traceback."""
    root = short_dir()
    stranger = root / "stranger.creds"
    stranger.write_text(Operator("other").user_creds("a", node_permissions("a")))
    stranger.chmod(0o600)
    result = Daemon(root, section(cluster.urls, "a", stranger)).run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("astrid: fleet: NATS at nats://127.0.0.1:"), last
    assert f"refused the user JWT of {stranger}: a user its operator and accounts" in last, last
    assert "Traceback" not in result.stderr
    for secret in secrets_of(stranger):
        assert secret[:20] not in result.stderr + result.stdout


def test_a_creds_file_open_to_group_is_refused(cluster: NatsCluster) -> None:
    """The credentials file must be the supervisor's own and 0600, as a password file."""
    root = short_dir()
    creds = root / "a.creds"
    creds.write_text(cluster.creds_file("a").read_text())
    creds.chmod(0o640)
    result = Daemon(root, section(cluster.urls, "a", creds)).run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last == (
        f"astrid: fleet: {creds}: credentials file is accessible by group or other"
        f" (mode 0640); run `chmod 600 {creds}`"
    )
    for secret in secrets_of(creds):
        assert secret[:20] not in result.stderr


def test_a_malformed_creds_file_is_refused_unechoed(cluster: NatsCluster) -> None:
    """A creds file whose JWT is mangled ends start-up with one clear line; its content is
    not printed."""
    root = short_dir()
    creds = root / "bad.creds"
    good = cluster.creds_file("a").read_text()
    jwt, _ = secrets_of(cluster.creds_file("a"))
    creds.write_text(good.replace(jwt, "eyJnot-a-jwt-but-maybe-a-secret-7781"))
    creds.chmod(0o600)
    result = Daemon(root, section(cluster.urls, "a", creds)).run_refused()
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"astrid: fleet: {creds}: the user JWT is malformed: not three base64url parts"
    )
    assert "maybe-a-secret" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.anyio
async def test_the_permissions_in_the_user_jwt_hold(cluster: NatsCluster) -> None:
    """The user JWT carries `astrid fleet permissions`' subjects (docs/fleet.md: nsc add
    user --allow-pub ...): node b may put its own heartbeat key, and the server refuses
    its put of a's."""
    daemon = Daemon(short_dir(), section(cluster.urls, "a", cluster.creds_file("a"))).start()
    try:
        async with cluster.client("b") as nc:
            kv = await nc.jetstream(timeout=JS_TIMEOUT).key_value(BUCKET)
            own = NodeRecord(
                node="b", host="h", pid=1, started_at=1.0, heartbeat_at=2.0, heartbeat=1.0
            )
            assert await kv.put("b", own.encode()) > 0
            with pytest.raises(nats.errors.TimeoutError):
                await (await refused_kv(nc, BUCKET)).put("a", b"forged")
            await anyio.sleep(0.3)
            assert json.loads((await kv.get("a")).value or b"{}")["node"] == "a"
    finally:
        assert daemon.stop() == 0
