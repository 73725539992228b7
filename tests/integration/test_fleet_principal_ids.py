"""A session is named across the fleet by its principal and its id: one principal's choice
of id never touches another's session.

Session ids are each node's, so alice's ``review`` on node a and bob's ``review`` on
node c are two sessions.  Node a is killed: alice's is adopted (by b, or by c, which
holds bob's of that id and gives the claim to the next node), and bob's on c runs on,
never fenced by alice's claim.  (Found by this test's first run: bob's live entry hid
alice's lost one, which was never adopted.)  Three real supervisors (the CLI double) over a real
3-server NATS cluster, with failover_test's configuration (bob on a and c only).
"""

from __future__ import annotations

import signal
import time

from sage.fleet.fencing import SWEEP_BEATS
from sage.fleet.routes import REGISTRY
from tests.support.daemon import Daemon
from tests.support.failover_fleet import (
    HEARTBEAT,
    LOST_AFTER,
    claim,
    fleet,
    local_rows,
    ok_json,
    running,
    value,
)
from tests.support.nats_cluster import NatsCluster, wait_for

__all__ = ("fleet",)  # the module's fixture: its own cluster and nodes


def test_alices_failover_never_ends_bobs_session_of_the_same_id(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """alice's ``review`` of a killed node is adopted; bob's ``review`` on c keeps its
    child, its registry entry and its own claim, and both answer their own principal."""
    cluster, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    ok_json(a, "sage", "spawn", "alice", "--session", "review")
    ok_json(c, "sage", "spawn", "bob", "--session", "review")
    wait_for(lambda: value(cluster, REGISTRY, "a.review"), 10.0, "a's entry for alice's review")
    wait_for(lambda: value(cluster, REGISTRY, "c.review"), 10.0, "c's entry for bob's review")
    bobs_pid = local_rows(c)["review"]["pid"]
    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()

    def adopted() -> bool:
        row = local_rows(b).get("review")
        return row is not None and row["principal_id"] == "alice" and running(b, "review")

    # c holds bob's review, so its adoption is refused duplicate_session and b takes it
    wait_for(adopted, LOST_AFTER + 30.0, "alice's review adopted by b")
    taken = claim(cluster, "review", "alice")
    assert taken is not None
    assert (taken["holder"], taken["principal_id"]) == ("b", "alice")
    assert claim(cluster, "review", "bob") is None  # bob's session was never raced for

    # several sweeps later bob's review still runs on c, the same child
    time.sleep(3 * SWEEP_BEATS * HEARTBEAT)
    row = local_rows(c)["review"]
    assert (row["principal_id"], row["state"], row["pid"]) == ("bob", "ready", bobs_pid), row
    assert not c.log_events("fleet.fenced")
    assert value(cluster, REGISTRY, "c.review") is not None

    # each principal reaches their own from any node
    for via in (b, c):
        for principal in ("alice", "bob"):
            if principal == "bob" and via is b:
                continue  # b does not serve bob
            sent = via.astrid(
                "sage", "send", "review", f"to {principal}", "--timeout", "20",
                "--principal", principal,
            )  # fmt: skip
            assert sent.returncode == 0, (via.root.name, principal, sent.stderr)
            assert f"echo: to {principal}" in sent.stdout
    assert local_rows(c)["review"]["pid"] == bobs_pid
