"""A node's own copy of the session registry, kept by a watch of the ``sage_sessions`` bucket.

A request for another node's session needs the session's owner.  Asking the
bucket for it costs a JetStream round trip on every request (about 0.5 ms on
loopback); this copy answers from memory.  :class:`RegistryCopy` is the sans-IO
core (entries in, answers out); :func:`follow` is its thin async shell, a nats-py
key-value watch (an ordered push consumer) that feeds it.

A copy may be stale: a put or a delete still on its way, or lost while NATS was
away.  So it is only a hint, and the router (sage/fleet/router.py) uses it under
two rules that keep a stale copy from ever sending a request to the wrong node
silently:

- only a *remote* owner is taken from the copy, and only when one node alone
  claims the session; a miss, several claims (the live one is chosen, which
  needs the node table), or an entry naming this node, is asked of the bucket (this node's runner has already said it does not
  have the session);
- when the owner named by the copy answers with an error (``unknown_session``,
  or any other, or it cannot be reached), the bucket is asked afresh, and the
  request goes to the node it names, if another; the copy is then known stale,
  and its watch is started anew.

The fleet listing (``astrid sage sessions`` on a fleet node) reads its rows of
the nodes that do not answer it from the copy too (:meth:`RegistryCopy.entries`),
once the watch has delivered the bucket stream's last sequence (one round trip asks
it), so the rows are those of the bucket at that moment; a copy not synced, found
stale, or behind (a watch whose consumer vanished silently) leaves the listing to
the bucket, read key by key.

Until the watch has delivered the bucket's current values the copy answers
nothing, and every lookup goes to the bucket, as without a copy.  The same holds
from the moment the NATS connection drops (a watch's consumer may not survive
an outage, and nats-py may give up re-creating it) until a new watch has caught
up after it is back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import structlog

from sage.errors import FleetError
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.routes import REGISTRY, SessionEntry, decode_keyed, parse_registry_key

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

__all__ = ("RegistryCopy", "current_entries", "follow")

log = structlog.get_logger("sage.fleet.registry")

RETRY = 2.0
"""Seconds between a failed watch and the next try."""
CHECK = 0.5
"""Seconds between two looks at the connection and at a stale copy, while watching."""
CATCH_UP = 0.5
"""Seconds a reader waits for the watch to deliver the bucket's latest update before it
reads the bucket instead (:func:`current_entries`)."""
CATCH_UP_CHECK = 0.005  # seconds between two looks at the copy meanwhile


class RegistryCopy:
    """Session id -> each node's entry (node -> :class:`SessionEntry`), as the watch last
    saw the bucket's ``<node>.<sid>`` keys."""

    def __init__(self) -> None:
        self._entries: dict[str, dict[str, SessionEntry]] = {}
        self._revisions: dict[str, int] = {}
        """Registry key -> the revision of its value here."""
        self._synced = False
        self._stale = False
        self.updates = 0
        """Watch updates applied (puts and deletes), for status and tests."""
        self.watches = 0
        """Watches started: the first, and one after each outage or stale copy."""
        self.revision = 0
        """The highest revision (the bucket stream's sequence) the watch delivered: the
        copy holds every update up to the stream's last sequence once it reaches it."""

    @property
    def synced(self) -> bool:
        """Whether the copy holds the bucket as of the watch's start, and what followed."""
        return self._synced

    def owner(self, sid: str) -> SessionEntry | None:
        """The copy's entry for ``sid`` when one node alone claims it; None when it has
        none, several, or is not synced."""
        claims = self._entries.get(sid) if self._synced else None
        if claims is None or len(claims) != 1:
            return None
        return next(iter(claims.values()))

    def entries(self, last: int) -> list[tuple[str, SessionEntry]] | None:
        """Every entry ``(sid, entry)``, by session id then node, as the bucket's keys
        hold them when its stream's last sequence is ``last``; None unless the copy is
        synced, not found stale, and has every update up to ``last`` (then the bucket is
        read instead)."""
        found = self.keyed_entries(last)
        return None if found is None else [(sid, entry) for sid, entry, _ in found]

    def keyed_entries(self, last: int) -> list[tuple[str, SessionEntry, int]] | None:
        """:meth:`entries` with each entry's revision, as the bucket's read gives them
        (sage/fleet/member.py, ``session_entries``)."""
        if not self._synced or self._stale or self.revision < last:
            return None
        found: list[tuple[str, SessionEntry, int]] = []
        for sid in sorted(self._entries):
            claims = self._entries[sid]
            found += [
                (sid, claims[node], self._revisions.get(f"{node}.{sid}", 0))
                for node in sorted(claims)
            ]
        return found

    @property
    def stale(self) -> bool:
        """Whether the copy was found to disagree with the bucket since its watch began."""
        return self._stale

    def found_stale(self) -> None:
        """The bucket named another owner than the copy: stop answering; the watch is
        started anew (:func:`follow`)."""
        self._stale = True
        self._synced = False

    def restart(self) -> None:
        """A new watch begins: nothing is known until it has caught up."""
        self._synced = False
        self._stale = False
        self._entries.clear()
        self._revisions.clear()
        self.revision = 0

    def caught_up(self) -> None:
        """The watch delivered every current value: the copy may answer."""
        self._synced = True

    def apply(self, key: str, value: bytes | None, revision: int = 0) -> None:
        """A put (``value``) or a delete or purge (None) of the key ``<node>.<sid>`` at
        ``revision``; a value that cannot be used (or names another node than its key)
        counts as none."""
        self.updates += 1
        self.revision = max(self.revision, revision)
        found = parse_registry_key(key)
        if found is None:
            return
        node, sid = found
        keyed = None if value is None else decode_keyed(key, value)
        claims = self._entries.setdefault(sid, {})
        if keyed is None:
            claims.pop(node, None)
            self._revisions.pop(key, None)
        else:
            claims[node] = keyed[1]
            self._revisions[key] = revision
        if not claims:
            del self._entries[sid]

    def __len__(self) -> int:
        """Sessions with an entry (of one node or more)."""
        return len(self._entries)


