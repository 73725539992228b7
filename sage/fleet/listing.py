"""The fleet-wide listings: every live node's sessions and pending approvals, and an
approval decided wherever it waits.

- :meth:`Listing.sessions` (``sage.v1.request.fleet.sessions``): this node's rows,
  then each live node's (asked at once, each within :data:`LISTING_DEADLINE`), each
  row with its ``node``; a node that cannot or will not say is shown from the
  registry's claims (the registry copy's once it holds the bucket's latest update,
  else the bucket's), its rows' ``state`` saying why (``lost``, ``stopped``,
  ``unreachable``, ``refused``).  NATS away or the buckets unreadable: this node's
  rows, with a warning.
- :meth:`Listing.approvals` (``sage.v1.request.fleet.approvals``): the same for the
  pending approvals the caller may answer (no registry rows: nothing says where an
  approval waits).
- :meth:`Listing.approve`: an approval the local runner does not hold is asked of
  every live node; the holder's answer is the reply.

A node that refuses the caller's principal (``principal_not_authenticated``) is named
in the reply's ``warning``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from bus import Envelope, Identity
from sage import replies
from sage.contract.codes import ErrorCode
from sage.contract.sessions import Verb
from sage.errors import FleetError
from sage.fleet.forwarding import LISTING_DEADLINE, unavailable
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import describe, nats_errors
from sage.fleet.nodes import NodeState
from sage.fleet.registry_copy import RegistryCopy, current_entries
from sage.fleet.routes import SessionEntry, approval_answer, registry_rows
from sage.fleet.runner_link import RunnerLink

__all__ = ("LISTING_FROM_BUCKET", "Listing")

log = structlog.get_logger("sage.fleet.router")

LISTING_FROM_BUCKET = "ASTRID_TEST_LISTING_FROM_BUCKET"
"""Set to ``1`` in a supervisor's environment, its fleet listing reads the bucket even
while the registry copy could answer: for the bench and tests only (they compare the two
paths), never a config option."""

Forward = Callable[..., Awaitable[dict[str, Any]]]
"""A request forwarded to a node (sage/fleet/forwarding.py, ``Forwarding.forward``)."""


class Listing:
    """This node's side of the fleet-wide listings (see the module docstring)."""

    def __init__(
        self,
        member: FleetMember,
        identity: Identity,
        runner: RunnerLink,
        registry_copy: RegistryCopy,
    ) -> None:
        self.member = member
        self.node = member.node
        self.identity = identity
        self.runner = runner
        self.registry_copy = registry_copy
        self.forward: Forward | None = None
        """How another node is asked (set by the router, which makes the forwarding)."""
        self.from_copy = os.environ.get(LISTING_FROM_BUCKET) != "1"

    async def local(
        self, payload: bytes, principal: str | None, identity: Identity, verb: str = Verb.SESSIONS
    ) -> dict[str, Any]:
        """This node's ``sessions`` (or ``approvals``), each row with its ``node``."""
        reply = await self.runner.ask(verb, None, payload, principal=principal, identity=identity)
        for row in reply.get(verb) or []:
            if isinstance(row, dict):
                row["node"] = self.node
        return reply

    async def _ask(self, node: str, verb: str, sid: str | None, request: Envelope) -> Any:
        assert self.forward is not None
        return await self.forward(node, verb, sid, request)

    async def live_peers(self) -> list[str]:
        with nats_errors("the node table"), anyio.fail_after(LISTING_DEADLINE):
            nodes = await self.member.nodes()
        return [v.node for v in nodes if v.node != self.node and v.state is NodeState.LIVE]

    async def approve(self, request: Envelope, verb: str, cid: str) -> dict[str, Any]:
        """An approval the local runner does not hold: asked of every live node; the one
        that holds it answers (for the caller's principal, as locally)."""
        if not self.member.connected:
            return unavailable(
                f"approval {cid!r} is not on node {self.node!r}, and the fleet cannot be asked"
                " now: NATS is not connected"
            )
        try:
            peers = await self.live_peers()
        except FleetError as exc:
            return unavailable(f"cannot read the node bucket now: {describe(exc)}")
        answers: list[dict[str, Any]] = []

        async def ask(node: str) -> None:
            answers.append(await self._ask(node, verb, cid, request))

        async with anyio.create_task_group() as tg:
            for node in peers:
                tg.start_soon(ask, node)
        answer = approval_answer(answers)
        if answer is not None:
            return answer
        return replies.error(
            ErrorCode.UNKNOWN_APPROVAL, f"no pending approval {cid!r} (unknown, decided or expired)"
        )

    async def approvals(self, request: Envelope) -> dict[str, Any]:
        """Every live node's pending approvals the caller may answer, with their node."""
        reply = await self.local(
            request.payload or b"{}", request.principal, self.identity, Verb.APPROVALS
        )
        if not reply.get("ok") or not self.member.connected:
            return reply
        try:
            peers = await self.live_peers()
        except FleetError as exc:
            reply["warning"] = f"this node's approvals only: {describe(exc)}"
            return reply
        rows: list[dict[str, Any]] = list(reply.get("approvals") or [])
        refused: dict[str, str] = {}

        async def ask(node: str) -> None:
            with anyio.move_on_after(LISTING_DEADLINE):
                data = await self._ask(node, Verb.APPROVALS, None, request)
                rows.extend(r for r in data.get("approvals") or [] if isinstance(r, dict))
                _note_refusal(refused, node, data)

        async with anyio.create_task_group() as tg:
            for node in peers:
                tg.start_soon(ask, node)
        reply["approvals"] = rows
        if refused:
            reply["warning"] = _refusals(refused)
        return reply

    async def sessions(self, request: Envelope) -> dict[str, Any]:
        """Every node's sessions the caller may see (see the module docstring)."""
        principal = request.principal
        reply = await self.local(request.payload or b"{}", principal, self.identity)
        if not reply.get("ok"):
            return reply
        rows: list[dict[str, Any]] = list(reply.get("sessions") or [])
        if not self.member.connected:
            reply["warning"] = "this node's sessions only: NATS is not connected"
            return reply
        try:
            with nats_errors("the buckets"), anyio.fail_after(LISTING_DEADLINE):
                nodes = await self.member.nodes()
                source, entries = await self._listed_entries()
        except FleetError as exc:
            reply["warning"] = f"this node's sessions only: {describe(exc)}"
            return reply
        states = {view.node: view.state for view in nodes}
        answers: dict[str, list[dict[str, Any]] | None] = {}
        refused: dict[str, str] = {}

        async def ask(node: str) -> None:
            with anyio.move_on_after(LISTING_DEADLINE):
                data = await self._ask(node, Verb.SESSIONS, None, request)
                if data.get("ok"):
                    answers[node] = [r for r in data.get("sessions") or [] if isinstance(r, dict)]
                    return
                _note_refusal(refused, node, data)
            answers[node] = None

        async with anyio.create_task_group() as tg:
            for node, state in states.items():
                if node != self.node and state is NodeState.LIVE:
                    tg.start_soon(ask, node)
        for node in sorted(states):
            answered = answers.get(node)
            if node != self.node and answered is not None:
                rows += answered
        listed = {row.get("session_id") for row in rows}
        # a node that cannot (or will not) say: what the registry knows, with the node's
        # state (a session another node listed, its adopter, is shown there only)
        shown = {
            node: "refused"
            if node in refused
            else "unreachable"
            if state is NodeState.LIVE
            else state.value
            for node, state in states.items()
            if node != self.node and answers.get(node) is None
        }
        moved = await self._moved(entries, shown, listed)
        rows += registry_rows(entries, shown, listed, principal, moved)
        log.info("fleet.listing", registry=source, claims=len(entries), rows=len(rows))
        reply["sessions"] = rows
        reply["nodes"] = {node: state.value for node, state in sorted(states.items())}
        if refused:
            reply["warning"] = _refusals(refused)
        return reply

    async def _moved(
        self,
        entries: list[tuple[str, SessionEntry]],
        shown: dict[str, str],
        listed: set[object],
    ) -> set[tuple[str, str]]:
        """The lost nodes' entries whose session another node took over (its
        ``sage_claims`` names that node): the entry stays until its node comes back,
        but the session is not there, and once it ended where it went no node lists it,
        so it must not come back as ``lost``.  Read for lost nodes only (few), at once,
        within the listing's deadline; an entry whose claim cannot be read is shown."""
        lost = [
            (sid, entry)
            for sid, entry in entries
            if shown.get(entry.node) == NodeState.LOST.value and sid not in listed
        ]
        moved: set[tuple[str, str]] = set()
        if not lost or self.member.claims is None:
            return moved

        async def check(sid: str, entry: SessionEntry) -> None:
            with contextlib.suppress(FleetError):
                claim, _ = await self.member.claim_of(entry.principal_id, sid)
                if claim is not None and claim.holder != entry.node:
                    moved.add((sid, entry.node))

        with anyio.move_on_after(LISTING_DEADLINE):
            async with anyio.create_task_group() as tg:
                for sid, entry in lost:
                    tg.start_soon(check, sid, entry)
        return moved

    async def _listed_entries(self) -> tuple[str, list[tuple[str, SessionEntry]]]:
        """Where the listing took the registry's claims from (``copy`` or ``bucket``), and
        them: from the registry copy once it holds the bucket's latest update (one round
        trip asks which; thousands of keys read one at a time would not fit
        :data:`LISTING_DEADLINE`), else from the bucket, key by key."""
        if self.from_copy:
            found = await current_entries(self.registry_copy, self.member.registry_revision)
            if found is not None:
                return "copy", [(sid, entry) for sid, entry, _ in found]
        return "bucket", [(sid, entry) for sid, entry, _ in await self.member.session_entries()]


def _note_refusal(refused: dict[str, str], node: str, reply: dict[str, Any]) -> None:
    """Keep ``node``'s answer if it refused the caller's principal (NotVouched)."""
    if reply.get("error") == ErrorCode.PRINCIPAL_NOT_AUTHENTICATED:
        refused[node] = str(reply.get("message") or "")


def _refusals(refused: dict[str, str]) -> str:
    return "; ".join(
        f"node {node!r} refused: {ErrorCode.PRINCIPAL_NOT_AUTHENTICATED}: {why}"
        for node, why in sorted(refused.items())
    )
