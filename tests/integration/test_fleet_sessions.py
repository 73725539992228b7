"""Sessions anywhere: three supervisors over a real 3-server NATS cluster, the CLI double.

Each node is a real supervisor process with the session runner (the Claude Code
double, tests/support/fake_claude.py), its own state folder and socket; the NATS
users hold exactly the permissions ``astrid fleet permissions`` prints.  Every step
is the ``astrid`` CLI on some node's socket, as a user would type it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.as_uid import NOGROUP
from tests.support.daemon import ASTRID, Daemon, all_running, node_root, short_dir
from tests.support.failover_fleet import audit_rows
from tests.support.nats_cluster import NatsCluster, wait_for

NODES = ["a", "b", "c"]
HEARTBEAT = 0.4
LOST_AFTER = 1.5


ALICE_UID, BOB_UID, CAROL_UID, DAVE_UID = 65533, 65534, 65532, 65531

EXTRA = {
    # a: carol is a's alone; b may vouch for alice and bob only (not dave, whom b
    # declares too); c's admins are admins here
    "a": (
        '[fleet.peers.b]\nprincipals = ["alice", "bob"]\n[fleet.peers.c]\nadmins = true\n'
        f'[[principals]]\nname = "carol"\nuids = [{CAROL_UID}]\noperator_key = true\n'
        f'[[principals]]\nname = "dave"\nuids = [{DAVE_UID}]\noperator_key = true\n'
    ),
    "b": f'[[principals]]\nname = "dave"\nuids = [{DAVE_UID}]\noperator_key = true\n',
}


def node_config(cluster: NatsCluster, node: str) -> str:
    """The runner with the double; principals alice and bob, each a uid of its own (the
    test, an admin, acts for either with --principal); a and b have more (EXTRA)."""
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE_CLAUDE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        '[limits]\nstop_grace = 2.0\n[socket]\ngroup = "nogroup"\n'
        + cluster.fleet_section(node, heartbeat=HEARTBEAT, lost_after=LOST_AFTER)
        + f'[[principals]]\nname = "alice"\nuids = [{ALICE_UID}]\noperator_key = true\n'
        + f'[[principals]]\nname = "bob"\nuids = [{BOB_UID}]\noperator_key = true\n'
        + EXTRA.get(node, "")
    )


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    # "d" is a NATS user of the cluster with no supervisor: it may forward to b only
    with NatsCluster([*NODES, "d"], peers={"d": ["b"]}) as cluster:
        env = {"ANTHROPIC_API_KEY": "sk-double"}
        with all_running(
            {node: Daemon(node_root(), node_config(cluster, node), env=env) for node in NODES}
        ) as daemons:
            yield cluster, daemons


def astrid(daemon: Daemon, *args: str, principal: str = "alice") -> Any:
    result = daemon.astrid(*args, "--principal", principal, timeout=30.0)
    return result


def ok_json(daemon: Daemon, *args: str, principal: str = "alice") -> Any:
    result = astrid(daemon, *args, "--json", principal=principal)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return json.loads(result.stdout)


def rows(daemon: Daemon, principal: str = "alice") -> dict[str, dict[str, Any]]:
    return {
        row["session_id"]: row for row in ok_json(daemon, "sage", "sessions", principal=principal)
    }


def raw_request(daemon: Daemon, topic: str, payload: Any, principal: str) -> Any:
    """One request on ``daemon``'s socket acting for ``principal``, as any client may."""

    async def main() -> Any:
        from bus.client import BusClient

        async with BusClient.connect(
            daemon.socket, role="cli", name="test", principal=principal
        ) as client:
            reply = await client.request(topic, payload, deadline=10.0)
            return json.loads(reply.payload)

    return anyio.run(main)


