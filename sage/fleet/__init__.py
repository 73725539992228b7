"""The fleet: several supervisors as one sage, over NATS with JetStream (docs/fleet.md).

Nodes join with their own NATS user, heartbeat into the ``sage_nodes``
key-value bucket with their load, and ``astrid fleet status`` shows which are
live, lost or stopped and how loaded.  ``nodes`` is the sans-IO core (records
in, verdicts out), ``placement`` the sans-IO choice of a node for a spawn,
``member`` the async shell (nats-py), ``permissions`` the subjects a node's user
needs; ``routes``/``router``, ``tools`` and ``audit_*`` are sessions, tools and
audit across nodes.  Without ``[fleet]`` none of it runs.
"""

from __future__ import annotations

from sage.errors import FleetAuthFailed, FleetError, FleetRecordError, FleetUnreachable, NotInFleet
from sage.fleet.member import STATUS_TOPIC, FleetMember, join, status_reply
from sage.fleet.nodes import NodeLoad, NodeRecord, NodeState, NodeTable, NodeView
from sage.fleet.permissions import BUCKET, node_permissions, server_block

__all__ = (
    "BUCKET",
    "STATUS_TOPIC",
    "FleetAuthFailed",
    "FleetError",
    "FleetMember",
    "FleetRecordError",
    "FleetUnreachable",
    "NodeLoad",
    "NodeRecord",
    "NodeState",
    "NodeTable",
    "NodeView",
    "NotInFleet",
    "join",
    "node_permissions",
    "server_block",
    "status_reply",
)
