"""What a fleet refuses: wrong credentials, no NATS, another node's key, a single host.

Real nats-server processes (the pinned one in the virtualenv), real supervisors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anyio
import nats
import pytest
from nats.js.errors import KeyNotFoundError

from sage.fleet.nodes import NodeRecord
from sage.fleet.permissions import BUCKET
from tests.support.daemon import Daemon, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, free_port, new_user_seed, refused_kv

NODES = ["a", "b"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[NatsCluster]:
    with NatsCluster(NODES, nkey_nodes=("k",)) as running:
        yield running


def section(
    urls: list[str], node: str, password_file: str, timeout: float = 5.0, *, key: str = ""
) -> str:
    quoted = ", ".join(f'"{url}"' for url in urls)
    secret = f'nkey_seed = "{key}"' if key else f'password_file = "{password_file}"'
    return (
        'capsules = ["echo"]\n[fleet]\n'
        f'url = [{quoted}]\nnode = "{node}"\n{secret}\n'
        f"heartbeat = 0.5\nlost_after = 2.0\nconnect_timeout = {timeout}\nreplicas = 3\n"
    )


def test_wrong_password_is_refused_with_a_clear_error(cluster: NatsCluster) -> None:
    """A node whose password is wrong does not start: one line, fleet_auth_failed's words,
    no traceback, and the wrong password is nowhere in what it printed."""
    root = short_dir()
    wrong = root / "wrong.password"
    wrong.write_text("not-the-password-0451\n")
    wrong.chmod(0o600)
    daemon = Daemon(root, section(cluster.urls, "a", str(wrong)))
    result = daemon.run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("astrid: fleet: NATS at nats://127.0.0.1:"), last
    assert "refused user 'a': wrong user or password" in last
    assert "Traceback" not in result.stderr
    assert "not-the-password-0451" not in result.stderr + result.stdout


def test_unreachable_nats_is_refused_naming_the_url() -> None:
    """No server listening: the supervisor gives up after connect_timeout and names the URL."""
    root = short_dir()
    password = root / "p"
    password.write_text("x\n")
    password.chmod(0o600)
    url = f"nats://127.0.0.1:{free_port()}"
    daemon = Daemon(root, section([url], "a", str(password), timeout=1.0))
    result = daemon.run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"astrid: fleet: cannot reach NATS at {url} within 1 s"), last
    assert "Traceback" not in result.stderr


def test_a_password_file_open_to_others_is_refused(cluster: NatsCluster) -> None:
    """The password file must be the supervisor's own and 0600."""
    root = short_dir()
    open_file = root / "open.password"
    open_file.write_text(cluster.passwords["a"] + "\n")
    open_file.chmod(0o644)
    result = Daemon(root, section(cluster.urls, "a", str(open_file))).run_refused()
    assert result.returncode == 1
    assert "accessible by group or other" in result.stderr
    assert cluster.passwords["a"] not in result.stderr


def test_without_fleet_status_says_not_in_a_fleet() -> None:
    """A single host: `astrid fleet status` exits 1 with not_in_fleet."""
    daemon = Daemon(short_dir(), 'capsules = ["echo"]\n').start()
    try:
        result = daemon.astrid("fleet", "status")
        assert result.returncode == 1
        assert result.stderr.strip() == (
            "astrid: not_in_fleet: this supervisor is not in a fleet (its config has no [fleet])"
        )
    finally:
        assert daemon.stop() == 0


@pytest.mark.anyio
async def test_a_node_may_put_its_own_key_and_never_another_nodes(cluster: NatsCluster) -> None:
    """With exactly the permissions `astrid fleet permissions` prints, node a creates and
    reads the bucket and puts its own key; the server refuses its put of b's key."""
    daemon = Daemon(
        short_dir(), section(cluster.urls, "b", str(cluster.password_file("b")))
    ).start()  # node b, a real supervisor, heartbeats into the bucket
    try:
        async with cluster.client("a") as nc:
            kv = await nc.jetstream(timeout=JS_TIMEOUT).key_value(BUCKET)
            denied = await refused_kv(nc, BUCKET)
            own = NodeRecord(
                node="a", host="h", pid=1, started_at=1.0, heartbeat_at=2.0, heartbeat=1.0
            )
            assert await kv.put("a", own.encode()) > 0
            assert (await kv.get("a")).value == own.encode()
            before = (await kv.get("b")).value
            forged = forged_record("b")
            with pytest.raises(nats.errors.TimeoutError):
                await denied.put("b", forged)
            await anyio.sleep(0.3)
            current = (await kv.get("b")).value
            assert current != forged
            assert json.loads(current or b"{}")["node"] == "b"
            assert before is not None
            # nor may it delete or purge another node's key (both are publishes there)
            with pytest.raises(nats.errors.TimeoutError):
                await denied.delete("b")
            assert (await kv.get("b")).value != forged
            with pytest.raises(KeyNotFoundError):
                await kv.get("nobody")
    finally:
        assert daemon.stop() == 0


