"""The registry rig: three supervisors (the CLI double, alice a uid of her own) over a
real 3-server NATS cluster, node b hibernating an idle session after 0.5 s, and what the
registry copy's and the registry trust's test modules read of them.

Each test module that names :func:`fleet` as a fixture gets a cluster and nodes of its
own (module scope).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import FAKE_CLAUDE
from tests.support.daemon import Daemon, node_root
from tests.support.failover_fleet import running_fleet
from tests.support.nats_cluster import NatsCluster

__all__ = ("ALICE_UID", "NODES", "fleet", "forwarded", "node_config", "send")

NODES = ["a", "b", "c"]
ALICE_UID = 65533


def node_config(cluster: NatsCluster, node: str) -> str:
    """The runner with the double; on node b an idle session hibernates after 0.5 s."""
    sleepy = "[sessions]\nhibernate_after = 0.5\n" if node == "b" else ""
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        '[limits]\nstop_grace = 2.0\n[socket]\ngroup = "nogroup"\n'
        + sleepy
        + cluster.fleet_section(node)
        + f'[[principals]]\nname = "alice"\nuids = [{ALICE_UID}]\noperator_key = true\n'
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with running_fleet(node_config, NODES, node_root) as running:
        yield running


def send(daemon: Daemon, sid: str, text: str) -> tuple[int, str]:
    result = daemon.astrid("sage", "send", sid, text, "--principal", "alice", timeout=30.0)
    return result.returncode, result.stdout + result.stderr


def forwarded(daemon: Daemon, sid: str) -> list[dict[str, Any]]:
    """The requests for ``sid`` that other nodes forwarded to ``daemon``, as it logged them."""
    return [r for r in daemon.log_events("fleet.forwarded_in") if r.get("session_id") == sid]
