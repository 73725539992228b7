"""``astrid capsule list`` and ``astrid tools list``: capsules and the tools they offer."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from bus import NoResponders
from sage.cli._common import add_common
from sage.cli._connect import connect, print_json
from sage.errors import SageError

__all__ = ("register",)


def register(sub: Any) -> None:
    group = sub.add_parser("capsule", help="capsules: list them and their state")
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    listing = commands.add_parser(
        "list",
        help="list capsules with state, restarts and last error",
        description=(
            "List the supervisor's capsules: name, version, state (running, backoff,"
            " failed, stopped), restarts and the last error."
        ),
    )
    add_common(listing)
    listing.set_defaults(handler=_list)

    install = commands.add_parser(
        "install",
        help="check a capsule folder, install it and start it",
        description=(
            "Check FOLDER (its Capsule.toml, that its entry imports, its tools, and that"
            " its [publish]/[subscribe] patterns cover what its tools need), copy it to"
            " <state_dir>/capsules/, and ask the running supervisor to start it. Installed"
            " capsules run as out-of-process workers and start with every supervisor start."
            " Exit 1 with every problem listed if the folder is not a good capsule."
        ),
    )
    install.add_argument("folder", metavar="FOLDER", help="the capsule's folder (a Python package)")
    install.add_argument("--force", action="store_true", help="replace an installed capsule")
    install.add_argument(
        "--check", action="store_true", help="only check the folder; install nothing"
    )
    add_common(install)
    install.set_defaults(handler=_install)

    tools = sub.add_parser("tools", help="the tool catalogue Claude sessions are offered")
    tool_commands = tools.add_subparsers(dest="action", metavar="ACTION", required=True)
    catalogue = tool_commands.add_parser(
        "list",
        help="list the tools in the catalogue",
        description=(
            "List the tools the tool bridge offers to Claude sessions (as mcp__sage__NAME),"
            " with the capsule that serves each and its description."
        ),
    )
    add_common(catalogue)
    catalogue.set_defaults(handler=_tools)


def _install(args: argparse.Namespace) -> int:
    from pathlib import Path

    import anyio

    from sage.capsule.install import check_capsule, install
    from sage.cli._connect import config_of
    from sage.daemon.workers import capsule_uids

    folder = Path(args.folder)
    if not folder.is_dir():
        raise SageError(f"{folder}: not a folder")
    # its import-time code runs in its sandbox, as its own uid when we are root
    check = check_capsule(folder, uids=capsule_uids(config_of(args)))
    if not check.ok:
        for problem in check.problems:
            print(f"astrid: {problem}", file=sys.stderr)
        return 1
    assert check.manifest is not None
    name = check.manifest.name
    if args.check:
        if args.json:
            print_json({"ok": True, "capsule": name, "tools": check.tools})
        else:
            print(f"{name}: good ({len(check.tools)} tools)")
        return 0
    target = install(check, config_of(args).state_dir, force=args.force)
    started = anyio.run(_load, args, name)
    if args.json:
        print_json(
            {
                "ok": True,
                "capsule": name,
                "folder": str(target),
                "tools": check.tools,
                "started": started,
            }
        )
        return 0
    print(f"installed {name} in {target} ({', '.join(check.tools) or 'no tools'})")
    if isinstance(started, str):
        print(started)
    elif started.get("ok"):
        print(f"started {name}")
    else:
        print(f"not started: {started.get('message')}")
    return 0


async def _load(args: argparse.Namespace, name: str) -> dict[str, Any] | str:
    """Ask a running supervisor to start the capsule; a note when none runs."""
    from bus import BusError

    try:
        async with connect(args) as client:
            reply = await client.request(
                "sage.v1.request.capsule.load", {"name": name}, deadline=10.0
            )
    except BusError as exc:
        return f"not started now ({exc}); it starts with the supervisor"
    answer: dict[str, Any] = msgspec.json.decode(reply.payload)
    return answer


async def _list(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        try:
            reply = await client.request("sage.v1.request.status", {}, deadline=5.0)
        except NoResponders:
            raise SageError("the supervisor did not answer the status request") from None
    capsules: list[dict[str, Any]] = msgspec.json.decode(reply.payload).get("capsules", [])
    if args.json:
        print_json(capsules)
        return 0
    print(f"{'CAPSULE':<16} {'VERSION':<9} {'STATE':<9} {'RESTARTS':>8}  LAST ERROR")
    for row in capsules:
        print(
            f"{row.get('name', ''):<16} {row.get('version', ''):<9} {row.get('state', ''):<9}"
            f" {row.get('restarts', 0):>8}  {row.get('last_error', '')}"
        )
    return 0


async def _tools(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        try:
            reply = await client.request("sage.v1.request.tools", {}, deadline=5.0)
        except NoResponders:
            raise SageError(
                "no tool bridge is running (is `tools` in supervisor.capsules?)"
            ) from None
    tools: list[dict[str, Any]] = msgspec.json.decode(reply.payload).get("tools", [])
    if args.json:
        print_json(tools)
        return 0
    if not tools:
        print("no tools")
        return 0
    width = max(len(t["name"]) for t in tools)
    for tool in tools:
        summary = (tool.get("description") or "").splitlines()[0:1]
        print(f"{tool['name']:<{width}}  {tool.get('capsule', ''):<12} {''.join(summary)}")
    return 0
