"""Malformed and abusive bus traffic, generated from a seed, sent over raw sockets.

A *case* is one draw of a generator: a few frames (valid, mutated, truncated,
oversized, not JSON, not UTF-8, nested too deep, of unknown type), a hello
abuse on a fresh connection, a burst of subscriptions past the cap, frames
interleaved over several connections and split mid-frame, a writer that
trickles a byte at a time, a connection cut mid-frame or reset.  The case
sequence of a worker depends only on its seed (``random.Random(f"{seed}:{index}")``):
what the sockets do (a connection the server closed is replaced) never draws
from it, so a seed replays the same cases.

A worker is a forked process, optionally under another uid; it reports its
counts as one JSON object on a pipe.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ("GENERATORS", "WorkerSpec", "run_worker")

MAX_PAYLOAD = 1024 * 1024
MAX_FRAME = MAX_PAYLOAD + 64 * 1024
"""The server's frame limit with the default ``bus.max_payload``."""
POOL = 3
"""Connections a worker keeps open and spreads its frames over."""

_LEN = struct.Struct(">I")

TOPICS = (
    "fuzz.v1.a",
    "fuzz.v1.b.c",
    "fuzz.v1.audit.x",
    "demo.v1.echo",
    "demo.v1.audit.x",
    "demo.v1.fuzz",
    "sage.v1.audit.fuzz",
    "sage.v1.hook.Stop",
    "sage.v1.request.status",
    "sage.v1.request.install",
    "sage.v1.request.nobody",
    "llm.v1.request.fuzz",
    "sage.v1.event.s1.text",
)
"""Topics the fuzzer uses (never ``canary.>``: that is the canary's)."""
BAD_TOPICS = (
    "",
    ".",
    "a..b",
    "a.>.b",
    ">",
    "*",
    "fuzz.*",
    "a b",
    "t\u00f6pic",
    "x" * 300,
    ".".join(["a"] * 17),
    "fuzz.v1.\u0000",
    "canary",
)
PATTERNS = ("fuzz.>", "fuzz.*.a", "demo.>", ">", "*", "*.v1.audit.>", "sage.v1.event.>", "a.>.b")
ROLES = ("cli", "cli", "capsule", "emit", "", "admin", "x" * 300)
JUNK: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    2**64,
    2**200,
    1.5e308,
    -0.0,
    "",
    "x" * 1000,
    [],
    {},
    [1, [2, [3]]],
    {"t": "pub"},
    "\u0000",
    "\ud83d\ude00",
)


def frame(body: bytes) -> bytes:
    return _LEN.pack(len(body)) + body