async def follow(
    kv: KeyValue,
    copy: RegistryCopy,
    connected: Callable[[], bool],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Keep ``copy`` by watching ``kv`` for ever.  A watch ends when the connection
    drops (``connected()`` false), when the copy was found stale, or when it fails
    (not permitted, say: logged once per run of failures); a new one starts once
    connected, after :data:`RETRY` seconds if it failed."""
    task_status.started()
    failing = False
    while True:
        await _until(connected)
        copy.restart()
        copy.watches += 1
        try:
            with nats_errors(f"the watch of {REGISTRY}"):
                await _watch_while_trusted(kv, copy, connected)
        except Exception as exc:  # the watch outlives any error: logged, watched again
            if not failing:
                log.warning("fleet.registry_watch_failed", code=code_of(exc), error=describe(exc))
            failing = True
            copy.restart()
            await anyio.sleep(RETRY)
            continue
        copy.restart()
        if failing:
            log.info("fleet.registry_watch_resumed")
        failing = False


async def current_entries(
    copy: RegistryCopy, last: Callable[[], Awaitable[int]]
) -> list[tuple[str, SessionEntry, int]] | None:
    """The copy's claims as the bucket holds them now: ``last()`` (a round trip) says the
    bucket stream's last sequence, and the watch is given up to :data:`CATCH_UP` seconds
    to deliver it; None when the copy is not synced, found stale, or still behind (the
    caller reads the bucket then)."""
    if not copy.synced:
        return None
    newest = await last()
    with anyio.move_on_after(CATCH_UP):  # an update on its way to the watch
        while True:  # (follow() applies the watch's updates and sets no event)
            if not copy.synced or copy.revision >= newest:
                break
            await anyio.sleep(CATCH_UP_CHECK)
    return copy.keyed_entries(newest)


async def _watch_while_trusted(
    kv: KeyValue, copy: RegistryCopy, connected: Callable[[], bool]
) -> None:
    """One watch, applied to ``copy`` until the connection drops or the copy is stale."""
    watcher: Any = await kv.watchall()
    try:
        async with anyio.create_task_group() as tg:

            async def until_untrusted() -> None:
                await _until(lambda: not connected() or copy.stale)
                tg.cancel_scope.cancel()

            tg.start_soon(until_untrusted)
            async for update in watcher:
                if update is None:  # the current values are all in
                    if not copy.stale:
                        copy.caught_up()
                    continue
                deleted = update.operation in ("DEL", "PURGE")
                value = None if deleted else (update.value or b"")
                copy.apply(update.key, value, update.revision or 0)
    finally:
        # the connection may be gone with it
        with (
            anyio.CancelScope(shield=True),
            anyio.move_on_after(1.0),
            contextlib.suppress(FleetError),
            nats_errors("the watch's stop"),
        ):
            await watcher.stop()


async def _until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds, looking every :data:`CHECK` seconds (the
    connection's state comes from nats-py's callbacks, which nothing here awaits)."""
    while True:
        if condition():
            return
        await anyio.sleep(CHECK)
