"""A lost node's registry claim outlives the session another node took from it (a node
deletes only its own claims): the ``sage_claims`` key that names the adopter keeps that
stale claim from ever being adopted again, even after the session ended there, and the
node that comes back ends its copy ``failed_over`` instead of resuming it.

Three real supervisors (the CLI double, ``[sessions] resume = true``) over a real
3-server NATS cluster, with failover_test's configuration.
"""

from __future__ import annotations

import signal
import time

from sage.fleet.failover import RESWEEP
from sage.fleet.routes import REGISTRY
from tests.support.daemon import Daemon
from tests.support.failover_fleet import (
    LOST_AFTER,
    audit_rows,
    claim,
    fleet,
    local_rows,
    ok_json,
    running,
    value,
)
from tests.support.nats_cluster import NatsCluster, wait_for

__all__ = ("fleet",)  # the module's fixture: its own cluster and nodes


def test_a_session_taken_over_and_ended_is_not_adopted_again_from_the_stale_claim(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = fleet
    a = daemons["a"]
    ok_json(a, "sage", "spawn", "alice", "--session", "r1")
    wait_for(lambda: value(cluster, REGISTRY, "a.r1"), 10.0, "a's claim to r1")
    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()

    adopter = wait_for(
        lambda: next((n for n in ("b", "c") if running(daemons[n], "r1")), None),
        LOST_AFTER + 15.0,
        "r1 adopted by b or c",
    )
    taken = claim(cluster, "r1")
    assert taken is not None
    assert (taken["holder"], taken["failed"]) == (adopter, False)
    assert value(cluster, REGISTRY, "a.r1") is not None  # a's stale claim stays
    ok_json(daemons[adopter], "sage", "stop", "r1")
    wait_for(lambda: value(cluster, REGISTRY, f"{adopter}.r1") is None, 10.0, "its claim gone")

    # a stays lost for more than a sweep: no node takes r1 again from a's claim
    time.sleep(RESWEEP + 3.0)
    assert not any(running(daemons[n], "r1") for n in ("b", "c"))
    adoptions = [
        row
        for n in ("b", "c")
        for row in audit_rows(daemons[n], "sage.v1.audit.session_failed_over")
        if row["session_id"] == "r1"
    ]
    assert len(adoptions) == 1, adoptions
    latest = claim(cluster, "r1")
    assert latest is not None
    assert latest["holder"] == adopter

    # a comes back: r1 was taken from it, so it ends it failed_over and drops its claim
    a.launch()
    a.wait_ready(30.0)
    local = local_rows(a)["r1"]
    assert (local["state"], local["reason"]) == ("ended", "failed_over")
    wait_for(lambda: value(cluster, REGISTRY, "a.r1") is None, 10.0, "a's stale claim gone")
