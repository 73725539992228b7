"""``astrid forge list|show|run|promote|rm|runs|secret``: the operator's view of forged tools.

Every command but ``secret`` is an admin request to the forge capsule
(``forge.v1.request.admin.<op>``) over the supervisor's socket; run it as the
supervisor's user.  ``secret`` writes the vault directly (namespace ``forge``)
and never prints a value.

Examples::

    astrid forge list
    astrid forge show fib --owner alice
    astrid forge run fib '{"n": 30}' --owner alice
    astrid forge promote fib --owner alice --session s1
    astrid forge rm fib --scope session --owner alice --session s1
    astrid forge runs fib --limit 5
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
from sage.cli._connect import config_of, connect, print_json
from sage.errors import SageError

__all__ = ("register",)

NAMESPACE = "forge"
DEADLINE = 10.0


def register(sub: Any) -> None:
    from sage.cli import add_common

    group = sub.add_parser(
        "forge",
        help="forged tools: list, show, run, promote, rm, runs, secrets",
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
    runs = cmd("runs", "list recent run manifests (of NAME, or of all tools)", _admin)
    runs.add_argument("name", metavar="NAME", nargs="?")
    runs.add_argument("--limit", type=int, default=20)

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
    if args.op == "runs":
        payload["limit"] = args.limit
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
    payload = _payload(args)
    async with connect(args) as client:
        try:
            reply = await client.request(
                f"forge.v1.request.admin.{args.op}", payload, deadline=DEADLINE
            )
        except NoResponders:
            raise SageError(
                "no forge is running (is the supervisor up with `forge` in supervisor.capsules?)"
            ) from None
    data: dict[str, Any] = msgspec.json.decode(reply.payload)
    if args.op == "run":
        envelope = data.get("structuredContent", data)
        print_json(envelope)
        return 1 if data.get("isError") or data.get("ok") is False else 0
    if data.get("ok") is False:
        error = data.get("error") or {}
        raise SageError(f"{error.get('kind', 'error')}: {error.get('message', '')}")
    if args.json:
        print_json(data)
    elif args.op == "list":
        _table(data.get("tools", []), ("name", "scope", "principal_id", "session_id", "call_count"))
    elif args.op == "runs":
        rows = data.get("runs", [])
        keys = list(rows[0])[:6] if rows else ["run_id"]
        _table(rows, tuple(keys))
    elif args.op == "show":
        record = data.get("tool") or data.get("record") or {}
        for key, value in record.items():
            if key != "impl":
                print(f"{key:<14} {msgspec.json.encode(value).decode()}")
        print("impl:")
        print(record.get("impl", ""))
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
    from sage.secrets import SecretStore

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
