"""Failover within the adopter's limits: three supervisors over a real 3-server NATS
cluster with the CLI double.

Node a (``max_live = 1``) runs two sessions of alice: ``z1`` idle, hibernated to make room
for ``m1``.  Node b (``max_live = 1``) is full: its one session is in a turn that does not
end.  Node c holds at most 2 live sessions of a principal.  a is killed: b (full) takes
nothing; c takes ``m1`` live and ``z1`` asleep (no child until a send, which resumes it).
The runner's own refusals of an adoption are the spawn's: ``host_full`` at b,
``principal_limit`` at c.  When a comes back and is killed again, c (the least loaded)
is at bob's cap: it refuses his session and gives the claim back, and b takes it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import FAKE_CLAUDE
from tests.support.daemon import Daemon, descendant_argvs
from tests.support.failover_fleet import (
    HEARTBEAT,
    LOST_AFTER,
    local_rows,
    ok_json,
    request,
    rows,
    running_fleet,
    stored,
    transcript_path,
)
from tests.support.nats_cluster import NatsCluster, wait_for

CS = "0d7c6c2e-3a4f-4b8e-9c1d-2e3f4a5b6c7d"
SESSIONS = {
    "a": "max_live = 1\n",
    "b": "max_live = 1\nwake_wait = 8\n",
    "c": "",
}
LIMITS = {"a": "", "b": "", "c": "max_sessions_per_principal = 2\n"}


def node_config(cluster: NatsCluster, node: str) -> str:
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        f"[limits]\nstop_grace = 2.0\n{LIMITS[node]}"
        f"[sessions]\nresume = true\n{SESSIONS[node]}"
        + cluster.fleet_section(node, heartbeat=HEARTBEAT, lost_after=LOST_AFTER)
        + '[[principals]]\nname = "alice"\noperator_key = true\n'
        '[[principals]]\nname = "bob"\noperator_key = true\n'
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with running_fleet(node_config) as running:
        yield running


def adopt(daemon: Daemon, sid: str, principal: str, *, asleep: bool = False) -> Any:
    payload = {
        "session_id": sid,
        "principal_id": principal,
        "claude_session": CS,
        "from_node": "a",
        "fresh": True,
        "asleep": asleep,
    }
    return request(daemon, "sage.v1.request.adopt", payload)


def children_of(daemon: Daemon) -> list[str]:
    """The command line of each process below ``daemon``, its arguments joined by spaces."""
    assert daemon.proc is not None
    return [" ".join(argv) for argv in descendant_argvs(daemon.proc.pid).values()]


def test_the_runner_refuses_an_adoption_past_its_limits(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    b, c = fleet[1]["b"], fleet[1]["c"]
    # b at max_live 1, its one session in a turn: nothing idle to hibernate
    ok_json(b, "sage", "spawn", "alice", "--session", "hb")
    busy = b.astrid("sage", "send", "hb", "/fault hang", "--timeout", "1")
    assert busy.returncode != 0  # the turn goes on
    began = time.monotonic()
    reply = adopt(b, "x1", "alice")
    assert (reply["ok"], reply["error"]) == (False, "host_full"), reply
    assert time.monotonic() - began < 3.0  # at once (a spawn waits wake_wait): others have room
    assert "x1" not in local_rows(b)
    # c: two live sessions of bob is his cap (no hibernation there to make room)
    ok_json(c, "sage", "spawn", "bob", "--session", "cb1")
    ok_json(c, "sage", "spawn", "bob", "--session", "cb2")
    reply = adopt(c, "x2", "bob")
    assert (reply["ok"], reply["error"]) == (False, "principal_limit"), reply
    assert "x2" not in local_rows(c)
    # asleep, it takes no live place: taken, no child
    reply = adopt(c, "x3", "bob", asleep=True)
    assert (reply["ok"], reply["pid"], reply["hibernated"]) == (True, None, True), reply
    assert local_rows(c)["x3"]["state"] == "hibernated"
    # x3 holds conversation CS now: no second session (no second child) on it
    reply = adopt(c, "x4", "bob", asleep=True)
    assert (reply["ok"], reply["error"]) == (False, "duplicate_session"), reply
    assert "'x3' here holds the conversation" in reply["message"], reply
    assert "x4" not in local_rows(c)
    for sid in ("cb1", "cb2", "x3"):
        ok_json(c, "sage", "stop", sid, "--principal", "bob")


def test_a_lost_nodes_sessions_go_where_there_is_room_and_asleep_stay_asleep(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    ok_json(a, "sage", "spawn", "alice", "--session", "z1")
    z1_conversation = request(a, "sage.v1.request.conversation.z1", {})["claude_session"]
    sent = a.astrid("sage", "send", "z1", "first turn", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    z1_replica, _ = wait_for(lambda: stored(cluster, "z1"), 10.0, "z1 replicated after its turn")
    ok_json(a, "sage", "spawn", "alice", "--session", "m1")  # z1 (idle) hibernates for it
    wait_for(lambda: local_rows(a)["z1"]["state"] == "hibernated", 10.0, "z1 hibernated")
    wait_for(lambda: rows(c).get("z1", {}).get("node") == "a", 15.0, "z1 listed on c")

    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()

    wait_for(lambda: local_rows(c).get("m1", {}).get("pid"), LOST_AFTER + 10.0, "m1 on c")
    wait_for(lambda: "z1" in local_rows(c), 10.0, "z1 on c")
    z1 = local_rows(c)["z1"]
    assert (z1["state"], z1.get("pid")) == ("hibernated", None), z1
    assert not any(z1_conversation in argv for argv in children_of(c))
    assert rows(b)["z1"]["node"] == "c"
    assert transcript_path(c, z1_conversation).read_bytes() == z1_replica  # restored asleep
    # b was full: it never even claimed them
    assert "failover_won" not in b.log()
    assert not {"m1", "z1"} & local_rows(b).keys()

    # a send wakes it with --resume on its conversation, and the reply is its own
    sent = b.astrid(
        "sage", "send", "z1", "after the loss", "--timeout", "20", "--principal", "alice"
    )
    assert sent.returncode == 0, sent.stderr
    assert "echo: after the loss" in sent.stdout
    assert any(f"--resume={z1_conversation}" in argv for argv in children_of(c))


def test_a_node_at_its_principal_cap_leaves_the_session_to_the_next(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """c, the least loaded, ranks first for bob's session but holds two of his already
    (its cap): it refuses, gives the claim back, and b (room made by hibernating its
    idle session) takes it."""
    _, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    a.launch()  # back from the kill of the test before
    a.wait_ready(30.0)
    ok_json(c, "sage", "spawn", "bob", "--session", "cb3")
    ok_json(c, "sage", "spawn", "bob", "--session", "cb4")
    ok_json(a, "sage", "spawn", "bob", "--session", "p1")
    ok_json(b, "sage", "interrupt", "hb")  # b: at max_live, its one session idle now
    wait_for(lambda: local_rows(b)["hb"]["state"] == "ready", 10.0, "hb idle")
    wait_for(lambda: rows(c).get("p1", {}).get("node") == "a", 15.0, "p1 listed on c")

    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()

    wait_for(lambda: local_rows(b).get("p1", {}).get("pid"), LOST_AFTER + 20.0, "p1 on b")
    assert "fleet.failover_refused" in c.log()
    assert "principal_limit" in c.log()
    assert "p1" not in local_rows(c)
    assert rows(c)["p1"]["node"] == "b"
    assert local_rows(b)["hb"]["state"] == "hibernated"  # the room b made
    sent = c.astrid("sage", "send", "p1", "still here", "--timeout", "20", "--principal", "bob")
    assert sent.returncode == 0, sent.stderr
    assert "echo: still here" in sent.stdout


def test_a_session_asleep_across_a_restart_is_adopted_asleep(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """At its start a node claims its sessions again (the registry says them running):
    those that sleep on say so again, so when it is lost they are adopted asleep."""
    cluster, daemons = fleet
    a = daemons["a"]
    a.launch()  # back from the kill of the test before
    a.wait_ready(30.0)
    ok_json(a, "sage", "spawn", "alice", "--session", "y1")
    sent = a.astrid("sage", "send", "y1", "first turn", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: stored(cluster, "y1"), 10.0, "y1 replicated after its turn")
    ok_json(a, "sage", "spawn", "bob", "--session", "y2")  # y1 (idle) hibernates for it
    wait_for(lambda: local_rows(a)["y1"]["state"] == "hibernated", 10.0, "y1 hibernated")
    a.stop()  # stopped, not lost: nobody takes its sessions; it keeps them at its start
    a.launch()
    a.wait_ready(30.0)
    assert local_rows(a)["y1"]["state"] == "hibernated"
    wait_for(lambda: rows(daemons["c"]).get("y2", {}).get("node") == "a", 10.0, "y2 on a")

    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()

    def adopted(sid: str) -> tuple[str, dict[str, Any]] | None:
        for node in ("b", "c"):
            row = local_rows(daemons[node]).get(sid)
            if row is not None and row["state"] != "ended":
                return node, row
        return None

    _, y1 = wait_for(lambda: adopted("y1"), LOST_AFTER + 20.0, "y1 adopted")
    assert (y1["state"], y1.get("pid")) == ("hibernated", None), y1
    wait_for(lambda: adopted("y2"), 20.0, "y2 adopted")
