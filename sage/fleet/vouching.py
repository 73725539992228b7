"""Whether a node may vouch for a principal: the check on forwarded requests and tool calls.

A request or tool call that another node forwards carries the principal that
node's bus established for its caller.  The NATS server proves which node sent
it (the origin token of the subject, sage/fleet/permissions.py); this module
decides whether that node may speak for that principal here:

- the origin's current heartbeat record (sage/fleet/nodes.py, a key only that
  node may write) must declare the principal among those it authenticates (its
  ``[[principals]]`` names);
- and when this node's config pins the origin, ``[fleet.peers.<origin>]
  principals = [...]``, the principal must be one of those too.  The record is
  the origin's own word, so only the pin bounds a compromised node;
- an admin of the origin (no principal) is an admin here only with
  ``[fleet.peers.<origin>] admins = true``.

Anything else is :class:`NotVouched` (``principal_not_authenticated``), which
the refusing node logs and audits as :data:`REJECTED` with the row of
:func:`rejected_row` (one builder for the forwarded request, the forwarded tool
call and the adoption, so the three rows cannot drift apart).  The
check is pure (:func:`check_vouched`); :class:`VouchedPrincipals` keeps the
origins' declared principals between reads of the bucket, asking the injected
reader again when the read is older than ``ttl`` (a principal removed on the
origin stops being taken within ``ttl``), or older than ``reread_after`` when
the principal is not among what it holds (one just added there is seen soon,
and a node naming principals it does not declare costs at most one read per
``reread_after``, however fast it asks).  Checks that need a read of the same
origin at the same time share one read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import anyio

from sage.config import FleetPeerConfig
from sage.errors import NotVouched
from sage.fleet.nodes import NodeRecord

__all__ = (
    "REJECTED",
    "REJECTED_EVENT",
    "TOOL_CALL",
    "VouchedPrincipals",
    "check_vouched",
    "rejected_row",
)

REJECTED = "fleet_principal_rejected"
"""The audit kind of a refusal: its row goes to ``sage.v1.audit.fleet_principal_rejected``."""
REJECTED_EVENT = "fleet.principal_rejected"
"""The log event of a refusal; its fields are the audit row's."""
TOOL_CALL = "tool.call"
"""The verb of a forwarded tool call's refusal, whose row also names the tool."""
NAME_MAX = 64
TOOL_NAME_MAX = 128


def check_vouched(
    origin: str,
    principal: str | None,
    declared: frozenset[str] | None,
    pin: FleetPeerConfig | None,
) -> None:
    """Return if node ``origin`` may act for ``principal`` here, else raise NotVouched.

    ``declared``: the principals ``origin``'s heartbeat record declares (None: no
    usable record); ``pin``: this node's ``[fleet.peers.<origin>]``, if any."""
    if principal is None:
        if pin is not None and pin.admins:
            return
        raise NotVouched(
            f"node {origin!r} forwarded an admin's request, and this node does not take"
            f" that node's admins ([fleet.peers.{origin}] admins = true); an admin there"
            " acts for a principal with --principal"
        )
    if declared is None:
        raise NotVouched(
            f"node {origin!r} has no heartbeat record here, so it vouches for no principal"
        )
    if principal not in declared:
        raise NotVouched(
            f"node {origin!r} does not authenticate principal {principal!r}"
            " (not among the principals its heartbeat record declares)"
        )
    if pin is not None and pin.principals is not None and principal not in pin.principals:
        raise NotVouched(
            f"node {origin!r} may not vouch for principal {principal!r} here"
            f" ([fleet.peers.{origin}] principals)"
        )


def rejected_row(
    origin: str,
    principal: str | None,
    verb: str,
    session_id: str | None,
    subject: str,
    refusal: NotVouched,
    tool_name: str | None = None,
) -> dict[str, str | None]:
    """The audit row (and log fields) of ``origin`` refused for ``principal``: what was
    asked (``verb``: a request's verb, ``tool.call``, or ``adopt`` with ``subject``
    empty), of which session, and why.  Only a tool call's row has ``tool_name``.
    Never the request's payload or the call's arguments; the names a sender chose are
    cut to their longest valid length, so a row stays small whatever it sent."""
    row: dict[str, str | None] = {
        "origin": origin,
        "principal_id": _clip(principal, NAME_MAX),
        "verb": verb,
    }
    if verb == TOOL_CALL:
        row["tool_name"] = _clip(tool_name, TOOL_NAME_MAX)
    row["session_id"] = _clip(session_id, NAME_MAX)
    row["subject"] = subject
    row["reason"] = str(refusal)
    return row


def _clip(value: str | None, most: int) -> str | None:
    return None if value is None else value[:most]


RecordReader = Callable[[str], Awaitable[NodeRecord | None]]


class VouchedPrincipals:
    """The check of :func:`check_vouched` with the origins' records read on demand."""

    def __init__(
        self,
        read: RecordReader,
        pins: Mapping[str, FleetPeerConfig],
        ttl: float,
        clock: Callable[[], float] = anyio.current_time,
        reread_after: float = 0.25,
    ) -> None:
        self._read = read
        self._pins = pins
        self._ttl = ttl
        self._reread_after = min(reread_after, ttl)
        self._clock = clock
        self._held: dict[str, tuple[float, frozenset[str] | None]] = {}
        self._reading: dict[str, _Reading] = {}

    async def check(self, origin: str, principal: str | None) -> None:
        """Raise NotVouched unless ``origin`` may act for ``principal`` here; what the
        reader raises (the bucket cannot be read now) goes through."""
        pin = self._pins.get(origin)
        if principal is None:  # the record has no say over admins
            check_vouched(origin, principal, None, pin)
            return
        held = self._held.get(origin)
        now = self._clock()
        age = now - held[0] if held is not None else float("inf")
        known = held is not None and held[1] is not None and principal in held[1]
        if age >= self._ttl or (not known and age >= self._reread_after):
            await self._reread(origin, now)
        check_vouched(origin, principal, self._held[origin][1], pin)

    async def _reread(self, origin: str, now: float) -> None:
        """Read ``origin``'s record, once however many checks want it at the same time:
        the others wait for that read and take its record or its error (a read
        cancelled, its caller's deadline passed, leaves the next waiter to read)."""
        while (reading := self._reading.get(origin)) is not None:
            await reading.done.wait()
            if reading.error is not None:
                raise reading.error
            if reading.read:
                return
        reading = self._reading[origin] = _Reading()
        try:
            record = await self._read(origin)
            declared = None if record is None else frozenset(record.principals or ())
            self._held[origin] = (now, declared)
            reading.read = True
        except Exception as exc:  # not handled: shared with the checks waiting, re-raised
            reading.error = exc
            raise
        finally:
            del self._reading[origin]
            reading.done.set()


class _Reading:
    """A read of one origin's record under way, for the checks that wait on it."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.read = False
        self.error: Exception | None = None
