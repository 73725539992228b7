"""A fleet to try on one machine: three NATS servers and the configs of three nodes.

``make fleet-trial`` (``python -m tests.support.fleet_trial``) starts the pinned
``nats-server`` three times on loopback ports as one JetStream cluster, with one user
per node and the subject permissions ``astrid fleet permissions`` prints (the same
cluster the fleet tests use: tests/support/nats_cluster.py), writes
``DIR/<node>/supervisor.toml`` for nodes a, b and c (state in ``DIR/<node>/state``,
the node's password in a 0600 file, the principal ``alice`` for the caller's uid),
prints how to start each, and keeps the servers up until Ctrl-C.  docs/fleet.md's
walk starts here; a real deployment writes its own server configs (docs/fleet.md,
"From one host to three").
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from tests.support.nats_cluster import NatsCluster

__all__ = ("node_config", "write_nodes")

NODES = ("a", "b", "c")
READY = "fleet-trial: ready"
"""The line after which every node's config is written and the cluster has a leader."""


def node_config(cluster: NatsCluster, node: str, principal: str, uid: int) -> str:
    """``node``'s whole supervisor config: its state beside the file, one principal for
    ``uid``, and the ``[fleet]`` table of ``cluster`` (default heartbeats)."""
    return (
        '[supervisor]\nstate_dir = "state"\n\n'
        f'[[principals]]\nname = "{principal}"\nuids = [{uid}]\n\n'
        + cluster.fleet_section(node, heartbeat=None, lost_after=None)
    )


def write_nodes(cluster: NatsCluster, root: Path, principal: str, uid: int) -> list[Path]:
    """Each node's ``supervisor.toml`` under ``root/<node>/``; their paths."""
    paths = []
    for node in cluster.nodes:
        folder = root / node
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o755)  # a principal's uid passes through to the socket
        path = folder / "supervisor.toml"
        path.write_text(node_config(cluster, node, principal, uid))
        path.chmod(0o600)  # it names the password file; keep it the operator's
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.fleet_trial",
        description="Start a 3-server NATS cluster on loopback and write the configs of "
        "fleet nodes a, b and c; runs until Ctrl-C (docs/fleet.md).",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the node configs go (default: a new /tmp folder)",
    )
    parser.add_argument(
        "--principal", default="alice", help="the principal mapped to your uid (alice)"
    )
    args = parser.parse_args(argv)
    root: Path = args.dir or Path(tempfile.mkdtemp(prefix="sage-fleet-", dir="/tmp"))
    root = root.resolve()
    if len(str(root / "a" / "state" / "run" / "astrid.sock")) > 100:
        parser.error(f"--dir {root}: too long for a Unix socket path below it; pick a shorter one")
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print("fleet-trial: starting three nats-server processes ...", file=sys.stderr, flush=True)
    cluster = NatsCluster(list(NODES))
    try:
        try:
            cluster.start()
        except Exception as exc:  # the servers' own words are in their logs
            print(f"fleet-trial: the cluster did not start: {exc}", file=sys.stderr)
            print(cluster.logs()[-2000:], file=sys.stderr)
            return 1
        paths = write_nodes(cluster, root, args.principal, os.getuid())
        astrid = Path(sys.executable).with_name("astrid")
        for node, path in zip(NODES, paths, strict=True):
            print(f"node {node}: {astrid} supervisor run --config {path}")
        print(f"then, e.g.: {astrid} fleet status --config {paths[0]}")
        print(READY, flush=True)
        while not stop:
            time.sleep(0.2)
    finally:
        cluster.stop()
    print("fleet-trial: servers stopped", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
