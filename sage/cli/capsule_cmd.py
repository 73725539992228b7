"""``astrid capsule list`` and ``astrid tools list``: capsules and the tools they offer."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import msgspec

from bus import NoResponders
from sage import replies
from sage.cli._commands import summary
from sage.cli._common import add_common, printable
from sage.cli._connect import connect, print_json
from sage.errors import SageError
from sage.replies import ReplyError

__all__ = ("register",)

CHANGE_DEADLINE = 30.0
"""Seconds a load, restart or removal may take (a worker is given 10 s to stop)."""


def register(sub: Any) -> None:
    group = sub.add_parser("capsule", help=summary("capsule"))
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
            " Prints the patterns it grants; a pattern reaching beyond the capsule's own"
            " tools (sage's requests and session events, approvals, hooks, the audit log,"
            " llm.v1, forge, other capsules' tool calls) is refused unless"
            " --allow-privileged grants it (recorded and audited)."
            " Exit 1 with every problem listed if the folder is not a good capsule."
        ),
    )
    install.add_argument("folder", metavar="FOLDER", help="the capsule's folder (a Python package)")
    install.add_argument(
        "--force",
        action="store_true",
        help="replace an installed capsule, and restart it if it runs",
    )
    install.add_argument(
        "--check", action="store_true", help="only check the folder; install nothing"
    )
    install.add_argument(
        "--allow-privileged",
        action="store_true",
        help=(
            "grant the manifest's privileged patterns (those reaching sage's requests,"
            " sessions' events, approvals, hooks, the audit log, llm.v1, other capsules'"
            " tool calls); refused without it"
        ),
    )
    add_common(install)
    install.set_defaults(handler=_install)

    restart = commands.add_parser(
        "restart",
        help="stop a capsule and start it again",
        description=(
            "Stop the running capsule NAME and start it again from its source (its"
            " built-in folder, its path in [supervisor] capsules, or its installed copy)."
            " Restarting `runner` interrupts its sessions; with [sessions] resume they"
            " come back. Admins only."
        ),
    )
    restart.add_argument("name", metavar="NAME", help="the capsule's name (astrid capsule list)")
    add_common(restart)
    restart.set_defaults(handler=_restart)

    remove = commands.add_parser(
        "rm",
        help="stop an installed capsule and delete it",
        description=(
            "Stop the installed capsule NAME and delete its copy under"
            " <state_dir>/capsules/; its tools leave the catalogue. Built-in capsules"
            " come from [supervisor] capsules: take them out of the config instead."
            " With no supervisor running, only the copy is deleted. Admins only."
        ),
    )
    remove.add_argument("name", metavar="NAME", help="the installed capsule's name")
    add_common(remove)
    remove.set_defaults(handler=_remove)

    tools = sub.add_parser("tools", help=summary("tools"))
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

    from sage.capsule.privileges import grant
    from sage.cli._connect import config_of
    from sage.daemon.install import check_capsule, install
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
    patterns = {
        "publish": list(check.manifest.publish.patterns),
        "subscribe": list(check.manifest.subscribe.patterns),
    }
    privileged = [
        {"kind": p.kind, "pattern": p.pattern, "reaches": p.reaches} for p in check.privileged
    ]
    if args.check:
        if args.json:
            print_json(
                {
                    "ok": True,
                    "capsule": name,
                    "tools": check.tools,
                    "patterns": patterns,
                    "privileged": privileged,
                }
            )
        else:
            print(f"{name}: good ({len(check.tools)} tools)")
            _print_patterns(check)
        return 0
    if check.privileged and not args.allow_privileged:
        for one in check.privileged:
            print(printable(f"astrid: privileged: {one}"), file=sys.stderr)
        print(
            f"astrid: {name} was not installed: its manifest reaches beyond its own tools;"
            " install it with --allow-privileged to grant these patterns",
            file=sys.stderr,
        )
        return 1
    state_dir = config_of(args).state_dir
    target = install(check, state_dir, force=args.force)
    granted = grant(state_dir, name, check.privileged)
    started = anyio.run(_load, args, name, args.force)
    if args.json:
        print_json(
            {
                "ok": True,
                "capsule": name,
                "folder": str(target),
                "tools": check.tools,
                "patterns": patterns,
                "privileged": privileged if granted is not None else [],
                "started": started,
            }
        )
        return 0
    print(f"installed {name} in {target} ({', '.join(check.tools) or 'no tools'})")
    _print_patterns(check)
    if isinstance(started, str):
        print(started)
    elif started.get("ok"):
        print(f"{'restarted' if started.get('replaced') else 'started'} {name}")
    else:
        print(f"not started: {started.get('message')}")
    return 0


def _print_patterns(check: Any) -> None:
    """The bus patterns the capsule's manifest grants it, privileged ones marked."""
    privileged = {(p.kind, p.pattern) for p in check.privileged}
    for kind in ("publish", "subscribe"):
        for pattern in getattr(check.manifest, kind).patterns:
            mark = "  (privileged)" if (kind, pattern) in privileged else ""
            print(printable(f"  {kind:<9} {pattern}{mark}"))


