"""Warm spares: a spawn with a spare ready against a cold one, with the real CLI.

One supervisor, the pinned Claude Code CLI against the Messages API
stand-in, ``[sessions] spares = 1``.  Rounds alternate, so machine noise hits
both alike:

- **warm**: wait (untimed) until a spare is ready, then a
  ``sage.v1.request.spawn`` without a session id and with an
  ``initial_message``: it takes the spare;
- **cold**: the same spawn naming its own session id, so it cannot take one.

Each round times, from the spawn request: the session's ``init`` event (ready
for a turn) and its first ``text`` event (the first streamed reply to the
initial message).  Medians in the table, p90 on the console.  Every process
started here is checked to be gone at the end.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid

import anyio

from tests.bench.bench_sessions import CLAUDE_BIN, _reap_leftovers, _remove
from tests.bench.report import Report, percentile
from tests.support.daemon import short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config
from tests.support.spares import ready_spares
from tests.support.standin import Standin, Text

ROUNDS = 15
API_KEY = "sk-bench"
EXTRA = (
    "[limits]\ninit_timeout = 60.0\nstop_grace = 2.0\n"
    "[sessions]\nspares = 1\nspare_max_age = 3600.0\n"
)


async def _round(sage: Sage, warm: bool) -> tuple[float, float, float]:
    """(seconds to the spawn reply, to ``init``, to the first ``text``)."""
    if warm:
        (sid, _), *_ = (await ready_spares(sage, within=60)).items()
        payload = {"principal_id": "alice", "initial_message": "hello"}
    else:
        sid = f"cold{uuid.uuid4().hex[:8]}"
        payload = {"principal_id": "alice", "session_id": sid, "initial_message": "hello"}
    events = await sage.events(sid)
    seen: dict[str, float] = {}
    t_reply = 0.0

    async def spawn() -> None:
        nonlocal t_reply
        reply = await sage.request("sage.v1.request.spawn", payload, within=60)
        t_reply = time.perf_counter() - t0
        if reply.get("session_id") != sid:
            raise RuntimeError(f"spawn went elsewhere ({'warm' if warm else 'cold'}): {reply}")

    try:
        async with anyio.create_task_group() as tg:
            t0 = time.perf_counter()
            tg.start_soon(spawn)
            while "text" not in seen:
                name, _ = await events.next(within=60)
                seen.setdefault(name, time.perf_counter() - t0)
                if name in ("exited", "error"):
                    raise RuntimeError(f"session {sid} ended: {events.seen}")
        await events.until("done", within=60)
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await sage.request(f"sage.v1.request.stop.{sid}", {}, within=30)
            await events.subscription.close()
    return t_reply, seen["init"], seen["text"]


async def _bench(report: Report) -> None:
    if not CLAUDE_BIN.is_file():
        raise SystemExit(
            f"bench_spares: Claude Code CLI not found at {CLAUDE_BIN}: run `make setup`"
        )
    standin = Standin(default=Text("ok"))
    await standin.start()
    root = short_dir()
    warm: list[tuple[float, float, float]] = []
    cold: list[tuple[float, float, float]] = []
    try:
        env = {"ANTHROPIC_API_KEY": API_KEY, **standin.offline_env()}
        async with running_sage(sage_config(CLAUDE_BIN, env, extra=EXTRA), root=root) as sage:
            print("  spares: warming up (one cold, one warm)", flush=True)
            await _round(sage, warm=False)
            await _round(sage, warm=True)
            for i in range(1, ROUNDS + 1):
                c = await _round(sage, warm=False)
                await ready_spares(sage, within=60)  # untimed: the next spare is up
                w = await _round(sage, warm=True)
                cold.append(c)
                warm.append(w)
                print(
                    f"  spares: round {i}/{ROUNDS}: ready cold {c[1] * 1e3:.0f} ms,"
                    f" warm {w[1] * 1e3:.1f} ms; first text cold {c[2] * 1e3:.0f} ms,"
                    f" warm {w[2] * 1e3:.0f} ms",
                    flush=True,
                )
    finally:
        await standin.stop()
        left = await _reap_leftovers(root)
        _remove(root)
        if left:
            raise RuntimeError(f"claude processes outlived the supervisor: {left}")

    med = statistics.median

    def col(rows: list[tuple[float, float, float]], k: int) -> list[float]:
        return [row[k] for row in rows]

    print(
        f"  spares: p90 ready cold {percentile(col(cold, 1), 0.9) * 1e3:.0f} ms,"
        f" warm {percentile(col(warm, 1), 0.9) * 1e3:.1f} ms; first text p90 cold"
        f" {percentile(col(cold, 2), 0.9) * 1e3:.0f} ms, warm {percentile(col(warm, 2), 0.9) * 1e3:.0f} ms;"
        f" spawn reply medians cold {med(col(cold, 0)) * 1e3:.1f} ms,"
        f" warm {med(col(warm, 0)) * 1e3:.1f} ms",
        flush=True,
    )
    report.add(
        "spares",
        f"spawn to ready, spare ready (median of {ROUNDS})",
        med(col(warm, 1)) * 1e3,
        "ms",
        reference=med(col(cold, 1)) * 1e3,
        reference_name="cold spawn to init",
        goal="<= 10 ms p50",
        higher_is_better=False,
    )
    report.add(
        "spares",
        f"spawn to first streamed reply, spare (median of {ROUNDS})",
        med(col(warm, 2)) * 1e3,
        "ms",
        reference=med(col(cold, 2)) * 1e3,
        reference_name="cold spawn to first text",
        goal="ratio <= 0.5",
        higher_is_better=False,
    )


def run(report: Report) -> None:
    anyio.run(_bench, report)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