def dumps(value: Any) -> bytes:
    """JSON as the fuzzer wants it: lone surrogates are kept (they are a case of their own)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


# -- values ---------------------------------------------------------------------------------


def payload(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.25 or depth > 3:
        return rng.choice((0, 1, -7, 3.25, 2**53, None, True, "", "hi", "\u00e9\u4e2d\ud83d\ude00"))
    if roll < 0.45:
        return "".join(chr(rng.randrange(32, 0x2FFF)) for _ in range(rng.randrange(64)))
    if roll < 0.6:
        return [payload(rng, depth + 1) for _ in range(rng.randrange(5))]
    if roll < 0.98:
        return {f"k{i}": payload(rng, depth + 1) for i in range(rng.randrange(5))}
    return "y" * rng.randrange(1, 200_000)


def topic(rng: random.Random) -> str:
    return rng.choice(BAD_TOPICS) if rng.random() < 0.1 else rng.choice(TOPICS)


def sid(rng: random.Random) -> int:
    return rng.choice((rng.randrange(40), rng.randrange(40), -1, 0, 2**63 - 1, 2**64, 2**90))


def valid_frame(rng: random.Random) -> dict[str, Any]:
    """A frame that decodes (its topic, sid or values may still be refused)."""
    kind = rng.choice(("pub", "pub", "pub", "sub", "unsub", "req", "reply", "ping"))
    if kind == "pub":
        out: dict[str, Any] = {"t": "pub", "topic": topic(rng), "payload": payload(rng)}
        if rng.random() < 0.2:
            out["obo"] = rng.choice(("alice", "bob", "x" * 65, "a b", ""))
        if rng.random() < 0.1:
            out["cid"] = "c" * rng.randrange(100)
        return out
    if kind == "sub":
        pattern = rng.choice(PATTERNS) if rng.random() < 0.8 else topic(rng)
        return {"t": "sub", "sid": sid(rng), "pattern": pattern}
    if kind == "unsub":
        return {"t": "unsub", "sid": sid(rng)}
    if kind == "req":
        return {
            "t": "req",
            "rid": rng.randrange(2**31),
            "topic": topic(rng),
            "payload": payload(rng),
            "timeout": rng.choice((None, 0, 0.01, 0.2, -1, 1e300, 300, 2)),
        }
    if kind == "reply":
        token = rng.choice(("", "x", "AAAAAAAAAAAAAAAA", "t" * 5000))
        return {"t": "reply", "to": token, "payload": payload(rng)}
    return {"t": "ping", "n": rng.choice((0, 1, 2**63 - 1, -5))}


def hello(rng: random.Random, *, admin: bool) -> dict[str, Any]:
    """A hello that a mapped uid's connection gets a welcome for."""
    roles = ("cli", "cli", "capsule", "emit") if admin else ("cli", "cli", "emit")
    out: dict[str, Any] = {"t": "hello", "role": rng.choice(roles), "version": 1}
    if admin and rng.random() < 0.3:
        out["principal"] = "alice"
    if rng.random() < 0.3:
        out["name"] = f"fuzz-{rng.randrange(1000)}"
    return out


# -- cases ------------------------------------------------------------------------------------


@dataclass
class Case:
    """What one draw sends: byte chunks for the chosen connection(s), and what then."""

    chunks: list[tuple[int, bytes]] = field(default_factory=list)
    """(connection slot, bytes); slot -1 is a fresh connection of the case's own."""
    fresh_hello: bool = False
    """The fresh connection gets no hello from the worker (the case brings its own)."""
    end: str = "keep"
    """After the chunks: ``keep``, ``close`` (FIN) or ``reset`` (RST) the fresh/last slot."""
    trickle: bytes = b""
    """Bytes for a new slow writer, sent a byte per case from then on."""
    frames: int = 0


Generator = Callable[[random.Random], Case]


def case_valid(rng: random.Random) -> Case:
    frames = [frame(dumps(valid_frame(rng))) for _ in range(rng.randrange(1, 6))]
    return Case([(rng.randrange(POOL), b"".join(frames))], frames=len(frames))


def case_wrong_types(rng: random.Random) -> Case:
    body = valid_frame(rng)
    key = rng.choice([*body, "t", "extra"])
    roll = rng.random()
    if roll < 0.7:
        body[key] = rng.choice(JUNK)
    elif roll < 0.85:
        body.pop(key, None)
    else:
        body = {"t": body["t"]}
    return Case([(rng.randrange(POOL), frame(dumps(body)))], frames=1)


def case_unknown_op(rng: random.Random) -> Case:
    tag = rng.choice(("nope", "welcome", "msg", "result", "err", "", "HELLO", 7, None, ["pub"]))
    body = {"t": tag, "topic": "fuzz.v1.a", "payload": 1} if rng.random() < 0.8 else {"x": 1}
    return Case([(rng.randrange(POOL), frame(dumps(body)))], frames=1)


def case_bad_json(rng: random.Random) -> Case:
    roll = rng.random()
    if roll < 0.4:
        body = rng.randbytes(rng.randrange(1, 200))
    elif roll < 0.8:  # a valid frame cut short, with a length that says so
        whole = dumps(valid_frame(rng))
        body = whole[: rng.randrange(len(whole))]
    else:  # a valid frame with a few bytes changed
        data = bytearray(dumps(valid_frame(rng)))
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        body = bytes(data)
    return Case([(rng.randrange(POOL), frame(body))], frames=1)


