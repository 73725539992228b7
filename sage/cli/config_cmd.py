"""``astrid config check FILE``: validate a config file without starting anything."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from sage.cli._connect import print_json
from sage.config import load_config
from sage.errors import ConfigError


def register(sub: Any) -> None:
    group = sub.add_parser("config", help="check or show configuration")
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = commands.add_parser(
        "check",
        help="validate a supervisor.toml",
        description="Decode FILE as the supervisor would; print the problem and exit 1 if it is bad.",
    )
    check.add_argument("file", metavar="FILE", help="the supervisor.toml to check")
    check.add_argument("--json", action="store_true", help="print the decoded config as JSON")
    check.set_defaults(handler=_check)
    show = commands.add_parser(
        "show",
        help="print the effective config as JSON",
        description="Print the config that --config FILE, $ASTRID_CONFIG or the defaults give.",
    )
    show.add_argument("--config", metavar="FILE", default=None, help="supervisor.toml to use")
    show.set_defaults(handler=_show)


def _shown(config: object) -> object:
    """The config as builtins, with ``[claude] env`` values hidden: they may hold keys."""
    data = msgspec.to_builtins(config)
    env = data.get("claude", {}).get("env", {})
    for key in env:
        env[key] = "<hidden>"
    return data


def _check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        if args.json:
            print_json({"ok": False, "error": str(exc)})
        else:
            print(f"astrid: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print_json({"ok": True, "config": _shown(config)})
    else:
        print(f"{args.file}: ok ({len(config.principals)} principals, socket {config.socket_path})")
    return 0


def _show(args: argparse.Namespace) -> int:
    print_json(_shown(load_config(args.config)))
    return 0
