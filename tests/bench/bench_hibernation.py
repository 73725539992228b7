"""Hibernation: thousands of logical sessions on one host, and a wake against a cold resume.

(a) Scale, with the CLI test double (tests/support/fake_claude.py): one
    supervisor with ``[sessions] max_live = 32`` and limits that let one
    principal hold every session (``max_sessions_per_principal`` counts live
    ones only, ``max_logical_sessions_per_principal`` all of them).  N logical
    sessions (10,000; the environment variable ``SAGE_BENCH_SESSIONS`` lowers
    it for a quick run) are spawned through the real runner over the socket,
    ``BATCH`` at a time, each batch waited for to its ``init`` events.  Past
    32 every spawn makes the least recently used idle session hibernate, so
    the run churns through N real double processes and N - 32 real
    hibernations: nothing is faked, every session's child really started,
    answered ``initialize`` and (but the last 32) was stopped.  The batch
    waits for its ``init`` events because the runner makes room only for a
    spawn that finds an idle (initialized) session, else at its hibernator's
    next look (0.5 s later): a next batch sent before the last one is up
    would measure that poll, not the spawn path.  On this 2-core machine the
    10,000 take 7.5 to 10 minutes (17 to 22 spawns/s, with other work on the
    machine or not; the supervisor's CPU per spawn grows with the sessions
    in its table, from 11 ms at 1,000 to 25 ms at 10,000), the whole module
    8.5 to 11: the real path is affordable, so it is the one measured.

    All along, a thread samples the supervisor's live ``claude`` children
    every 20 ms (its non-zombie children from /proc that carry the
    supervisor's ``ASTRID_SOCKET`` in their environment); their maximum must
    never pass ``max_live``: the bench fails if it does.  The supervisor's
    RSS (``VmRSS`` of its process, not its children) is read after a warm-up
    session and again once all N sessions exist (N - 32 hibernated, per the
    state store and the ``hibernated`` events) and the process settled; the
    table's figure is the whole growth over N (conservative: the 32 live
    ones and every fixed cost count too); the console also shows the slope
    between the first fifth of the sessions and all of them.

    Then ``WAKES`` random hibernated sessions get one send each, ``BATCH`` at
    a time: send to their first ``text`` event (wake to first reply, the
    double resuming the same claude session id), p50 and p90, and the most
    live children while they wake.  The console also says what the sessions
    listing (``astrid sage sessions``) answers with every session in the
    table; the bench does not rely on it.

(b) Wake against a cold resume, with the pinned Claude Code CLI against the
    Messages API stand-in.  The issue's goal is "wake to first reply <= 1.2x
    a cold spawn with ``--resume``": the same conversation picked up by a
    ``claude`` process that starts from nothing.  The reference is therefore
    the bare CLI (the e2e host, tests/support/host.py, as bench_sessions'
    reference for spawn) started with the very argv and environment the
    runner builds for a resume (:func:`capsules.runner.command.build_launch`,
    ``resume=True``, the supervisor's own config and home): process start,
    ``initialize``, the user line, to its first streamed text.  Ours: a
    session hibernated by ``[sessions] hibernate_after`` gets a
    ``sage.v1.request.send.<sid>``: to its first ``text`` event (the wake,
    the ``--resume`` child, its ``initialize``, the turn).  Each side resumes
    a conversation of its own that grows by one turn a round, so both
    transcripts stay the same length.  Rounds alternate (ours, then bare),
    ours waited for to hibernate again before the bare one starts so the
    two never overlap; medians in the table, p90 on the console.  A cold
    spawn through sage with the same resume has no request of its own (a
    supervisor restart is the only path), and a fresh spawn resumes nothing:
    the bare ``--resume`` start is the honest cold resume.

Every process started here is stopped and every temp folder removed, also on
failure; the supervisor's children are checked gone at the end.
"""

from __future__ import annotations

import contextlib
import os
import random
import sqlite3
import statistics
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec

