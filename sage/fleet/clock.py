"""How far this host's clock is from a NATS server's, and how far it may be.

Sans-IO: the numbers come from ``astrid doctor`` (sage/fleet/probe.py), which sends a
JetStream request and notes the local time before and after; the answer carries the
server's time (``ts``, RFC 3339 with nanoseconds, in a stream info answer).

Why it matters: a node writes ``heartbeat_at`` from its own clock, and every other node
judges it by its own (sage/fleet/nodes.py): the age it computes is the real age plus the
difference of the two clocks.  A node is lost past ``lost_after``, and a live node's
record is at most ``heartbeat`` old, so two clocks more than ``lost_after - heartbeat``
apart make a live node lost (its sessions adopted elsewhere) or keep a dead one live;
and a node's lease (sage/lease.py) holds only while no two clocks are more than
``[fleet] max_clock_skew`` apart.  Each host measured against the same servers, each
within half of the smaller, keeps every pair within it: :func:`skew_budget`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

__all__ = ("Skew", "measure", "parse_server_time", "skew_budget")

_RFC3339 = re.compile(
    r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d{1,9}))?(Z|[+-]\d{2}:\d{2})\Z"
)


def parse_server_time(text: str) -> float:
    """Unix seconds of a server's RFC 3339 time (``2026-12-06T01:15:50.333891285Z``);
    ValueError when it is not one."""
    match = _RFC3339.match(text)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {text[:40]!r}")
    whole, fraction, zone = match.groups()
    stamp = datetime.fromisoformat(whole + ("+00:00" if zone == "Z" else zone))
    if stamp.tzinfo is None:  # pragma: no cover - the zone is always there
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp() + (int(fraction.ljust(9, "0")) / 1e9 if fraction else 0.0)


@dataclass(frozen=True)
class Skew:
    """The server's clock minus ours, measured over one request."""

    offset: float
    """Seconds the server's clock is ahead of ours (negative: behind)."""
    uncertainty: float
    """Half the request's round trip: the server stamped its answer somewhere in it."""


def measure(sent: float, received: float, server: float) -> Skew:
    """The skew of a server that stamped ``server`` on an answer to a request sent at
    ``sent`` and answered at ``received`` (our clock): it stamped it halfway, at best."""
    return Skew(offset=server - (sent + received) / 2, uncertainty=max(0.0, received - sent) / 2)


def skew_budget(max_clock_skew: float) -> float:
    """How far one host's clock may be from the servers': half of ``[fleet]
    max_clock_skew``, what two nodes may differ by for the lease to hold (sage/lease.py).
    It is always within ``lost_after - heartbeat`` too: the config refuses a lease
    shorter than a heartbeat."""
    return max_clock_skew / 2