def case_invalid_utf8(rng: random.Random) -> Case:
    bad = rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"))
    bodies = (
        b'{"t":"pub","topic":"fuzz.v1.a","payload":"' + bad + b'"}',
        b'{"t":"pub","topic":"fuzz.v1.' + bad + b'","payload":1}',
        b'{"t":"req","rid":1,"topic":"demo.v1.echo","payload":{"k":"' + bad + b'"}}',
        b'{"t":"reply","to":"x","payload":"' + bad + b'"}',
        b'{"t":"sub","sid":3,"pattern":"' + bad + b'"}',
        b'{"t":"pub","topic":"fuzz.v1.a","payload":"\\ud800"}',
        b'{"t":"pub","topic":"fuzz.v1.a","payload":"\\udfff\\ud800x"}',
    )
    return Case([(rng.randrange(POOL), frame(rng.choice(bodies)))], frames=1)


def case_deep(rng: random.Random) -> Case:
    depth = rng.choice((100, 1000, 10_000, 100_000, 400_000))
    opener, closer = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
    nested = opener * depth + b"1" + closer * depth
    body = b'{"t":"pub","topic":"fuzz.v1.a","payload":' + nested + b"}"
    return Case([(rng.randrange(POOL), frame(body))], frames=1)


def case_bad_length(rng: random.Random) -> Case:
    roll = rng.random()
    if roll < 0.25:  # zero-length frames
        return Case([(rng.randrange(POOL), _LEN.pack(0) * rng.randrange(1, 200))], frames=1)
    if roll < 0.5:  # a length longer than what follows, then the connection ends
        body = dumps(valid_frame(rng))
        data = _LEN.pack(len(body) + rng.randrange(1, 10_000)) + body
        return Case([(-1, data)], end=rng.choice(("close", "reset")), frames=1)
    if roll < 0.75:  # over the limit, only the start of the body, then it ends
        size = rng.choice((MAX_FRAME + 1, 2**31, 2**32 - 1))
        data = _LEN.pack(size) + rng.randbytes(rng.randrange(0, 70_000))
        return Case([(-1, data)], end=rng.choice(("close", "reset")), frames=1)
    # a header split over several writes, then the frame
    whole = frame(dumps(valid_frame(rng)))
    cut = rng.randrange(1, 4)
    slot = rng.randrange(POOL)
    return Case([(slot, whole[:cut]), (slot, whole[cut:])], frames=1)


def case_oversized(rng: random.Random) -> Case:
    """A whole frame over the limit: its body is skipped as it arrives, the connection lives."""
    size = MAX_FRAME + rng.randrange(1, 1000)
    data = _LEN.pack(size) + b"z" * size + frame(dumps({"t": "ping", "n": 9}))
    return Case([(rng.randrange(POOL), data)], frames=2)


def case_big_payload(rng: random.Random) -> Case:
    size = rng.choice((MAX_PAYLOAD - 20, MAX_PAYLOAD + 10, 500_000))
    body = b'{"t":"pub","topic":"fuzz.v1.a","payload":"' + b"p" * size + b'"}'
    return Case([(rng.randrange(POOL), frame(body))], frames=1)


def case_many_subscriptions(rng: random.Random) -> Case:
    """Past the 1024 subscriptions of a connection, on a connection of its own."""
    frames = [
        frame(dumps({"t": "sub", "sid": i, "pattern": rng.choice(PATTERNS)}))
        for i in range(rng.randrange(1000, 1100))
    ]
    frames.append(frame(dumps({"t": "pub", "topic": "fuzz.v1.a", "payload": 1})))
    return Case([(-1, b"".join(frames))], end=rng.choice(("close", "reset", "keep")), frames=1100)