from bus.client import RemoteSubscription
from capsules.runner.session_life import HOOKS
from sage.claude.protocol import (
    AssistantMessage,
    OutgoingState,
    ResultMessage,
    StreamEvent,
    TextBlock,
    encode_initialize,
    encode_user_turn,
)
from tests.bench.bench_sessions import (
    CLAUDE_BIN,
    FAKE,
    _Bare,
    _reap,
    _reap_leftovers,
    _remove,
)
from tests.bench.report import Report, percentile
from tests.support.daemon import short_dir
from tests.support.host import Host
from tests.support.procs import rss_kib
from tests.support.sage_harness import Events, Sage, running_sage, sage_config
from tests.support.standin import Standin, Text

SESSIONS = int(os.environ.get("SAGE_BENCH_SESSIONS", "10000"))
MAX_LIVE = 32
BATCH = 16
WAKES = 200
SAMPLE_EVERY = 0.02
ROUNDS = 15
API_KEY = "sk-bench"
SCALE = (
    "[limits]\nmax_sessions_per_principal = 1000\n"
    "max_logical_sessions_per_principal = 1000000\ninit_timeout = 60.0\nstop_grace = 2.0\n"
    f"[sessions]\nmax_live = {MAX_LIVE}\nwake_wait = 60.0\n"
)
WAKE = "[limits]\ninit_timeout = 60.0\nstop_grace = 2.0\n[sessions]\nhibernate_after = 0.5\n"


# -- the supervisor's live children, sampled in a thread ------------------------------


