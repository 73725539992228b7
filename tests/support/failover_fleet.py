"""The failover rig: three supervisors over a real 3-server NATS cluster with the CLI
double, every node with ``[sessions] resume = true`` and short heartbeats, and what the
failover, fencing, re-adoption and adoption test modules read of them (their listings,
audit rows, the object store's replicas, the registry's values, where a transcript is).

Each test module that names :func:`fleet` as a fixture gets a cluster and nodes of its
own (module scope).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from sage.fleet.claims import Claims
from sage.fleet.routes import Claim
from sage.fleet.transcripts import transcript_rel
from tests.support import FAKE_CLAUDE
from tests.support.daemon import Daemon, all_running, short_dir
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, stored_transcript

__all__ = (
    "HEARTBEAT",
    "LOST_AFTER",
    "NODES",
    "argv_of",
    "audit_rows",
    "claim",
    "conversation_of",
    "fleet",
    "home_of",
    "local_rows",
    "node_config",
    "ok_json",
    "put_claim",
    "put_transcript",
    "request",
    "rows",
    "running",
    "running_fleet",
    "stored",
    "transcript_path",
    "value",
)

NODES = ["a", "b", "c"]
HEARTBEAT = 0.4
LOST_AFTER = 1.5


def node_config(cluster: NatsCluster, node: str) -> str:
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        "[limits]\nstop_grace = 2.0\n[sessions]\nresume = true\n"
        + cluster.fleet_section(node, heartbeat=HEARTBEAT, lost_after=LOST_AFTER)
        + '[[principals]]\nname = "alice"\noperator_key = true\n'
        # bob only on a and c: b cannot run his sessions, so it never takes them
        + ('[[principals]]\nname = "bob"\noperator_key = true\n' if node != "b" else "")
    )


@contextlib.contextmanager
def running_fleet(
    config_of: Callable[[NatsCluster, str], str],
    nodes: Sequence[str] = NODES,
    root: Callable[[], Path] = short_dir,
) -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    """A 3-server NATS cluster and a supervisor per node of ``nodes``, each with the
    config ``config_of(cluster, node)`` and the API key of the CLI double, all ready."""
    with NatsCluster(list(nodes)) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-double"}
        with all_running(
            {node: Daemon(root(), config_of(cluster, node), env=env) for node in nodes}
        ) as daemons:
            yield cluster, daemons


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with running_fleet(node_config) as running:
        yield running


def ok_json(daemon: Daemon, *args: str) -> Any:
    result = daemon.astrid(*args, "--json", timeout=30.0)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return json.loads(result.stdout)


def rows(daemon: Daemon) -> dict[str, dict[str, Any]]:
    return {row["session_id"]: row for row in ok_json(daemon, "sage", "sessions")}


def request(daemon: Daemon, topic: str, payload: Any) -> Any:
    """One request on ``daemon``'s socket, as its admin."""

    async def main() -> Any:
        from bus.client import BusClient

        async with BusClient.connect(daemon.socket, role="cli", name="test") as client:
            reply = await client.request(topic, payload, deadline=10.0)
            return json.loads(reply.payload)

    return anyio.run(main)


def local_rows(daemon: Daemon) -> dict[str, dict[str, Any]]:
    """The node's own runner's sessions, ended ones too (not the fleet-wide listing)."""
    listing = request(daemon, "sage.v1.request.sessions", {"all": True})
    return {row["session_id"]: row for row in listing["sessions"]}


def audit_rows(daemon: Daemon, kind: str) -> list[dict[str, Any]]:
    import sqlite3

    db = sqlite3.connect(f"file:{daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    try:
        found = db.execute("SELECT payload FROM entries WHERE kind = ?", (kind,)).fetchall()
    finally:
        db.close()
    return [json.loads(payload)["payload"] for (payload,) in found]


def stored(
    cluster: NatsCluster, sid: str, node: str | None = None
) -> tuple[bytes, dict[str, Any]] | None:
    """``node``'s copy of ``sid``'s transcript and its description (as the NATS admin);
    without ``node``, the first of :data:`NODES` that holds one."""
    for name in [node] if node is not None else NODES:
        found = anyio.run(stored_transcript, cluster, name, sid)
        if found is not None:
            return found[0], json.loads(found[1] or "{}")
    return None


def claim(cluster: NatsCluster, sid: str, principal: str = "alice") -> dict[str, Any] | None:
    """``principal``'s session ``sid``'s claim in ``sage_claims`` (the latest of every node's keys, as the NATS
    admin), with ``holder``; None: none, or withdrawn."""

    async def main() -> dict[str, Any] | None:
        async with cluster.client() as nc:
            found, _ = await Claims(nc.jetstream(timeout=JS_TIMEOUT), "admin").latest(
                principal, sid
            )
        if found is None:
            return None
        return {**msgspec.to_builtins(found), "holder": found.holder}

    return anyio.run(main)


def put_claim(cluster: NatsCluster, sid: str, claim: Claim) -> None:
    """Store ``claim`` as its node's latest claim to ``sid`` (as the NATS admin, naming the
    revision it read)."""

    async def main() -> None:
        async with cluster.client() as nc:
            js = nc.jetstream(timeout=JS_TIMEOUT)
            _, revision = await Claims(js, claim.node).latest(claim.principal_id, sid)
            await Claims(js, claim.node).write(sid, claim, revision)

    anyio.run(main)


def argv_of(pid: int) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as file:
        return [part.decode() for part in file.read().split(b"\0") if part]


def conversation_of(pid: int) -> str:
    """The claude_session a child of the double runs (``--session-id`` or ``--resume``)."""
    for arg in argv_of(pid):
        for flag in ("--session-id=", "--resume="):
            if arg.startswith(flag):
                return arg.removeprefix(flag)
    raise AssertionError(f"no conversation in {argv_of(pid)}")


def home_of(daemon: Daemon) -> Path:
    return daemon.root / "state" / "homes" / "alice"


def transcript_path(daemon: Daemon, claude_session: str) -> Path:
    home = home_of(daemon)
    return home / transcript_rel(os.path.realpath(home), claude_session)


def put_transcript(daemon: Daemon, claude_session: str, data: bytes) -> Path:
    """Where the real CLI keeps it, owned by the principal's children (the home's owner)."""
    home = home_of(daemon)
    owner = home.stat()
    path = transcript_path(daemon, claude_session)
    folder = home
    for part in path.relative_to(home).parts[:-1]:
        folder = folder / part
        folder.mkdir(mode=0o700, exist_ok=True)
        os.chown(folder, owner.st_uid, owner.st_gid)
    path.write_bytes(data)
    os.chown(path, owner.st_uid, owner.st_gid)
    return path


def value(cluster: NatsCluster, bucket: str, key: str) -> dict[str, object] | None:
    """``key``'s value in ``bucket``, decoded (as the NATS admin); None: no such key."""
    found = cluster.admin_get(bucket, key)
    return None if found is None else json.loads(found)


def running(daemon: Daemon, sid: str) -> bool:
    """Whether ``daemon``'s own runner has ``sid`` and it has not ended."""
    row = local_rows(daemon).get(sid)
    return row is not None and row["state"] != "ended"
