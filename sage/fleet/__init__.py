"""The fleet: several supervisors as one sage, over NATS with JetStream (docs/fleet.md).

This slice: nodes join with their own NATS user, heartbeat into the
``sage_nodes`` key-value bucket, and ``astrid fleet status`` shows which are
live, lost or stopped.  ``nodes`` is the sans-IO core (records in, verdicts out),
``member`` the async shell (nats-py), ``permissions`` the subjects a node's user
needs.  Without ``[fleet]`` none of it runs.
"""

from __future__ import annotations

from sage.fleet.member import (
    STATUS_TOPIC,
    FleetAuthFailed,
    FleetError,
    FleetMember,
    FleetUnreachable,
    NotInFleet,
    join,
    status_reply,
)
from sage.fleet.nodes import FleetRecordError, NodeRecord, NodeState, NodeTable, NodeView
from sage.fleet.permissions import BUCKET, node_permissions, server_block

__all__ = (
    "BUCKET",
    "STATUS_TOPIC",
    "FleetAuthFailed",
    "FleetError",
    "FleetMember",
    "FleetRecordError",
    "FleetUnreachable",
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
