"""``astrid config check FILE`` and ``astrid config show``.

``check`` decodes FILE as the supervisor would (a misspelt key gets the nearest
one suggested), then looks for what the start would fail on: capsule names
that are neither built in nor a folder with a ``Capsule.toml``, manifests that
do not load; and warns about ``allowed_tools`` naming no tool any configured
capsule, the forge or Claude Code itself offers.  ``show`` prints the effective
config as TOML (JSON with ``--json``), ``[claude] env`` values hidden.
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import sys
from typing import Any

import msgspec

from sage.capsule.manifest import load_manifest
from sage.cli._commands import summary
from sage.cli._connect import print_json
from sage.config import Config, load_config
from sage.daemon.capsule_host import capsule_folder, missing_capsule
from sage.errors import ConfigError, FleetNoAuth

#: Claude Code's own tools: kept in step with the installer's deny list.
_BUILT_IN_TOOLS_MODULE = "capsules.installer.files"


def register(sub: Any) -> None:
    group = sub.add_parser("config", help=summary("config"))
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = commands.add_parser(
        "check",
        help="validate a supervisor.toml",
        description="Decode FILE as the supervisor would; print the problem and exit 1 if it is bad.",
    )
    check.add_argument("file", metavar="FILE", help="the supervisor.toml to check")
    check.add_argument(
        "--json", action="store_true", help="print {ok, errors, warnings, config} as JSON"
    )
    check.set_defaults(handler=_check)
    show = commands.add_parser(
        "show",
        help="print the effective config as TOML",
        description="Print the config that --config FILE, $ASTRID_CONFIG or the defaults give,"
        " every key with its value ([claude] env values hidden).",
    )
    show.add_argument("--config", metavar="FILE", default=None, help="supervisor.toml to use")
    show.add_argument("--json", action="store_true", help="print JSON instead of TOML")
    show.set_defaults(handler=_show)


def _shown(config: object) -> object:
    """The config as builtins, with ``[claude] env`` values hidden: they may hold keys."""
    data = msgspec.to_builtins(config)
    env = data.get("claude", {}).get("env", {})
    for key in env:
        env[key] = "<hidden>"
    return data


def problems(config: Config) -> tuple[list[str], list[str]]:
    """What the supervisor's start would fail on (errors), and likely mistakes (warnings)."""
    errors: list[str] = []
    warnings: list[str] = []
    tools: set[str] = set()
    for name in config.supervisor.capsules:
        folder = capsule_folder(name)
        missing = missing_capsule(name)
        if missing is not None:
            errors.append(missing)
            continue
        try:
            manifest = load_manifest(folder)
        except ConfigError as exc:
            errors.append(f"supervisor.capsules: {name}: {exc}")
            continue
        for pattern in manifest.subscribe.patterns:
            parts = pattern.split(".")
            if parts[:3] == ["tool", "v1", "execute"] and len(parts) == 4 and "*" not in parts[3]:
                tools.add(f"mcp__sage__{parts[3]}")
    from importlib import import_module

    tools.update(getattr(import_module(_BUILT_IN_TOOLS_MODULE), "BUILT_IN_TOOLS", ()))
    for principal in config.principals:
        for name in principal.allowed_tools:
            if name.startswith("mcp__forge__"):
                continue  # forged at runtime
            if "*" in name and any(fnmatch.fnmatchcase(t, name) for t in tools):
                continue
            if name in tools:
                continue
            close = difflib.get_close_matches(name, sorted(tools), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            warnings.append(
                f"principals[{principal.name}].allowed_tools: {name!r} names no tool a"
                f" configured capsule, the forge or Claude Code offers{hint}"
            )
    if config.fleet is not None:
        from sage.fleet.auth import AuthMethod, auth_method  # sans-IO: no nats-py

        try:
            if auth_method(config.fleet) is AuthMethod.NONE:
                warnings.append(
                    "fleet.insecure_no_auth: the node signs in to NATS with no credentials"
                    " (any client of the servers may act as any node): for a trial only"
                )
        except FleetNoAuth as exc:
            errors.append(str(exc))
    live, cap = config.sessions.max_live, config.limits.max_sessions_per_principal
    if live and live <= cap and len(config.principals) > 1:
        warnings.append(
            f"sessions.max_live = {live} is at or below limits.max_sessions_per_principal ="
            f" {cap}: one principal could hold every live slot; sage keeps a slot for each"
            " other principal with sessions (its share), but a cap below max_live says so"
            " outright (docs/operations.md, Hibernation)"
        )
    return errors, warnings


def _check(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.file)
    except ConfigError as exc:
        if args.json:
            print_json({"ok": False, "errors": [str(exc)], "warnings": [], "error": str(exc)})
        else:
            print(f"astrid: {exc}", file=sys.stderr)
        return 1
    errors, warnings = problems(config)
    if args.json:
        print_json(
            {
                "ok": not errors,
                "errors": errors,
                "warnings": warnings,
                "config": _shown(config),
            }
        )
        return 1 if errors else 0
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    if errors:
        return 1
    count = len(config.principals)
    print(
        f"{args.file}: ok ({count} principal{'' if count == 1 else 's'},"
        f" socket {config.socket_path}"
        f"{f', {len(warnings)} warning' + ('' if len(warnings) == 1 else 's') if warnings else ''})"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    shown = _shown(load_config(args.config))
    if args.json:
        print_json(shown)
    else:
        assert isinstance(shown, dict)
        sys.stdout.write(to_toml(shown))
    return 0


def to_toml(data: dict[str, Any]) -> str:
    """The config's builtins as TOML: scalars first, then a table per section,
    ``[[principals]]`` last; ``base_dir`` (set by the loader) and unset (None)
    values left out, which read back as the same defaults."""
    lines: list[str] = []
    for key, value in data.items():
        table = isinstance(value, dict) or (
            isinstance(value, list) and any(isinstance(v, dict) for v in value)
        )
        if not table and key != "base_dir" and value is not None:
            lines.append(f"{key} = {_value(value)}")
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_value(v)}" for k, v in value.items() if v is not None)
    for key, value in data.items():
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for item in value:
                lines.append(f"\n[[{key}]]")
                lines.extend(f"{k} = {_value(v)}" for k, v in item.items() if v is not None)
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string is a JSON string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")
