"""Where a request about a session goes: the local runner, else the fleet's router.

One implementation for ``astrid sage`` and :mod:`sage.client`: a session (or an
approval) the local runner does not know is looked for in the fleet, whose router
forwards the request to the node that holds it.
"""

from __future__ import annotations

from typing import Any

from bus import NoResponders
from sage.errors import SageError

__all__ = ("NoFleet", "call_runner", "call_session", "in_fleet")


async def call_runner(client: Any, topic: str, payload: Any, deadline: float) -> dict[str, Any]:
    """Ask the session runner; its ``ok`` reply, or a :class:`SageError` with its error."""
    from sage import replies  # msgspec: not for `astrid --help`

    try:
        reply = await client.request(topic, payload, deadline=deadline)
    except NoResponders:
        raise SageError(
            "no session runner is running (is `runner` in supervisor.capsules?)"
        ) from None
    return replies.parse(reply.payload)  # a failure raises ReplyError: "CODE: MESSAGE"


class NoFleet(SageError):
    """The supervisor asked is not in a fleet (nobody answers its fleet requests)."""

    code = "not_in_fleet"


async def in_fleet(client: Any, verb: str, payload: Any, deadline: float) -> dict[str, Any]:
    """Ask the fleet's router of the local supervisor (``sage.v1.request.fleet.<verb>``)."""
    from sage import replies  # msgspec: not for `astrid --help`

    try:
        reply = await client.request(f"sage.v1.request.fleet.{verb}", payload, deadline=deadline)
    except NoResponders:
        raise NoFleet(
            "not_in_fleet: this supervisor is not in a fleet (its config has no [fleet])"
        ) from None
    return replies.parse(reply.payload)


async def call_session(
    client: Any, verb: str, sid: str, payload: Any, deadline: float
) -> dict[str, Any]:
    """A request about session ``sid`` (or approval, for ``approve``): the local runner's
    answer, as on a single host; one it does not know (``unknown_session``,
    ``unknown_approval``) is looked for in the fleet, whose router forwards the request
    to the node that holds it.  Not in a fleet: the runner's answer stands.

    For a session, both requests are sent at once, so a session on another node does
    not wait for the local runner's ``unknown_session`` first: the router forwards only
    a request for a session the registry puts on another node (it answers
    ``unknown_session`` at once for this node's), and the runner acts only on its own
    sessions, so at most one of them acts.  The runner's answer wins unless it is
    ``unknown_session``; then the router's is awaited (else it is dropped unread).  An approval is asked of every live node by the router: it
    is asked only after the runner did not know it."""
    import msgspec  # not for `astrid --help`

    from sage import replies
    from sage.replies import ReplyError

    if verb in _ASKED_EVERYWHERE:
        try:
            return await call_runner(client, f"sage.v1.request.{verb}.{sid}", payload, deadline)
        except ReplyError as exc:
            if exc.code not in ("unknown_session", "unknown_approval"):
                raise
            try:
                return await in_fleet(client, f"{verb}.{sid}", payload, deadline + 5.0)
            except NoFleet:
                raise exc from None
    body = msgspec.json.encode(payload)
    runner = client.begin_request(f"sage.v1.request.{verb}.{sid}", body, deadline=deadline)
    fleet = client.begin_request(
        f"sage.v1.request.fleet.{verb}.{sid}", body, deadline=deadline + 5.0
    )
    try:
        try:
            local = replies.parse((await runner.result()).payload)
        except NoResponders:
            raise SageError(
                "no session runner is running (is `runner` in supervisor.capsules?)"
            ) from None
        except ReplyError as exc:
            if exc.code != "unknown_session":
                raise
            try:
                return replies.parse((await fleet.result()).payload)
            except NoResponders:  # not in a fleet: the runner's answer stands
                raise exc from None
        return local
    finally:
        fleet.forget()


_ASKED_EVERYWHERE = frozenset({"approve"})
"""Verbs the router asks of every live node (no registry says where an approval waits)."""
