"""tests/support/as_uid.py, which the root-only tests rely on to act as other uids:
the child's lines reach the test, its failure is a line and an exit status, and
it never returns into pytest."""

from __future__ import annotations

import os

import pytest

from tests.support.as_uid import NOGROUP, Say, fork_as


def _finish(pid: int, fd: int) -> tuple[list[str], int]:
    with os.fdopen(fd) as lines:
        out = lines.read().splitlines()
    _, status = os.waitpid(pid, 0)
    return out, os.waitstatus_to_exitcode(status)


def test_the_childs_lines_reach_the_test_and_it_exits_0() -> None:
    async def main(say: Say) -> None:
        say("one")
        say(f"pid {os.getpid()}")

    pid, fd = fork_as(None, main)
    assert pid != os.getpid()
    assert _finish(pid, fd) == (["one", f"pid {pid}"], 0)


def test_a_failing_child_reports_and_exits_1() -> None:
    async def main(say: Say) -> None:
        say("started")
        raise LookupError("no such thing")

    pid, fd = fork_as(None, main)
    out, code = _finish(pid, fd)
    assert out == ["started", "error LookupError('no such thing')"]
    assert code == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to take another uid")
def test_the_child_runs_as_the_uid_with_group_nogroup_only() -> None:
    async def main(say: Say) -> None:
        say(f"{os.getuid()} {os.geteuid()} {os.getgid()} {os.getgroups()}")

    pid, fd = fork_as(91001, main)
    assert _finish(pid, fd) == ([f"91001 91001 {NOGROUP} []"], 0)