def case_interleave(rng: random.Random) -> Case:
    """Frames cut at random points and the pieces spread over the pooled connections."""
    queues: list[collections.deque[bytes]] = []
    n = 0
    for _ in range(POOL):
        count = rng.randrange(1, 4)
        data = b"".join(frame(dumps(valid_frame(rng))) for _ in range(count))
        n += count
        cuts = sorted(rng.randrange(len(data)) for _ in range(rng.randrange(1, 4)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        queues.append(collections.deque(p for p in pieces if p))
    chunks: list[tuple[int, bytes]] = []
    while any(queues):  # each connection's pieces in order, the connections taking turns at random
        slot = rng.choice([i for i, q in enumerate(queues) if q])
        chunks.append((slot, queues[slot].popleft()))
    return Case(chunks, frames=n)


def case_disconnect(rng: random.Random) -> Case:
    """A connection that goes away in the middle of something."""
    data = frame(dumps(hello(rng, admin=False)))
    roll = rng.random()
    if roll < 0.3:
        whole = frame(dumps(valid_frame(rng)))
        data += whole[: rng.randrange(1, len(whole))]
    elif roll < 0.6:
        data += frame(dumps({"t": "sub", "sid": 1, "pattern": ">"}))
        data += frame(dumps({"t": "req", "rid": 1, "topic": "sage.v1.audit.fuzz", "payload": 1}))
    else:
        data += frame(dumps({"t": "req", "rid": 2, "topic": "demo.v1.echo", "payload": [1]}))
        data += frame(dumps({"t": "req", "rid": 3, "topic": "fuzz.v1.a", "timeout": 300}))
    return Case([(-1, data)], fresh_hello=True, end=rng.choice(("close", "reset")), frames=3)


def case_hello_abuse(rng: random.Random) -> Case:
    """Something wrong with the handshake, on a fresh connection."""
    good = hello(rng, admin=True)
    variants: list[bytes] = [
        frame(dumps({**good, "version": rng.choice((0, 2, -1, 2**70, "1", None))})),
        frame(dumps({**good, "role": rng.choice(ROLES)})),
        frame(dumps({**good, "principal": rng.choice(("bob", "", "../x", "a" * 70, 5, ["a"]))})),
        frame(dumps({**good, "name": rng.choice(("x" * 60_000, "\u0000", "\ud800", 5))})),
        frame(dumps({"t": "hello"})),
        frame(dumps({**good, "unknown": [1, 2, 3]})),
        frame(dumps(good)) + frame(dumps(good)),
        frame(dumps({"t": "pub", "topic": "fuzz.v1.a", "payload": 1})),
        frame(dumps([good])),
        frame(b'"hello"'),
        frame(rng.randbytes(rng.randrange(1, 64))),
        frame(dumps(good)) + rng.randbytes(rng.randrange(1, 64)),
    ]
    return Case(
        [(-1, rng.choice(variants))],
        fresh_hello=True,
        end=rng.choice(("close", "reset", "keep")),
        frames=1,
    )


def case_slow_writer(rng: random.Random) -> Case:
    """A writer that sends its hello and a frame a byte per case (the hello deadline applies)."""
    data = frame(dumps(hello(rng, admin=False))) + frame(dumps(valid_frame(rng)))
    return Case(trickle=data, frames=2)


GENERATORS: dict[str, tuple[Generator, float]] = {
    "valid_frames": (case_valid, 30.0),
    "wrong_types": (case_wrong_types, 15.0),
    "unknown_op": (case_unknown_op, 6.0),
    "bad_json": (case_bad_json, 15.0),
    "invalid_utf8": (case_invalid_utf8, 8.0),
    "deep_nesting": (case_deep, 1.0),
    "bad_length": (case_bad_length, 6.0),
    "oversized": (case_oversized, 0.05),
    "big_payload": (case_big_payload, 0.1),
    "many_subscriptions": (case_many_subscriptions, 0.05),
    "interleave": (case_interleave, 8.0),
    "disconnect": (case_disconnect, 3.0),
    "hello_abuse": (case_hello_abuse, 4.0),
    "slow_writer": (case_slow_writer, 0.05),
}
"""Each case kind and its weight in the draw."""


# -- the worker -------------------------------------------------------------------------------


class Conn:
    """One raw connection; ``dead`` once the server closed it or a send failed."""

    def __init__(self, path: str, stats: dict[str, int]) -> None:
        self.stats = stats
        self.dead = False
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(2.0)
        stats["connections"] += 1
        try:
            self.sock.connect(path)
        except OSError:
            stats["connect_failures"] += 1
            self.dead = True

    def send(self, data: bytes) -> None:
        if self.dead:
            return
        try:
            self.sock.sendall(data)
            self.stats["bytes"] += len(data)
        except TimeoutError:
            self.stats["send_stalls"] += 1  # the server did not read 2 s worth of our bytes
            self.dead = True
        except OSError:
            self.dead = True

    def drain(self) -> None:
        """Read what the server sent (so its outbox never fills), without waiting."""
        if self.dead:
            return
        self.sock.settimeout(0.0)  # with a timeout, Python would wait for data first
        try:
            while True:
                if not self.sock.recv(1 << 20):
                    self.dead = True
                    return
        except BlockingIOError:
            pass
        except OSError:
            self.dead = True
            return
        self.sock.settimeout(2.0)

    def close(self, how: str = "close") -> None:
        if how == "reset":
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()
        self.dead = True


@dataclass(frozen=True)
class WorkerSpec:
    index: int
    label: str
    uid: int | None
    """None: the process's own uid (root: an admin)."""
    cases: int
    seed: str


def run_worker(spec: WorkerSpec, path: Path, deadline: float, out_fd: int) -> None:
    """Send ``spec.cases`` cases (or until ``deadline``, a monotonic time) and report them."""
    signal.alarm(max(1, int(deadline - time.monotonic()) + 30))  # a stuck worker ends itself
    if spec.uid is not None:
        os.setgroups([])
        os.setgid(65534)
        os.setuid(spec.uid)
    admin = spec.uid is None
    rng = random.Random(f"{spec.seed}:{spec.index}")
    names = list(GENERATORS)
    weights = [GENERATORS[n][1] for n in names]
    stats: dict[str, int] = collections.Counter()
    kinds: dict[str, int] = collections.Counter()
    last: collections.deque[str] = collections.deque(maxlen=12)
    sock_path = str(path)

    def fresh(with_hello: bool) -> Conn:
        conn = Conn(sock_path, stats)
        if with_hello:
            conn.send(frame(dumps(hello(hello_rng, admin=admin))))
        return conn

    # hellos of replacement connections come from their own stream: replacing a
    # connection depends on what the server did, and must not shift the case sequence
    hello_rng = random.Random(f"{spec.seed}:{spec.index}:hello")
    pool = [fresh(True) for _ in range(POOL)]
    trickles: list[tuple[Conn, bytes]] = []
    done = 0
    while done < spec.cases and time.monotonic() < deadline:
        name = rng.choices(names, weights)[0]
        case = GENERATORS[name][0](rng)
        done += 1
        kinds[name] += 1
        stats["frames"] += case.frames
        last.append(f"{done}:{name}")
        if case.trickle and len(trickles) < 2:
            trickles.append((fresh(False), case.trickle))
        own: Conn | None = None
        for slot, data in case.chunks:
            if slot < 0:
                if own is None:
                    own = fresh(not case.fresh_hello)
                own.send(data)
            else:
                if pool[slot].dead:
                    pool[slot].close()
                    pool[slot] = fresh(True)
                pool[slot].send(data)
        if own is not None:
            if case.end == "keep":
                own.drain()
                time.sleep(0.001)
                own.drain()
            own.close("reset" if case.end == "reset" else "close")
        elif case.end != "keep" and case.chunks:
            slot = case.chunks[-1][0]
            pool[slot].close(case.end)
        kept: list[tuple[Conn, bytes]] = []
        for conn, rest in trickles:
            conn.send(rest[:1])
            if rest[1:] and not conn.dead:
                kept.append((conn, rest[1:]))
            else:
                conn.drain()
                conn.close()
        trickles = kept
        for conn in pool:
            conn.drain()
        if done % 64 == 0:
            time.sleep(0.0005)  # let a single-core supervisor breathe a little
    for conn in pool:
        conn.close()
    for conn, _ in trickles:
        conn.close()
    report = {
        "index": spec.index,
        "label": spec.label,
        "seed": f"{spec.seed}:{spec.index}",
        "cases": done,
        "kinds": dict(kinds),
        "last": list(last),
        **stats,
    }
    os.write(out_fd, json.dumps(report).encode())
