"""This node's entries in the session registry (``sage_sessions``), kept from its runner.

- **Books.** :meth:`RegistryKeeper.keep_books` follows this node's sessions' lifecycle
  events (their own queue, sage/fleet/lifecycle.py: deltas never crowd them out): a
  ``spawned`` puts ``{node, principal_id, state, at, resume}`` under ``<node>.<sid>``
  (the only keys this node's NATS user may write), a ``hibernated`` marks it asleep
  (a node that adopts it keeps it so), an ``exited`` deletes it; failover hears of
  each finished turn and each end.  :attr:`RegistryKeeper.here` is the sessions this
  node's runner has.
- **Writes.** One task writes them in order (:meth:`RegistryKeeper.write`); a write
  that fails is logged, and the next resync puts the registry right.  Deleting a
  claim deletes this node's ``sage_claims`` key too when no other node claims the
  session (:meth:`RegistryKeeper.forget`).
- **Resync.** At start, after each outage of NATS and after a lifecycle event was
  dropped, :meth:`RegistryKeeper.resync` makes the registry agree with the runner's
  listing; a session another node took meanwhile is fenced, never claimed again.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import msgspec
import structlog
from anyio.streams.memory import MemoryObjectSendStream

from sage.contract.sessions import EntryState, RecordState, SessionEvent, SessionRow, Verb, event_of
from sage.errors import FleetError, FleetRaceLost
from sage.fleet.failover import Failover
from sage.fleet.forwarding import LISTING_DEADLINE
from sage.fleet.lifecycle import LifecycleEvents
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.routes import CLAIMS, REGISTRY, SessionEntry, registry_key
from sage.fleet.runner_link import RunnerLink
from sage.fleet.states import RESYNC_TRANSITIONS, Machine, ResyncState

__all__ = ("RESYNC_CHECK", "RegistryKeeper")

log = structlog.get_logger("sage.fleet.router")

RESYNC_CHECK = 1.0  # seconds between two looks at whether the registry needs a resync
WRITES_QUEUED = 1024  # registry writes waiting at most (past it: dropped, and resynced)

Fence = Callable[[list[str]], Awaitable[list[str]]]
"""Fence these sessions (sage/fleet/fencer.py): those still this node's are returned."""


