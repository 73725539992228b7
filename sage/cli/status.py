"""``astrid status``: uptime, capsules, connections, bus and audit statistics."""

from __future__ import annotations

import argparse
from typing import Any

from sage import replies
from sage.cli._commands import summary
from sage.cli._common import add_common
from sage.cli._connect import ask, print_json


def register(sub: Any) -> None:
    status = sub.add_parser(
        "status",
        help=summary("status"),
        description="Ask the running supervisor for uptime, capsules, connections and bus statistics.",
    )
    add_common(status)
    status.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    reply = ask(args, "sage.v1.request.status", {}, deadline=5.0)
    data = replies.parse(reply.payload)
    if args.json:
        print_json(data)
        return 0
    bus = data["bus"]
    print(f"sage {data['version']}  pid {data['pid']}  up {_duration(data['uptime_s'])}")
    print(f"config     {data['config']}")
    print(f"socket     {data['socket']}")
    print(f"principals {', '.join(data['principals']) or '-'}")
    capsules = data["capsules"]
    print(f"capsules   {len(capsules)}")
    for capsule in capsules:
        print(
            f"  {capsule['name']:<20} {capsule['state']:<10} restarts {capsule.get('restarts', 0)}"
        )
    conns = data["connections"]
    print(
        f"connections {conns.get('connections', 0)} (accepted {conns.get('accepted', 0)}, refused {conns.get('refused', 0)}, slow {conns.get('disconnected_slow', 0)})"
    )
    print(
        f"bus        published {bus['published']}  delivered {bus['delivered']}  dropped {bus['dropped']}  "
        f"subscriptions {bus['subscriptions']}  requests {bus['requests']}  "
        f"no_responders {bus['no_responders']}  acl_denied {bus['acl_denied']}"
    )
    audit = data.get("audit") or {}
    if audit:
        print("audit      " + "  ".join(f"{k} {v}" for k, v in audit.items()))
    return 0


def _duration(seconds: float) -> str:
    s = int(seconds)
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
