"""The astrid command table: each command parsed as the whole parser would, and a start
that imports only what the command needs (every command starts a Python)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from sage.cli import build_parser
from sage.cli._commands import COMMANDS


def _choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_astrid_help_from_the_table_is_the_whole_parsers() -> None:
    """The table's lines, in its order, are what the command modules register."""
    whole = build_parser()
    assert list(_choices(whole)) == list(COMMANDS)
    assert build_parser(listing=True).format_help() == whole.format_help()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_alone_parses_as_in_the_whole_parser(command: str) -> None:
    """The module the table names registers the command, with every option and action."""
    alone = _choices(build_parser(command))[command]
    assert alone.format_help() == _choices(build_parser())[command].format_help()


def _loaded(*argv: str) -> set[str]:
    """The modules ``astrid ARGV`` imported (run in a fresh interpreter)."""
    code = (
        "import sys\n"
        "from sage.cli import main\n"
        "try:\n"
        f"    main({list(argv)!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(done.stderr.splitlines()[-1].split())


def test_astrid_help_imports_no_command() -> None:
    """Listing the commands loads none of them, nor msgspec, anyio or the config."""
    loaded = _loaded("--help")
    assert not {f"sage.cli.{m}" for m, _ in COMMANDS.values()} & loaded
    assert not {"msgspec", "anyio", "asyncio", "sage.config"} & loaded


def test_astrid_status_imports_no_event_loop() -> None:
    """status asks once, without anyio or asyncio, and loads no other command."""
    loaded = _loaded("status", "--config", "/nonexistent/supervisor.toml")
    assert "sage.cli.status" in loaded
    assert not {"anyio", "asyncio", "structlog", "bus.broker", "sage.cli.sage_cmd"} & loaded


def test_astrid_sage_send_imports_no_event_loop() -> None:
    """send follows its turn with the blocking client: no anyio, asyncio or ssl, and
    not the stream decoder (it sizes the turn with one encoder)."""
    loaded = _loaded("sage", "send", "s1", "hi", "--config", "/nonexistent/supervisor.toml")
    assert "sage.cli.turn" in loaded
    assert not {"anyio", "asyncio", "ssl", "sage.claude.protocol.decoder"} & loaded
