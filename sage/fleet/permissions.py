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
- the session registry, the ``sage_sessions`` bucket: put and delete only the keys
  under its own name, ``$KV.sage_sessions.<node>.>`` (a key is ``<node>.<sid>``: a
  node claims only for itself, and cannot rewrite or delete another's claim); read
  every key, its stream's info, and watch it through a consumer of its own;
- failover's races, the ``sage_claims`` bucket: put and withdraw only its own claims,
  ``$KV.sage_claims.<node>.>`` (a key is ``<node>.<sid>``: each write names the last
  revision of every node's key for the session, sage/fleet/claims.py), read them all:
  it decides who adopts, and routes nothing;
- forwarded requests (sage/fleet/routes.py): publish on the peers' request
  prefixes with its own name as the origin, ``sage.fleet.<peer>.request.<node>.>``
  (every node's, ``*``, or the ``peers`` named), never with another's, so the
  receiver may take the origin from the subject; subscribe to its own prefix
  only, and answer them (``allow_responses``, the reply subjects of requests it
  received and nothing else);
- session events: publish its own sessions' events, ``sage.fleet.<node>.event.>``,
  subscribe to every node's (``sage.fleet.*.event.>``) while a local client watches.
- the fleet audit (sage/fleet/audit_stream.py): publish on its own audit subjects
  only, ``sage.audit.<node>.entry``, ``.checkpoint`` and ``.key`` (never
  another node's); create the ``sage_audit`` stream, read its info and last
  messages, and read it whole through a consumer of its own (create, fetch,
  delete: no purge, no message delete, no update); ask any node to compare its
  log (``sage.fleet.*.audit.verify``), take such requests on its own subject
  only, ``sage.fleet.<node>.audit.verify``, and answer them (``allow_responses``:
  a reply to a request it received, nothing else).
- tools anywhere (sage/fleet/tools.py): its own catalogue key
  ``$KV.sage_tools.<node>`` and the same reads of ``KV_sage_tools``; tool calls
  published to other nodes' call subjects with its own name as the origin,
  ``sage.fleet.<other>.tool.call.<node>`` (its own call subjects are denied),
  received on its own call subjects only, and answered through
  ``allow_responses`` (a reply to the requester's inbox, nothing else).
- failover (sage/fleet/failover.py): the ``sage_transcripts`` bucket, its own copies
  only (``$KV.sage_transcripts.<node>.>``: ``<node>.<sid>.<part>``), read any node's
  from the stream's leader (the message get: the bucket has no direct gets).

Every stream is made by the fleet itself with no rollups, purges or message deletes
(sage/fleet/streams.py), so a header or an API call cannot do what these subjects
forbid; no node may update or delete a stream, and every node checks each one's
configuration at its start.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sage.fleet.routes import CLAIMS, CLAIMS_STREAM, REGISTRY, REGISTRY_STREAM
from sage.fleet.transcripts import TRANSCRIPTS, TRANSCRIPTS_STREAM

__all__ = (
    "AUDIT_STREAM",
    "BUCKET",
    "STREAM",
    "TOOLS_BUCKET",
    "TOOLS_STREAM",
    "call_subject",
    "inbox_prefix",
    "node_permissions",
    "parse_call_subject",
    "server_block",
)

BUCKET = "sage_nodes"
"""The JetStream key-value bucket holding one heartbeat record per node."""
STREAM = f"KV_{BUCKET}"
"""The stream behind the bucket (JetStream names a bucket's stream ``KV_<bucket>``)."""
AUDIT_STREAM = "sage_audit"
"""The JetStream stream every node streams its audit entries and checkpoints to."""
TOOLS_BUCKET = "sage_tools"
"""The key-value bucket holding each node's tool catalogue under the node's name."""
TOOLS_STREAM = f"KV_{TOOLS_BUCKET}"


def call_subject(node: str, origin: str) -> str:
    """The subject of a tool call ``origin`` sends to ``node`` (both checked names, or
    ``*`` in a permission)."""
    return f"sage.fleet.{node}.tool.call.{origin}"


def parse_call_subject(node: str, subject: str) -> str | None:
    """The origin of a tool call on ``node``'s own subject (None: not one; a name is
    ``[A-Za-z0-9_-]{1,64}``, checked by the caller)."""
    prefix = f"sage.fleet.{node}.tool.call."
    if not subject.startswith(prefix):
        return None
    origin = subject.removeprefix(prefix)
    return origin or None


def inbox_prefix(node: str) -> str:
    """Where the node's replies arrive: its own inboxes, never another node's."""
    return f"_INBOX.{node}"


def node_permissions(node: str, peers: Sequence[str] = ()) -> dict[str, Any]:
    """The ``permissions`` of a node's NATS user, as the server config spells them.

    ``peers``: the nodes it may forward requests and tool calls to (none named: every
    node)."""
    others = [peer for peer in peers if peer != node] or ["*"]
    # the origin token is the node's own name: the server proves who sent a request
    targets = [f"sage.fleet.{peer}.request.{node}.>" for peer in others]
    tool_calls = [call_subject(peer, node) for peer in others]
    return {
        "publish": {
            "allow": [
                f"$KV.{BUCKET}.{node}",
                f"$JS.API.STREAM.CREATE.{STREAM}",
                f"$JS.API.STREAM.INFO.{STREAM}",
                f"$JS.API.STREAM.MSG.GET.{STREAM}",
                f"$JS.API.DIRECT.GET.{STREAM}.>",
                f"$KV.{REGISTRY}.{node}.>",
                f"$JS.API.STREAM.CREATE.{REGISTRY_STREAM}",
                f"$JS.API.STREAM.INFO.{REGISTRY_STREAM}",
                f"$JS.API.STREAM.MSG.GET.{REGISTRY_STREAM}",
                f"$JS.API.DIRECT.GET.{REGISTRY_STREAM}.>",
                f"$JS.API.CONSUMER.CREATE.{REGISTRY_STREAM}",
                f"$JS.API.CONSUMER.CREATE.{REGISTRY_STREAM}.>",
                f"$JS.API.CONSUMER.INFO.{REGISTRY_STREAM}.*",
                f"$JS.API.CONSUMER.DELETE.{REGISTRY_STREAM}.*",
                f"$KV.{CLAIMS}.{node}.>",
                f"$JS.API.STREAM.CREATE.{CLAIMS_STREAM}",
                f"$JS.API.STREAM.INFO.{CLAIMS_STREAM}",
                f"$JS.API.STREAM.MSG.GET.{CLAIMS_STREAM}",
                f"$JS.API.DIRECT.GET.{CLAIMS_STREAM}.>",
                *targets,
                f"sage.fleet.{node}.event.>",
                f"sage.audit.{node}.entry",
                f"sage.audit.{node}.checkpoint",
                f"sage.audit.{node}.key",
                f"$JS.API.STREAM.CREATE.{AUDIT_STREAM}",
                f"$JS.API.STREAM.INFO.{AUDIT_STREAM}",
                f"$JS.API.STREAM.MSG.GET.{AUDIT_STREAM}",
                f"$JS.API.DIRECT.GET.{AUDIT_STREAM}.>",
                f"$JS.API.CONSUMER.CREATE.{AUDIT_STREAM}.>",
                f"$JS.API.CONSUMER.MSG.NEXT.{AUDIT_STREAM}.*",
                f"$JS.API.CONSUMER.DELETE.{AUDIT_STREAM}.*",
                "sage.fleet.*.audit.verify",
                f"$KV.{TOOLS_BUCKET}.{node}",
                f"$JS.API.STREAM.CREATE.{TOOLS_STREAM}",
                f"$JS.API.STREAM.INFO.{TOOLS_STREAM}",
                f"$JS.API.STREAM.MSG.GET.{TOOLS_STREAM}",
                f"$JS.API.DIRECT.GET.{TOOLS_STREAM}.>",
                *tool_calls,
                f"$KV.{TRANSCRIPTS}.{node}.>",
                f"$JS.API.STREAM.CREATE.{TRANSCRIPTS_STREAM}",
                f"$JS.API.STREAM.INFO.{TRANSCRIPTS_STREAM}",
                f"$JS.API.STREAM.MSG.GET.{TRANSCRIPTS_STREAM}",
            ],
            "deny": [call_subject(node, "*")],
        },
        "subscribe": {
            "allow": [
                f"{inbox_prefix(node)}.>",
                f"sage.fleet.{node}.request.>",
                "sage.fleet.*.event.>",
                f"sage.fleet.{node}.audit.verify",
                call_subject(node, "*"),
            ]
        },
        "allow_responses": True,
    }


def server_block(node: str, user: str, nkey: str = "", peers: Sequence[str] = ()) -> str:
    """A user entry for the server's ``authorization { users = [...] }``.

    With ``nkey`` (the node's public key, ``U...``) the entry names the key and
    holds no secret at all; else the password is not in it either: ``$<VAR>``
    makes the server read it from its own environment (a bcrypt hash from
    ``nats server passwd`` is the better value)."""
    perms = node_permissions(node, peers)
    variable = "SAGE_NODE_" + "".join(c if c.isalnum() else "_" for c in node).upper()
    who = [f'  nkey: "{nkey}"'] if nkey else [f'  user: "{user}"', f"  password: ${variable}"]

    def items(values: list[str]) -> str:
        return ", ".join(f'"{value}"' for value in values)

    return "\n".join(
        [
            f"# sage fleet node {node!r}: its heartbeats, its claims in the session registry"
            " and failover's claims (its own keys only), its"
            f" sessions' requests and events, its own audit in the {AUDIT_STREAM} stream,"
            " its tool catalogue and tool calls, its copies of its sessions' transcripts",
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
