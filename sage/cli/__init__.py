"""The ``astrid`` command line.

One module per command group registers its sub-commands with
:func:`argparse`; :func:`main` parses, runs the chosen handler and turns every
:class:`sage.errors.SageError` (and bus error) into one line on stderr with a
non-zero exit.  A handler is a plain function ``(args) -> int`` or a
coroutine function, run under anyio.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from bus import BusError, sole_error
from sage.cli._common import printable
from sage.errors import SageError

__all__ = ("build_parser", "main")


def _groups() -> list[Any]:
    from sage.cli import (
        audit,
        bus_cmd,
        capsule_cmd,
        config_cmd,
        doctor,
        fleet_cmd,
        forge_cmd,
        llm_cmd,
        mcp_cmd,
        sage_cmd,
        status,
        supervisor_cmd,
    )

    return [
        supervisor_cmd,
        config_cmd,
        status,
        doctor,
        sage_cmd,
        capsule_cmd,
        bus_cmd,
        audit,
        forge_cmd,
        llm_cmd,
        mcp_cmd,
        fleet_cmd,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="astrid",
        description="Drive the sage supervisor: bus, audit log, sessions.",
        epilog="Each command takes --config FILE (or ASTRID_CONFIG) and most take --json, after"
        " the command or before it (astrid --config x.toml status). See `astrid COMMAND --help`.",
    )
    # also accepted before the command (astrid --config x.toml status); after it wins
    parser.add_argument("--config", metavar="FILE", dest="top_config", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", dest="top_json", help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in _groups():
        group.register(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    """Parse ``words``; for a command that passes arguments through (``astrid sage repl
    NAME -- ARGS``, which has ``claude_args``) everything after the first ``--`` is
    passed as is: argparse would read it against the positionals, or refuse it.
    ``--config`` and ``--json`` given before the command apply to it."""
    args: argparse.Namespace | None = None
    if "--" in words:
        cut = words.index("--")
        head = parser.parse_args(words[:cut])
        if hasattr(head, "claude_args"):
            head.claude_args = [*(head.claude_args or []), *words[cut + 1 :]]
            args = head
    if args is None:
        args = parser.parse_args(words)  # "--" keeps its usual meaning (bus pub T -- -1)
    if args.top_config is not None and getattr(args, "config", None) is None:
        if not hasattr(args, "config"):
            parser.error(f"astrid {args.command} takes no --config")
        args.config = args.top_config
    if args.top_json:
        if not hasattr(args, "json"):
            parser.error(f"astrid {args.command} has no --json output")
        args.json = True
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parse(parser, words)
    handler = args.handler
    try:
        try:
            is_async = inspect.iscoroutinefunction(handler)
            code = anyio.run(handler, args) if is_async else handler(args)
        except BaseExceptionGroup as group:
            raise sole_error(group) from None
    except (SageError, BusError) as exc:
        print(f"astrid: {printable(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    return int(code or 0)