class LiveChildren:
    """The supervisor's live ``claude`` children, counted every ``SAMPLE_EVERY`` s.

    A child is a non-zombie process whose parent is the supervisor and whose
    environment carries ``marker`` (checked once per pid and start time)."""

    def __init__(self, supervisor: int, marker: bytes) -> None:
        self.supervisor = supervisor
        self.marker = marker
        self.samples = 0
        self.most = 0  # since the last window()
        self.most_ever = 0
        self.over: list[tuple[float, int]] = []  # (when, how many) above MAX_LIVE
        self._ours: set[tuple[int, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="live-children", daemon=True)

    def count(self) -> int:
        n = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            # fields[0] is the state, [1] the parent, [19] the start time
            if fields[0] == "Z" or fields[1] != str(self.supervisor):
                continue
            key = (int(entry), fields[19])
            if key not in self._ours:
                try:
                    with open(f"/proc/{entry}/environ", "rb") as f:
                        if self.marker not in f.read():
                            continue
                except OSError:
                    continue
                self._ours.add(key)
            n += 1
        return n

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            n = self.count()
            with self._lock:
                self.samples += 1
                self.most = max(self.most, n)
                self.most_ever = max(self.most_ever, n)
                if n > MAX_LIVE:
                    self.over.append((time.time(), n))

    def window(self) -> int:
        """The most seen since the last call; a new window starts."""
        with self._lock:
            most, self.most = self.most, 0
        return most

    @contextlib.contextmanager
    def running(self) -> Iterator[LiveChildren]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()


# -- (a) scale with the double ---------------------------------------------------------


class _Seen:
    """Sessions that sent a given event (one subscription, every session's)."""

    def __init__(self) -> None:
        self.sids: set[str] = set()
        self.first: dict[str, float] = {}
        self.count = 0
        self._changed = anyio.Event()

    async def follow(self, subscription: RemoteSubscription) -> None:
        try:
            while True:
                envelope = await subscription.get()
                sid = envelope.topic.split(".")[3]
                self.count += 1
                self.sids.add(sid)
                self.first.setdefault(sid, time.perf_counter())
                self._changed.set()
                self._changed = anyio.Event()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await subscription.close()

    async def wait_for(self, sids: list[str] | None, count: int = 0, within: float = 60) -> None:
        with anyio.fail_after(within):
            while not (set(sids or ()) <= self.sids and self.count >= count):
                await self._changed.wait()

    def forget(self, sids: list[str]) -> None:
        for sid in sids:
            self.sids.discard(sid)
            self.first.pop(sid, None)


def _records(root: Path) -> dict[str, dict[str, Any]]:
    """The session records of the state store (read beside the supervisor)."""
    db = sqlite3.connect(f"file:{root / 'state' / 'state.db'}?mode=ro", uri=True, timeout=30)
    try:
        rows = db.execute("SELECT key, value FROM kv WHERE namespace = 'sessions'").fetchall()
    finally:
        db.close()
    return {key: msgspec.json.decode(value) for key, value in rows}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user and system) ``pid`` has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _states(records: dict[str, dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for record in records.values():
        out[record["state"]] = out.get(record["state"], 0) + 1
    return out


async def _spawn(sage: Sage, sid: str) -> int:
    reply = await sage.request(
        "sage.v1.request.spawn", {"principal_id": "alice", "session_id": sid}, within=120
    )
    if not reply.get("ok"):
        raise RuntimeError(f"spawn {sid} failed: {reply}")
    return int(reply["pid"])


async def _spawn_all(
    sage: Sage, spid: int, inits: _Seen, live: LiveChildren
) -> tuple[float, list[float], list[tuple[int, int]]]:
    """Spawn ``SESSIONS`` sessions ``BATCH`` at a time, each batch to its inits;
    (seconds, spawn-to-init per session, (sessions, RSS KiB) checkpoints)."""
    to_init: list[float] = []
    rss: list[tuple[int, int]] = []
    t0 = time.perf_counter()
    t_chunk, chunk = t0, max(BATCH, (SESSIONS // 10) // BATCH * BATCH)
    done_chunk, cpu_chunk = 0, _cpu_s(spid)
    for start in range(0, SESSIONS, BATCH):
        sids = [f"h{i}" for i in range(start, min(start + BATCH, SESSIONS))]
        t_batch = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for sid in sids:
                tg.start_soon(_spawn, sage, sid)
        await inits.wait_for(sids, within=120)
        to_init += [inits.first[sid] - t_batch for sid in sids]
        done = start + len(sids)
        if done % chunk == 0 or done == SESSIONS:
            now, cpu = time.perf_counter(), _cpu_s(spid)
            rss.append((done, rss_kib(spid)))
            spawned, cpu_chunk = done - done_chunk, cpu - cpu_chunk
            print(
                f"  hibernation: {done:,} sessions in {now - t0:.1f} s"
                f" ({spawned / (now - t_chunk):.1f} spawns/s lately, supervisor CPU"
                f" {cpu_chunk / spawned * 1e3:.1f} ms a spawn), supervisor RSS"
                f" {rss[-1][1]:,} KiB, most live children {live.most_ever}",
                flush=True,
            )
            t_chunk, done_chunk, cpu_chunk = now, done, cpu
    return time.perf_counter() - t0, to_init, rss


async def _wake_all(
    sage: Sage, sids: list[str], texts: _Seen, dones: _Seen
) -> tuple[list[float], list[float]]:
    """One send to each of ``sids``, ``BATCH`` at a time: (to first text, to done)."""
    to_text: list[float] = []
    to_done: list[float] = []

    async def one(sid: str) -> None:
        reply = await sage.send(sid, "wake up")
        if not reply.get("ok"):
            raise RuntimeError(f"send to hibernated {sid} failed: {reply}")

    for start in range(0, len(sids), BATCH):
        batch = sids[start : start + BATCH]
        texts.forget(batch)
        dones.forget(batch)
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for sid in batch:
                tg.start_soon(one, sid)
        await dones.wait_for(batch, within=120)
        to_text += [texts.first[sid] - t0 for sid in batch]
        to_done += [dones.first[sid] - t0 for sid in batch]
    return to_text, to_done


async def _scale(report: Report) -> None:
    root = short_dir()
    config = sage_config(FAKE, {"FAKE_CLAUDE_MODE": "", "ANTHROPIC_API_KEY": API_KEY}, extra=SCALE)
    left: list[int] = []
    try:
        async with running_sage(config, root=root) as sage:
            supervisor = sage.daemon.proc
            assert supervisor is not None
            spid = supervisor.pid
            live = LiveChildren(spid, f"ASTRID_SOCKET={sage.daemon.socket}".encode())
            inits, hibernated, texts, dones = _Seen(), _Seen(), _Seen(), _Seen()
            with live.running():
                async with anyio.create_task_group() as tg:
                    for seen, name in (
                        (inits, "init"),
                        (hibernated, "hibernated"),
                        (texts, "text"),
                        (dones, "done"),
                    ):
                        subscription = await sage.client.subscribe(f"sage.v1.event.*.{name}")
                        tg.start_soon(seen.follow, subscription)
                    cold = rss_kib(spid)
                    # one session first: code paths and lazy imports run once, not per session
                    await _spawn(sage, "warm")
                    await inits.wait_for(["warm"])
                    await sage.request("sage.v1.request.stop.warm", {}, within=30)
                    await anyio.sleep(0.5)
                    before = rss_kib(spid)
                    live.window()
                    print(
                        f"  hibernation: {SESSIONS:,} sessions, {BATCH} at once, max_live"
                        f" {MAX_LIVE}; supervisor RSS cold {cold:,} KiB, after a warm-up"
                        f" session {before:,} KiB",
                        flush=True,
                    )
                    spawn_s, to_init, checkpoints = await _spawn_all(sage, spid, inits, live)
                    spawn_most = live.window()
                    # every session beyond max_live hibernated; then let the process settle
                    await hibernated.wait_for(None, count=SESSIONS - MAX_LIVE, within=120)
                    await anyio.sleep(2.0)
                    after = rss_kib(spid)
                    records = _records(root)
                    states = _states(records)
                    print(f"  hibernation: stored session states {states}", flush=True)
                    asleep = [sid for sid, r in records.items() if r["state"] == "hibernated"]
                    running = states.get("running", 0)
                    if len(asleep) + running != SESSIONS or running > MAX_LIVE:
                        raise RuntimeError(
                            f"expected {SESSIONS:,} sessions, at most {MAX_LIVE} of them"
                            f" running, the others hibernated; the store has {states}"
                        )
                    if running < MAX_LIVE:  # a slot is free that nothing waits for
                        print(
                            f"  hibernation: WARNING: {MAX_LIVE - running} more sessions"
                            f" hibernated than max_live needed ({running} live at the end)",
                            flush=True,
                        )
                    listing_note = await _try_listing(sage)
                    sample = random.Random(17).sample(asleep, min(WAKES, len(asleep)))
                    live.window()
                    t_wake = time.perf_counter()
                    to_text, to_done = await _wake_all(sage, sample, texts, dones)
                    wake_s = time.perf_counter() - t_wake
                    await anyio.sleep(0.5)
                    wake_most = live.window()
                    tg.cancel_scope.cancel()
            t_stop = time.perf_counter()
        print(
            f"  hibernation: supervisor stopped with {SESSIONS:,} sessions in"
            f" {time.perf_counter() - t_stop:.1f} s",
            flush=True,
        )
    finally:
        left = await _reap_leftovers(root)
        _remove(root)
    if left:
        raise RuntimeError(f"fake_claude processes outlived the supervisor: {sorted(left)}")
    if live.over:
        raise RuntimeError(
            f"live claude children passed max_live = {MAX_LIVE}: {len(live.over)} samples,"
            f" most {max(n for _, n in live.over)} (first at {live.over[0][0]:.3f})"
        )
    print(
        f"  hibernation: all {len(inits.sids):,} sessions' children are gone; live children"
        f" sampled {live.samples:,} times, never above {live.most_ever}",
        flush=True,
    )
    per = (after - before) / SESSIONS
    first_n, first_rss = checkpoints[1] if len(checkpoints) > 2 else checkpoints[0]
    slope = (after - first_rss) / max(1, SESSIONS - first_n)
    print(
        f"  hibernation: supervisor RSS {before:,} -> {after:,} KiB with {SESSIONS:,}"
        f" sessions ({per:.2f} KiB each; slope from {first_n:,} sessions"
        f" {slope:.2f} KiB each); spawn to init p50 {statistics.median(to_init) * 1e3:.0f} ms,"
        f" p90 {percentile(to_init, 0.9) * 1e3:.0f} ms (batches of {BATCH})",
        flush=True,
    )
    print(
        f"  hibernation: {len(to_text)} wakes in {wake_s:.1f} s; to first text p50"
        f" {statistics.median(to_text) * 1e3:.0f} ms, p90 {percentile(to_text, 0.9) * 1e3:.0f} ms;"
        f" to done p50 {statistics.median(to_done) * 1e3:.0f} ms; {listing_note}",
        flush=True,
    )
    report.add(
        "hibernate",
        f"spawns/s, {SESSIONS:,} sessions, max_live {MAX_LIVE} (double)",
        SESSIONS / spawn_s,
        "spawns/s",
        goal=f"{SESSIONS:,} in {spawn_s:.0f} s",
    )
    report.add(
        "hibernate",
        "most live children while spawning",
        spawn_most,
        "processes",
        goal=f"<= max_live ({MAX_LIVE})",
        higher_is_better=False,
    )
    report.add(
        "hibernate",
        f"supervisor RSS per session ({len(asleep):,} hibernated)",
        per,
        "KiB/session",
        goal="<= 10 KiB",
        higher_is_better=False,
    )
    report.add(
        "hibernate",
        f"wake to first reply p50 ({len(to_text)} wakes, double)",
        statistics.median(to_text) * 1e3,
        "ms",
        goal=f"p90 {percentile(to_text, 0.9) * 1e3:.0f} ms",
        higher_is_better=False,
    )
    report.add(
        "hibernate",
        "most live children while waking",
        wake_most,
        "processes",
        goal=f"<= max_live ({MAX_LIVE})",
        higher_is_better=False,
    )


async def _try_listing(sage: Sage) -> str:
    """What ``sage.v1.request.sessions`` (``astrid sage sessions``) answers with every
    session in the table; for the console, the bench does not rely on it."""
    t0 = time.perf_counter()
    try:
        listing = await sage.request("sage.v1.request.sessions", {}, within=10)
    except Exception as exc:  # the figure is the answer, whatever it is
        return f"the sessions listing failed after {time.perf_counter() - t0:.1f} s: {exc!r}"
    if not listing.get("ok"):
        return f"the sessions listing failed: {listing.get('error')}: {listing.get('message')}"
    return (
        f"the sessions listing has {len(listing['sessions']):,} rows"
        f" ({time.perf_counter() - t0:.2f} s)"
    )


# -- (b) wake against a cold --resume, real CLI -----------------------------------------


class _BareResume(_Bare):
    """The bare CLI resuming a conversation of its own, started as the runner would."""

    def __init__(self, config_path: Path) -> None:
        super().__init__(config_path)
        self.claude_session = str(uuid.uuid4())

    async def resumed(self, resume: bool = True) -> tuple[float, float]:
        """(seconds to the initialize answer, seconds to the first streamed text)."""
        self.n += 1
        launch = self.launch(  # the identity file is written here, untimed
            f"bareresume{self.n}", claude_session=self.claude_session, resume=resume
        )
        t0 = time.perf_counter()
        proc = await anyio.open_process(
            launch.argv, env=launch.env, cwd=launch.cwd, start_new_session=True
        )
        host = Host(proc)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(host.read_stdout)
                tg.start_soon(host.drain_stderr)
                with anyio.fail_after(60):
                    outcome = await host.request(
                        "initialize", lambda rid: encode_initialize(rid, HOOKS)
                    )
                    t_init = time.perf_counter() - t0
                    if outcome.state is not OutgoingState.COMPLETED:
                        raise RuntimeError(f"bare claude --resume: initialize failed: {outcome}")
                    await host.write(encode_user_turn("hello again"))
                    await host.wait_until(lambda: _texted(host.inbox))
                    t_text = time.perf_counter() - t0
                    await host.until(ResultMessage)
                await self.stop(host, proc)
                tg.cancel_scope.cancel()
        finally:
            await _reap(proc, launch)
        return t_init, t_text


def _texted(inbox: list[Any]) -> bool:
    """Whether the CLI streamed any text yet (what the runner turns into ``text``)."""
    for msg in inbox:
        if isinstance(msg, StreamEvent):
            event = msg.event_dict()
            delta = event.get("delta") or {}
            if event.get("type") == "content_block_delta" and delta.get("text"):
                return True
        elif (
            isinstance(msg, AssistantMessage)
            and msg.parent_tool_use_id is None
            and any(isinstance(b, TextBlock) and b.text for b in msg.message.content)
        ):
            return True
    return False


async def _wake_round(sage: Sage, events: Events, sid: str) -> tuple[float, float]:
    """Send to hibernated ``sid``: (seconds to its ``init``, to its first ``text``)."""
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    reply = await sage.send(sid, "hello again")
    if not reply.get("ok"):
        raise RuntimeError(f"send to hibernated {sid} failed: {reply}")
    while "text" not in seen:
        name, _ = await events.next(within=60)
        seen.setdefault(name, time.perf_counter() - t0)
        if name in ("exited", "error"):
            raise RuntimeError(f"session {sid} ended on its wake: {events.seen[-10:]}")
    if "waking" not in seen:
        raise RuntimeError(f"session {sid} was not asleep: {events.seen[-10:]}")
    await events.until("done", within=60)
    return seen.get("init", float("nan")), seen["text"]


async def _wake_vs_cold(report: Report) -> None:
    if not CLAUDE_BIN.is_file():
        raise SystemExit(
            f"bench_hibernation: Claude Code CLI not found at {CLAUDE_BIN}: run `make setup`"
        )
    standin = Standin(default=Text("ok"))
    await standin.start()
    root = short_dir()
    ours: list[tuple[float, float]] = []
    bare: list[tuple[float, float]] = []
    try:
        env = {"ANTHROPIC_API_KEY": API_KEY, **standin.offline_env()}
        async with running_sage(sage_config(CLAUDE_BIN, env, extra=WAKE), root=root) as sage:
            reference = _BareResume(sage.daemon.config)
            print("  hibernation: real CLI, two conversations of one turn each", flush=True)
            await reference.resumed(resume=False)  # its first turn: the transcript to resume
            sid = "sleeper"
            events, reply = await sage.spawn(sid, initial_message="hello")
            if not reply.get("ok"):
                raise RuntimeError(f"spawn {sid} failed: {reply}")
            await events.until("hibernated", within=60)
            # warm-up of both paths, untimed
            await _wake_round(sage, events, sid)
            await events.until("hibernated", within=60)
            await reference.resumed()
            for i in range(1, ROUNDS + 1):
                w = await _wake_round(sage, events, sid)
                await events.until("hibernated", within=60)  # never beside the bare one
                await anyio.sleep(0.2)
                b = await reference.resumed()
                ours.append(w)
                bare.append(b)
                print(
                    f"  hibernation: round {i}/{ROUNDS}: first text, wake {w[1] * 1e3:.0f} ms"
                    f" (init {w[0] * 1e3:.0f}), bare --resume {b[1] * 1e3:.0f} ms"
                    f" (initialize {b[0] * 1e3:.0f})",
                    flush=True,
                )
            turns = (await sage.request(f"sage.v1.request.session.{sid}", {}))["session"]["turns"]
            await events.subscription.close()
    finally:
        await standin.stop()
        left = await _reap_leftovers(root)
        _remove(root)
        if left:
            raise RuntimeError(f"claude processes outlived the supervisor: {left}")
    if turns != ROUNDS + 2:
        raise RuntimeError(f"the woken session has {turns} turns, expected {ROUNDS + 2}")

    med = statistics.median
    w_text, b_text = [r[1] for r in ours], [r[1] for r in bare]
    print(
        f"  hibernation: first text p90: wake {percentile(w_text, 0.9) * 1e3:.0f} ms, bare --resume"
        f" {percentile(b_text, 0.9) * 1e3:.0f} ms; medians to init: wake"
        f" {med([r[0] for r in ours]) * 1e3:.0f} ms, bare initialize"
        f" {med([r[0] for r in bare]) * 1e3:.0f} ms; the session had {turns} turns",
        flush=True,
    )
    report.add(
        "hibernate",
        f"wake to first reply, real CLI (median of {ROUNDS})",
        med(w_text) * 1e3,
        "ms",
        reference=med(b_text) * 1e3,
        reference_name="bare claude --resume, start to first text",
        goal="ratio <= 1.2",
        higher_is_better=False,
    )


def run(report: Report) -> None:
    t0 = time.perf_counter()
    anyio.run(_scale, report)
    anyio.run(_wake_vs_cold, report)
    print(f"  hibernation: the bench took {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