def relayed_ids(watcher: Daemon, owner: Daemon, sid: str) -> tuple[list[int], list[int]]:
    """On ``watcher``'s socket: follow ``sid`` through the router while a turn is sent on
    ``owner``'s; the ids of the live envelopes a ring keeps (not a whole ``assistant``
    message: capsules/runner/history.py), and of a replay of the last three."""
    from capsules.runner.history import NOT_KEPT

    async def main() -> tuple[list[int], list[int]]:
        from bus.client import BusClient

        async with BusClient.connect(
            watcher.socket, role="cli", name="test", principal="alice"
        ) as client:
            events = await client.subscribe(f"sage.v1.event.{sid}.>")
            topic = f"sage.v1.request.fleet.session.{sid}"
            await client.request(topic, {"replay": 0}, deadline=10.0)
            result = await anyio.run_process(
                [*ASTRID, "sage", "send", sid, "numbered", *alice_on(owner)],
                check=False,
                env=owner.env,
            )
            assert result.returncode == 0, result.stderr
            ids = []
            with anyio.fail_after(10):
                async for envelope in events:
                    if envelope.topic.rsplit(".", 1)[-1] not in NOT_KEPT:
                        ids.append(envelope.id)
                    if envelope.topic.endswith(".done"):
                        break
            reply = await client.request(topic, {"replay": 3}, deadline=10.0)
            replay = [event["id"] for event in json.loads(reply.payload)["events"]]
            return ids, replay

    return anyio.run(main)


def read_events_until(proc: subprocess.Popen[str], name: str, within: float) -> list[Any]:
    """The JSON lines ``proc`` prints, up to the first event ``name`` (read in a thread)."""
    import queue
    import threading

    lines: queue.Queue[str] = queue.Queue()
    stdout = proc.stdout
    assert stdout is not None

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    events: list[Any] = []
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        events.append(json.loads(line))
        if events[-1]["event"] == name:
            return events
    raise AssertionError(f"no {name} event within {within} s: {events}")


