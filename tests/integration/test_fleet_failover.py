"""Failover: three supervisors over a real 3-server NATS cluster with the CLI double.

Every node has ``[sessions] resume = true``.  A session's transcript is replicated to
the ``sage_transcripts`` object store after each turn; SIGKILL its node and another
takes it (exactly one), restores the transcript under the principal's home there and
runs ``claude --resume`` on the same conversation under the same session id; the
node that comes back does not resume it.  A transcript that is a link out of the
home is never replicated.  The double writes no transcript of its own: the test puts
one where the real CLI would.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import anyio

from tests.support.daemon import Daemon, descendant_argvs
from tests.support.failover_fleet import (
    LOST_AFTER,
    argv_of,
    audit_rows,
    conversation_of,
    fleet,
    home_of,
    local_rows,
    ok_json,
    put_transcript,
    request,
    rows,
    stored,
    transcript_path,
)
from tests.support.nats_cluster import NatsCluster, wait_for

__all__ = ("fleet",)  # the module's fixture: its own cluster and nodes


def test_a_transcript_that_links_out_of_the_home_is_not_replicated(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = fleet
    b = daemons["b"]
    ok_json(b, "sage", "spawn", "alice", "--session", "h1")
    claude_session = conversation_of(rows(b)["h1"]["pid"])
    secret = b.root / "operator-secret"
    secret.write_bytes(b"the operator's secret\n")
    owner = home_of(b).stat()  # even a file the principal's uid owns: not by a link
    os.chown(secret, owner.st_uid, owner.st_gid)
    path = put_transcript(b, claude_session, b"x")
    path.unlink()
    path.symlink_to(secret)
    sent = b.astrid("sage", "send", "h1", "hello", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    wait_for(
        lambda: '"fleet.transcript_refused"' in b.log() and "h1" in b.log(),
        10.0,
        "b refuses the linked transcript",
    )
    assert stored(cluster, "h1") is None
    # the same session's transcript once it is a file of its own: replicated
    path.unlink()
    put_transcript(b, claude_session, b"mine\n")
    sent = b.astrid("sage", "send", "h1", "again", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: stored(cluster, "h1"), 10.0, "h1 replicated")
    ok_json(b, "sage", "stop", "h1")
    wait_for(lambda: stored(cluster, "h1") is None, 10.0, "h1's replica deleted at its end")


def test_adopting_and_reading_conversations_are_the_supervisors_alone(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """A principal cannot make a node adopt a session, read what a replica needs, or ask
    which sessions run elsewhere: those requests are the supervisor's own."""
    _, daemons = fleet
    b = daemons["b"]
    ok_json(b, "sage", "spawn", "alice", "--session", "p1")

    async def ask(topic: str, payload: Any) -> Any:
        from bus.client import BusClient

        async with BusClient.connect(
            b.socket, role="cli", name="test", principal="alice"
        ) as client:
            reply = await client.request(topic, payload, deadline=10.0)
            return json.loads(reply.payload)

    adopt = {
        "session_id": "p2",
        "principal_id": "alice",
        "claude_session": "0d7c6c2e-3a4f-4b8e-9c1d-2e3f4a5b6c7d",
        "from_node": "a",
    }
    for topic, payload in [
        ("sage.v1.request.adopt", adopt),
        ("sage.v1.request.conversation.p1", {}),
        ("sage.v1.request.fleet.claims", {"session_ids": ["p1"]}),
    ]:
        reply = anyio.run(ask, topic, payload)
        assert (reply["ok"], reply["error"]) == (False, "not_authorized"), (topic, reply)
    assert "p2" not in local_rows(b)
    assert request(b, "sage.v1.request.conversation.p1", {})["claude_session"]  # the admin's
    ok_json(b, "sage", "stop", "p1")


