"""``astrid fleet``: the nodes of the fleet this supervisor is in, and a node's NATS permissions."""

from __future__ import annotations

import argparse
import re
import time
from typing import Any

from sage import replies
from sage.cli._commands import summary
from sage.cli._common import add_common, printable
from sage.cli._connect import connect, print_json
from sage.errors import SageError

STATUS_TOPIC = "sage.v1.request.fleet.status"  # answered by the supervisor (sage/fleet/)


def register(sub: Any) -> None:
    group = sub.add_parser(
        "fleet",
        help=summary("fleet"),
        description="Several supervisors as one sage over NATS with JetStream (docs/fleet.md).",
    )
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = commands.add_parser(
        "status",
        help="the fleet's nodes: live, lost or stopped, their last heartbeat and load",
        description=(
            "Ask the local supervisor for the nodes in the sage_nodes bucket. A node is lost"
            " when its last heartbeat is older than [fleet] lost_after. Each node's load is"
            " as its last heartbeat said: live claude children / its [sessions] max_live"
            " ('-': no bound), idle and hibernated sessions ('load ?': not said). Exits 1"
            " (not_in_fleet) when the supervisor has no [fleet]."
        ),
    )
    add_common(status)
    status.set_defaults(handler=_status)
    permissions = commands.add_parser(
        "permissions",
        help="the NATS authorization entry a node's user needs (subject permissions)",
        description=(
            "Print a user entry for the NATS server's `authorization { users = [...] }`: the"
            " node may put its own heartbeat key only, read the sage_nodes bucket, write the"
            " sage_sessions registry, forward requests and tool calls to its peers with"
            " its own name as the origin (sage.fleet.<peer>.request.<node>.>,"
            " sage.fleet.<peer>.tool.call.<node>: never as another node) and answer those"
            " on its own, publish its own sessions' events and read every node's, and"
            " receive replies on its own inboxes. The password is a $VARIABLE the server reads from its"
            " environment; put a bcrypt hash there (`nats server passwd`)."
        ),
    )
    permissions.add_argument("--node", required=True, help="the node's name ([fleet] node)")
    permissions.add_argument("--user", default="", help="its NATS user (default: the node name)")
    permissions.add_argument(
        "--nkey", default="", help="its NKey's public key (U...), for a node with [fleet] nkey_seed"
    )
    permissions.add_argument(
        "--peers",
        default="",
        metavar="A,B",
        help="the nodes it may forward requests and tool calls to (default: every node)",
    )
    permissions.add_argument("--json", action="store_true", help="only the permissions, as JSON")
    permissions.set_defaults(handler=_permissions)


async def _status(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        reply = await client.request(STATUS_TOPIC, {}, deadline=8.0)
    data = replies.parse(reply.payload)  # not_in_fleet: ReplyError, one line, exit 1
    if args.json:
        print_json(data)
        return 0
    nodes = data.get("nodes") or []
    print(
        f"node {printable(data['node'])}  lost after {data['lost_after']:g} s  nodes {len(nodes)}"
    )
    now = time.time()
    for node in nodes:
        age = now - float(node["heartbeat_at"])
        up = now - float(node["started_at"])
        print(
            f"  {printable(node['node']):<20} {printable(node['state']):<8}"
            f" last heartbeat {age:6.1f} s ago  host {printable(node['host'])}"
            f"  pid {node['pid']}  up {up:.0f} s  sessions {node.get('sessions', 0)}"
            f"  {_load(node.get('load'))}"
        )
    return 0


def _load(load: Any) -> str:
    """``live 12/32 idle 3 hibernated 40`` (``live 12/-``: no max_live); ``load ?``:
    the node did not say (an older node, or its runner did not answer)."""
    if not isinstance(load, dict):
        return "load ?"
    bound = load.get("max_live")
    return (
        f"live {load.get('live', 0)}/{'-' if bound is None else bound}"
        f" idle {load.get('idle', 0)} hibernated {load.get('hibernated', 0)}"
    )


def _permissions(args: argparse.Namespace) -> int:
    from sage.config import NAME_PATTERN
    from sage.fleet.permissions import node_permissions, server_block

    if not re.match(NAME_PATTERN, args.node):
        raise SageError(
            f"--node: {args.node!r} is not a node name ([A-Za-z0-9_-]{{1,64}})",
            code="bad_node_name",
        )
    if args.user and not re.match(r"^[A-Za-z0-9_.@-]{1,128}\Z", args.user):
        raise SageError(f"--user: {args.user!r} is not a NATS user name", code="bad_user_name")
    if args.nkey and not re.match(r"^U[A-Z2-7]{55}\Z", args.nkey):
        raise SageError(
            f"--nkey: {args.nkey!r} is not a user's public NKey (U...)", code="bad_nkey"
        )
    if args.nkey and args.user:
        raise SageError("--nkey and --user: an NKey user has no name; give one", code="bad_nkey")
    peers = [peer.strip() for peer in args.peers.split(",") if peer.strip()]
    for peer in peers:
        if not re.match(NAME_PATTERN, peer):
            raise SageError(f"--peers: {peer!r} is not a node name", code="bad_node_name")
    if args.json:
        print_json(node_permissions(args.node, peers))
        return 0
    print(server_block(args.node, args.user or args.node, args.nkey, peers))
    return 0