def test_sessions_anywhere(fleet: tuple[NatsCluster, dict[str, Daemon]]) -> None:
    """Spawn on a from b's socket; send and watch from c; another principal on c finds
    nothing; the listing on every node shows the node; stop from b."""
    _, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]

    # docs/fleet.md's example as written: an admin names the principal, no --principal
    example = b.astrid("sage", "spawn", "alice", "--node", "a", "--session", "doc1")
    assert (example.returncode, example.stdout) == (0, "doc1\n"), example.stderr
    assert ok_json(b, "sage", "stop", "doc1")["ok"]
    spawned = ok_json(b, "sage", "spawn", "alice", "--node", "a", "--session", "s1")
    assert spawned["session_id"] == "s1"
    assert spawned["node"] == "a"
    pid = spawned["pid"]
    # it runs on a: a's own runner lists it (the local path, unchanged)
    assert rows(a)["s1"]["pid"] == pid

    # the registry is written from a's spawned event: every node finds it
    def listed_everywhere() -> bool:
        return all(rows(d).get("s1", {}).get("node") == "a" for d in daemons.values())

    wait_for(listed_everywhere, 15.0, "s1 listed with node a on every node")
    load = {
        n["node"]: n["sessions"]
        for n in json.loads(b.astrid("fleet", "status", "--json").stdout)["nodes"]
    }
    assert load == {"a": 1, "b": 0, "c": 0}, load  # from the registry
    table = astrid(c, "sage", "sessions")
    assert table.returncode == 0, table.stderr
    header, *lines = table.stdout.splitlines()
    assert header.split()[:2] == ["NODE", "SESSION"]
    assert any(line.split()[:2] == ["a", "s1"] for line in lines), table.stdout

    # send from c: the reply streams through c's socket
    sent = astrid(c, "sage", "send", "s1", "hello from c", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    assert "echo: hello from c" in sent.stdout  # the double echoes the turn

    # watch from c: replay of the earlier events
    watched = astrid(c, "sage", "watch", "s1", "--replay", "3", "-n", "3")
    assert watched.returncode == 0, watched.stderr
    events = [json.loads(line) for line in watched.stdout.splitlines()]
    assert len(events) == 3
    assert events[-1]["event"] == "done"
    # and live: a watch on c follows a turn sent on a's own socket
    watch = subprocess.Popen(
        [*ASTRID, "sage", "watch", "s1", "--principal", "alice", "--config", str(c.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=c.env,
    )
    try:
        wait_for(lambda: a.log().count('"verb": "session"') >= 2, 10.0, "the watch asked a")
        assert astrid(a, "sage", "send", "s1", "live turn", "--timeout", "20").returncode == 0
        live = read_events_until(watch, "done", 10.0)
    finally:
        watch.kill()
        watch.communicate()
    text = "".join(e["data"].get("delta", "") for e in live if e["event"] == "text")
    assert text == "echo: live turn", live
    # a replay through the router names the events by this bus's ids: a watch's dedupe
    # of replayed and live events holds across nodes
    live_ids, replayed = relayed_ids(c, a, "s1")
    assert len(replayed) == 3, replayed
    assert replayed == live_ids[-3:], (replayed, live_ids)

    # another principal on c: the same answer as for a session that is not there
    for verb in ("stop", "interrupt"):
        refused = astrid(c, "sage", verb, "s1", principal="bob")
        assert refused.returncode == 1
        assert "unknown_session" in refused.stderr, refused.stderr
    refused = astrid(c, "sage", "send", "s1", "hi", principal="bob")
    assert "unknown_session: no session 's1'" in refused.stderr
    assert "s1" not in rows(c, principal="bob")
    # a payload that names a principal changes nothing: only c's bus decides who asks
    forged = raw_request(
        c, "sage.v1.request.fleet.stop.s1", {"origin": "a", "principal": "alice"}, "bob"
    )
    assert forged["error"] == "unknown_session", forged
    # the principal crosses with the request: bob may not spawn for alice on a
    refused = astrid(b, "sage", "spawn", "alice", "--node", "a", principal="bob")
    assert refused.returncode == 1
    assert "not_authorized" in refused.stderr, refused.stderr

    # a keeps who vouched for whom: b spawned for alice, c sent for her; bob got nothing
    vouched = {
        (row["origin"], row["verb"], row["principal_id"], row["ok"])
        for row in audit_rows(a, "sage.v1.audit.fleet_request")
    }
    assert {("b", "spawn", "alice", True), ("c", "send", "alice", True)} <= vouched
    assert ("b", "spawn", "bob", False) in vouched
    # stop from b
    stopped = astrid(b, "sage", "stop", "s1")
    assert stopped.returncode == 0, stopped.stderr
    wait_for(lambda: "s1" not in rows(c), 15.0, "s1 gone from the listing")
    gone = astrid(c, "sage", "stop", "s1")
    assert gone.returncode == 1
    assert "unknown_session" in gone.stderr or "session_ended" in gone.stderr


def test_bad_routes_are_refused_before_any_subject(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """A node name or session id with wildcards or dots never reaches a NATS subject."""
    _, daemons = fleet
    b = daemons["b"]
    for bad in ("*", ">", "a.b", "a b"):
        result = astrid(b, "sage", "spawn", "alice", "--node", bad)
        assert result.returncode == 1
        assert f"bad_request: node {bad!r}: 1-64 of [A-Za-z0-9_-]" in result.stderr, result.stderr
    here = ok_json(b, "sage", "spawn", "alice", "--node", "b", "--session", "s0")
    assert (here["session_id"], here["node"]) == ("s0", "b")
    ok_json(b, "sage", "stop", "s0")
    result = astrid(b, "sage", "spawn", "alice", "--node", "nosuchnode")
    assert result.returncode == 1
    assert "fleet_unavailable" in result.stderr
    assert "'nosuchnode'" in result.stderr


def test_a_node_may_not_publish_on_a_peer_it_was_not_given(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """NATS user d may forward to b only: the server refuses its request to a, and its
    subscription to a's requests; a never sees it."""
    cluster, daemons = fleet
    ok_json(daemons["a"], "sage", "spawn", "alice", "--session", "s2")
    errors: list[str] = []

    async def main() -> None:

        async with cluster.client("d", errors=errors) as nc:
            payload = json.dumps({"principal": None, "payload": {}}).encode()
            await nc.publish("sage.fleet.a.request.d.stop.s2", payload, reply="_INBOX.d.x")
            await nc.subscribe("sage.fleet.a.request.>")
            await nc.flush()
            await anyio.sleep(0.5)

    anyio.run(main)
    assert any(
        "permissions violation for publish" in e.lower() and "sage.fleet.a.request" in e
        for e in errors
    ), errors
    assert any("permissions violation for subscription" in e.lower() for e in errors), errors
    assert rows(daemons["a"])["s2"]["state"] != "ended"  # not stopped
    assert not [
        line
        for line in daemons["a"].log().splitlines()
        if '"fleet.forwarded_in"' in line and '"s2"' in line
    ]
    ok_json(daemons["a"], "sage", "stop", "s2")


def test_a_node_may_not_name_another_as_the_origin(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """NATS user b publishes a request to a with c in the origin token: the server
    refuses it (b may publish only its own name there) and a never sees it; the same
    request with its own name reaches a."""
    cluster, daemons = fleet
    a = daemons["a"]
    ok_json(a, "sage", "spawn", "alice", "--session", "s11")
    errors: list[str] = []

    async def main() -> dict[str, Any]:

        async with cluster.client("b", errors=errors) as nc:
            payload = json.dumps({"principal": "alice", "payload": {}}).encode()
            await nc.publish("sage.fleet.a.request.c.session.s11", payload, reply="_INBOX.b.x")
            await nc.flush()
            await anyio.sleep(0.5)
            own = await nc.request("sage.fleet.a.request.b.session.s11", payload, timeout=5.0)
            answer: dict[str, Any] = json.loads(own.data)
            return answer

    answer = anyio.run(main)
    assert any(
        "permissions violation for publish" in e.lower() and "sage.fleet.a.request.c." in e
        for e in errors
    ), errors
    assert answer["ok"] is True, answer  # b's own name: a answers
    forwarded = [line for line in a.log().splitlines() if '"fleet.forwarded_in"' in line]
    assert not [line for line in forwarded if '"origin": "c"' in line and '"s11"' in line]
    assert [line for line in forwarded if '"origin": "b"' in line and '"s11"' in line]
    ok_json(a, "sage", "stop", "s11")


def raw_node_request(cluster: NatsCluster, node: str, subject: str, principal: str | None) -> Any:
    """One forwarded request as NATS user ``node`` would publish it (no supervisor), its
    answer."""

    async def main() -> Any:

        async with cluster.client(node) as nc:
            payload = json.dumps({"principal": principal, "payload": {}}).encode()
            return json.loads((await nc.request(subject, payload, timeout=5.0)).data)

    return anyio.run(main)


def test_a_node_may_act_only_for_the_principals_it_authenticates(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Node b claiming carol (a's principal, not among b's): refused and audited on a.
    dave, whom b declares but a's [fleet.peers.b] does not pin: refused. An admin on b:
    refused (its listing says so); an admin on c ([fleet.peers.c] admins = true): taken."""
    cluster, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    ok_json(a, "sage", "spawn", "carol", "--session", "s12", principal="carol")
    ok_json(a, "sage", "spawn", "dave", "--session", "s13", principal="dave")

    def registered() -> bool:  # c's admins may list a's sessions (admins = true there)
        listing = c.astrid("sage", "sessions", "--json")
        return {"s12", "s13"} <= {r["session_id"] for r in json.loads(listing.stdout or "[]")}

    wait_for(registered, 15.0, "s12 and s13 in the registry")

    # b's own user, with b's own name as the origin, claims carol: no
    claimed = raw_node_request(cluster, "b", "sage.fleet.a.request.b.stop.s12", "carol")
    assert claimed["error"] == "principal_not_authenticated", claimed
    assert "node 'b' does not authenticate principal 'carol'" in claimed["message"]
    # b declares dave, but a takes only alice and bob from b
    pinned = astrid(b, "sage", "stop", "s13", principal="dave")
    assert pinned.returncode == 1
    assert "principal_not_authenticated" in pinned.stderr, pinned.stderr
    assert "[fleet.peers.b] principals" in pinned.stderr
    # an admin on b is not an admin on a
    admin = b.astrid("sage", "stop", "s12")
    assert admin.returncode == 1
    assert "principal_not_authenticated" in admin.stderr, admin.stderr
    assert "admins = true" in admin.stderr
    listing = b.astrid("sage", "sessions")
    assert listing.returncode == 0, listing.stderr
    assert "node 'a' refused: principal_not_authenticated" in listing.stderr
    assert all(r["state"] != "ended" for r in rows(a, principal="carol").values())
    assert rows(a, principal="dave")["s13"]["state"] != "ended"

    refused = audit_rows(a, "sage.v1.audit.fleet_principal_rejected")
    seen = {(r["origin"], r["principal_id"], r["verb"], r["session_id"]) for r in refused}
    assert {
        ("b", "carol", "stop", "s12"),
        ("b", "dave", "stop", "s13"),
        ("b", None, "stop", "s12"),
        ("b", None, "sessions", None),
    } <= seen, seen
    (row,) = [r for r in refused if r["principal_id"] == "carol"]
    assert row["subject"] == "sage.fleet.a.request.b.stop.s12"
    assert set(row) == {"origin", "principal_id", "verb", "session_id", "subject", "reason"}
    # nothing was done for them: no forwarded request of b's is in a's chain for these
    done = audit_rows(a, "sage.v1.audit.fleet_request")
    assert not [r for r in done if r["session_id"] in ("s12", "s13") and r["origin"] == "b"]

    # c's admins are a's admins: an admin on c stops carol's session
    stopped = c.astrid("sage", "stop", "s12")
    assert stopped.returncode == 0, stopped.stderr
    ok_json(a, "sage", "stop", "s13", principal="dave")


def test_concurrent_watchers_share_one_relay(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Four requests for a remote session's events at once, then a send: each event is
    republished once (one NATS subscription for the session, not one per request)."""
    _, daemons = fleet
    a, b = daemons["a"], daemons["b"]
    ok_json(b, "sage", "spawn", "alice", "--session", "s40")

    async def main() -> tuple[dict[str, Any], dict[str, int]]:
        from bus.client import BusClient

        async with BusClient.connect(a.socket, role="cli", name="t", principal="alice") as client:
            events = await client.subscribe("sage.v1.event.s40.>")
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(client.request, "sage.v1.request.fleet.session.s40", {})
            topic = "sage.v1.request.fleet.send.s40"
            reply = json.loads((await client.request(topic, {"text": "hi"}, deadline=20)).payload)
            counts: dict[str, int] = {}
            with anyio.move_on_after(2.0):  # the done, then time for any copy of it
                async for envelope in events:
                    name = envelope.topic.rsplit(".", 1)[1]
                    counts[name] = counts.get(name, 0) + 1
            return reply, counts

    reply, counts = anyio.run(main)
    assert reply["ok"], reply
    assert counts.get("done") == 1, counts
    assert all(n == 1 for name, n in counts.items() if name not in ("text", "usage")), counts
    ok_json(b, "sage", "stop", "s40")


def test_a_relayed_event_of_another_principal_is_dropped(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Node b (its own NATS user, so the server lets it) publishes an approval_request
    for alice's session s41 as bob: a's relay drops it (logged once) and relays alice's."""
    cluster, daemons = fleet
    a, b = daemons["a"], daemons["b"]
    ok_json(b, "sage", "spawn", "alice", "--session", "s41")

    async def main() -> tuple[list[str], list[str]]:
        from bus.client import BusClient

        def event(principal: str, payload: Any) -> bytes:
            return json.dumps({"principal": principal, "ts": 1.0, "payload": payload}).encode()

        async with (
            cluster.client("b") as nc,
            BusClient.connect(a.socket, role="cli", name="t", principal="alice") as alice,
            BusClient.connect(a.socket, role="cli", name="t", principal="bob") as bob,
        ):
            alice_events = await alice.subscribe("sage.v1.event.s41.>")
            bob_events = await bob.subscribe("sage.v1.event.s41.>")
            reply = await alice.request("sage.v1.request.fleet.session.s41", {})
            assert json.loads(reply.payload)["ok"], reply.payload
            forged = event("bob", {"call_id": "c1", "tool_name": "rm"})
            for _ in range(2):
                await nc.publish("sage.fleet.b.event.s41.approval_request", forged)
            await nc.publish("sage.fleet.b.event.s41.text", event("alice", {"text": "m"}))
            await nc.flush()
            seen: list[str] = []
            with anyio.fail_after(5.0):
                async for envelope in alice_events:
                    seen.append(envelope.topic)
                    if envelope.topic.endswith(".text"):
                        break
            leaked: list[str] = []
            with anyio.move_on_after(0.5):
                async for envelope in bob_events:
                    leaked.append(envelope.topic)
            return seen, leaked

    seen, leaked = anyio.run(main)
    assert "sage.v1.event.s41.text" in seen, seen
    forged = "sage.v1.event.s41.approval_request"
    assert forged not in seen, seen
    assert forged not in leaked, leaked

    def dropped_lines() -> list[str]:
        return [line for line in a.log().splitlines() if "fleet.relayed_event_dropped" in line]

    wait_for(lambda: bool(dropped_lines()), 15.0, "the dropped event logged")
    dropped = dropped_lines()
    assert len(dropped) == 1, dropped
    assert '"s41"' in dropped[0]
    assert '"bob"' in dropped[0]
    ok_json(b, "sage", "stop", "s41")


ASK = '/fault ask mcp__sage__greet {"name":"Ada"}'


def alice_on(daemon: Daemon) -> list[str]:
    return ["--principal", "alice", "--config", str(daemon.config)]


def test_an_approval_is_answered_from_another_node(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """A tool call of a session on a waits (send --approve ask on a); b lists it with its
    node; bob on b cannot approve it; an admin on c does (a takes c's admins), though b,
    which does not, may refuse c first."""
    _, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    ok_json(a, "sage", "spawn", "alice", "--session", "s8")
    send = subprocess.Popen(
        [*ASTRID, "sage", "send", "s8", ASK, "--approve", "ask", *alice_on(a)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=a.env,
    )
    try:

        def pending() -> list[Any]:
            found: list[Any] = ok_json(b, "sage", "approvals")
            return found

        (row,) = wait_for(pending, 10.0, "b lists the approval waiting on a")
        assert (row["node"], row["session_id"], row["tool_name"]) == ("a", "s8", "mcp__sage__greet")
        assert ok_json(b, "sage", "approvals", principal="bob") == []
        refused = astrid(b, "sage", "approve", row["approval_id"], principal="bob")
        assert refused.returncode == 1
        assert "unknown_approval" in refused.stderr, refused.stderr
        approved = c.astrid("sage", "approve", row["approval_id"])
        assert approved.returncode == 0, approved.stderr
        assert approved.stdout == "allowed: mcp__sage__greet in session s8\n"
        out, err = send.communicate(timeout=15)
    finally:
        send.kill()
        send.communicate()
    assert (send.returncode, out) == (0, "allowed\n"), err
    ok_json(a, "sage", "stop", "s8")


def test_a_send_on_another_node_is_the_approver(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """send --approve ask on c for a session on a: the call waits for an answer (c's
    router stands in as the approver on a) and one from b allows it; --approve deny
    (no approver anywhere) is denied at once, as on one node."""
    _, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    ok_json(a, "sage", "spawn", "alice", "--session", "s9")
    wait_for(lambda: "s9" in rows(c), 15.0, "s9 listed on c")
    denied = astrid(c, "sage", "send", "s9", ASK)  # off a terminal: deny
    assert denied.stdout == "denied: no approver is listening\n", denied.stderr
    send = subprocess.Popen(
        [*ASTRID, "sage", "send", "s9", ASK, "--approve", "ask", *alice_on(c)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=c.env,
    )
    try:
        (row,) = wait_for(lambda: ok_json(b, "sage", "approvals"), 10.0, "the call waits")
        assert (row["node"], row["session_id"]) == ("a", "s9")
        approved = astrid(b, "sage", "approve", row["approval_id"])
        assert approved.returncode == 0, approved.stderr
        out, err = send.communicate(timeout=15)
    finally:
        send.kill()
        send.communicate()
    assert (send.returncode, out) == (0, "allowed\n"), err
    assert "[approval] waiting: `astrid sage approve" in err
    ok_json(a, "sage", "stop", "s9")


def astrid_as(uid: int, daemon: Daemon, *args: str) -> dict[str, Any]:
    """``astrid sage ARGS`` as ``uid`` (no admin, no --principal: its own principal): the
    CLI's own code in a forked child (other uids cannot start this interpreter)."""
    import grp  # noqa: F401 - what the CLI imports late, loaded while the stdlib is ours
    import pwd  # noqa: F401
    import urllib.parse  # noqa: F401

    import sage.cli

    sage.cli.build_parser()  # imports every command module

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(out_r)
            os.close(err_r)
            os.setgroups([])
            os.setgid(NOGROUP)
            os.setuid(uid)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - pytest's capture is not ours
            sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
            code = sage.cli.main(["sage", *args, "--config", str(daemon.config)])
        except BaseException as exc:
            os.write(2, f"child: {exc!r}\n".encode())
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    os.close(out_w)
    os.close(err_w)
    with os.fdopen(out_r) as out, os.fdopen(err_r) as err:
        found = {"out": out.read(), "err": err.read()}
    _, status = os.waitpid(pid, 0)
    return {"code": os.waitstatus_to_exitcode(status), **found}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as two other uids")
def test_real_users_on_another_node(fleet: tuple[NatsCluster, dict[str, Daemon]]) -> None:
    """Real uids on c's socket, not admins: alice's send to her session on a streams
    back to her; bob's stop of it and his listing find nothing."""
    _, daemons = fleet
    a, c = daemons["a"], daemons["c"]
    ok_json(a, "sage", "spawn", "alice", "--session", "s10")
    wait_for(lambda: "s10" in rows(c), 15.0, "s10 listed on c")
    sent = astrid_as(ALICE_UID, c, "send", "s10", "as myself", "--timeout", "20")
    assert (sent["code"], sent["out"]) == (0, "echo: as myself\n"), sent["err"]
    listed = astrid_as(ALICE_UID, c, "sessions", "--json")
    assert [(r["session_id"], r["node"]) for r in json.loads(listed["out"])] == [("s10", "a")]
    stop = astrid_as(BOB_UID, c, "stop", "s10")
    assert (stop["code"], stop["err"]) == (1, "astrid: unknown_session: no session 's10'\n")
    assert json.loads(astrid_as(BOB_UID, c, "sessions", "--json")["out"]) == []
    assert rows(a)["s10"]["state"] != "ended"
    stopped = astrid_as(ALICE_UID, c, "stop", "s10")
    assert stopped["code"] == 0, stopped["err"]


def test_a_killed_node_shows_its_sessions_lost(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """SIGKILL c with a session: the other nodes list it lost, with its node; requests
    for it say fleet_unavailable; their own sessions go on."""
    _, daemons = fleet
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    ok_json(c, "sage", "spawn", "alice", "--session", "s3")
    ok_json(b, "sage", "spawn", "alice", "--session", "s4")
    wait_for(lambda: rows(a).get("s3", {}).get("node") == "c", 15.0, "s3 listed on a")
    c.signal(signal.SIGKILL)
    c.proc.wait()  # type: ignore[union-attr]
    wait_for(lambda: rows(a).get("s3", {}).get("state") == "lost", LOST_AFTER + 4, "s3 lost")
    row = rows(b)["s3"]
    assert (row["node"], row["state"]) == ("c", "lost")
    assert rows(b)["s4"]["state"] not in ("lost", "ended")
    result = astrid(a, "sage", "stop", "s3")
    assert result.returncode == 1
    assert "fleet_unavailable" in result.stderr, result.stderr
    ok_json(b, "sage", "stop", "s4")


def test_with_nats_gone_a_node_loses_its_lease_and_takes_its_sessions_back_after(
    fleet: tuple[NatsCluster, dict[str, Daemon]],
) -> None:
    """Every NATS server killed: no heartbeat renews a's lease, so a fences its own
    session (its child killed, the session hibernated: another node could adopt it
    meanwhile) and starts no child, a request for b's session answers
    fleet_unavailable, the listing shows a's sessions with a warning.  NATS back: the
    lease is back, the session wakes on a send, a spawn starts, b reaches it."""
    cluster, daemons = fleet
    a, b = daemons["a"], daemons["b"]
    ok_json(a, "sage", "spawn", "alice", "--session", "s5")
    ok_json(b, "sage", "spawn", "alice", "--session", "s6")
    wait_for(lambda: "s6" in rows(a), 15.0, "s6 listed on a")
    cluster.kill_all()
    wait_for(lambda: '"fleet.disconnected"' in a.log(), 10.0, "a sees NATS gone")
    wait_for(lambda: a.log_events("fleet.lease_lost"), 20.0, "a's lease lost")
    wait_for(lambda: rows(a).get("s5", {}).get("state") == "hibernated", 10.0, "s5 fenced")
    sent = astrid(a, "sage", "send", "s5", "still here", "--timeout", "20")
    assert sent.returncode == 1
    assert "fleet_lease_lost" in sent.stderr, sent.stderr
    remote = astrid(a, "sage", "send", "s6", "hello")
    assert remote.returncode == 1
    assert "fleet_unavailable" in remote.stderr, remote.stderr
    assert "NATS is not connected" in remote.stderr
    listing = astrid(a, "sage", "sessions")
    assert listing.returncode == 0, listing.stderr
    assert "s5" in listing.stdout
    assert "s6" not in listing.stdout
    assert "this node's sessions only: NATS is not connected" in listing.stderr
    refused = astrid(a, "sage", "spawn", "alice", "--session", "s7")
    assert refused.returncode == 1
    assert "fleet_lease_lost" in refused.stderr, refused.stderr
    for index in range(cluster.size):
        cluster.launch(index)
    cluster.wait_meta_leader()
    wait_for(lambda: a.log_events("fleet.lease_regained"), 30.0, "a's lease back")
    sent = astrid(a, "sage", "send", "s5", "back", "--timeout", "20")
    assert sent.returncode == 0, sent.stderr
    assert "echo: back" in sent.stdout  # woken with --resume: its conversation goes on
    ok_json(a, "sage", "stop", "s5")
    ok_json(a, "sage", "spawn", "alice", "--session", "s7")

    def sent_from_b() -> bool:
        result = astrid(b, "sage", "send", "s7", "back again", "--timeout", "10")
        return result.returncode == 0 and "echo: back again" in result.stdout

    wait_for(sent_from_b, 15.0, "b reaches s7 through the registry")
    ok_json(b, "sage", "stop", "s7")


def test_without_a_fleet_nothing_changes() -> None:
    """A single host: the runner's answers stand, --node says there is no fleet, the
    listing has no node column."""
    uid = os.getuid()
    config = (
        f'capsules = ["runner"]\n[claude]\nbinary = "{FAKE_CLAUDE}"\n'
        f'[[principals]]\nname = "alice"\nuids = [{uid}]\noperator_key = true\n'
    )
    daemon = Daemon(short_dir(), config, env={"ANTHROPIC_API_KEY": "sk-double"}).start()
    try:
        result = daemon.astrid("sage", "spawn", "alice", "--node", "a")
        assert (result.returncode, result.stderr) == (
            1,
            "astrid: not_in_fleet: this supervisor is not in a fleet (its config has no [fleet])\n",
        )
        result = daemon.astrid("sage", "stop", "nope")
        assert (result.returncode, result.stderr) == (
            1,
            "astrid: unknown_session: no session 'nope'\n",
        )
        assert daemon.astrid("sage", "spawn", "alice", "--session", "here").returncode == 0
        listing = daemon.astrid("sage", "sessions")
        assert listing.returncode == 0, listing.stderr
        assert listing.stdout.startswith("SESSION ")
        assert "here" in listing.stdout
    finally:
        daemon.stop()
