"""What the command modules share that is not a connection: the common flags, the runner call.

It imports nothing of ``sage.cli`` (which imports the command modules), so a
command module can import it without a cycle; and nothing heavy, since
:mod:`sage.cli` imports it for ``astrid --help`` too.
"""

from __future__ import annotations

import argparse
import re

from sage.routing import call_runner

__all__ = ("add_common", "call_runner", "printable")  # call_runner: sage.routing's

_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_CONTROLS_AND_LINES = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object, *, lines: bool = False) -> str:
    """``text`` safe for a terminal: control characters (escape sequences, carriage
    returns...) shown as ``\\xNN``, so what a capsule, a tool or Claude wrote cannot
    move the cursor, rewrite what is shown or retitle the window.  ``lines`` keeps
    newlines and tabs (a tool's source)."""
    pattern = _CONTROLS if lines else _CONTROLS_AND_LINES
    return pattern.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def add_common(parser: argparse.ArgumentParser, *, json_output: bool = True) -> None:
    """Give a command the flags every command takes."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="supervisor.toml to use (default: $ASTRID_CONFIG, else the embedded defaults)",
    )
    if json_output:
        parser.add_argument("--json", action="store_true", help="print JSON for programs")
