"""Failover's claims in the ``sage_claims`` bucket: a compare-and-set no third node can forge.

Each node writes only its own keys, ``$KV.sage_claims.<node>.<principal>.<sid>`` (its
NATS user may publish nothing else there: sage/fleet/permissions.py), so the server
proves who wrote a claim.  Session ids are each node's (two principals may each have a
``review`` on two nodes), so a session is named across the fleet by its principal and
its id: its claim is the *latest* message of all its keys,
``$KV.sage_claims.*.<principal>.<sid>`` (:meth:`Claims.latest`, read from the stream's
leader), and no claim to one principal's session touches another's.
A write names the revision of that latest message
(``Nats-Expected-Last-Subject-Sequence`` with ``Nats-Expected-Last-Subject-Sequence-Subject``
set to the session's subject filter: NATS 2.11 and later), so it fails when any
node wrote any of the session's keys since (:class:`~sage.errors.FleetRaceLost`):
of two nodes that race for one session exactly one wins, and no node can write,
replace or withdraw another's claim.  A withdrawn claim is a delete marker on the
node's own key, written the same way.

The bucket's stream allows no rollup, purge or message delete
(sage/fleet/streams.py), so no publish erases another node's claim either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sage.errors import FleetNotFound
from sage.fleet.nats_errors import nats_errors
from sage.fleet.routes import CLAIMS, CLAIMS_STREAM, Claim, claim_filter, claim_key, decode_claim

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

__all__ = ("EXPECTED_SEQ", "EXPECTED_SUBJECT", "Claims", "cas_headers")

EXPECTED_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
_OPERATION = "KV-Operation"


def cas_headers(last: int, subjects: str) -> dict[str, str]:
    """The headers of a publish stored only if the last message on ``subjects`` (a filter,
    wildcards allowed) is still the one at revision ``last`` (0: there is none)."""
    return {EXPECTED_SEQ: str(last), EXPECTED_SUBJECT: subjects}


class Claims:
    """This node's claims, and every node's as read (see the module docstring)."""

    def __init__(self, js: JetStreamContext, node: str) -> None:
        self.js = js
        self.node = node

    async def latest(self, principal: str, sid: str) -> tuple[Claim | None, int]:
        """``principal``'s session ``sid``'s claim (None: none, withdrawn, or unusable) and
        the revision a write names to replace it (0: no node ever wrote one).  A value
        whose ``node`` is not its key's writer, or whose ``principal_id`` is not its key's,
        is a lie, and counts as none."""
        subjects = claim_filter(principal, sid)
        try:
            with nats_errors(f"the {CLAIMS} bucket"):
                msg = await self.js.get_last_msg(CLAIMS_STREAM, subjects, direct=False)
        except FleetNotFound:
            return None, 0
        revision = int(msg.seq or 0)
        operation = (msg.headers or {}).get(_OPERATION)
        writer = (msg.subject or "").split(".")[2:3]
        if operation in ("DEL", "PURGE") or not writer:
            return None, revision
        claim = decode_claim(msg.data or b"")
        if claim is None or claim.node != writer[0] or claim.principal_id != principal:
            return None, revision
        return claim, revision

    async def write(self, sid: str, claim: Claim, last: int) -> int:
        """Store ``claim`` (this node's, to ``claim.principal_id``'s session ``sid``) under
        this node's key if ``last`` is still the revision of the session's latest claim;
        its revision, or FleetRaceLost when another node wrote meanwhile."""
        if claim.node != self.node:
            raise ValueError(f"node {self.node!r} writes its own claims, not {claim.node!r}'s")
        if not claim.principal_id:
            raise ValueError(f"a claim to {sid!r} names its principal")
        principal = claim.principal_id
        with nats_errors(f"the {CLAIMS} bucket"):
            ack = await self.js.publish(
                f"$KV.{CLAIMS}.{claim_key(self.node, principal, sid)}",
                claim.encode(),
                headers=cas_headers(last, claim_filter(principal, sid)),
            )
        return int(ack.seq)

    async def withdraw(self, principal: str, sid: str, last: int) -> int:
        """Withdraw this node's claim to ``principal``'s ``sid`` (a delete marker on its own
        key) if ``last`` is still the latest revision; FleetRaceLost if not."""
        headers = {**cas_headers(last, claim_filter(principal, sid)), _OPERATION: "DEL"}
        with nats_errors(f"the {CLAIMS} bucket"):
            ack = await self.js.publish(
                f"$KV.{CLAIMS}.{claim_key(self.node, principal, sid)}", b"", headers=headers
            )
        return int(ack.seq)