def forged_record(node: str) -> bytes:
    return json.dumps(
        {
            "node": node,
            "host": "forged",
            "pid": 4242,
            "started_at": 0,
            "heartbeat_at": 9e12,
            "heartbeat": 1.0,
        }
    ).encode()


@pytest.mark.anyio
async def test_a_malformed_record_is_ignored_and_logged(cluster: NatsCluster) -> None:
    """Garbage under a key of the bucket (written by an admin user) is left out of
    `astrid fleet status`, which still lists the node, and named in the log."""
    daemon = Daemon(
        short_dir(), section(cluster.urls, "a", str(cluster.password_file("a")))
    ).start()
    try:
        async with cluster.client() as admin:
            kv = await admin.jetstream(timeout=JS_TIMEOUT).key_value(BUCKET)
            await kv.put("zz", b"\x00not json")
        result = await anyio.to_thread.run_sync(lambda: daemon.astrid("fleet", "status", "--json"))
        assert result.returncode == 0, result.stderr
        names = [n["node"] for n in json.loads(result.stdout)["nodes"]]
        assert "a" in names
        assert "zz" not in names
        log = daemon.log()
        assert '"fleet.record_ignored"' in log
        assert '"key": "zz"' in log
    finally:
        assert daemon.stop() == 0


def test_a_node_with_an_nkey_joins_and_its_seed_is_in_no_log(cluster: NatsCluster) -> None:
    """[fleet] nkey_seed: the node signs in with its NKey (the server knows only the
    public key), heartbeats, and its seed is in neither its log nor its argv."""
    daemon = Daemon(
        short_dir(), section(cluster.urls, "k", "", key=str(cluster.seed_file("k")))
    ).start()
    try:
        result = daemon.astrid("fleet", "status", "--json")
        assert result.returncode == 0, result.stderr
        nodes = {n["node"]: n["state"] for n in json.loads(result.stdout)["nodes"]}
        assert nodes["k"] == "live"
        assert daemon.proc is not None
        with open(f"/proc/{daemon.proc.pid}/cmdline", "rb") as file:
            assert cluster.seeds["k"].encode() not in file.read()
    finally:
        assert daemon.stop() == 0
    assert cluster.seeds["k"] not in daemon.log()
    assert '"fleet.joined"' in daemon.log()


def test_an_nkey_the_servers_do_not_know_is_refused(cluster: NatsCluster) -> None:
    """A valid seed whose public key is in no server's users: fleet_auth_failed's line."""
    root = short_dir()
    stranger = root / "stranger.nk"
    seed = new_user_seed()
    stranger.write_text(seed + "\n")
    stranger.chmod(0o600)
    result = Daemon(root, section(cluster.urls, "k", "", key=str(stranger))).run_refused()
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert f"refused the NKey of {stranger}: a key its servers do not know" in last, last
    assert seed not in result.stderr
    assert "Traceback" not in result.stderr


def test_a_file_that_is_no_nkey_seed_is_refused_unechoed(cluster: NatsCluster) -> None:
    """A seed file holding something else ends start-up; its content is not printed."""
    root = short_dir()
    bogus = root / "bogus.nk"
    bogus.write_text("SUnot-a-seed-but-maybe-a-secret-7781\n")
    bogus.chmod(0o600)
    result = Daemon(root, section(cluster.urls, "k", "", key=str(bogus))).run_refused()
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == f"astrid: fleet: {bogus}: not an NKey seed"
    assert "maybe-a-secret" not in result.stderr