class RegistryKeeper:
    """This node's claims in the registry (see the module docstring)."""

    def __init__(
        self,
        member: FleetMember,
        runner: RunnerLink,
        failover: Failover | None,
        resumes: Callable[[], bool],
        lifecycle: LifecycleEvents,
    ) -> None:
        self.member = member
        self.node = member.node
        self.runner = runner
        self.failover = failover
        self.resumes = resumes
        """Whether this node's sessions are resumed (here after a restart, elsewhere after
        its loss): ``[sessions] resume``."""
        self.lifecycle = lifecycle
        """The lifecycle events' own queue (made again, and added to the bus, by the router)."""
        self.fence: Fence | None = None
        """How a session another node took is ended here (set by the router)."""
        self.here: dict[str, str] = {}
        """This node's sessions: id -> principal (a session is named across the fleet by
        both: sage/fleet/claims.py)."""
        """Sessions this node's runner has: spawned and not exited, as its events said, and
        those its listing had at a resync (restored at a start, say)."""
        self.resync_state = Machine(
            f"registry of {self.node}", RESYNC_TRANSITIONS, ResyncState.NEEDED
        )
        """Whether the registry agrees with the runner (sage/fleet/states.py)."""
        self._exited_meanwhile: set[str] = set()
        """While listing: the sessions whose ``exited`` came after the listing was asked."""
        self._writes: MemoryObjectSendStream[tuple[str, SessionEntry | None, str]] | None = None

    def writes(self) -> Any:
        """A new queue of writes: its receiving end, for :meth:`write` (its sending end is
        this keeper's)."""
        send, receive = anyio.create_memory_object_stream[tuple[str, SessionEntry | None, str]](
            WRITES_QUEUED
        )
        self._writes = send
        return receive

    def close(self) -> None:
        if self._writes is not None:
            self._writes.close()

    # -- books ------------------------------------------------------------------------

    async def keep_books(self, lifecycle: Any) -> None:
        """The registry and failover follow this node's sessions' lifecycle events."""
        async for envelope in lifecycle:
            if envelope.source.startswith("fleet:"):
                continue  # another node's session, republished here: not in our books
            found = event_of(envelope.topic)
            if found is None:
                continue
            sid, name = found
            if name in (SessionEvent.SPAWNED, SessionEvent.HIBERNATED) and envelope.principal:
                # a hibernated session says so: a node that adopts it keeps it asleep
                entry = SessionEntry(
                    node=self.node,
                    principal_id=envelope.principal,
                    state=EntryState.RUNNING
                    if name == SessionEvent.SPAWNED
                    else EntryState.HIBERNATED,
                    at=time.time(),
                    resume=self.resumes(),
                )
                self.note(sid, entry)
                self.here[sid] = envelope.principal
            elif name == SessionEvent.EXITED:
                self.note(sid, None, self.here.pop(sid, "") or envelope.principal or "")
                if self.resync_state.state is ResyncState.LISTING:
                    self._exited_meanwhile.add(sid)
                if self.failover is not None:
                    self.failover.ended(sid)
            elif name == SessionEvent.DONE and self.failover is not None:
                self.failover.turn_done(sid)

    def note(self, sid: str, entry: SessionEntry | None, principal: str = "") -> None:
        """Put ``entry`` (None: delete this node's entry for ``principal``'s ``sid``) in
        line to be written."""
        try:
            assert self._writes is not None
            self._writes.send_nowait((sid, entry, principal))
        except anyio.WouldBlock:  # the registry is told again by the next resync
            log.warning("fleet.registry_write_dropped", session_id=sid)
            self.lifecycle.lost = True

    # -- writes -----------------------------------------------------------------------

    async def write(self, writes: Any) -> None:
        registry = self.member.registry
        assert registry is not None
        async for sid, entry, principal in writes:
            try:
                with nats_errors(f"the {REGISTRY} bucket"), anyio.fail_after(5.0):
                    if entry is None:
                        await self.forget(registry, sid, principal)
                    else:
                        await registry.put(registry_key(self.node, sid), entry.encode())
            except Exception as exc:  # the writes outlive any error: logged, resynced later
                log.warning(
                    "fleet.registry_write_failed",
                    session_id=sid,
                    code=code_of(exc),
                    error=describe(exc),
                )

    async def forget(self, registry: Any, sid: str, principal: str) -> None:
        """Delete this node's entry for ``sid`` (a session this node ended ``failed_over``
        runs on another, whose entry is under that node's name and stays).  Its
        ``sage_claims`` key goes too when it names this node and no other node claims
        the session; while a lost node's stale entry remains, the key stays, saying the
        session was taken from that node, so no one adopts it from there again."""
        with nats_errors(f"the {REGISTRY} bucket"):
            await registry.delete(registry_key(self.node, sid))
        claims = self.member.claims
        if claims is None or not principal:
            return
        claim, revision = await self.member.claim_of(principal, sid)
        if claim is None or claim.holder != self.node:
            return
        others = await self.member.entries_of(sid)
        if any(entry.principal_id == principal for entry in others.values()):
            return  # a stale entry of the node it was taken from: the claim stays
        with contextlib.suppress(FleetRaceLost), nats_errors(f"the {CLAIMS} bucket"):
            await claims.withdraw(principal, sid, last=revision)

    # -- resync -----------------------------------------------------------------------

    async def keep(self) -> None:
        """Make the registry agree with the runner at start and after each outage: a
        spawn or an end whose write was lost meanwhile (or a restart that ended
        sessions without ``exited``) is written again."""
        while True:
            if self.lifecycle.lost:  # a spawned or exited was dropped (logged): look again
                self.lifecycle.lost = False
                self.resync_state.move(ResyncState.NEEDED)
            if not self.member.connected:
                self.resync_state.move(ResyncState.NEEDED)
            elif self.resync_state.state is ResyncState.NEEDED:
                await self.resync()
            await anyio.sleep(RESYNC_CHECK)

    async def resync(self) -> bool:
        """One pass (False: the runner or the registry could not be read; try again)."""
        since = time.time()
        self._exited_meanwhile = set()
        self.resync_state.move(ResyncState.LISTING)
        try:
            listing = await self.runner.ask(Verb.SESSIONS)
        except BaseException:  # not handled: the resync is needed again, re-raised
            self.resync_state.move(ResyncState.NEEDED)
            raise
        if not listing.get("ok"):
            self.resync_state.move(ResyncState.NEEDED)
            return False  # no runner yet (it starts after the router), or none at all
        live = {
            row.session_id: row.principal_id
            for row in _rows(listing.get("sessions"))
            if row.state != RecordState.ENDED
        }
        self.here |= {
            sid: principal
            for sid, principal in live.items()
            if principal and sid not in self._exited_meanwhile
        }
        self.resync_state.move(ResyncState.COMPARING)
        try:
            with nats_errors(f"the {REGISTRY} bucket"), anyio.fail_after(LISTING_DEADLINE):
                entries = await self.member.session_entries()
        except FleetError as exc:
            log.warning("fleet.registry_unreadable", code=exc.code, error=describe(exc))
            self.resync_state.move(ResyncState.NEEDED)
            return False
        mine = {sid: entry for sid, entry, _ in entries if entry.node == self.node}
        # a session another node took while this one was away is never claimed again:
        # it ends here (its exited deletes this node's entry), the adopter keeps it
        missing = [sid for sid, principal in live.items() if principal and sid not in mine]
        assert self.fence is not None
        taken = set(missing) - set(await self.fence(sorted(missing)))
        put = delete = 0
        for sid, principal in sorted(live.items()):
            if principal and sid not in mine and sid not in taken:
                entry = SessionEntry(
                    node=self.node, principal_id=principal, at=since, resume=self.resumes()
                )
                self.note(sid, entry)
                put += 1
        for sid, entry in sorted(mine.items()):
            # an entry written after the listing was taken is a spawn's: left alone
            if sid not in live and entry.at < since:
                self.note(sid, None, entry.principal_id)
                delete += 1
        if put or delete:
            log.info("fleet.registry_resynced", put=put, deleted=delete)
        self.resync_state.move(ResyncState.SYNCED)
        return True


def _rows(rows: Any) -> list[SessionRow]:
    """The listing's rows that are rows (a row that is not is left out, as before)."""
    out: list[SessionRow] = []
    for row in rows or []:
        if isinstance(row, dict) and "session_id" in row:
            with contextlib.suppress(msgspec.ValidationError):
                out.append(msgspec.convert(row, SessionRow))
    return out