async def _load(args: argparse.Namespace, name: str, replace: bool) -> dict[str, Any] | str:
    """Ask a running supervisor to start the capsule (replacing a running one when
    ``replace``); a note when none runs."""
    from bus import BusError

    try:
        async with connect(args) as client:
            reply = await client.request(
                "sage.v1.request.capsule.load",
                {"name": name, "replace": replace},
                deadline=CHANGE_DEADLINE,
            )
    except BusError as exc:
        return f"not started now ({exc}); it starts with the supervisor"
    try:
        return replies.parse(reply.payload)
    except ReplyError as refused:  # printed as "not started: MESSAGE", kept whole for --json
        return refused.reply


async def _change(args: argparse.Namespace, verb: str) -> dict[str, Any]:
    """Send ``sage.v1.request.capsule.<verb> {name}``; the reply's fields, or an error."""
    async with connect(args) as client:
        try:
            reply = await client.request(
                f"sage.v1.request.capsule.{verb}", {"name": args.name}, deadline=CHANGE_DEADLINE
            )
        except NoResponders:
            raise SageError("the supervisor did not answer the capsule request") from None
    return replies.parse(reply.payload)


async def _restart(args: argparse.Namespace) -> int:
    data = await _change(args, "restart")
    if args.json:
        print_json(data)
    else:
        print(f"restarted {args.name}")
    return 0


async def _remove(args: argparse.Namespace) -> int:
    from bus import BusError
    from sage.cli._connect import config_of
    from sage.daemon.install import uninstall

    try:
        data = await _change(args, "remove")
    except BusError:  # no supervisor: only the installed copy is there to delete
        from sage.capsule.privileges import revoke

        state_dir = config_of(args).state_dir
        if uninstall(state_dir, args.name) is None:
            raise SageError(f"no installed capsule {args.name!r} in {state_dir}") from None
        revoke(state_dir, args.name)
        data = {"ok": True, "capsule": args.name, "running": False}
    if args.json:
        print_json(data)
    else:
        print(f"removed {args.name}")
    return 0


async def _list(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        try:
            reply = await client.request("sage.v1.request.status", {}, deadline=5.0)
        except NoResponders:
            raise SageError("the supervisor did not answer the status request") from None
        clashes = await _clashes(client)
    capsules: list[dict[str, Any]] = replies.parse(reply.payload).get("capsules", [])
    for row in capsules:
        row["tool_clashes"] = [c for c in clashes if c.get("capsule") == row.get("name")]
    if args.json:
        print_json(capsules)
        return 0
    print(f"{'CAPSULE':<16} {'VERSION':<9} {'STATE':<9} {'RESTARTS':>8}  LAST ERROR")
    for row in capsules:
        print(
            f"{printable(row.get('name', '')):<16} {printable(row.get('version', '')):<9}"
            f" {row.get('state', ''):<9} {row.get('restarts', 0):>8}"
            f"  {printable(row.get('last_error', ''))}"
        )
    for row in capsules:
        held = row.get("privileged")
        if held:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(held.get("granted_at", 0)))
            grants = [f"publish {p}" for p in held.get("publish", [])]
            grants += [f"subscribe {p}" for p in held.get("subscribe", [])]
            print(
                printable(
                    f"privileged: {row.get('name')} holds {', '.join(grants)}"
                    f" (granted {when} by uid {held.get('granted_by')})"
                )
            )
    _print_clashes(clashes)
    return 0


async def _clashes(client: Any) -> list[dict[str, str]]:
    """Tools offered but not in force (their name is another capsule's); none without a bridge."""
    try:
        reply = await client.request("sage.v1.request.tools", {}, deadline=5.0)
    except NoResponders:
        return []
    found: list[dict[str, str]] = msgspec.json.decode(reply.payload).get("clashes", [])
    return found


def _print_clashes(clashes: list[dict[str, str]]) -> None:
    for clash in clashes:
        node, owner_node = clash.get("node"), clash.get("owner_node")
        where = f" on node {node}" if node and node != owner_node else ""
        owner_where = f" on node {owner_node}" if where and owner_node else ""
        print(
            printable(
                f"clash: tool {clash.get('name')!r} of capsule {clash.get('capsule')}{where} is"
                f" not offered: capsule {clash.get('owner')}{owner_where} has that name"
            )
        )


async def _tools(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        try:
            reply = await client.request("sage.v1.request.tools", {}, deadline=5.0)
        except NoResponders:
            raise SageError(
                "no tool bridge is running (is `tools` in supervisor.capsules?)"
            ) from None
    listing = replies.parse(reply.payload)
    tools: list[dict[str, Any]] = listing.get("tools", [])
    clashes: list[dict[str, str]] = listing.get("clashes", [])
    if args.json:
        print_json(tools)
        return 0
    if not tools:
        print("no tools")
    else:
        width = max(len(t["name"]) for t in tools)
        nodes = any(t.get("node") for t in tools)  # a fleet: which node serves each tool
        for tool in tools:
            summary = (tool.get("description") or "").splitlines()[0:1]
            node = f"{printable(tool.get('node') or '-'):<8} " if nodes else ""
            print(
                f"{printable(tool['name']):<{width}}  {node}{printable(tool.get('capsule', '')):<12}"
                f" {printable(''.join(summary))}"
            )
    _print_clashes(clashes)
    return 0
