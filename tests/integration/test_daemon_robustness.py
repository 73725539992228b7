"""Peers that misbehave never take the supervisor down (found in review, pinned here)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from bus import BusError
from bus.unix import ensure_private_dir
from tests.support.daemon import ASTRID, Daemon, short_dir


def _frame(obj: object) -> bytes:
    body = obj if isinstance(obj, bytes) else msgspec.json.encode(obj)
    return struct.pack(">I", len(body)) + body


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(short_dir()).start()
    yield d
    assert d.proc is not None
    assert d.proc.poll() is None, "the supervisor died"
    assert d.stop() == 0


def test_many_peers_that_hang_up_at_once(daemon: Daemon) -> None:
    """Fifty peers that send a bad first frame and close at once leave the daemon serving."""
    socks = [_connect(daemon.socket) for _ in range(50)]
    for sock in socks:
        sock.sendall(_frame({"t": "pub", "topic": "a", "payload": 1}))
    for sock in socks:
        sock.close()
    time.sleep(0.3)
    assert daemon.status()["pid"]


def test_deeply_nested_frame_is_a_bad_frame(daemon: Daemon) -> None:
    """A frame nested thousands deep is refused with an error, before or after hello."""
    deep = b'{"t":"pub","topic":"demo.x","payload":' + b"[" * 5000 + b"]" * 5000 + b"}"
    sock = _connect(daemon.socket)
    sock.sendall(
        _frame({"t": "hello", "role": "cli"}) + _frame(deep) + _frame({"t": "ping", "n": 9})
    )
    sock.settimeout(5)
    data = b""
    while b'"pong"' not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed; got {data!r}"
        data += chunk
    assert b"nested too deeply" in data
    sock.close()
    raw = _connect(daemon.socket)
    raw.sendall(_frame(deep))
    raw.close()
    time.sleep(0.2)
    assert daemon.status()["pid"]


def test_subscriber_that_leaves_with_unread_messages(daemon: Daemon) -> None:
    """A subscriber that closes while messages are queued for it does not crash the daemon."""
    for _ in range(3):
        sub = subprocess.Popen(
            [*ASTRID, "bus", "sub", "demo.>", "-n", "1", "--config", str(daemon.config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)
        payload = '{"x": "' + "y" * 50000 + '"}'
        pubs = [
            subprocess.Popen(
                [*ASTRID, "bus", "pub", "demo.flood", payload, "--config", str(daemon.config)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for _ in range(4)
        ]
        for pub in pubs:
            pub.wait(20)
        sub.wait(20)
    assert daemon.status()["pid"]


def test_hello_trickled_byte_by_byte_still_times_out() -> None:
    """The hello deadline is for the whole handshake, not for each read."""
    d = Daemon(short_dir(), extra="[socket]\nhello_timeout = 1.0\n").start()
    try:
        sock = _connect(d.socket)
        sock.settimeout(0.3)
        hello = _frame({"t": "hello", "role": "cli", "name": "a-slow-client"})
        start = time.monotonic()
        closed = False
        for byte in hello[:-1]:  # about 50 bytes, 0.3 s apart: 15 s if never cut off
            try:
                sock.sendall(bytes([byte]))
                data = sock.recv(65536)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                closed = True
                break
            if data == b"" or b'"timeout"' in data:
                closed = True
                break
        elapsed = time.monotonic() - start
        assert closed, "a trickled hello kept the connection open past the deadline"
        assert elapsed < 10
        sock.close()
    finally:
        assert d.stop() == 0


def test_world_writable_folder_is_refused_not_chmodded(tmp_path: Path) -> None:
    """An existing folder others can write to is refused and left as it was."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(BusError, match="writable by others"):
        ensure_private_dir(shared)
    assert shared.stat().st_mode & 0o7777 == 0o1777


def test_new_folder_is_created_private(tmp_path: Path) -> None:
    """A folder the supervisor creates is 0700; an existing private one is kept."""
    target = tmp_path / "a" / "run"
    ensure_private_dir(target)
    assert target.stat().st_mode & 0o777 == 0o700
    os.chmod(target, 0o750)
    ensure_private_dir(target)
    assert target.stat().st_mode & 0o777 == 0o700


