"""Sessions anywhere: a send routed through another node against a local one, and
events relayed across nodes, with the CLI double (tests/support/fake_claude.py).

The rig is the fleet's integration test's (tests/integration/test_fleet_sessions.py):
a real 3-server NATS cluster with JetStream (tests/support/nats_cluster.py, the
pinned ``nats-server``), and two real supervisors, nodes ``a`` and ``c``, each with
the session runner, its own state folder and socket, and the NATS user
``astrid fleet permissions`` prints.  Every session lives on ``a``; one bus client
sits on each node's socket, acting for alice as the CLI does.

(a) Routed against local.  One session on ``a``; both clients subscribe to its
    events for the whole run (as ``astrid sage send`` does before it sends; c's
    router keeps its relay open while c's client is subscribed).  Rounds
    alternate a turn sent on a's socket (``sage.v1.request.send.<sid>``, the local
    path) and one sent on c's, the way the CLI sends: :func:`call_session`, which
    asks the local runner and ``sage.v1.request.fleet.send`` at once; the runner
    says ``unknown_session`` and c's router forwards over NATS to a's.  Each is
    timed from the request to the reply, and to the turn's ``done`` event as that
    client sees it (for c, relayed back over NATS).  A third turn a round, on c's
    socket too, asks c's router alone (``sage.v1.request.fleet.send``): on the
    console only, it shows what the runner's ask beside it costs.  A fourth, on
    a's socket, is the CLI's way for a local session (:func:`call_session`: the
    runner answers, the router's ask beside it is not awaited): it must be as fast
    as the plain local send.  Both clients read every turn's events, so every path
    runs under the same load.  p50 and p90 of each; the table has the p50 of the
    CLI's way with the local p50 as reference (ratio) and the overhead (goal <= 2
    ms, the issue's).

(b) Events across nodes.  A session on ``a`` gets bursts of ``BURST`` turns sent
    at once on a's socket, queued by the session; the double answers each with
    three ``text`` deltas (the runner passes ``--include-partial-messages``; the
    double cuts any reply into at most three), then ``done``.  Both clients watch
    the same bursts (c's relay opened with ``sage.v1.request.fleet.session``, as
    ``astrid sage watch`` does); each counts the events it sees from the first
    send to the burst's last ``done``: events per second for each watcher, and
    c's against a's.  The session produces them as fast as it can, so a's figure
    is the producer's rate and c's says whether the relay keeps up with it; the
    two must see the very same events.

(c) Failover.  Another rig with the default ``heartbeat`` (2 s) and ``lost_after``
    (6 s), ``[sessions] resume = true`` and three nodes a, b, c.  Each of
    ``KILLS`` rounds spawns a session on ``a``, puts a transcript where the real
    CLI would (about 100 KiB; the double writes none), sends a turn and waits for
    its replica in the ``sage_transcripts`` object store; then SIGKILLs ``a`` and
    times, from the kill, the session's ``init`` on whichever of b and c adopts
    it (its ``resumed`` with reason ``failover`` comes first).  ``a`` starts
    again between rounds (and ends the session ``failed_over``).  The figure is
    bounded below by ``lost_after`` less the age of a's last heartbeat: the loss
    must first be seen (goal <= 10 s).

(d) The listing at scale, on the first rig after (b). ``LISTED`` registry claims of
    sessions of ``SILENT`` nodes that stopped (their records and claims put by the
    admin, as those nodes would have left them; no supervisor runs for them), then
    ``astrid sage sessions --json`` on a, whose router takes the silent nodes' rows from
    its registry copy, and on c, whose router reads the bucket key by key
    (``ASTRID_TEST_LISTING_FROM_BUCKET=1`` in c's environment, a test-only hook; nothing
    else of c changes), alternating, ``LISTING_ROUNDS`` of each: the CLI's whole run (a
    new process each), and the listing request alone on a bus client
    (``sage.v1.request.fleet.sessions``). p50 of each and the bucket's against the
    copy's. Both must list the same rows (every claim, unless the bucket's read runs out
    of its 3 s deadline: then said).

Every process started here is stopped and checked gone, also on failure: the
supervisors' children (by their socket in the environment) and the NATS servers.
"""

