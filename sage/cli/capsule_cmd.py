"""``astrid capsule list``: the supervisor's capsules, their state, restarts and last error."""

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
