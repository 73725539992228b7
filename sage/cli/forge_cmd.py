"""``astrid forge list|show|run|promote|rm|runs|secret``: the operator's view of forged tools.

Every command but ``secret`` and ``runs`` is an admin request to the forge
capsule (``forge.v1.request.admin.<op>``) over the supervisor's socket; run it
as the supervisor's user.  ``runs list|prune`` (``forge.v1.request.runs.<op>``)
work for an operator on every principal's runs, for a principal's user on its
own.  ``secret`` writes the vault directly (namespace ``forge``) and never
prints a value.

Examples::

    astrid forge list
    astrid forge show fib --owner alice
    astrid forge run fib '{"n": 30}' --owner alice
    astrid forge promote fib --owner alice --session s1
    astrid forge rm fib --scope session --owner alice --session s1
    astrid forge runs list fib --limit 5
    astrid forge runs prune --principal bob --keep-bytes 100000000 --dry-run
    astrid forge runs prune --older-than 86400
    astrid forge secret set OPENAI_API_KEY          # hidden prompt
    printf %s "$KEY" | astrid forge secret set OPENAI_API_KEY --stdin
"""

from __future__ import annotations

import argparse
import getpass
import sys
from typing import Any

import msgspec

from bus import NoResponders
from sage import replies
from sage.cli._commands import summary
from sage.cli._common import add_common, printable
from sage.cli._connect import config_of, connect, print_json
from sage.errors import SageError

__all__ = ("register",)

NAMESPACE = "forge"
DEADLINE = 10.0


def register(sub: Any) -> None:
    group = sub.add_parser(
        "forge",
        help=summary("forge"),
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)

    def cmd(name: str, text: str, handler: Any) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=text, description=text)
        add_common(parser)
        parser.set_defaults(handler=handler, op=name)
        return parser

    cmd("list", "list every forged tool (all scopes, principals, sessions)", _admin)
    show = cmd("show", "print one tool's record, its implementation included", _admin)
    show.add_argument("name", metavar="NAME")
    show.add_argument("--scope", choices=("session", "project", "user"))
    _owner(show)
    run = cmd("run", "call a tool as PRINCIPAL with JSON arguments; prints the envelope", _admin)
    run.add_argument("name", metavar="NAME")
    run.add_argument("arguments", metavar="JSON", help="the arguments, e.g. '{\"n\": 30}'")
    _owner(run)
    promote = cmd("promote", "promote a session tool so every session sees it", _admin)
    promote.add_argument("name", metavar="NAME")
    promote.add_argument("--force", action="store_true", help="replace a different impl")
    _owner(promote)
    rm = cmd("rm", "remove a tool from one scope", _admin)
    rm.add_argument("name", metavar="NAME")
    rm.add_argument("--scope", required=True, choices=("session", "project", "user"))
    _owner(rm)
    runs = commands.add_parser(
        "runs",
        help="run manifests and spilled output: list, prune",
        description="Runs (manifests and spilled stdout) under <forge root>/runs.",
    )
    add_common(runs)
    runs.set_defaults(handler=_runs, runs_action="list", name=None, limit=20, owner=None)
    runs_actions = runs.add_subparsers(dest="runs_action", metavar="ACTION")
    ls_runs = runs_actions.add_parser(
        "list", help="recent runs (of NAME, or of all tools) and the bytes held"
    )
    ls_runs.add_argument("name", metavar="NAME", nargs="?")
    ls_runs.add_argument("--limit", type=_positive, default=20)
    ls_runs.add_argument("--principal", dest="owner", metavar="P", help="only P's runs")
    add_common(ls_runs)
    prune = runs_actions.add_parser(
        "prune",
        help="remove runs: older than SECONDS, and/or the oldest until N bytes are left",
        description=(
            "Remove runs (oldest first) of principal P, or of all: those older than"
            " SECONDS, then more until the rest hold at most N bytes. A run in use is"
            " kept. A principal's user may prune only its own runs."
        ),
    )
    prune.add_argument("--principal", dest="owner", metavar="P", help="only P's runs")
    prune.add_argument("--older-than", type=_seconds, metavar="SECONDS")
    prune.add_argument("--keep-bytes", type=_bytes, metavar="N")
    prune.add_argument("--dry-run", action="store_true", help="print what would go")
    add_common(prune)

    secret = commands.add_parser(
        "secret",
        help="vault entries for meta.secrets",
        description="Forge secrets (namespace forge).",
    )
    actions = secret.add_subparsers(dest="secret_action", metavar="ACTION", required=True)
    put = actions.add_parser("set", help="store a secret (value from a hidden prompt or --stdin)")
    put.add_argument("name", metavar="NAME")
    put.add_argument("--stdin", action="store_true", help="read the value from stdin")
    add_common(put, json_output=False)
    put.set_defaults(handler=_secret_set)
    ls = actions.add_parser("list", help="list secret names (never values)")
    add_common(ls)
    ls.set_defaults(handler=_secret_list)
    delete = actions.add_parser("rm", help="remove a secret")
    delete.add_argument("name", metavar="NAME")
    add_common(delete, json_output=False)
    delete.set_defaults(handler=_secret_rm)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def _bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of bytes: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError("must be a finite number, 0 or more")
    return value