def test_a_killed_nodes_session_resumes_on_another_node(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    cluster, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    ok_json(a, "sage", "spawn", "alice", "--session", "f1")
    ok_json(a, "sage", "spawn", "bob", "--session", "g1")  # no turn: no transcript
    claude_session = conversation_of(rows(a)["f1"]["pid"])
    sent = a.astrid("sage", "send", "f1", "first turn", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    replica = wait_for(lambda: stored(cluster, "f1"), 10.0, "f1 replicated after its turn")
    data, meta = replica
    assert data == transcript_path(a, claude_session).read_bytes()  # the CLI wrote it
    assert b"first turn" in data
    assert (meta["claude_session"], meta["node"], meta["turns"]) == (claude_session, "a", 1)

    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()

    def adopted() -> str | None:
        row = rows(c).get("f1", {})
        node = row.get("node")
        return node if node in ("b", "c") and row.get("state") not in ("lost", "ended") else None

    adopter_name = wait_for(adopted, LOST_AFTER + 10.0, "f1 resumed on b or c")
    adopter = daemons[adopter_name]
    other = daemons["c" if adopter_name == "b" else "b"]
    # exactly one adopter, and it said so in its chain
    wait_for(
        lambda: audit_rows(adopter, "sage.v1.audit.session_failed_over"),
        5.0,
        "the adoption audited",
    )
    (row,) = [
        r
        for r in audit_rows(adopter, "sage.v1.audit.session_failed_over")
        if r["session_id"] == "f1"
    ]
    assert (row["session_id"], row["from_node"], row["node"]) == ("f1", "a", adopter_name)
    assert [
        r for r in audit_rows(other, "sage.v1.audit.session_failed_over") if r["session_id"] == "f1"
    ] == []
    assert "f1" not in local_rows(other)
    # the same conversation, restored under alice's home there, hers and private
    pid = local_rows(adopter)["f1"]["pid"]
    assert f"--resume={claude_session}" in argv_of(pid)
    restored = transcript_path(adopter, claude_session)
    assert restored.read_bytes() == data
    st = restored.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, home_of(adopter).stat().st_uid)
    assert "failover" in adopter.log()
    # bob's session: only c runs bob; with no transcript it starts afresh under its id
    wait_for(lambda: rows(c).get("g1", {}).get("node") == "c", 10.0, "g1 adopted by c")
    (bobs,) = [
        r
        for r in audit_rows(daemons["c"], "sage.v1.audit.session_failed_over")
        if r["session_id"] == "g1"
    ]
    assert (bobs["principal_id"], bobs["conversation"]) == ("bob", False)
    assert "g1" not in local_rows(daemons["b"])

    # send from c reaches it, wherever it runs
    sent = c.astrid(
        "sage", "send", "f1", "after failover", "--timeout", "20", "--principal", "alice"
    )
    assert sent.returncode == 0, sent.stderr
    assert "echo: after failover" in sent.stdout
    events = request(adopter, "sage.v1.request.session.f1", {"replay": 30})["events"]
    resumed = [e["data"] for e in events if e["event"] == "resumed"]
    assert resumed == [{"principal_id": "alice", "reason": "failover", "from_node": "a"}], events

    # a comes back: it does not resume f1 (another node runs it), it ends it failed_over
    a.launch()
    a.wait_ready(30.0)
    assert a.proc is not None
    local = local_rows(a)["f1"]
    assert (local["state"], local["reason"]) == ("ended", "failed_over")
    children = list(descendant_argvs(a.proc.pid).values())
    assert not any(f"--resume={claude_session}" in argv for argv in children), children
    assert rows(a)["f1"]["node"] == adopter_name  # the registry still names the adopter
    sent = a.astrid("sage", "send", "f1", "from a again", "--timeout", "20", "--principal", "alice")
    assert sent.returncode == 0, sent.stderr
    assert "echo: from a again" in sent.stdout
    assert local_rows(adopter)["f1"]["pid"] == pid
    ok_json(c, "sage", "stop", "f1", "--principal", "alice")  # wherever it runs (b or c)
    ok_json(c, "sage", "stop", "g1", "--principal", "bob")
    wait_for(lambda: stored(cluster, "f1") is None, 10.0, "f1's replica deleted at its end")


def test_a_session_that_ended_where_it_was_adopted_is_not_listed_lost(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """The lost node's entry outlives the session, whose claim names its adopter: once the
    adopter ended it, the listing must not show it again as the lost node's."""
    cluster, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    if a.proc is None or a.proc.poll() is not None:
        a.launch()
        a.wait_ready(30.0)
    ok_json(a, "sage", "spawn", "alice", "--session", "e1")
    sent = a.astrid("sage", "send", "e1", "a turn", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    wait_for(lambda: stored(cluster, "e1"), 10.0, "e1 replicated after its turn")
    a.signal(signal.SIGKILL)
    assert a.proc is not None
    a.proc.wait()
    try:
        wait_for(
            lambda: rows(c).get("e1", {}).get("node") in ("b", "c"),
            LOST_AFTER + 15.0,
            "e1 adopted by b or c",
        )
        ok_json(c, "sage", "stop", "e1", "--principal", "alice")
        assert "e1" not in rows(c), rows(c).get("e1")  # not 'lost' on a
        ended = {row["session_id"]: row for row in ok_json(c, "sage", "sessions", "--all")}
        assert ended.get("e1", {}).get("state") != "lost", ended.get("e1")
    finally:
        a.launch()
        a.wait_ready(30.0)