from __future__ import annotations

import contextlib
import json
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

from bus.client import BusClient, RemoteSubscription
from sage.cli._common import call_runner
from sage.cli.sage_cmd import call_session
from sage.contract.sessions import FLEET_SESSIONS_TOPIC as LISTING
from sage.fleet.listing import LISTING_FROM_BUCKET
from sage.fleet.nodes import NodeRecord
from sage.fleet.permissions import BUCKET
from sage.fleet.routes import REGISTRY, SessionEntry, registry_key
from tests.bench.bench_sessions import FAKE, _reap_leftovers, _remove
from tests.bench.report import Report, percentile
from tests.support.daemon import Daemon, node_root, short_dir
from tests.support.failover_fleet import put_transcript
from tests.support.nats_cluster import JS_TIMEOUT, NatsCluster, stored_transcript

NODES = ("a", "c")
ROUNDS = 100  # of each path, alternating
WARMUP = 5
BURSTS = 5
BURST = 1000  # turns sent back to back, queued by the session
ALICE_UID = 65533
DEADLINE = 30.0
LISTED = 3000  # registry claims of sessions on nodes that stopped
SILENT = 3  # those nodes
LISTING_ROUNDS = 10  # of each path, alternating
FROM_BUCKET = "c"  # the node whose listing reads the bucket (a's reads its copy)


def _config(cluster: NatsCluster, node: str) -> str:
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        '[limits]\nstop_grace = 2.0\n[socket]\ngroup = "nogroup"\n'
        + cluster.fleet_section(node, heartbeat=None, lost_after=None)
        + f'[[principals]]\nname = "alice"\nuids = [{ALICE_UID}]\noperator_key = true\n'
    )


@contextlib.contextmanager
def _nodes(
    nodes: Sequence[str],
    config: Callable[[NatsCluster, str], str],
    root: Callable[[], Path],
    extra_env: Callable[[str], dict[str, str]] = lambda node: {},
) -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    """A cluster and one supervisor per node (its config, in a folder from ``root``, with
    ``extra_env(node)`` in its environment); all stopped, reaped and checked gone after."""
    with NatsCluster(list(nodes)) as cluster:
        daemons: dict[str, Daemon] = {}
        try:
            for node in nodes:
                env = {"ANTHROPIC_API_KEY": "sk", **extra_env(node)}
                daemons[node] = Daemon(root(), config(cluster, node), env=env)
                daemons[node].launch()
            for daemon in daemons.values():
                daemon.wait_ready(30.0)
            yield cluster, daemons
        finally:
            left: list[int] = []
            for daemon in daemons.values():
                daemon.stop()
                left += anyio.run(_reap_leftovers, daemon.root)
                _remove(daemon.root)
            servers = list(cluster.procs)
    alive = [p.pid for p in servers if p is not None and p.poll() is None]
    if left or alive:
        raise RuntimeError(f"outlived the bench: claude doubles {left}, nats-servers {alive}")


@contextlib.contextmanager
def _fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    """Nodes a and c (alice's uid reaches their sockets through node_root); c's fleet
    listing reads the bucket, a's its registry copy."""

    def extra_env(node: str) -> dict[str, str]:
        return {LISTING_FROM_BUCKET: "1"} if node == FROM_BUCKET else {}

    with _nodes(NODES, _config, node_root, extra_env) as fleet:
        yield fleet


def _client(daemon: Daemon) -> contextlib.AbstractAsyncContextManager[BusClient]:
    return BusClient.connect(daemon.socket, role="cli", name="bench", principal="alice")


