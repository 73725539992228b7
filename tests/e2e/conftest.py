"""Fixtures for the end-to-end tests against the real Claude Code CLI."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.host import FINDINGS, Host, run_claude
from tests.e2e.standin import Standin

CLAUDE_BIN = (
    Path(__file__).resolve().parents[2]
    / ".tools/node_modules/@anthropic-ai/claude-code-linux-x64/claude"
)


@pytest.fixture
def anyio_backend() -> str:
    """The event loop every e2e test runs on."""
    return "asyncio"


@pytest.fixture
def claude_bin() -> Path:
    """The pinned native CLI binary; a missing one is a failure, never a skip."""
    if not CLAUDE_BIN.is_file():
        pytest.fail(f"Claude Code CLI not found at {CLAUDE_BIN}: run `make setup`", pytrace=False)
    return CLAUDE_BIN


@pytest.fixture
async def standin(request: pytest.FixtureRequest) -> AsyncIterator[Standin]:
    """A Messages API stand-in per test (param True: answer with Connection: close)."""
    server = Standin(connection_close=getattr(request, "param", False))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
        FINDINGS["standin_calls"].update(server.calls())


@pytest.fixture
def claude_home(tmp_path: Path) -> Path:
    """HOME and working directory of the CLI."""
    home = tmp_path / "home"
    home.mkdir()
    return home


@pytest.fixture
def claude(
    claude_bin: Path, standin: Standin, claude_home: Path
) -> Callable[..., AbstractAsyncContextManager[Host]]:
    """``async with claude(**options) as host``: a running, initialized CLI."""
    run: Callable[..., AbstractAsyncContextManager[Host]] = functools.partial(
        run_claude, claude_bin, standin.url, claude_home
    )
    return run


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Report protocol findings: unknown message types and what the CLI called."""
    if not any(FINDINGS.values()):
        return
    terminalreporter.section("e2e protocol findings")
    for name, counts in FINDINGS.items():
        items = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none"
        terminalreporter.write_line(f"{name}: {items}")
