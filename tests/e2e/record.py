"""Record the golden stream-json transcripts from a real Claude Code CLI.

    python -m tests.e2e.record                      # the pinned binary
    python -m tests.e2e.record --binary PATH        # another release
    make transcripts                                # the same as the first

Each scenario runs the real ``claude`` offline against the Messages API
stand-in (:mod:`tests.support.standin`), with the host of :mod:`tests.support.host`
answering its control requests, and writes the CLI's stdout, unedited but
for the host paths and the stand-in's port, to
``tests/fixtures/claude-code-<version>/<scenario>.jsonl``.  The protocol
tests (tests/unit/test_protocol.py) decode those files; re-recording for a
new release is this one command, then a look at what the tests say.

Paths are rewritten so a transcript does not depend on where it was made:
the temporary home becomes ``/home/svc/work`` and the stand-in's address
``127.0.0.1:8080``.  Scenarios that need a particular release behaviour
(``permission_mode_auto``: the default ``auto`` mode of 2.1.296 to 2.1.301)
are recorded only when the binary shows it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from pathlib import Path

import anyio

from sage.claude.binary import INSTALLED_BINARY, read_claude_version
from sage.claude.protocol import SystemApiRetry, encode_user_turn
from sage.errors import SageError
from tests.support.host import Host, claude_env, run_claude
from tests.support.standin import Error, Standin, Text, ToolUse

__all__ = ("FIXTURES", "SCENARIOS", "fixture_dir", "main", "record")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
HOME = "/home/svc/work"
STANDIN = "127.0.0.1:8080"
EXPLICIT_MODE = ("--permission-mode", "default")  # what sage passes
RETRIES = 4  # api_retry lines kept of the 401 run (the CLI would go on for minutes)
GREET = ToolUse("mcp__sage__greet", {"name": "Ada"})


def fixture_dir(version: str) -> Path:
    """Where the transcripts of one release live."""
    return FIXTURES / f"claude-code-{version}"


@dataclass(frozen=True)
class Run:
    """What a scenario needs: the binary, a stand-in and a fresh home."""

    binary: Path
    standin: Standin
    home: Path


Scenario = Callable[[Run], Awaitable[bytes | None]]


async def print_text_only(run: Run) -> bytes:
    """``claude -p PROMPT`` with stream-json output and the default tools."""
    run.standin.push(Text("hello from fake api"))
    argv = [str(run.binary), "-p", "say hello", "--output-format", "stream-json", "--verbose"]
    result = await anyio.run_process(
        [*argv, *EXPLICIT_MODE],
        env=claude_env(run.home, run.standin.url),
        cwd=run.home,
        check=True,
    )
    return result.stdout


async def permission_prompt(run: Run) -> bytes:
    """A tool that is not pre-allowed: ``can_use_tool``, allowed, then the call."""
    run.standin.push(GREET, Text("hello from fake api after tool"))
    async with _host(run, allowed_tools=(), permission_prompt=True, hooks=False) as host:
        await host.turn("greet Ada")
        return bytes(host.stdout)


async def tool_loop_with_hook_callback(run: Run) -> bytes:
    """A pre-allowed tool with a PreToolUse hook callback registered at initialize."""
    run.standin.push(GREET, Text("hello from fake api after tool"))
    async with _host(run, hooks=True) as host:
        await host.turn("greet Ada")
        return bytes(host.stdout)


async def tool_loop_partial(run: Run) -> bytes:
    """Two turns with partial messages: a tool loop with a prompt, then plain text."""
    run.standin.push(GREET, Text("hello after tool"), Text("second turn"))
    extra = ("--include-partial-messages",)
    async with _host(run, allowed_tools=(), permission_prompt=True, extra=extra) as host:
        await host.turn("greet Ada")
        await host.turn("again")
        return bytes(host.stdout)


async def api_retry_401_truncated(run: Run) -> bytes:
    """A bad key: the CLI retries with growing delays; cut after a few retries."""
    run.standin.default = Error(401, "authentication_error", "invalid x-api-key")
    async with _host(run, permission_prompt=True) as host:
        await host.write(encode_user_turn("hello"))
        await host.wait_until(
            lambda: sum(isinstance(m, SystemApiRetry) for m in host.inbox) >= RETRIES
        )
        return _first_lines(bytes(host.stdout), _retry_cut(bytes(host.stdout)))


async def permission_mode_auto(run: Run) -> bytes | None:
    """No ``--permission-mode``: on a release whose default is ``auto`` the CLI's own
    classifier decides (``system/permission_denied``); sage must never run this way."""
    run.standin.push(GREET, Text("after the classifier"))
    async with _host(run, allowed_tools=(), permission_prompt=True, mode=()) as host:
        await host.turn("greet Ada")
        if b'"permissionMode":"auto"' not in host.stdout:
            return None  # this release defaults to "default": nothing to record
        return bytes(host.stdout)


SCENARIOS: dict[str, Scenario] = {
    "print_text_only": print_text_only,
    "permission_prompt": permission_prompt,
    "tool_loop_with_hook_callback": tool_loop_with_hook_callback,
    "tool_loop_partial": tool_loop_partial,
    "api_retry_401_truncated": api_retry_401_truncated,
    "permission_mode_auto": permission_mode_auto,
}


def _host(
    run: Run,
    *,
    allowed_tools: tuple[str, ...] = ("mcp__sage__greet",),
    permission_prompt: bool = False,
    hooks: bool = False,
    extra: tuple[str, ...] = (),
    mode: tuple[str, ...] = EXPLICIT_MODE,
) -> AbstractAsyncContextManager[Host]:
    return run_claude(
        run.binary,
        run.standin.url,
        run.home,
        allowed_tools=allowed_tools,
        permission_prompt=permission_prompt,
        hooks=hooks,
        extra=(*mode, *extra),
    )


def _retry_cut(stdout: bytes) -> int:
    """How many lines end with the RETRIES-th api_retry line."""
    seen = 0
    for number, line in enumerate(stdout.splitlines(), 1):
        if b'"subtype":"api_retry"' in line:
            seen += 1
            if seen == RETRIES:
                return number
    return len(stdout.splitlines())


def _first_lines(data: bytes, n: int) -> bytes:
    return b"".join(line + b"\n" for line in data.splitlines()[:n])


def normalize(data: bytes, home: Path, port: int) -> bytes:
    """Rewrite the run's home and the stand-in's address to fixed strings."""
    real = os.fsencode(home)
    out = data.replace(os.fsencode(os.path.realpath(home)), HOME.encode())
    out = out.replace(real, HOME.encode())
    out = re.sub(rb"(127\.0\.0\.1|localhost):%d\b" % port, STANDIN.encode(), out)
    return out if out.endswith(b"\n") or not out else out + b"\n"


async def record(binary: Path, out: Path | None = None, only: list[str] | None = None) -> Path:
    """Run every scenario (or ``only`` those) against ``binary``; the folder written."""
    version = await read_claude_version(binary)
    target = out or fixture_dir(version)
    target.mkdir(parents=True, exist_ok=True)
    for name, scenario in SCENARIOS.items():
        if only and name not in only:
            continue
        async with Standin() as standin:
            with tempfile.TemporaryDirectory(prefix="sage-record-") as tmp:
                home = Path(tmp)
                with anyio.fail_after(120):
                    data = await scenario(Run(binary, standin, home))
                if data is None:
                    print(f"  {name}: not shown by {version}, skipped", file=sys.stderr)
                    continue
                text = normalize(data, home, standin.port)
        path = target / f"{name}.jsonl"
        path.write_bytes(text)
        print(f"  {name}: {len(text.splitlines())} lines -> {path}", file=sys.stderr)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.e2e.record",
        description="Record golden stream-json transcripts from a real Claude Code CLI "
        "into tests/fixtures/claude-code-<version>/.",
    )
    parser.add_argument(
        "--binary",
        type=Path,
        default=Path(os.environ.get("SAGE_CLAUDE_BIN") or INSTALLED_BINARY),
        help="the claude binary (default: $SAGE_CLAUDE_BIN, else the pinned one in .tools/)",
    )
    parser.add_argument("--out", type=Path, help="write here instead of tests/fixtures/...")
    parser.add_argument(
        "scenario", nargs="*", help=f"scenarios to record (default all: {', '.join(SCENARIOS)})"
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.scenario) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    binary = args.binary.absolute()
    if not binary.is_file():
        parser.error(f"{binary}: no such file (run `make setup`)")
    print(f"recording {binary}", file=sys.stderr)
    try:
        anyio.run(record, binary, args.out, args.scenario or None)
    except SageError as exc:
        print(f"record: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