async def _until_done(
    events: RemoteSubscription, kinds: Counter[str] | None = None
) -> tuple[float, int]:
    """(when the next ``done`` arrived, events seen up to it); ``kinds`` counts them."""
    seen = 0
    with anyio.fail_after(DEADLINE):
        while True:
            envelope = await events.get()
            seen += 1
            name = envelope.topic.rsplit(".", 1)[1]
            if kinds is not None:
                kinds[name] += 1
            if name == "done":
                return time.perf_counter(), seen
            if name in ("exited", "error"):
                raise RuntimeError(f"the session ended: {envelope.topic} {envelope.payload!r}")


async def _turn(
    sender: BusClient,
    path: str,
    sid: str,
    text: str,
    mine: RemoteSubscription,
    other: RemoteSubscription,
) -> tuple[float, float, int, int]:
    """One turn: (s to the reply, s to the sender's ``done``, events the sender's and
    the other client's subscriptions saw)."""
    t0 = time.perf_counter()
    payload = {"text": text}
    if path in ("routed", "local_cli"):  # as the CLI does (sage.cli.sage_cmd.call_session)
        reply = await call_session(sender, "send", sid, payload, DEADLINE)
    elif path == "direct":  # the router alone (the runner's unknown_session not asked)
        reply = await call_runner(sender, f"sage.v1.request.fleet.send.{sid}", payload, DEADLINE)
    else:
        reply = await call_runner(sender, f"sage.v1.request.send.{sid}", payload, DEADLINE)
    t_reply = time.perf_counter() - t0
    if not reply.get("ok", True):
        raise RuntimeError(f"send failed: {reply}")
    t_done, n_mine = await _until_done(mine)
    _, n_other = await _until_done(other)
    return t_reply, t_done - t0, n_mine, n_other


async def _spawn(client: BusClient, sid: str) -> None:
    payload = {"principal_id": "alice", "session_id": sid}
    await call_runner(client, "sage.v1.request.spawn", payload, DEADLINE)


