"""The NATS subject permissions a fleet node's user needs, and nothing more.

A node authenticates to NATS as a user of its own; the server's authorization
block bounds what that user may publish and subscribe to.  This module is the
one place that says which subjects this slice of the fleet uses, so that
``astrid fleet permissions --node NAME`` prints them and the tests run nodes
with exactly them:

- its own heartbeat key, ``$KV.sage_nodes.<node>`` (a put is a publish there):
  no other node's key;
- the JetStream API calls on the bucket's stream ``KV_sage_nodes``: create it
  (idempotent: the same config), read its info (which lists the keys), read a
  key's last value (direct get, or the message get when direct is off);
- replies on an inbox of its own, ``_INBOX.<node>.>`` (the client is told to use
  that prefix), so one node cannot read the replies meant for another;
- tools anywhere (sage/fleet/tools.py): its own catalogue key
  ``$KV.sage_tools.<node>`` and the same reads of ``KV_sage_tools``; tool calls
  published to other nodes' call subjects ``sage.fleet.<other>.tool.call`` (its
  own is denied), received on its own call subject only, and answered through
  ``allow_responses`` (a reply to the requester's inbox, nothing else).
"""

from __future__ import annotations

from typing import Any

__all__ = (
    "BUCKET",
    "STREAM",
    "TOOLS_BUCKET",
    "TOOLS_STREAM",
    "call_subject",
    "inbox_prefix",
    "node_permissions",
    "server_block",
)

BUCKET = "sage_nodes"
"""The JetStream key-value bucket holding one heartbeat record per node."""
STREAM = f"KV_{BUCKET}"
"""The stream behind the bucket (JetStream names a bucket's stream ``KV_<bucket>``)."""
TOOLS_BUCKET = "sage_tools"
"""The key-value bucket holding each node's tool catalogue under the node's name."""
TOOLS_STREAM = f"KV_{TOOLS_BUCKET}"


def call_subject(node: str) -> str:
    """The subject node ``node`` answers tool calls on (``node`` is a checked name)."""
    return f"sage.fleet.{node}.tool.call"


def inbox_prefix(node: str) -> str:
    """Where the node's replies arrive: its own inboxes, never another node's."""
    return f"_INBOX.{node}"


def node_permissions(node: str) -> dict[str, Any]:
    """The ``permissions`` of a node's NATS user, as the server config spells them."""
    return {
        "publish": {
            "allow": [
                f"$KV.{BUCKET}.{node}",
                f"$JS.API.STREAM.CREATE.{STREAM}",
                f"$JS.API.STREAM.INFO.{STREAM}",
                f"$JS.API.STREAM.MSG.GET.{STREAM}",
                f"$JS.API.DIRECT.GET.{STREAM}.>",
                f"$KV.{TOOLS_BUCKET}.{node}",
                f"$JS.API.STREAM.CREATE.{TOOLS_STREAM}",
                f"$JS.API.STREAM.INFO.{TOOLS_STREAM}",
                f"$JS.API.STREAM.MSG.GET.{TOOLS_STREAM}",
                f"$JS.API.DIRECT.GET.{TOOLS_STREAM}.>",
                call_subject("*"),
            ],
            "deny": [call_subject(node)],
        },
        "subscribe": {"allow": [f"{inbox_prefix(node)}.>", call_subject(node)]},
        "allow_responses": True,
    }


def server_block(node: str, user: str, nkey: str = "") -> str:
    """A user entry for the server's ``authorization { users = [...] }``.

    With ``nkey`` (the node's public key, ``U...``) the entry names the key and
    holds no secret at all; else the password is not in it either: ``$<VAR>``
    makes the server read it from its own environment (a bcrypt hash from
    ``nats server passwd`` is the better value)."""
    perms = node_permissions(node)
    variable = "SAGE_NODE_" + "".join(c if c.isalnum() else "_" for c in node).upper()
    who = [f'  nkey: "{nkey}"'] if nkey else [f'  user: "{user}"', f"  password: ${variable}"]

    def items(values: list[str]) -> str:
        return ", ".join(f'"{value}"' for value in values)

    return "\n".join(
        [
            f"# sage fleet node {node!r}: its heartbeat and tool catalogue keys, tool calls",
            "{",
            *who,
            "  permissions: {",
            f"    publish: {{ allow: [{items(perms['publish']['allow'])}],"
            f" deny: [{items(perms['publish']['deny'])}] }}",
            f"    subscribe: {{ allow: [{items(perms['subscribe']['allow'])}] }}",
            "    allow_responses: true",
            "  }",
            "}",
        ]
    )
