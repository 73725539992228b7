"""Placement by load: which nodes may take a new session, in the order to ask them (sans-IO).

``astrid sage spawn PRINCIPAL --node any`` (or any spawn without ``--node``
under ``[fleet] placement = "least_loaded"``) places the session on the least
loaded live node.  :func:`place` takes the nodes as their heartbeats show them
(:class:`~sage.fleet.nodes.NodeView`), the principal the session is for and the
asking node's name, and returns a :class:`Placement`: the candidates in the order
to ask them, and every other node with why it was passed over.

A node is passed over when it is not live (lost or stopped), its record says
nothing usable of its load or principals (an older node, a runner that did
not answer, values out of bounds), its principals do not include the
session's, or it is full: at its ``max_live`` with no idle session to
hibernate to make room.  The others are ordered by their share of live slots
in use (``live / max_live``; a node without ``max_live`` is measured against
:data:`UNBOUNDED_SLOTS`), then the asking node first, then by name.

The async shell (sage/fleet/router.py) asks each candidate in turn and moves
on when one refuses for a reason of its own (:data:`NODE_REFUSALS`).
"""

from __future__ import annotations

import msgspec

from sage.contract.codes import ErrorCode
from sage.fleet.nodes import NodeState, NodeView

__all__ = (
    "ANY",
    "NODE_REFUSALS",
    "UNBOUNDED_SLOTS",
    "Passed",
    "Placement",
    "place",
    "refusal_text",
    "share",
    "why_not",
)

ANY = "any"
"""``spawn --node any``: the fleet places the session (no node may be named so)."""

UNBOUNDED_SLOTS = 100
"""The live slots a node without ``[sessions] max_live`` is taken to have when its load
is compared with others' (a live ``claude`` holds about 200 MiB: about 100 a host)."""

NODE_REFUSALS = frozenset(
    {
        ErrorCode.HOST_FULL,
        ErrorCode.PRINCIPAL_LIMIT,
        ErrorCode.UNKNOWN_PRINCIPAL,
        ErrorCode.PRINCIPAL_NOT_AUTHENTICATED,
        ErrorCode.NO_RUNNER,
        ErrorCode.NOT_READY,
        ErrorCode.FLEET_UNAVAILABLE,
        ErrorCode.CLAUDE_MISSING,
        ErrorCode.CLAUDE_UNSUPPORTED,
        ErrorCode.SPAWN_FAILED,
        ErrorCode.HOME_UNREACHABLE,
        ErrorCode.UNSAFE_HOME,
        ErrorCode.CWD_MISSING,
        ErrorCode.API_KEY_MISSING,
        ErrorCode.API_KEY_UNREADABLE,
        ErrorCode.SECRET_STORE_FAILED,
        ErrorCode.SESSION_UID_UNAVAILABLE,
    }
)
"""Refusals of a spawn that another node might not give: placement asks the next one.
Any other (a bad request, a session id taken, not authorized) is the caller's answer."""


class Passed(msgspec.Struct, frozen=True):
    """A node that was not asked, or refused, and why."""

    node: str
    why: str


class Placement(msgspec.Struct, frozen=True):
    candidates: tuple[str, ...]
    """The nodes to ask, the least loaded first."""
    passed: tuple[Passed, ...]
    """The nodes not to ask, by name, each with why."""


def share(view: NodeView, more: int = 0) -> float:
    """Its share of live slots in use (the load placement orders by), ``more`` sessions
    started there since its heartbeat included."""
    assert view.load is not None
    return (view.load.live + more) / (view.load.max_live or UNBOUNDED_SLOTS)


def why_not(view: NodeView, principal: str, *, more: int = 0, slot: bool = True) -> str | None:
    """Why ``view``'s node may not take a session of ``principal`` (None: it may):
    ``more`` sessions started there since its heartbeat; ``slot`` False: the session
    takes no live slot (it comes asleep), so a full node may take it."""
    if view.state is not NodeState.LIVE:
        return str(view.state.value)
    load = view.load
    if load is None or view.principals is None:
        return "its load is unknown (an older node, or its runner did not answer)"
    if principal not in view.principals:
        return f"it does not serve principal {principal!r}"
    if slot and load.full_after(more):
        return f"full: live {load.live + more}/{load.max_live}, none idle"
    return None


def place(nodes: list[NodeView], principal: str, local: str) -> Placement:
    """The nodes that may take a session of ``principal``, least loaded first (ties: the
    ``local`` node, then by name), and the others with why not."""
    candidates: list[NodeView] = []
    passed: list[Passed] = []
    for view in sorted(nodes, key=lambda v: v.node):
        why = why_not(view, principal)
        if why is None:
            candidates.append(view)
        else:
            passed.append(Passed(view.node, why))
    candidates.sort(key=lambda v: (share(v), v.node != local, v.node))
    return Placement(tuple(v.node for v in candidates), tuple(passed))


def refusal_text(principal: str, passed: list[Passed]) -> str:
    """The one line of a spawn no node would take: each node and why."""
    if not passed:
        return f"no node of the fleet may take a session of {principal!r}: no node is known"
    reasons = "; ".join(f"{p.node}: {p.why}" for p in passed)
    return f"no node of the fleet may take a session of {principal!r} ({reasons})"