async def _routed_vs_local(daemons: dict[str, Daemon], report: Report) -> None:
    sid = "routed"
    async with _client(daemons["a"]) as on_a, _client(daemons["c"]) as on_c:
        ev_a = await on_a.subscribe(f"sage.v1.event.{sid}.>")
        ev_c = await on_c.subscribe(f"sage.v1.event.{sid}.>")
        await _spawn(on_a, sid)
        # the registry is written from a's spawned event: wait until c's router finds it
        with anyio.fail_after(DEADLINE):
            while True:
                try:
                    await call_session(on_c, "send", sid, {"text": "warm"}, DEADLINE)
                    break
                except Exception as exc:  # unknown_session until the registry has it
                    if "unknown_session" not in str(exc):
                        raise
                    await anyio.sleep(0.05)
        await _until_done(ev_c)
        await _until_done(ev_a)
        for _ in range(WARMUP):
            await _turn(on_a, "local", sid, "warm", ev_a, ev_c)
            await _turn(on_a, "local_cli", sid, "warm", ev_a, ev_c)
            await _turn(on_c, "routed", sid, "warm", ev_c, ev_a)
            await _turn(on_c, "direct", sid, "warm", ev_c, ev_a)
        local: list[tuple[float, float]] = []
        local_cli: list[tuple[float, float]] = []
        routed: list[tuple[float, float]] = []
        direct: list[tuple[float, float]] = []
        for i in range(ROUNDS):
            r_local = await _turn(on_a, "local", sid, f"local {i}", ev_a, ev_c)
            r_cli = await _turn(on_a, "local_cli", sid, f"local cli {i}", ev_a, ev_c)
            r_routed = await _turn(on_c, "routed", sid, f"routed {i}", ev_c, ev_a)
            r_direct = await _turn(on_c, "direct", sid, f"direct {i}", ev_c, ev_a)
            local.append(r_local[:2])
            local_cli.append(r_cli[:2])
            routed.append(r_routed[:2])
            direct.append(r_direct[:2])
            if any(r[2] != r[3] for r in (r_local, r_cli, r_routed, r_direct)):
                raise RuntimeError(f"round {i}: the two clients saw different events")
        await call_runner(on_a, f"sage.v1.request.stop.{sid}", {}, DEADLINE)

    def ms(values: list[float], q: float) -> float:
        return (statistics.median(values) if q == 0.5 else percentile(values, q)) * 1e3

    figures = {}
    for what, k in (("reply", 0), ("done", 1)):
        lo, ro, do, lc = ([r[k] for r in rs] for rs in (local, routed, direct, local_cli))
        figures[what] = (ms(lo, 0.5), ms(lo, 0.9), ms(ro, 0.5), ms(ro, 0.9))
        print(
            f"  fleet: send to {what}: local, the CLI's way (call_session on the owner's"
            f" socket) p50 {ms(lc, 0.5):.2f} ms p90 {ms(lc, 0.9):.2f} ms",
            flush=True,
        )
        print(
            f"  fleet: send to {what}: the router asked straight (no local runner first)"
            f" p50 {ms(do, 0.5):.2f} ms p90 {ms(do, 0.9):.2f} ms",
            flush=True,
        )
        print(
            f"  fleet: send to {what}, {ROUNDS} rounds: local p50 {figures[what][0]:.2f} ms"
            f" p90 {figures[what][1]:.2f} ms; routed through c p50 {figures[what][2]:.2f} ms"
            f" p90 {figures[what][3]:.2f} ms; p50 overhead"
            f" {figures[what][2] - figures[what][0]:.2f} ms",
            flush=True,
        )
    lc50 = ms([r[0] for r in local_cli], 0.5)
    report.add(
        "fleet",
        "send to reply, local the CLI's way p50",
        lc50,
        "ms",
        reference=figures["reply"][0],
        reference_name="local send",
        goal="no slower than the local send (the fleet is asked beside the runner)",
        higher_is_better=False,
    )
    for what in ("reply", "done"):
        l50, _, r50, r90 = figures[what]
        report.add(
            "fleet",
            f"send to {what}, routed via another node p50",
            r50,
            "ms",
            reference=l50,
            reference_name="local send",
            goal=f"overhead {r50 - l50:.2f} ms (<= 2 ms); p90 {r90:.1f}",
            higher_is_better=False,
        )


async def _events_across(daemons: dict[str, Daemon], report: Report) -> None:
    sid = "stream"
    counts = {"a": 0, "c": 0}
    spans = {"a": 0.0, "c": 0.0}
    kinds: dict[str, Counter[str]] = {"a": Counter(), "c": Counter()}
    async with _client(daemons["a"]) as on_a, _client(daemons["c"]) as on_c:
        ev_a = await on_a.subscribe(f"sage.v1.event.{sid}.>")
        ev_c = await on_c.subscribe(f"sage.v1.event.{sid}.>")
        await _spawn(on_a, sid)
        # c's watch: its router relays a's events while c's client is subscribed
        with anyio.fail_after(DEADLINE):
            while True:
                try:
                    topic = f"sage.v1.request.fleet.session.{sid}"
                    await call_runner(on_c, topic, {"replay": 0}, DEADLINE)
                    break
                except Exception as exc:  # unknown_session until the registry has it
                    if "unknown_session" not in str(exc):
                        raise
                    await anyio.sleep(0.05)
        await _turn(on_a, "local", sid, "warm", ev_a, ev_c)
        for i in range(BURSTS):
            results: dict[str, tuple[float, int]] = {}
            async with anyio.create_task_group() as tg:
                t0 = time.perf_counter()
                tg.start_soon(_watch_burst, "a", ev_a, results, kinds["a"])
                tg.start_soon(_watch_burst, "c", ev_c, results, kinds["c"])
                topic = f"sage.v1.request.send.{sid}"
                for j in range(BURST):  # all at once, queued behind each other by the session
                    payload = {"text": f"burst {i} turn {j}"}
                    tg.start_soon(call_runner, on_a, topic, payload, DEADLINE)
            for node in ("a", "c"):
                counts[node] += results[node][1]
                spans[node] += results[node][0] - t0
            print(
                f"  fleet: burst {i + 1}/{BURSTS} of {BURST} turns: a saw {results['a'][1]}"
                f" events in {(results['a'][0] - t0) * 1e3:.0f} ms, c {results['c'][1]} in"
                f" {(results['c'][0] - t0) * 1e3:.0f} ms",
                flush=True,
            )
        await call_runner(on_a, f"sage.v1.request.stop.{sid}", {}, DEADLINE)
    if kinds["a"] != kinds["c"]:
        raise RuntimeError(f"the watchers saw different events: {kinds}")
    rate = {node: counts[node] / spans[node] for node in counts}
    print(
        f"  fleet: {counts['a']:,} events in {BURSTS * BURST} turns; watched on a"
        f" {rate['a']:,.0f}/s, on c (relayed) {rate['c']:,.0f}/s; events"
        f" {dict(kinds['c'].most_common())}",
        flush=True,
    )
    report.add(
        "fleet",
        "events/s seen on another node (relayed)",
        rate["c"],
        "events/s",
        reference=rate["a"],
        reference_name="watched on the session's node",
        goal=f"{counts['c']:,} events, {BURSTS * BURST} turns",
    )


