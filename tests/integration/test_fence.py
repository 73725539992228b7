"""The fence process (sage/fence.py) with real processes: below this test's process, a
session's child (its own group, ASTRID_SESSION_ID in its environment, a grandchild in
its group) and a process that is no session's child; grants on the fence's stdin."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sage.fence import session_groups

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
WITH_GRANDCHILD = [
    sys.executable,
    "-c",
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c',"
    " 'import time; time.sleep(60)']); time.sleep(60)",
]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ASTRID_SESSION_ID"}
    return {**env, **extra}


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stderr):
            if pipe is not None:
                pipe.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            return file.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def wait(check: object, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if callable(check) and check():
            return True
        time.sleep(0.02)
    return False


def test_a_lost_lease_kills_the_sessions_groups_and_nothing_else(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    session = subprocess.Popen(
        WITH_GRANDCHILD, env=_env(ASTRID_SESSION_ID="s1"), start_new_session=True
    )
    other = subprocess.Popen(SLEEPER, env=_env(), start_new_session=True)
    procs += [session, other]
    assert wait(lambda: session_groups(os.getpid()) == [session.pid], 5.0)

    def grandchildren() -> list[int]:
        return [
            int(p)
            for p in os.listdir("/proc")
            if p.isdigit() and p != str(session.pid) and _pgid(int(p)) == session.pid
        ]

    assert wait(grandchildren, 5.0)
    (grandchild,) = grandchildren()
    fence = subprocess.Popen(
        [sys.executable, "-m", "sage.fence", str(os.getpid())],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    procs.append(fence)
    assert fence.stdin is not None
    fence.stdin.write(f"{time.monotonic() + 0.5!r}\n".encode())
    fence.stdin.flush()
    time.sleep(0.3)
    assert alive(session.pid)  # the lease holds
    assert wait(lambda: not alive(session.pid), 3.0), "the session's child outlived its lease"
    assert wait(lambda: not alive(grandchild), 3.0), "its tool outlived the lease"
    assert alive(other.pid)  # no session's child: left alone
    assert session.wait() == -9

    # lost: a child started now goes too; a new grant stops the killing
    late = subprocess.Popen(SLEEPER, env=_env(ASTRID_SESSION_ID="s2"), start_new_session=True)
    procs.append(late)
    assert wait(lambda: not alive(late.pid), 3.0)
    fence.stdin.write(f"{time.monotonic() + 30!r}\n".encode())
    fence.stdin.flush()
    time.sleep(0.2)
    kept = subprocess.Popen(SLEEPER, env=_env(ASTRID_SESSION_ID="s3"), start_new_session=True)
    procs.append(kept)
    time.sleep(0.5)
    assert alive(kept.pid)
    fence.stdin.close()  # the supervisor is gone: the fence ends
    assert fence.wait(timeout=5) == 0
    assert fence.stderr is not None
    said = fence.stderr.read().decode()
    assert f"killed group {session.pid}" in said
    assert alive(kept.pid)


def test_a_fence_without_a_grant_kills_nothing(procs: list[subprocess.Popen[bytes]]) -> None:
    session = subprocess.Popen(SLEEPER, env=_env(ASTRID_SESSION_ID="s1"), start_new_session=True)
    procs.append(session)
    fence = subprocess.Popen(
        [sys.executable, "-m", "sage.fence", str(os.getpid())], stdin=subprocess.PIPE, env=_env()
    )
    procs.append(fence)
    time.sleep(0.5)
    assert alive(session.pid)  # a node that never held a lease has nothing to fence
    assert fence.stdin is not None
    fence.stdin.write(b"not a number\n")
    fence.stdin.close()
    assert fence.wait(timeout=5) == 0
    assert alive(session.pid)
    bad = subprocess.run(
        [sys.executable, "-m", "sage.fence"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2
    assert "usage: python -m sage.fence ROOT_PID" in bad.stderr


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
