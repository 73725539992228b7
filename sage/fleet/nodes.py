"""The node table: heartbeat records in, liveness verdicts out (sans-IO).

Each node of a fleet keeps one record in the ``sage_nodes`` bucket under its
own name and rewrites it every ``heartbeat`` seconds.  This module decodes those
records and judges them against a clock the caller passes: ``live`` while the
last heartbeat is at most ``lost_after`` seconds old, ``lost`` after that, and
``stopped`` when the node said it left (a graceful stop).  Nothing here reads a
clock, a socket or the bucket: the shell (sage/fleet/member.py) feeds it.

A record that cannot be used (not JSON, a field missing or of the wrong type,
or a record filed under another node's key) is left out and named in
``NodeTable.ignored``; the others are judged as usual.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import msgspec

from sage.config import NAME_PATTERN
from sage.errors import SageError

__all__ = (
    "FleetRecordError",
    "NodeRecord",
    "NodeState",
    "NodeTable",
    "NodeView",
    "decode_record",
)

_NAME = re.compile(NAME_PATTERN)


class FleetRecordError(SageError):
    """A heartbeat record in the bucket cannot be used."""

    code = "fleet_record_invalid"


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """What a node writes at each heartbeat (JSON in the bucket)."""

    node: str
    host: str
    pid: int
    started_at: float
    """Wall-clock seconds (Unix time) when the node's supervisor started."""
    heartbeat_at: float
    """Wall-clock seconds of this heartbeat, by the node's own clock."""
    heartbeat: float
    """The node's heartbeat interval, in seconds."""
    stopped: bool = False
    """The node's last word: it stopped on purpose (not lost)."""
    principals: tuple[str, ...] = ()
    """The principals the node authenticates (its ``[[principals]]`` names): the only
    ones it may forward requests and tool calls for (sage/fleet/vouching.py)."""

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


_decoder = msgspec.json.Decoder(NodeRecord)


def decode_record(key: str, data: bytes) -> NodeRecord:
    """The record stored under ``key``, or :class:`FleetRecordError` saying why not."""
    try:
        record = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FleetRecordError(f"record {key!r}: {exc}") from None
    if record.node != key:
        raise FleetRecordError(f"record {key!r}: it names node {record.node!r}")
    if not _NAME.match(key):
        raise FleetRecordError(f"record {key!r}: not a node name")
    if not (record.heartbeat > 0 and record.pid > 0):
        raise FleetRecordError(f"record {key!r}: heartbeat and pid must be positive")
    return record


class NodeState(enum.Enum):
    LIVE = "live"
    LOST = "lost"
    STOPPED = "stopped"


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """One node as ``astrid fleet status`` shows it."""

    node: str
    state: NodeState
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    age_s: float
    """Seconds since the node's last heartbeat (negative: its clock is ahead of ours)."""

    def to_builtins(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class NodeTable:
    """The latest record of each node, judged against ``now`` on demand."""

    def __init__(self, lost_after: float) -> None:
        if lost_after <= 0:
            raise ValueError("lost_after must be positive")
        self.lost_after = lost_after
        self._records: dict[str, NodeRecord] = {}
        self.ignored: dict[str, str] = {}
        """key -> why its record was left out."""

    def observe(self, key: str, data: bytes) -> NodeRecord | None:
        """Take the record stored under ``key``; None (and noted) when it is unusable."""
        try:
            record = decode_record(key, data)
        except FleetRecordError as exc:
            self._records.pop(key, None)
            self.ignored[key] = str(exc)
            return None
        self.ignored.pop(key, None)
        self._records[key] = record
        return record

    def forget(self, key: str) -> None:
        """The key was deleted from the bucket."""
        self._records.pop(key, None)
        self.ignored.pop(key, None)

    def state_of(self, record: NodeRecord, now: float) -> NodeState:
        if record.stopped:
            return NodeState.STOPPED
        if now - record.heartbeat_at > self.lost_after:
            return NodeState.LOST
        return NodeState.LIVE

    def verdicts(self, now: float) -> list[NodeView]:
        """Every usable node's state at ``now``, by name."""
        return [
            NodeView(
                node=record.node,
                state=self.state_of(record, now),
                host=record.host,
                pid=record.pid,
                started_at=record.started_at,
                heartbeat_at=record.heartbeat_at,
                age_s=round(now - record.heartbeat_at, 3),
            )
            for _, record in sorted(self._records.items())
        ]
