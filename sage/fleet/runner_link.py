"""The fleet's way to this node's session runner: one request on the local bus.

Every part of the fleet that asks the runner (the router's forwarded requests and
listings, the registry's resync, fencing's yields, failover's replicas and
adoptions) asks through :class:`RunnerLink`: the runner's topic (sage/contract/),
the verb's deadline (:data:`DEADLINES`), on behalf of the principal the caller was
established as, and the answer as a reply dict, never an exception: no runner is
``no_runner``, a bus that cannot carry it ``fleet_unavailable``, an answer that is
no reply ``internal_error``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bus import Bus, BusError, Identity, NoResponders
from sage import replies
from sage.contract.codes import ErrorCode
from sage.contract.sessions import Verb, request_topic

__all__ = ("DEADLINES", "DEFAULT_DEADLINE", "NETWORK_SLACK", "RunnerLink", "deadline_of")

DEADLINES: dict[str, float] = {
    Verb.SPAWN: 30.0,
    Verb.SEND: 120.0,
    Verb.WAKE: 120.0,
    Verb.STOP: 30.0,
    Verb.ADOPT: 120.0,
    Verb.YIELD: 30.0,
}
"""Seconds a request may take at the runner that answers it (others: :data:`DEFAULT_DEADLINE`);
a request forwarded to another node waits :data:`NETWORK_SLACK` more."""
DEFAULT_DEADLINE = 10.0
NETWORK_SLACK = 2.0


def deadline_of(verb: str) -> float:
    """Seconds the runner may take to answer ``verb``."""
    return DEADLINES.get(verb, DEFAULT_DEADLINE)


class RunnerLink:
    """Requests to this node's runner (``node``: this node's name, for the messages)."""

    def __init__(self, bus: Bus, identity: Identity, node: str) -> None:
        self.bus = bus
        self.identity = identity
        self.node = node

    async def ask(
        self,
        verb: str,
        sid: str | None = None,
        payload: bytes = b"{}",
        *,
        principal: str | None = None,
        identity: Identity | None = None,
    ) -> dict[str, Any]:
        """The runner's reply to ``verb`` (about ``sid``) on behalf of ``principal`` (None:
        as an admin), asked as ``identity`` (default: the fleet's own)."""
        try:
            answer = await self.bus.request_raw(
                identity or self.identity,
                request_topic(verb, sid),
                payload,
                deadline=deadline_of(verb),
                on_behalf_of=principal,
            )
        except NoResponders:
            return replies.error(ErrorCode.NO_RUNNER, f"node {self.node!r} runs no session runner")
        except BusError as exc:
            return replies.error(ErrorCode.FLEET_UNAVAILABLE, f"node {self.node!r}: {exc}")
        try:
            data = msgspec.json.decode(answer.payload)
        except msgspec.DecodeError:
            return replies.error(
                ErrorCode.INTERNAL_ERROR, f"node {self.node!r}: a reply that is not JSON"
            )
        if isinstance(data, dict):
            return data
        return replies.error(ErrorCode.INTERNAL_ERROR, "bad reply")

    async def ask_as_supervisor(self, verb: str, sid: str | None, body: Any) -> dict[str, Any]:
        """``verb`` with ``body`` (a struct or builtins) as the supervisor (an admin)."""
        return await self.ask(verb, sid, msgspec.json.encode(body))