async def _watch_burst(
    node: str,
    events: RemoteSubscription,
    into: dict[str, tuple[float, int]],
    kinds: Counter[str],
) -> None:
    """Count ``events`` until ``BURST`` turns are done: (when the last was, how many)."""
    seen = 0
    for _ in range(BURST):
        when, n = await _until_done(events, kinds)
        seen += n
    into[node] = (when, seen)


async def _put_silent_nodes(cluster: NatsCluster) -> None:
    """The records of ``SILENT`` stopped nodes and ``LISTED`` claims of theirs, alice's."""
    now = time.time()
    async with cluster.client() as admin:
        js = admin.jetstream(timeout=JS_TIMEOUT)
        nodes, registry = await js.key_value(BUCKET), await js.key_value(REGISTRY)
        for i in range(SILENT):
            node = f"silent{i}"
            record = NodeRecord(
                node=node,
                host="gone",
                pid=1,
                started_at=now,
                heartbeat_at=now,
                heartbeat=2.0,
                stopped=True,
            )
            await nodes.put(node, record.encode())

        async def put(first: int) -> None:
            for n in range(first, LISTED, 50):
                node = f"silent{n % SILENT}"
                entry = SessionEntry(node=node, principal_id="alice", at=now)
                await registry.put(registry_key(node, f"listed{n:05d}"), entry.encode())

        async with anyio.create_task_group() as tg:
            for first in range(50):
                tg.start_soon(put, first)


def _cli_listing(daemon: Daemon) -> tuple[float, list[dict[str, object]], str]:
    """One ``astrid sage sessions --json`` for alice: (s, its rows, its stderr)."""
    t0 = time.perf_counter()
    result = daemon.astrid("sage", "sessions", "--json", "--principal", "alice", timeout=60.0)
    took = time.perf_counter() - t0
    if result.returncode != 0:
        raise RuntimeError(f"the listing failed: {result.stderr}")
    return took, json.loads(result.stdout), result.stderr


async def _bus_listing(client: BusClient) -> tuple[float, list[dict[str, object]]]:
    """The router's listing asked straight on a bus client: (s, its rows)."""
    t0 = time.perf_counter()
    reply = await call_runner(client, LISTING, {}, DEADLINE)
    return time.perf_counter() - t0, list(reply.get("sessions") or [])


