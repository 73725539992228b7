"""Usage ledger and metrics: what recording spend costs a turn, and what a scrape costs.

(a) A turn, ``sage.v1.request.send.<sid>`` to the session's ``done`` event, with the
    CLI test double (its turns are fast, so sage's own overhead is what shows):
    a supervisor with ``[usage] ledger = true`` and ``[metrics] listen`` against one
    with ``ledger = false`` and no metrics, started side by side, turns interleaved
    (ours, reference, ours ...) so machine noise hits both alike; medians.  Goal:
    ratio at most 1.03.
(b) ``GET /metrics`` of the supervisor with the ledger on, median of the scrapes: with
    its one session, then with ``SCRAPE_SESSIONS`` (1,000) in its table, spawned through
    the real runner ``BATCH`` at a time (each batch to its ``init`` events, as
    bench_hibernation does), all but ``max_live`` of them hibernated: the sessions by
    state gauge is asked of the runner at each scrape, so a scrape's cost is what a
    table of that size costs it.  Goal: under 50 ms.  ``SAGE_BENCH_SESSIONS`` lowers
    the count for a quick run.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import anyio

from tests.bench.bench_hibernation import BATCH, _Seen, _spawn
from tests.bench.report import Report
from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import Events, Sage, running_sage, sage_config

ROUNDS = 60
SCRAPES = 30
SCRAPE_SESSIONS = min(1000, int(os.environ.get("SAGE_BENCH_SESSIONS", "1000")))
MAX_LIVE = 16
ENV = {"ANTHROPIC_API_KEY": "sk-double"}
ROOM = (
    "[limits]\nmax_sessions_per_principal = 1000\n"
    "max_logical_sessions_per_principal = 1000000\ninit_timeout = 60.0\nstop_grace = 2.0\n"
    f"[sessions]\nmax_live = {MAX_LIVE}\nwake_wait = 60.0\n"
)
"""Both supervisors: room for the scrape's sessions, at most MAX_LIVE of them live."""


async def _fill(sage: Sage, count: int) -> int:
    """Spawn ``count`` more sessions of alice, ``BATCH`` at a time, each batch to its
    ``init`` events (past ``max_live`` each spawn hibernates an idle one); how many."""
    inits = _Seen()
    subscription = await sage.client.subscribe("sage.v1.event.*.init")
    t0 = time.perf_counter()
    async with anyio.create_task_group() as follow:
        follow.start_soon(inits.follow, subscription)
        for start in range(0, count, BATCH):
            sids = [f"m{i}" for i in range(start, min(start + BATCH, count))]
            async with anyio.create_task_group() as tg:
                for sid in sids:
                    tg.start_soon(_spawn, sage, sid)
            await inits.wait_for(sids, within=120)
        follow.cancel_scope.cancel()
    print(f"  usage: {count:,} sessions spawned in {time.perf_counter() - t0:.1f} s", flush=True)
    return count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _turn(sage: Sage, events: Events, sid: str) -> float:
    t0 = time.perf_counter()
    reply = await sage.send(sid, "hello")
    assert reply["ok"], reply
    await events.until("done")
    return time.perf_counter() - t0


async def _scrape(port: int) -> float:
    t0 = time.perf_counter()
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        try:
            while True:
                data += await stream.receive()
        except anyio.EndOfStream:
            pass
    assert data.startswith(b"HTTP/1.1 200"), data[:80]
    return time.perf_counter() - t0


async def _bench(report: Report) -> None:
    port = _free_port()
    on = sage_config(
        FAKE_CLAUDE,
        {"FAKE_CLAUDE_MODE": ""},
        extra=f'{ROOM}[usage]\nledger = true\n[metrics]\nlisten = "127.0.0.1:{port}"\n',
        principal_extra="budget_tokens_per_day = 1000000000\n",
    )
    off = sage_config(
        FAKE_CLAUDE, {"FAKE_CLAUDE_MODE": ""}, extra=f"{ROOM}[usage]\nledger = false\n"
    )
    async with running_sage(on, env=ENV) as ours:
        ours_events = await ours.ready("u1")
        async with running_sage(off, env=ENV) as ref:
            ref_events = await ref.ready("u1")
            for _ in range(5):  # warm both
                await _turn(ours, ours_events, "u1")
                await _turn(ref, ref_events, "u1")
            mine: list[float] = []
            theirs: list[float] = []
            for _ in range(ROUNDS):
                mine.append(await _turn(ours, ours_events, "u1"))
                theirs.append(await _turn(ref, ref_events, "u1"))
        scrapes = [await _scrape(port) for _ in range(SCRAPES)]
        spawned = await _fill(ours, SCRAPE_SESSIONS - 1)
        many = [await _scrape(port) for _ in range(SCRAPES)]
    report.add(
        "usage",
        "turn send->done, ledger+metrics on (double)",
        statistics.median(mine) * 1000,
        "ms",
        reference=statistics.median(theirs) * 1000,
        reference_name="ledger off, no metrics",
        goal="ratio <= 1.03",
        higher_is_better=False,
    )
    report.add(
        "usage",
        "GET /metrics, 1 session",
        statistics.median(scrapes) * 1000,
        "ms",
        goal="< 50 ms",
        higher_is_better=False,
    )
    report.add(
        "usage",
        f"GET /metrics, {spawned + 1:,} sessions ({MAX_LIVE} live)",
        statistics.median(many) * 1000,
        "ms",
        goal="< 50 ms",
        higher_is_better=False,
    )


def run(report: Report) -> None:
    anyio.run(_bench, report)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
