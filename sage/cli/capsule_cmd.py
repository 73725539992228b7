"""``astrid capsule list`` and ``astrid tools list``: capsules and the tools they offer."""

from __future__ import annotations

import argparse
from typing import Any

import msgspec

from bus import NoResponders
from sage.cli._connect import connect, print_json
from sage.errors import SageError

__all__ = ("register",)


def register(sub: Any) -> None:
    from sage.cli import add_common

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