async def _listing_at_scale(
    cluster: NatsCluster, daemons: dict[str, Daemon], report: Report
) -> None:
    t0 = time.perf_counter()
    await _put_silent_nodes(cluster)
    put_s = time.perf_counter() - t0
    copy_node = "a"

    def silent(rows: list[dict[str, object]]) -> list[tuple[object, ...]]:
        return sorted(
            (r["session_id"], r["node"], r["state"])
            for r in rows
            if str(r.get("node")).startswith("silent")
        )

    expected = [(f"listed{n:05d}", f"silent{n % SILENT}", "stopped") for n in range(LISTED)]
    with anyio.fail_after(DEADLINE):  # a's copy has them all (its watch delivered them)
        while True:
            _, rows, _ = await anyio.to_thread.run_sync(_cli_listing, daemons[copy_node])
            if silent(rows) == expected:
                break
            await anyio.sleep(0.2)
    cli: dict[str, list[float]] = {copy_node: [], FROM_BUCKET: []}
    bus: dict[str, list[float]] = {copy_node: [], FROM_BUCKET: []}
    found: dict[str, list[tuple[object, ...]]] = {}
    warnings: dict[str, str] = {}
    async with _client(daemons[copy_node]) as on_copy, _client(daemons[FROM_BUCKET]) as on_bucket:
        clients = {copy_node: on_copy, FROM_BUCKET: on_bucket}
        for _ in range(LISTING_ROUNDS):
            for node in (copy_node, FROM_BUCKET):
                took, rows, stderr = await anyio.to_thread.run_sync(_cli_listing, daemons[node])
                cli[node].append(took)
                found[node] = silent(rows)
                if stderr.strip():
                    warnings[node] = stderr.strip().splitlines()[-1]
                took, rows = await _bus_listing(clients[node])
                bus[node].append(took)
    complete = len(found[FROM_BUCKET]) == LISTED
    if found[copy_node] != expected:
        raise RuntimeError(f"the copy's listing has {len(found[copy_node])} of {LISTED} rows")
    if complete and found[FROM_BUCKET] != found[copy_node]:
        raise RuntimeError("the copy's listing and the bucket's differ")
    ms = {
        what: {node: statistics.median(values) * 1e3 for node, values in timed.items()}
        for what, timed in (("cli", cli), ("bus", bus))
    }
    bucket_said = (
        "listed them all"
        if complete
        else f"listed {len(found[FROM_BUCKET])} ({warnings.get(FROM_BUCKET, 'no warning')})"
    )
    print(
        f"  fleet: listing at scale: {LISTED} claims of {SILENT} stopped nodes put in"
        f" {put_s:.1f} s; the bucket's listing {bucket_said}",
        flush=True,
    )
    for what, name in (
        ("cli", "astrid sage sessions --json"),
        ("bus", "the listing request alone"),
    ):
        print(
            f"  fleet: {name}, {LISTING_ROUNDS} rounds: from the copy p50"
            f" {ms[what][copy_node]:.1f} ms; from the bucket p50 {ms[what][FROM_BUCKET]:.1f} ms;"
            f" ratio {ms[what][FROM_BUCKET] / ms[what][copy_node]:.1f}x",
            flush=True,
        )
        report.add(
            "fleet",
            f"{name}, {LISTED} claims, from the copy p50",
            ms[what][copy_node],
            "ms",
            reference=ms[what][FROM_BUCKET],
            reference_name="the bucket read key by key",
            goal="well under the 3 s listing deadline",
            higher_is_better=False,
        )


KILLS = 3
FAILOVER_NODES = ("a", "b", "c")


def _failover_config(cluster: NatsCluster, node: str) -> str:
    """Default heartbeat and lost_after: what the goal is stated for."""
    return (
        'capsules = ["runner"]\n'
        f'[claude]\nbinary = "{FAKE}"\nenv = {{ FAKE_CLAUDE_MODE = "" }}\n'
        "[limits]\nstop_grace = 2.0\n[sessions]\nresume = true\n"
        + cluster.fleet_section(node, heartbeat=None, lost_after=None)
        + '[[principals]]\nname = "alice"\noperator_key = true\n'
    )


