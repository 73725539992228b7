"""Fixtures for the end-to-end tests against the real Claude Code CLI."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest

from sage.claude.binary import AUTO_DEFAULT_WITNESS
from tests.support.host import FINDINGS, Host, run_claude
from tests.support.standin import Standin

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "node_modules/@anthropic-ai/claude-code-linux-x64/claude"
#: The binary under test: $SAGE_CLAUDE_BIN (the CI matrix sets it for the floor and
#: the newest release; `make setup` installs them under .tools/<version>/), else the pin.
CLAUDE_BIN = Path(os.environ.get("SAGE_CLAUDE_BIN") or ROOT / ".tools" / NATIVE)
#: A release whose -p default permission mode is "auto" (2.1.296 to 2.1.301).
AUTO_DEFAULT_VERSION = AUTO_DEFAULT_WITNESS
AUTO_DEFAULT_BIN = ROOT / ".tools" / AUTO_DEFAULT_VERSION / NATIVE


@pytest.fixture
def claude_bin() -> Path:
    """The native CLI binary under test; a missing one is a failure, never a skip."""
    if not CLAUDE_BIN.is_file():
        pytest.fail(f"Claude Code CLI not found at {CLAUDE_BIN}: run `make setup`", pytrace=False)
    return CLAUDE_BIN


@pytest.fixture
def auto_default_claude_bin() -> Path:
    """The release whose default mode is auto, which `make setup` installs as a witness."""
    if not AUTO_DEFAULT_BIN.is_file():
        pytest.fail(f"{AUTO_DEFAULT_BIN} missing: run `make setup`", pytrace=False)
    return AUTO_DEFAULT_BIN


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
