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

A record also says the node's load (:class:`NodeLoad`: its live ``claude``
children, ``max_live``, idle and hibernated sessions) and the principals it
serves.  Both are optional: a record of an older node has neither, and a load
that is out of bounds (negative, past :data:`MOST`, more idle than live) or a
principal that is not a name leaves the node's liveness as it is and its load
and principals unknown (named in ``NodeTable.unknown_load``): placement
(sage/fleet/placement.py) never trusts what it cannot check.

And it says what the node spent this UTC day and month, by principal
(:class:`~sage.contract.usage.SpendReport`), which the other nodes count against
budgets (sage/fleet/spend.py).  A spend out of its bounds leaves it unknown
(named in ``NodeTable.unknown_load`` too), and the load and principals as they are.
``astrid fleet status`` never shows it (:meth:`NodeView.to_builtins`): spend is
``astrid sage usage``'s, which shows a principal only its own.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any

import msgspec

from sage.config import NAME_PATTERN
from sage.contract.usage import SpendReport
from sage.errors import FleetRecordError

__all__ = (
    "NodeLoad",
    "NodeRecord",
    "NodeState",
    "NodeTable",
    "NodeView",
    "decode_record",
)

_NAME = re.compile(NAME_PATTERN)

MOST = 1_000_000
"""No count of a node's sessions is larger (a host runs on the order of 100)."""
_Count = Annotated[int, msgspec.Meta(ge=0, le=MOST)]
_Principal = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]


class NodeLoad(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """A node's sessions at its heartbeat, as its session runner counts them."""

    live: _Count = 0
    """Sessions with a ``claude`` child now (each holds a live slot)."""
    max_live: Annotated[int, msgspec.Meta(ge=1, le=MOST)] | None = None
    """Its ``[sessions] max_live``; None: no bound."""
    idle: _Count = 0
    """Live sessions idle now: what it may hibernate to make room."""
    hibernated: _Count = 0
    """Sessions asleep, without a child."""

    def __post_init__(self) -> None:
        if self.idle > self.live:
            raise ValueError(f"idle {self.idle} is more than live {self.live}")

    @property
    def full(self) -> bool:
        """At ``max_live`` with nothing idle to make room: a spawn there waits or fails."""
        return self.full_after(0)

    def full_after(self, more: int) -> bool:
        """Whether it is full once ``more`` sessions started there since this count (each
        takes a free slot, else an idle session's, which hibernates to make room)."""
        return self.max_live is not None and self.live + more >= self.max_live + self.idle


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
    load: NodeLoad | None = None
    """Its sessions; None: unknown (an older node, or its runner did not answer)."""
    principals: Annotated[list[_Principal], msgspec.Meta(max_length=10_000)] | None = None
    """The principals its config names; None: unknown (an older node)."""
    spend: SpendReport | None = None
    """What it spent this UTC day and month, by principal; None: unknown (an older node,
    a node that keeps no ledger, or a report out of bounds)."""

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


class _Liveness(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """A record read without its load and principals (when those cannot be used)."""

    node: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    heartbeat: float
    stopped: bool = False


class _Placed(_Liveness, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """A record read without its spend (when that cannot be used)."""

    load: NodeLoad | None = None
    principals: Annotated[list[_Principal], msgspec.Meta(max_length=10_000)] | None = None


_decoder = msgspec.json.Decoder(NodeRecord)
_placed_decoder = msgspec.json.Decoder(_Placed)
_liveness_decoder = msgspec.json.Decoder(_Liveness)


def decode_record(key: str, data: bytes) -> NodeRecord:
    """The record stored under ``key``, or :class:`FleetRecordError` saying why not.

    A load or principals out of bounds leave them None (see :func:`load_problem`)."""
    try:
        record = _decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FleetRecordError(f"record {key!r}: {exc}") from None
    if record.node != key:
        raise FleetRecordError(f"record {key!r}: it names node {record.node!r}")
    if not _NAME.match(key):
        raise FleetRecordError(f"record {key!r}: not a node name")
    if not (record.heartbeat > 0 and record.pid > 0):
        raise FleetRecordError(f"record {key!r}: heartbeat and pid must be positive")
    return record


def _decode(data: bytes) -> NodeRecord:
    try:
        return _decoder.decode(data)
    except msgspec.ValidationError:
        pass
    try:
        placed = _placed_decoder.decode(data)  # a spend out of bounds: left out
        return NodeRecord(**msgspec.structs.asdict(placed))
    except msgspec.ValidationError:
        liveness = _liveness_decoder.decode(data)  # raises when the liveness is bad too
    return NodeRecord(**msgspec.structs.asdict(liveness))


def load_problem(data: bytes) -> str | None:
    """Why the load, principals or spend of a record are left unknown; None: they are
    usable (or absent).  Only for a record :func:`decode_record` took."""
    try:
        _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return str(exc)
    return None


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
    load: NodeLoad | None = None
    principals: list[str] | None = None
    spend: SpendReport | None = None
    """What the node spent (for budgets); never in :meth:`to_builtins`."""

    def to_builtins(self) -> dict[str, Any]:
        """The view as ``astrid fleet status`` shows it: without the spend."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        out.pop("spend", None)
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
        self.unknown_load: dict[str, str] = {}
        """key -> why its record's load, principals or spend were left unknown."""

    def observe(self, key: str, data: bytes) -> NodeRecord | None:
        """Take the record stored under ``key``; None (and noted) when it is unusable."""
        try:
            record = decode_record(key, data)
        except FleetRecordError as exc:
            self._records.pop(key, None)
            self.unknown_load.pop(key, None)
            self.ignored[key] = str(exc)
            return None
        self.ignored.pop(key, None)
        unknown = record.load is None or record.principals is None or record.spend is None
        problem = load_problem(data) if unknown else None
        if problem is None:
            self.unknown_load.pop(key, None)
        else:
            self.unknown_load[key] = problem
        self._records[key] = record
        return record

    def forget(self, key: str) -> None:
        """The key was deleted from the bucket."""
        self._records.pop(key, None)
        self.ignored.pop(key, None)
        self.unknown_load.pop(key, None)

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
                load=record.load,
                principals=record.principals,
                spend=record.spend,
            )
            for _, record in sorted(self._records.items())
        ]