async def _kill_and_time(
    cluster: NatsCluster, daemons: dict[str, Daemon], sid: str
) -> tuple[float, str]:
    """One round: (s from a's SIGKILL to the session's init elsewhere, the adopter)."""
    a = daemons["a"]
    async with _client(a) as on_a:
        await _spawn(on_a, sid)
        # the runner's word for the conversation (a child's /proc/<pid>/cmdline may still
        # be the launcher's, between its fork and its exec)
        async with BusClient.connect(a.socket, role="cli", name="bench") as admin:
            topic = f"sage.v1.request.conversation.{sid}"  # the supervisor's (an admin's)
            info = await call_runner(admin, topic, {}, DEADLINE)
        put_transcript(a, info["claude_session"], b'{"type":"user"}\n' * 6400)
        events = await on_a.subscribe(f"sage.v1.event.{sid}.>")
        await call_runner(on_a, f"sage.v1.request.send.{sid}", {"text": "hi"}, DEADLINE)
        await _until_done(events)
    with anyio.fail_after(DEADLINE):
        while True:  # its replica is in the object store: what an adopter restores
            if await stored_transcript(cluster, "a", sid) is not None:
                break
            await anyio.sleep(0.05)
    async with _client(daemons["b"]) as on_b, _client(daemons["c"]) as on_c:
        watches = {
            "b": await on_b.subscribe(f"sage.v1.event.{sid}.>"),
            "c": await on_c.subscribe(f"sage.v1.event.{sid}.>"),
        }
        a.signal(signal.SIGKILL)
        t0 = time.perf_counter()
        first: list[tuple[float, str]] = []

        async def wait_init(node: str, tg: anyio.abc.TaskGroup) -> None:
            async for envelope in watches[node]:
                if envelope.topic.endswith(".init"):
                    first.append((time.perf_counter() - t0, node))
                    tg.cancel_scope.cancel()
                    return

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                for node in watches:
                    tg.start_soon(wait_init, node, tg)
    assert a.proc is not None
    a.proc.wait()
    a.launch()
    a.wait_ready(30.0)
    return first[0]


async def _failover(cluster: NatsCluster, daemons: dict[str, Daemon], report: Report) -> None:
    times: list[float] = []
    for round_ in range(KILLS):
        seconds, node = await _kill_and_time(cluster, daemons, f"lost{round_}")
        print(
            f"  fleet: failover round {round_ + 1}: init on {node} {seconds:.2f} s after the kill"
        )
        times.append(seconds)
    report.add(
        "fleet",
        "failover: node SIGKILL to session init elsewhere",
        statistics.median(times),
        "s",
        goal=f"<= 10 s (heartbeat 2 s, lost_after 6 s); max {max(times):.2f} of {KILLS}",
        higher_is_better=False,
    )


@contextlib.contextmanager
def _failover_fleet() -> Iterator[tuple[NatsCluster, dict[str, Daemon]]]:
    with _nodes(FAILOVER_NODES, _failover_config, short_dir) as fleet:
        yield fleet


def run(report: Report) -> None:
    t0 = time.perf_counter()
    with _fleet() as (cluster, daemons):
        print(
            f"  fleet: 3 NATS servers and nodes {', '.join(NODES)} ready in"
            f" {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
        anyio.run(_routed_vs_local, daemons, report)
        anyio.run(_events_across, daemons, report)
        anyio.run(_listing_at_scale, cluster, daemons, report)
    with _failover_fleet() as (cluster, daemons):
        anyio.run(_failover, cluster, daemons, report)
    print(f"  fleet: the bench took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    r = Report()
    if sys.argv[1:] == ["failover"]:  # the failover rig alone
        with _failover_fleet() as (cluster, daemons):
            anyio.run(_failover, cluster, daemons, r)
    elif sys.argv[1:] == ["listing"]:  # the listing at scale alone
        with _fleet() as (cluster, daemons):
            anyio.run(_listing_at_scale, cluster, daemons, r)
    else:
        run(r)
    print(r.render())
