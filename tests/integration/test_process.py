"""sage.process with real processes: groups, death signal, pipes, the stop sequence."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import pytest

from sage.errors import ProcessError
from sage.process import Child, ExitStatus, Ring, stop

pytestmark = pytest.mark.anyio

ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}


async def _read_all(child: Child, which: str = "stdout") -> bytes:
    read = child.read_stdout if which == "stdout" else child.read_stderr
    out = bytearray()
    while chunk := await read():
        out += chunk
    return bytes(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def test_ring_keeps_the_tail() -> None:
    ring = Ring(4)
    ring.append(b"ab")
    ring.append(b"cdef")
    assert ring.tail() == b"cdef"
    ring.append(b"g")
    assert ring.tail() == b"defg"
    ring.append(b"0123456789")
    assert ring.tail() == b"6789"
    assert ring.total == 17
    assert Ring(8).text() == ""


async def test_output_env_and_group(tmp_path: Path) -> None:
    child = Child.spawn(
        ["/bin/sh", "-c", 'echo "$FOO $HOME"; env | sort; ps -o pgid= -p $$'],
        env={**ENV, "FOO": "bar", "HOME": str(tmp_path)},
        cwd=tmp_path,
    )
    try:
        out = await _read_all(child)
        status = await child.wait()
    finally:
        child.close()
    lines = out.decode().splitlines()
    assert lines[0] == f"bar {tmp_path}"
    names = {line.split("=", 1)[0] for line in lines[1:-1]}
    assert names <= {"FOO", "HOME", "PATH", "LC_ALL", "PWD", "SHLVL", "_", "OLDPWD"}
    assert int(lines[-1]) == child.pid  # its own process group
    assert status == ExitStatus(exit_code=0)


async def test_write_and_eof(tmp_path: Path) -> None:
    child = Child.spawn(["/bin/cat"], env=ENV, cwd=tmp_path)
    try:
        await child.write(b"hello\n")
        assert await child.read_stdout() == b"hello\n"
        big = b"x" * (1 << 20)
        async with anyio.create_task_group() as tg:
            got = bytearray()

            async def reader() -> None:
                while len(got) < len(big):
                    got.extend(await child.read_stdout())

            tg.start_soon(reader)
            await child.write(big)  # larger than the pipe: needs the concurrent reader
        assert bytes(got) == big
        child.close_stdin()
        assert await child.wait() == ExitStatus(exit_code=0)
        with pytest.raises(ProcessError, match="input is closed"):
            await child.write(b"more")
    finally:
        child.close()


async def test_write_to_a_child_that_stopped_reading(tmp_path: Path) -> None:
    child = Child.spawn(["/bin/sh", "-c", "exec 0<&-; exit 0"], env=ENV, cwd=tmp_path)
    try:
        await child.wait()
        with pytest.raises(ProcessError, match="stopped reading"):
            await child.write(b"x" * 100_000)
    finally:
        child.close()


async def test_missing_binary_and_cwd(tmp_path: Path) -> None:
    with pytest.raises(ProcessError, match="cannot start"):
        Child.spawn([str(tmp_path / "nope")], env=ENV, cwd=tmp_path)
    with pytest.raises(ProcessError, match="in "):
        Child.spawn(["/bin/true"], env=ENV, cwd=tmp_path / "missing")
    with pytest.raises(ProcessError, match="empty"):
        Child.spawn([], env=ENV, cwd=tmp_path)


async def test_stderr_flood_does_not_stall_stdout(tmp_path: Path) -> None:
    script = "head -c 10000000 /dev/zero >&2; echo done"
    child = Child.spawn(["/bin/sh", "-c", script], env=ENV, cwd=tmp_path)
    ring = Ring(4096)

    async def drain() -> None:
        while chunk := await child.read_stderr():
            ring.append(chunk)

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(drain)
                assert await _read_all(child) == b"done\n"
        assert ring.total == 10_000_000
        assert len(ring.tail()) == 4096
        assert (await child.wait()).exit_code == 0
    finally:
        child.close()


async def test_exit_is_seen_while_a_grandchild_holds_the_pipes(tmp_path: Path) -> None:
    child = Child.spawn(["/bin/sh", "-c", "sleep 300 & echo $!; exit 3"], env=ENV, cwd=tmp_path)
    try:
        grandchild = int((await child.read_stdout()).decode())
        with anyio.fail_after(5):
            assert await child.wait() == ExitStatus(exit_code=3)
        # the leader's group was killed before it was reaped
        assert _gone(grandchild)
        with anyio.fail_after(5):
            assert await child.read_stdout() == b""
    finally:
        child.close()


async def test_stop_sequence_steps(tmp_path: Path) -> None:
    # 1. ends on end of input
    cat = Child.spawn(["/bin/cat"], env=ENV, cwd=tmp_path)
    t0 = time.monotonic()
    assert await stop(cat, grace=5) == ExitStatus(exit_code=0)
    assert time.monotonic() - t0 < 2
    cat.close()
    # 2. needs SIGTERM
    sleeper = Child.spawn(["/bin/sleep", "300"], env=ENV, cwd=tmp_path)
    assert await stop(sleeper, grace=0.2) == ExitStatus(signal=signal.SIGTERM)
    sleeper.close()
    # 3. ignores SIGTERM: SIGKILL
    stubborn = Child.spawn(
        ["/bin/sh", "-c", "trap '' TERM; echo ready; while :; do sleep 0.05; done"],
        env=ENV,
        cwd=tmp_path,
    )
    assert await stubborn.read_stdout() == b"ready\n"
    t0 = time.monotonic()
    assert await stop(stubborn, grace=0.2) == ExitStatus(signal=signal.SIGKILL)
    assert 0.35 < time.monotonic() - t0 < 3
    stubborn.close()


async def test_stop_with_a_gentler_first_step(tmp_path: Path) -> None:
    child = Child.spawn(["/bin/sh", "-c", "read line; exit 7"], env=ENV, cwd=tmp_path)

    async def ask() -> None:
        await child.write(b"please stop\n")

    try:
        assert await stop(child, grace=5, end_input=ask) == ExitStatus(exit_code=7)
    finally:
        child.close()


async def test_two_waiters_see_the_same_status(tmp_path: Path) -> None:
    child = Child.spawn(["/bin/sh", "-c", "sleep 0.2; exit 4"], env=ENV, cwd=tmp_path)
    results: list[ExitStatus] = []

    async def waiter() -> None:
        results.append(await child.wait())

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
        assert results == [ExitStatus(exit_code=4)] * 2
    finally:
        child.close()


async def test_cancelled_reader_leaves_nothing_behind(tmp_path: Path) -> None:
    child = Child.spawn(["/bin/sleep", "300"], env=ENV, cwd=tmp_path)
    with anyio.move_on_after(0.2):
        await child.read_stdout()
    cpu0 = time.process_time()
    await anyio.sleep(0.3)
    assert time.process_time() - cpu0 < 0.1  # no spinning after the cancel
    child.close()  # kills the group
    with anyio.fail_after(5):
        assert (await child.wait()).signal == signal.SIGKILL
    assert not _alive(child.pid)


def test_children_die_with_the_supervisor(tmp_path: Path) -> None:
    """PR_SET_PDEATHSIG: a parent that dies without cleaning up takes its child along."""
    script = textwrap.dedent(
        f"""
        import anyio, os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from sage.process import Child

        async def main():
            child = Child.spawn(["/bin/sleep", "300"], env={{"PATH": "/bin"}}, cwd="/")
            print(child.pid, flush=True)
            os._exit(0)  # no cleanup at all

        anyio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    pid = int(out.stdout.strip())
    assert _gone(pid), "the child outlived its parent"


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid change needs root")
def test_a_child_that_changes_uid_still_dies_with_its_parent_and_its_group() -> None:
    """A uid change clears PR_SET_PDEATHSIG; the runner's setpriv prefix sets it again,
    and root still signals the group of a child that runs as another uid."""
    from sage.security.runas import RunAs, setpriv_prefix

    prefix = setpriv_prefix(RunAs(91001, 91001, (91000,)))
    script = textwrap.dedent(
        f"""
        import anyio, os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from sage.process import Child

        async def main():
            child = Child.spawn({prefix!r} + ["/bin/sleep", "300"], env={{"PATH": "/bin"}},
                                cwd="/")
            await anyio.sleep(0.3)  # setpriv has changed the uid and exec'd sleep
            print(child.pid, flush=True)
            os._exit(0)  # no cleanup at all

        anyio.run(main)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=30, check=True
    )
    pid = int(out.stdout.strip())
    assert _gone(pid), "the child outlived its parent across the uid change"


@pytest.mark.skipif(os.geteuid() != 0, reason="a uid change needs root")
async def test_the_group_of_a_child_of_another_uid_is_stopped() -> None:
    from sage.security.runas import RunAs, setpriv_prefix

    prefix = setpriv_prefix(RunAs(91001, 91001, (91000,)))
    child = Child.spawn(
        [*prefix, "/bin/sh", "-c", "trap '' TERM; /bin/sleep 300 & wait"],
        env={"PATH": "/bin"},
        cwd="/",
    )
    await anyio.sleep(0.3)
    status_text = await anyio.Path(f"/proc/{child.pid}/status").read_text()
    assert "Uid:\t91001\t91001\t91001\t91001" in status_text
    with anyio.fail_after(10):
        status = await stop(child, grace=0.3)
    assert status.signal == signal.SIGKILL  # SIGTERM ignored, SIGKILL to the group
    child.close()