async def _runs(args: argparse.Namespace) -> int:
    args.runs_action = args.runs_action or "list"  # `astrid forge runs` alone lists
    if args.runs_action == "list":
        payload: dict[str, Any] = {"limit": args.limit}
        if args.name is not None:
            payload["name"] = args.name
    else:
        if args.older_than is None and args.keep_bytes is None:
            raise SageError("prune needs --older-than SECONDS, --keep-bytes N or both")
        payload = {"dry_run": args.dry_run}
        if args.older_than is not None:
            payload["older_than"] = args.older_than
        if args.keep_bytes is not None:
            payload["keep_bytes"] = args.keep_bytes
    if args.owner is not None:
        payload["principal_id"] = args.owner
    data = replies.parse(await _request(args, f"forge.v1.request.runs.{args.runs_action}", payload))
    if args.json:
        print_json(data)
    elif args.runs_action == "list":
        _table(
            data.get("runs", []),
            ("run_id", "tool", "principal_id", "session_id", "ok", "bytes"),
        )
        print(
            f"held: {data.get('total_bytes')} bytes"
            f" (cap {data.get('max_bytes')}, per principal {data.get('max_bytes_per_principal')})"
        )
    else:
        verb = "would remove" if data.get("dry_run") else "removed"
        for row in data.get("removed", []):
            print(f"{verb} {row['run_id']}  {row.get('principal_id') or '-'}  {row['bytes']}")
        freed = "would free" if data.get("dry_run") else "freed"
        print(f"{verb} {data.get('count', 0)} runs, {freed} {data.get('bytes', 0)} bytes")
    return 0


async def _request(args: argparse.Namespace, topic: str, payload: dict[str, Any]) -> bytes:
    async with connect(args) as client:
        try:
            reply = await client.request(topic, payload, deadline=DEADLINE)
        except NoResponders:
            raise SageError(
                "no forge is running (is the supervisor up with `forge` in supervisor.capsules?)"
            ) from None
    return reply.payload


def _owner(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--owner", metavar="PRINCIPAL", help="the principal the tool belongs to")
    parser.add_argument("--session", metavar="SID", help="the session of a session-scope tool")


def _payload(args: argparse.Namespace) -> dict[str, Any]:
    payload: dict[str, Any] = {}
    for key, field in (("name", "name"), ("scope", "scope"), ("principal_id", "owner")):
        value = getattr(args, field, None)
        if value is not None:
            payload[key] = value
    if getattr(args, "session", None):
        payload["session_id"] = args.session
    if getattr(args, "force", False):
        payload["force"] = True
    if args.op == "run":
        try:
            arguments = msgspec.json.decode(args.arguments)
        except msgspec.DecodeError as exc:
            raise SageError(f"the JSON argument is not valid JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise SageError("the JSON argument must be an object, e.g. '{\"n\": 30}'")
        payload["arguments"] = arguments
    return payload


async def _admin(args: argparse.Namespace) -> int:
    raw = await _request(args, f"forge.v1.request.admin.{args.op}", _payload(args))
    if args.op == "run":  # an MCP result, or the failure reply to a refused request
        result: dict[str, Any] = msgspec.json.decode(raw)
        envelope = result.get("structuredContent", result)
        print_json(envelope)
        return 1 if result.get("isError") or result.get("ok") is False else 0
    data = replies.parse(raw)
    if args.json:
        print_json(data)
    elif args.op == "list":
        _table(data.get("tools", []), ("name", "scope", "principal_id", "session_id", "call_count"))
    elif args.op == "show":
        record = data.get("tool") or data.get("record") or {}
        for key, value in record.items():
            if key != "impl":
                print(f"{key:<14} {msgspec.json.encode(value).decode()}")
        print("impl:")
        print(printable(record.get("impl", ""), lines=True))
    else:
        print(f"{args.op}: {data.get('name', args.name)}")
    return 0


def _table(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> None:
    if not rows:
        print("none")
        return
    cells = [[str(row.get(k) if row.get(k) is not None else "-") for k in keys] for row in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    print("  ".join(k.upper().ljust(w) for k, w in zip(keys, widths, strict=True)))
    for cell in cells:
        print("  ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)))


def _store(args: argparse.Namespace) -> Any:
    from sage.security.secrets import SecretStore

    return SecretStore.open(config_of(args))


def _secret_set(args: argparse.Namespace) -> int:
    if args.stdin:
        value = sys.stdin.read().rstrip("\n")
    else:
        value = getpass.getpass(f"value of {args.name}: ")
    _store(args).put(NAMESPACE, args.name, value)
    print(f"stored {args.name}")
    return 0


def _secret_list(args: argparse.Namespace) -> int:
    names = _store(args).names(NAMESPACE)
    if args.json:
        print_json(names)
    else:
        print("\n".join(names) if names else "none")
    return 0


def _secret_rm(args: argparse.Namespace) -> int:
    if not _store(args).delete(NAMESPACE, args.name):
        raise SageError(f"no forge secret named {args.name!r}")
    print(f"removed {args.name}")
    return 0
