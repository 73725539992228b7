"""The ``astrid`` command line.

One module per command group registers its sub-commands with
:func:`argparse`; :func:`main` parses, runs the chosen handler and turns every
:class:`sage.errors.SageError` (and bus error) into one line on stderr with a
non-zero exit.  A handler is a plain function ``(args) -> int`` or a
coroutine function, run under anyio.

Every command starts a Python, so the start is kept short: a command's
module (and what it imports) is imported only when that command runs;
:data:`sage.cli._commands.COMMANDS` says which module registers which command
and gives the line ``astrid --help`` shows for each, so listing them imports
none.  :func:`build_parser` without arguments is still the whole parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from bus.errors import BusError, sole_error
from sage.cli._commands import COMMANDS, module_of, summary
from sage.cli._common import printable
from sage.errors import SageError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import ModuleType

__all__ = ("build_parser", "main")

_CO_COROUTINE = 0x80  # inspect.CO_COROUTINE, without importing inspect


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"sage.cli.{name}")


def _command(words: Sequence[str]) -> str | None:
    """The command ``words`` name: the first word that is not a top-level option."""
    rest = list(words)
    while rest:
        word = rest.pop(0)
        if word == "--config":
            if rest:
                rest.pop(0)
        elif word != "--json" and not word.startswith("--config="):
            return word
    return None


def build_parser(command: str | None = None, *, listing: bool = False) -> argparse.ArgumentParser:
    """The parser of every command (``command`` None), or of ``command`` alone with the
    others' lines only (a command of :data:`~sage.cli._commands.COMMANDS`), or of no
    command but their lines (``listing``: ``astrid --help``, a mistyped command)."""
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
    chosen = None if command is None else module_of(command)
    registered: set[str] = set()
    for name in COMMANDS:
        module = module_of(name)
        if listing or (chosen is not None and module != chosen):
            sub.add_parser(name, help=summary(name))  # its line in --help, nothing more
        elif module not in registered:  # a module may register two commands (capsule, tools)
            registered.add(module)
            _module(module).register(sub)
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
    words = list(sys.argv[1:] if argv is None else argv)
    command = _command(words)
    # --help, no command, or one that does not exist: the commands' lines are enough
    parser = build_parser(command) if command in COMMANDS else build_parser(listing=True)
    args = _parse(parser, words)
    handler = args.handler
    try:
        try:
            if getattr(handler, "__code__", None) and handler.__code__.co_flags & _CO_COROUTINE:
                import anyio

                code = anyio.run(handler, args)
            else:
                code = handler(args)
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
