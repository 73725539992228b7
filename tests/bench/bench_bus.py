"""Bus throughput and latency: in process, over the Unix socket, and against NATS.

(a) In process: publish -> deliver -> consume with 1, 10 and 100 subscribers
    (a third exact, a third ``*``, a third ``>``), against an asyncio.Queue
    put/get baseline measured in the same run.
(b) Over the Unix socket: one publishing client process to one subscribing
    client process through a BusServer in this process.
(c) The same workload through nats-server with nats-py clients.

Each figure is the best of a few runs (the machine has 2 cores and may be
shared).  Child processes are this module run with ``child ...`` arguments.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel

from tests.bench.report import Report, percentile

SOCKET_MESSAGES = 200_000
PAYLOAD = b'"0123456789abcdef"'
TOPIC = "bench.socket.x"
BATCH = 256
RUNS = 3


# -- (a) in process -------------------------------------------------------------


def _patterns(n: int) -> list[str]:
    kinds = ["bench.inproc.x", "bench.*.x", "bench.>"]
    return [kinds[i % 3] for i in range(n)]


async def _inproc(n_subs: int, n_msgs: int, *, timed: bool) -> tuple[float, list[float], int]:
    """(seconds, latencies in s, dropped) for n_msgs published to n_subs consumers.

    Untimed runs publish in batches of BATCH between checkpoints (throughput);
    timed runs publish one envelope per checkpoint (publish-to-consume latency).
    """
    batch = 1 if timed else BATCH
    from bus.acl import Identity
    from bus.broker import Bus

    bus = Bus(queue_size=BATCH * 4)
    who = Identity("bench")
    subs = [bus.subscribe(p, Identity(f"s{i}")) for i, p in enumerate(_patterns(n_subs))]
    sent: list[float] = []
    lat: list[float] = []
    first_id = 0
    clock = time.perf_counter
    done = anyio.Event()
    remaining = [n_subs]

    async def consume(sub: Any) -> None:
        got = 0
        if timed:
            async for env in sub:
                lat.append(clock() - sent[env.id - first_id])
                got += 1
                if got == n_msgs:
                    break
        else:
            async for _env in sub:
                got += 1
                if got == n_msgs:
                    break
        remaining[0] -= 1
        if not remaining[0]:
            done.set()

    async with anyio.create_task_group() as tg:
        for sub in subs:
            tg.start_soon(consume, sub)
        await anyio.wait_all_tasks_blocked()
        publish = bus.publish_raw
        first_id = bus.publish_raw(who, "bench.warm", PAYLOAD).id + 1
        start = clock()
        for i in range(0, n_msgs, batch):
            for _ in range(min(batch, n_msgs - i)):
                if timed:
                    sent.append(clock())
                publish(who, "bench.inproc.x", PAYLOAD)
            await anyio.lowlevel.checkpoint()
        await done.wait()
        elapsed = clock() - start
    return elapsed, lat, bus.dropped


async def _queue_baseline(n_msgs: int, *, timed: bool) -> tuple[float, list[float]]:
    queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    clock = time.perf_counter
    sent: list[float] = []
    lat: list[float] = []
    batch = 1 if timed else BATCH

    async def consume() -> None:
        for _ in range(n_msgs):
            seq, _payload = await queue.get()
            if timed:
                lat.append(clock() - sent[seq])

    task = asyncio.ensure_future(consume())
    await asyncio.sleep(0)
    start = clock()
    for i in range(0, n_msgs, batch):
        for j in range(i, min(i + batch, n_msgs)):
            if timed:
                sent.append(clock())
            queue.put_nowait((j, PAYLOAD))
        await asyncio.sleep(0)
    await task
    return clock() - start, lat


def _bench_inproc(report: Report) -> None:
    n_base = 300_000
    base = min(asyncio.run(_queue_baseline(n_base, timed=False))[0] for _ in range(RUNS))
    base_rate = n_base / base
    _, base_lat = asyncio.run(_queue_baseline(20_000, timed=True))
    report.add("bus", "asyncio.Queue put/get (baseline)", base_rate, "msgs/s")
    for n_subs, n_msgs in ((1, 300_000), (10, 60_000), (100, 10_000)):
        best = min(
            anyio.run(lambda: _inproc(n_subs, n_msgs, timed=False))[0]  # noqa: B023
            for _ in range(RUNS)
        )
        n_timed = 20_000 // n_subs + 1000
        _, lat, dropped = anyio.run(lambda: _inproc(n_subs, n_timed, timed=True))  # noqa: B023
        rate = n_subs * n_msgs / best
        report.add(
            "bus",
            f"in-process deliveries, {n_subs} sub(s)",
            rate,
            "deliveries/s",
            reference=base_rate,
            reference_name="asyncio.Queue",
            goal=">= 1M/s" if n_subs == 1 else "",
        )
        report.add(
            "bus", f"in-process p50 latency, {n_subs} sub(s)", percentile(lat, 0.5) * 1e6, "us"
        )
        report.add(
            "bus",
            f"in-process p99 latency, {n_subs} sub(s)",
            percentile(lat, 0.99) * 1e6,
            "us",
            reference=percentile(base_lat, 0.99) * 1e6,
            reference_name="asyncio.Queue p99",
            higher_is_better=False,
        )
        if dropped:
            report.add("bus", f"in-process dropped, {n_subs} sub(s)", dropped, "msgs")


# -- child processes ------------------------------------------------------------


async def _ours_sub(path: str, n: int) -> dict[str, Any]:
    from bus import BusClient

    async with BusClient.connect(path, role="cli", name="bench-sub") as client:
        sub = await client.subscribe(TOPIC)
        print("ready", flush=True)
        got = 0
        first = 0.0
        with anyio.move_on_after(60):
            async for _env in sub:
                got += 1
                if got == 1:
                    first = time.monotonic()
                if got == n:
                    break
        return {"got": got, "first": first, "last": time.monotonic()}


async def _ours_pub(path: str, n: int) -> dict[str, Any]:
    from bus import BusClient

    async with BusClient.connect(path, role="emit", name="bench-pub") as client:
        publish = client.publish_raw
        start = time.monotonic()
        for i in range(0, n, BATCH):
            for _ in range(min(BATCH, n - i)):
                publish(TOPIC, PAYLOAD)
            await anyio.lowlevel.checkpoint()
        await client.flush()
        return {"start": start, "end": time.monotonic()}


async def _nats_sub(url: str, n: int) -> dict[str, Any]:
    import nats

    nc = await nats.connect(url)
    got = 0
    first = 0.0
    finished = asyncio.Event()
    last = [0.0]

    async def on_msg(_msg: Any) -> None:
        nonlocal got, first
        got += 1
        if got == 1:
            first = time.monotonic()
        if got == n:
            last[0] = time.monotonic()
            finished.set()

    await nc.subscribe(TOPIC, cb=on_msg, pending_msgs_limit=n * 2, pending_bytes_limit=-1)
    await nc.flush()
    print("ready", flush=True)
    try:
        await asyncio.wait_for(finished.wait(), 60)
    except TimeoutError:
        last[0] = time.monotonic()
    await nc.close()
    return {"got": got, "first": first, "last": last[0]}


async def _nats_pub(url: str, n: int) -> dict[str, Any]:
    import nats

    nc = await nats.connect(url)
    publish = nc.publish
    start = time.monotonic()
    for i in range(0, n, BATCH):
        for _ in range(min(BATCH, n - i)):
            await publish(TOPIC, PAYLOAD)
        await asyncio.sleep(0)
    await nc.flush()
    end = time.monotonic()
    await nc.close()
    return {"start": start, "end": end}


def _child(argv: list[str]) -> None:
    kind, role, address, n = argv[0], argv[1], argv[2], int(argv[3])
    fn: Callable[[str, int], Coroutine[Any, Any, dict[str, Any]]]
    if kind == "ours":
        fn = _ours_sub if role == "sub" else _ours_pub
        result = anyio.run(fn, address, n)
    else:
        fn = _nats_sub if role == "sub" else _nats_pub
        result = asyncio.run(fn(address, n))
    print(json.dumps(result), flush=True)


# -- (b) and (c): one publisher process -> one subscriber process ---------------


def _spawn(kind: str, role: str, address: str, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.bench.bench_bus", "child", kind, role, address, str(n)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )


def _pair_sync(kind: str, address: str, n: int) -> tuple[float, int]:
    """Run one subscriber and one publisher process; (msgs/s, messages received)."""
    sub = _spawn(kind, "sub", address, n)
    try:
        assert sub.stdout is not None
        line = sub.stdout.readline().strip()
        if line != "ready":
            raise RuntimeError(f"{kind} subscriber did not start: {line!r}")
        pub = _spawn(kind, "pub", address, n)
        out, _ = pub.communicate(timeout=80)
        pub_result = json.loads(out.strip().splitlines()[-1])
        sub_out, _ = sub.communicate(timeout=80)
        sub_result = json.loads(sub_out.strip().splitlines()[-1])
    finally:
        for proc in (sub,):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    elapsed = sub_result["last"] - pub_result["start"]
    return sub_result["got"] / elapsed, sub_result["got"]


async def _ours_socket(n: int) -> list[tuple[float, int]]:
    from bus import BusServer
    from bus.acl import Identity
    from bus.broker import Bus

    def authorize(peer: Any, hello: Any) -> Identity:
        return Identity(f"{hello.role}:{peer.uid}", uid=peer.uid)

    base = tempfile.mkdtemp(prefix="sgb", dir="/tmp")
    path = Path(base) / "bus.sock"
    bus = Bus(queue_size=1_000_000)
    server = BusServer(bus, path, authorize, slow_consumer_timeout=60.0)
    results = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(server.serve)
            for _ in range(RUNS):
                results.append(await anyio.to_thread.run_sync(_pair_sync, "ours", str(path), n))
            tg.cancel_scope.cancel()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nats_socket(n: int) -> list[tuple[float, int]] | None:
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    if not os.path.exists(exe):
        return None
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        url = f"nats://127.0.0.1:{port}"
        return [_pair_sync("nats", url, n) for _ in range(RUNS)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _bench_socket(report: Report) -> None:
    n = SOCKET_MESSAGES
    ours = anyio.run(_ours_socket, n)
    ours_rate = max(rate for rate, got in ours if got == n) if ours else 0.0
    nats_runs = _nats_socket(n)
    nats_rate = max((rate for rate, _got in nats_runs), default=0.0) if nats_runs else None
    report.add(
        "bus",
        f"socket pub->sub, {n // 1000}k msgs, 2 processes",
        ours_rate,
        "msgs/s",
        reference=nats_rate,
        reference_name="nats-server + nats-py",
        goal=">= 1.5x NATS",
    )
    if nats_runs:
        lost = n - max(got for _rate, got in nats_runs)
        if lost:
            report.add("bus", "nats-py messages not received (best run)", lost, "msgs")
        ratio = ours_rate / nats_rate if nats_rate else float("nan")
        print(f"  bus: socket ratio ours/NATS = {ratio:.2f}x (goal >= 1.5x)", flush=True)


def run(report: Report) -> None:
    """Add the bus rows to ``report`` (about a minute)."""
    started = time.monotonic()
    _bench_inproc(report)
    _bench_socket(report)
    print(f"  bus: bench took {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        _child(sys.argv[2:])
    else:
        report = Report()
        run(report)
        print(report.render())