def test_payloads_that_are_not_utf8_reach_neither_a_capsule_nor_a_subscriber(
    daemon: Daemon,
) -> None:
    """b'"\\xff"' requested of demo.v1.echo crashed the echo capsule into failed, and one
    published on demo.bad killed an admin's astrid bus sub: both are refused at the server."""
    before = daemon.status()["bus"]["subscriptions"]
    sub = subprocess.Popen(
        [*ASTRID, "bus", "sub", "demo.>", "-n", "1", "--config", str(daemon.config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 10
    while daemon.status()["bus"]["subscriptions"] <= before:
        assert time.monotonic() < deadline, "astrid bus sub never subscribed"
        time.sleep(0.05)
    sock = _connect(daemon.socket)
    sock.sendall(
        _frame({"t": "hello", "role": "cli"})
        + b"".join(
            _frame(b'{"t":"req","rid":%d,"topic":"demo.v1.echo","payload":"\xff"}' % i)
            for i in range(8)
        )
        + _frame(b'{"t":"pub","topic":"demo.bad","payload":"\xff"}')
        + _frame({"t": "pub", "topic": "demo.good", "payload": {"ok": 1}})
        + _frame({"t": "ping", "n": 1})
    )
    sock.settimeout(10)
    data = b""
    while b'"pong"' not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed; got {data!r}"
        data += chunk
    sock.close()
    assert data.count(b'"bad_payload"') == 9
    out, err = sub.communicate(timeout=20)
    assert sub.returncode == 0, err
    assert [msgspec.json.decode(line)["topic"] for line in out.splitlines()] == ["demo.good"]
    echo = next(c for c in daemon.status()["capsules"] if c["name"] == "echo")
    assert (echo["state"], echo["restarts"]) == ("running", 0)
    answer = daemon.astrid("bus", "request", "demo.v1.echo", '{"hi": 1}')
    assert answer.returncode == 0, answer.stderr


def test_the_log_stays_json_lines_while_slow_consumers_are_cut_off_mid_read() -> None:
    """Subscribers that never read but keep writing are cut off as slow consumers while their
    socket is readable: anyio's own stream then made asyncio print InvalidStateError
    tracebacks (191 under fuzzing). Every line of the supervisor's log must stay JSON."""
    import json
    import threading

    d = Daemon(
        short_dir(),
        "capsules = []\n[bus]\nqueue_size = 4\nslow_consumer_timeout = 0.01\n",
    ).start()
    stop = time.monotonic() + 4.0

    def victim() -> None:
        while time.monotonic() < stop:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(str(d.socket))
            sock.sendall(
                _frame({"t": "hello", "role": "cli"})
                + _frame({"t": "sub", "sid": 1, "pattern": "demo.>"})
            )
            sock.settimeout(0.5)
            with contextlib.suppress(OSError):
                for i in range(2000):  # never reads; writes until it is cut off
                    sock.send(_frame({"t": "ping", "n": i}))
                    time.sleep(0.0005)
            sock.close()

    def publisher() -> None:
        sock = _connect(d.socket)
        sock.sendall(_frame({"t": "hello", "role": "cli"}))
        sock.settimeout(10)
        burst = _frame({"t": "pub", "topic": "demo.x", "payload": {"x": "y" * 20000}}) * 20
        while time.monotonic() < stop:
            sock.sendall(burst + _frame({"t": "ping", "n": 1}))
            sock.recv(65536)
        sock.close()

    threads = [threading.Thread(target=victim) for _ in range(6)]
    threads += [threading.Thread(target=publisher) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert d.status()["pid"]
    finally:
        assert d.stop() == 0
    lines = d.log().splitlines()
    not_json = []
    for line in lines:
        try:
            json.loads(line)
        except ValueError:
            not_json.append(line)
    assert not_json == [], f"{len(not_json)} lines are not JSON, e.g. {not_json[:6]}"
    assert not [line for line in lines if '"asyncio.error"' in line]  # nor errors in JSON
    assert sum('"bus.disconnect"' in line for line in lines) >= 50  # it was provoked
