"""Failover: transcripts replicated after each turn, a lost node's sessions resumed elsewhere.

The async shell of :mod:`sage.fleet.adoption` and :mod:`sage.fleet.transcripts`,
run by the router (sage/fleet/router.py) of each node:

- **Replication.** On a node with ``[sessions] resume = true``, each finished turn
  (a ``done`` event) marks its session; one worker, off the event path, asks the
  runner what the conversation is (``sage.v1.request.conversation.<sid>``), reads
  the transcript safely in a thread and puts it into the ``sage_transcripts``
  object store under the session id.  A burst of turns is one upload; the end of a
  session (``exited``) deletes the object, unless another node runs it now.
- **Takeover.** Every second the node reads the verdicts; when a node is ``lost``
  (not ``stopped``), its registry entries that say ``resume`` are taken by the live
  nodes that run their principal and have room by their heartbeats' loads, each
  after ``STAGGER`` seconds per node ranked before it for that session (the least
  loaded first, :func:`~sage.fleet.adoption.adopters`).  A node writes only its own
  registry keys, so the race is run in the ``sage_claims`` bucket (session id ->
  :class:`~sage.fleet.routes.Claim`): the write naming the revision it read before
  its wait makes exactly one winner, which puts its own ``<node>.<sid>`` entry
  (state ``adopting``; the lost node's stays, and routing follows the live one),
  restores the transcript under the principal's home and asks its runner to
  ``adopt`` the session (the same id, ``--resume`` on the same conversation; a
  session hibernated there is adopted asleep).  A runner that refuses for a reason
  of its own (:data:`ADOPT_REFUSALS`: no room, a principal's cap) gives the claim
  back to the lost node, and the next ranked node takes it.  A session whose
  ``sage_claims`` key names another node than the lost one was taken from it
  before: its stale entry is never adopted again.
- **Claims.** A node that starts again asks (``sage.v1.request.fleet.claims``),
  before its runner resumes anything, which of its sessions another node took;
  those it ends ``failed_over`` (deleting its own registry entry at once), the
  rest it claims again in ``sage_claims`` (the same revision race), so no
  conversation ever has two children.  A node back after it may have been judged
  lost while alive does the same (:meth:`Failover.take_back`, from the router's
  fencing: sage/fleet/fencing.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import structlog

from bus import Bus, BusError, Envelope, Identity
from sage import replies
from sage.config import Config, PrincipalConfig
from sage.contract.codes import ErrorCode
from sage.contract.sessions import (
    AdoptRequest,
    ClaimsReply,
    ClaimsRequest,
    ConversationReply,
    EntryState,
    Verb,
    audit_topic,
)
from sage.errors import FleetError, FleetRaceLost, NotVouched, SageError
from sage.fleet.adoption import Owed, Pending, adoptable, adopters, adopting_entry, rank
from sage.fleet.fencing import runs_elsewhere
from sage.fleet.member import FleetMember
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.nodes import NodeState, NodeView
from sage.fleet.placement import NODE_REFUSALS
from sage.fleet.routes import CLAIMS, REGISTRY, Claim, SessionEntry, check_name, registry_key
from sage.fleet.states import CLAIM_TRANSITIONS, ClaimState, Machine
from sage.fleet.transcripts import (
    TRANSCRIPTS,
    TranscriptMeta,
    TranscriptRefused,
    read_transcript,
    restore_transcript,
    transcript_rel,
)
from sage.fleet.vouching import REJECTED, REJECTED_EVENT, check_vouched, rejected_row

__all__ = ("Failover", "lost_entries")

log = structlog.get_logger("sage.fleet.failover")

CHECK = 1.0  # seconds between two looks at the node verdicts
RESWEEP = 10.0  # seconds between two passes over the registry while a node stays lost
ADOPTIONS = 4  # sessions restored and started at once
STAGGER = 0.5  # seconds a node waits per node ranked before it for a session
RECHECK = 2.0  # seconds to the next pass after a race lost: the winner may release it
REFUSED_FOR = 30.0  # seconds a node leaves alone a session it refused (no room, say)
ADOPT_REFUSALS = (NODE_REFUSALS - {ErrorCode.FLEET_UNAVAILABLE}) | {ErrorCode.DUPLICATE_SESSION}
"""A runner's refusals of an adoption another node might not give: the claim is released
for the next node.  (No answer in time is not one: the session may yet start here.)  A
session of another principal with the same id here (ids are each node's) is one: the
next node takes it."""
OWED = 4096  # sessions whose replica may wait at once
STORE_DEADLINE = 30.0

Ask = Callable[[Verb, str | None, Any], Awaitable[dict[str, Any]]]
"""A request to the local runner as the supervisor (an admin): verb, session id, body (a
contract struct) -> reply (sage/fleet/runner_link.py)."""


class Failover:
    """This node's replicas and takeovers (see the module docstring)."""

    def __init__(
        self, bus: Bus, member: FleetMember, config_of: Callable[[], Config], ask: Ask
    ) -> None:
        self.bus = bus
        self.member = member
        self.node = member.node
        self.config_of = config_of
        self.ask = ask
        self.identity = Identity("fleet")
        self.pending = Pending(OWED)
        self._owed = anyio.Event()
        self.tries: dict[str, Machine[ClaimState]] = {}
        """The lost nodes' sessions this node is trying to adopt now, each with its claim's
        state (sage/fleet/states.py)."""
        self._limiter = anyio.CapacityLimiter(ADOPTIONS)
        self._refused: dict[str, float] = {}
        """sid -> until when this node leaves it to others (it refused it)."""
        self._unvouched: set[str] = set()
        """Sessions whose lost node may not act for their principal here (audited once)."""
        self._recheck = False
        """A race was lost: look again soon, the winner may release it."""
        self.replicated = 0
        """Transcripts put so far (for tests and the bench)."""

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._replicate_owed)
        tg.start_soon(self._watch)

    # -- replication -----------------------------------------------------------------

    def turn_done(self, sid: str) -> None:
        """A turn of ``sid`` finished: its transcript is owed (never blocks)."""
        if self.config_of().sessions.resume:
            self.pending.owe(sid, Owed.PUT)
            self._owed.set()

    def ended(self, sid: str) -> None:
        """``sid`` ended for good here: its replica goes (unless another node runs it)."""
        self.pending.owe(sid, Owed.DELETE)
        self._owed.set()

    async def _replicate_owed(self) -> None:
        while True:
            await self._owed.wait()
            self._owed = anyio.Event()
            while (debt := self.pending.next()) is not None:
                sid, what = debt
                try:
                    with (
                        nats_errors(f"the {TRANSCRIPTS} object store"),
                        anyio.fail_after(STORE_DEADLINE),
                    ):
                        if what is Owed.PUT:
                            await self._put(sid)
                        else:
                            await self._forget(sid)
                except TranscriptRefused as exc:
                    log.warning("fleet.transcript_refused", session_id=sid, reason=str(exc))
                except Exception as exc:  # the replicas outlive any error: logged, next one
                    log.warning(
                        "fleet.transcript_failed",
                        session_id=sid,
                        op=what.value,
                        code=code_of(exc),
                        error=describe(exc),
                    )

    async def _put(self, sid: str) -> None:
        store = self.member.transcripts
        if store is None or not self.member.connected:
            return
        reply = await self.ask(Verb.CONVERSATION, sid, {})
        if not reply.get("ok"):
            return  # ended meanwhile
        info = msgspec.convert(reply, ConversationReply)
        config = self.config_of()
        assert config.fleet is not None
        principal = config.principal(info.principal_id)
        if principal is None:
            return
        claude_session = info.claude_session
        cwd = info.cwd
        limit = config.fleet.transcript_max_bytes

        def read() -> bytes:
            home, uid, _ = _home_of(config, principal)
            rel = transcript_rel(cwd or os.path.realpath(home), claude_session)
            return read_transcript(home, rel, uid, limit)

        try:
            data = await anyio.to_thread.run_sync(read)
        except FileNotFoundError:
            log.debug("fleet.transcript_missing", session_id=sid)
            return
        meta = TranscriptMeta(
            session_id=sid,
            principal_id=principal.name,
            claude_session=claude_session,
            cwd=info.cwd,
            model=info.model,
            node=self.node,
            turns=info.turns,
            size=len(data),
            cost_usd=info.cost_usd,
            started_at=info.started_at,
        )
        await store.put(sid, data, meta)
        self.replicated += 1
        log.debug("fleet.transcript_replicated", session_id=sid, size=len(data))

    async def _forget(self, sid: str) -> None:
        """This node's copy of a session that ended here (a node that took it over keeps
        its own: it made one as it adopted it)."""
        store = self.member.transcripts
        if store is None or not self.member.connected:
            return
        await store.delete(sid)

    # -- takeover --------------------------------------------------------------------

    async def _watch(self) -> None:
        seen: set[str] = set()
        swept = 0.0
        async with anyio.create_task_group() as tg:
            while True:
                await anyio.sleep(CHECK)
                config = self.config_of()
                if config.fleet is None or not config.fleet.adopt or not self.member.connected:
                    continue
                try:
                    with nats_errors("the node table"), anyio.fail_after(5.0):
                        views = await self.member.nodes()
                        lost = {v.node for v in views if v.state is NodeState.LOST}
                        fresh = lost - seen
                        seen = lost
                        now = anyio.current_time()
                        every = RECHECK if self._recheck else RESWEEP
                        if not lost or (not fresh and now - swept < every):
                            continue
                        swept, self._recheck = now, False
                        entries = lost_entries(
                            await self.member.session_entries(),
                            {v.node for v in views if v.state is NodeState.LIVE},
                        )
                except Exception as exc:  # the watch outlives any error: logged, looked again
                    log.warning(
                        "fleet.failover_check_failed", code=code_of(exc), error=describe(exc)
                    )
                    continue
                # every node plans alike: by the heartbeats' loads, for every principal
                found = adoptable(entries, views, self.node, lambda _: True)
                plan = adopters(found, views)
                self._unvouched &= {sid for sid, _, _ in found}
                self._refused = {s: t for s, t in self._refused.items() if t > now}
                for sid, entry, revision in found:
                    place = rank(sid, self.node, plan)
                    if (
                        place is None  # full, or not for this node: the next ones take it
                        or sid in self.tries
                        or sid in self._refused
                        or not self._may_run(entry.principal_id)
                        or not self._vouched(sid, entry, views)
                    ):
                        continue
                    self.tries[sid] = Machine(f"claim {sid}", CLAIM_TRANSITIONS, ClaimState.PLANNED)
                    tg.start_soon(self._adopt, sid, entry, revision, place * STAGGER)

    def _vouched(self, sid: str, entry: SessionEntry, views: list[NodeView]) -> bool:
        """Whether the lost node that ran ``sid`` could act for its principal here, as a
        request it forwarded would be checked (its last record declares the principal,
        this node's ``[fleet.peers.<node>]`` allows it): a session, and the transcript
        that comes with it, is that node's word, so a node pinned to alice cannot plant
        a conversation in bob's home by writing an entry and going silent.  Refused:
        logged and audited ``fleet_principal_rejected`` once per session."""
        fleet = self.config_of().fleet
        view = next((v for v in views if v.node == entry.node), None)
        declared = None if view is None or view.principals is None else frozenset(view.principals)
        try:
            check_vouched(
                entry.node,
                entry.principal_id,
                declared,
                None if fleet is None else fleet.peers.get(entry.node),
            )
        except NotVouched as exc:
            if sid not in self._unvouched:
                self._unvouched.add(sid)
                refused = rejected_row(entry.node, entry.principal_id, "adopt", sid, "", exc)
                log.warning(REJECTED_EVENT, **refused)
                self._audit(REJECTED, refused)
            return False
        return True

    def _may_run(self, principal_id: str) -> bool:
        principal = self.config_of().principal(principal_id)
        return principal is not None and principal.interaction_mode != "repl"

    async def _adopt(self, sid: str, entry: SessionEntry, revision: int, wait: float) -> None:
        try:
            # read before the wait: a node first wins only once
            with nats_errors(f"the {CLAIMS} bucket"), anyio.fail_after(5.0):
                claim, revision = await self.member.claim_of(entry.principal_id, sid)
            claim_state = self.tries.setdefault(
                sid, Machine(f"claim {sid}", CLAIM_TRANSITIONS, ClaimState.PLANNED)
            )
            if claim is not None and (claim.holder != entry.node or claim.failed):
                claim_state.move(ClaimState.TAKEN_BEFORE)
                log.debug("fleet.failover_taken_before", session_id=sid, by=claim.holder)
                return
            claim_state.move(ClaimState.WAITING)
            await anyio.sleep(wait)  # the nodes ranked first for it try first
            async with self._limiter:
                if await self._back(entry.node):
                    # it was alive after all (a pause, a partition): it keeps its sessions
                    # and claims them again; a race won now would only be fenced there
                    claim_state.move(ClaimState.OWNER_BACK)
                    log.info("fleet.failover_node_back", session_id=sid, node=entry.node)
                    return
                await self._take(sid, entry, revision, claim_state)
        except Exception as exc:  # an adoption's task outlives any error: logged
            log.error(
                "fleet.failover_failed", session_id=sid, code=code_of(exc), error=describe(exc)
            )
            tried = self.tries.get(sid)
            if tried is not None and not tried.over:
                tried.move(ClaimState.FAILED)
        finally:
            self.tries.pop(sid, None)

    async def _back(self, node: str) -> bool:
        """Whether ``node``, judged lost when this adoption was planned, is live again
        (its heartbeats came back): read once more just before the race."""
        with nats_errors("the node table"), anyio.fail_after(5.0):
            views = await self.member.nodes()
        return any(v.node == node and v.state is NodeState.LIVE for v in views)

    async def _take(
        self, sid: str, entry: SessionEntry, revision: int, claim_state: Machine[ClaimState]
    ) -> None:
        registry, store, claims = self.member.registry, self.member.transcripts, self.member.claims
        assert registry is not None
        assert store is not None
        assert claims is not None
        now = time.time()
        claim_state.move(ClaimState.RACING)
        try:
            with nats_errors(f"the {CLAIMS} bucket"), anyio.fail_after(5.0):
                won = await claims.write(
                    sid,
                    Claim(node=self.node, at=now, principal_id=entry.principal_id),
                    last=revision,
                )
        except FleetRaceLost:
            claim_state.move(ClaimState.LOST)
            log.info("fleet.failover_lost_race", session_id=sid, from_node=entry.node)
            self._recheck = True
            return
        claim_state.move(ClaimState.WON)
        mine = registry_key(self.node, sid)
        with nats_errors(f"the {REGISTRY} bucket"), anyio.fail_after(5.0):
            await registry.put(mine, adopting_entry(entry, self.node, now).encode())
        started = time.monotonic()
        log.info("fleet.failover_won", session_id=sid, from_node=entry.node)
        config = self.config_of()
        principal = config.principal(entry.principal_id)
        meta: TranscriptMeta | None = None
        data = b""
        why = code = ""
        try:
            if principal is None:  # (a config reloaded since the plan): another may run it
                why = f"unknown_principal: principal {entry.principal_id!r} is not configured here"
                claim_state.move(ClaimState.RELEASED)
                await self._release(sid, entry, won, why)
                return
            claim_state.move(ClaimState.RESTORING)
            assert config.fleet is not None
            limit = config.fleet.transcript_max_bytes
            # the lost node's own copy: its word, as the session is
            with nats_errors(f"the {TRANSCRIPTS} bucket"), anyio.fail_after(STORE_DEADLINE):
                found = await store.get(entry.node, sid, entry.principal_id, limit)
            if found is None:
                log.warning("fleet.failover_no_transcript", session_id=sid, from_node=entry.node)
            else:
                meta, data = found
                await anyio.to_thread.run_sync(self._restore, config, principal, meta, data)
            adopt = AdoptRequest(
                session_id=sid,
                principal_id=entry.principal_id,
                claude_session=meta.claude_session if meta else str(uuid.uuid4()),
                from_node=entry.node,
                cwd=meta.cwd if meta else "",
                model=meta.model if meta else "",
                turns=meta.turns if meta else 0,
                cost_usd=meta.cost_usd if meta else 0.0,
                started_at=meta.started_at if meta else 0.0,
                fresh=meta is None,
                asleep=entry.state == EntryState.HIBERNATED,
            )
            reply = await self.ask(Verb.ADOPT, None, adopt)
            if not reply.get("ok"):
                code = str(reply.get("error"))
                why = f"{code}: {reply.get('message')}"
                if reply.get("error") in ADOPT_REFUSALS:
                    claim_state.move(ClaimState.RELEASED)
                    await self._release(sid, entry, won, why)
                    return
        except Exception as exc:  # after the win, anything: the failure path, never silence
            why = (str(exc) if isinstance(exc, (SageError, OSError)) else describe(exc)) or repr(
                exc
            )
            code = code_of(exc)
        if not why:
            claim_state.move(ClaimState.ADOPTED)
            log.info(
                "fleet.failed_over",
                session_id=sid,
                from_node=entry.node,
                seconds=round(time.monotonic() - started, 3),
            )
            if meta is not None:  # this node's own copy from now on (the lost one's may go)
                await self._copy(sid, meta, data)
            return
        # this node won but cannot run it: the session is lost, and says why
        claim_state.move(ClaimState.FAILED)
        log.error(
            "fleet.failover_failed", session_id=sid, from_node=entry.node, code=code, reason=why
        )
        self._audit(
            "session_failover_failed",
            {
                "principal_id": entry.principal_id,
                "session_id": sid,
                "from_node": entry.node,
                "reason": why[:500],
            },
        )
        back = Claim(
            node=self.node,
            at=time.time(),
            principal_id=entry.principal_id,
            back=entry.node,
            failed=True,
        )
        # given back to the lost node, which resumes it if it comes back
        await self._give_back(sid, mine, back, won)

    async def _copy(self, sid: str, meta: TranscriptMeta, data: bytes) -> None:
        """Store the adopted transcript as this node's copy (logged when it cannot be:
        the next finished turn puts it again)."""
        store = self.member.transcripts
        assert store is not None
        try:
            with nats_errors(f"the {TRANSCRIPTS} bucket"), anyio.fail_after(STORE_DEADLINE):
                await store.put(sid, data, meta)
        except FleetError as exc:
            log.warning("fleet.transcript_failed", session_id=sid, op="put", code=exc.code)

    async def _release(self, sid: str, entry: SessionEntry, won: int, why: str) -> None:
        """This node won ``sid`` but may not run it (no room, a cap): its own registry
        claim goes and the race's claim goes back to the lost node (not failed), for the
        next ranked node to take."""
        log.warning("fleet.failover_refused", session_id=sid, from_node=entry.node, reason=why)
        self._refused[sid] = anyio.current_time() + REFUSED_FOR
        back = Claim(
            node=self.node, at=time.time(), principal_id=entry.principal_id, back=entry.node
        )
        await self._give_back(sid, registry_key(self.node, sid), back, won)

    async def _give_back(self, sid: str, mine: str, back: Claim, won: int) -> None:
        """This node's registry claim ``mine`` goes, and this node's ``sage_claims`` claim
        gives ``sid`` ``back`` unless a claim was written since ``won`` (the revision
        this node's win wrote); within 5 s, a failure logged."""
        registry, claims = self.member.registry, self.member.claims
        assert registry is not None
        assert claims is not None
        with anyio.move_on_after(5.0):
            try:
                with nats_errors(f"the {REGISTRY} bucket"):
                    await registry.delete(mine)
                with contextlib.suppress(FleetRaceLost), nats_errors(f"the {CLAIMS} bucket"):
                    await claims.write(sid, back, last=won)
            except FleetError as exc:
                log.warning(
                    "fleet.registry_write_failed",
                    session_id=sid,
                    code=exc.code,
                    error=describe(exc),
                )

    def _restore(
        self, config: Config, principal: PrincipalConfig, meta: TranscriptMeta, data: bytes
    ) -> None:
        """Write the transcript under the principal's home here (made when missing)."""
        home, uid, gid = _home_of(config, principal)
        if not home.is_dir():
            from sage.claude.homes import own_home

            if uid != os.getuid():
                own_home(
                    home,
                    uid,
                    gid,
                    homes_dir=config.homes_dir if home.parent == config.homes_dir else None,
                )
            else:
                home.mkdir(mode=0o700, parents=True, exist_ok=True)
        cwd = meta.cwd or os.path.realpath(home)
        restore_transcript(home, transcript_rel(cwd, meta.claude_session), data, uid, gid)

    # -- claims of a node that starts again ------------------------------------------------

    async def claims(self, request: Envelope) -> dict[str, Any]:
        """``{session_ids}`` -> ``{elsewhere: {sid: node}}``: those another node runs now;
        the others are claimed for this node (an admin's request only: the runner's)."""
        if request.principal is not None:
            return replies.error(ErrorCode.NOT_AUTHORIZED, "only the session runner asks this")
        try:
            body = msgspec.json.decode(request.payload or b"{}", type=ClaimsRequest)
            sessions = {
                check_name(sid, "session id"): check_name(body.principals.get(sid, ""), "principal")
                for sid in body.session_ids
            }
        except (msgspec.DecodeError, msgspec.ValidationError, SageError) as exc:
            return replies.error(ErrorCode.BAD_REQUEST, f"claims: {exc}")
        registry, claims = self.member.registry, self.member.claims
        if registry is None or claims is None or not self.member.connected:
            return replies.error(ErrorCode.FLEET_UNAVAILABLE, "NATS is not connected")
        try:
            with nats_errors(f"the {CLAIMS} bucket"), anyio.fail_after(10.0):
                elsewhere = await self.take_back(sessions)
        except FleetError as exc:
            return replies.error(ErrorCode.FLEET_UNAVAILABLE, f"the registry: {describe(exc)}")
        if elsewhere:
            log.info("fleet.sessions_taken_elsewhere", sessions=elsewhere)
        return replies.ok(**msgspec.to_builtins(ClaimsReply(elsewhere=elsewhere)))

    async def take_back(self, sessions: dict[str, str]) -> dict[str, str]:
        """Of ``sessions`` (id -> principal: this node's sessions, at its start or back
        after it may have been judged lost), those another node took (id -> node): this
        node's registry
        entry for each goes at once (two live entries would be a conflict).  The others
        are claimed again for this node in ``sage_claims``: an adopter that read the
        revision before is late and loses its race.  A FleetError when the buckets cannot
        be read or written."""
        registry, claims = self.member.registry, self.member.claims
        assert registry is not None
        assert claims is not None
        elsewhere: dict[str, str] = {}
        for sid, principal in sessions.items():
            for _ in range(3):
                claim, revision = await self.member.claim_of(principal, sid)
                node = runs_elsewhere(self.node, claim)
                if node is not None:
                    elsewhere[sid] = node
                    with nats_errors(f"the {REGISTRY} bucket"):
                        await registry.delete(registry_key(self.node, sid))
                    break
                if claim is not None and claim.node == self.node and not claim.back:
                    break  # this node's own claim is the latest already
                again = Claim(node=self.node, at=time.time(), principal_id=principal)
                try:  # an adopter that read the same revision now loses its race
                    await claims.write(sid, again, last=revision)
                    break
                except FleetRaceLost:
                    continue
        return elsewhere

    def _audit(self, kind: str, payload: dict[str, Any]) -> None:
        try:
            self.bus.publish(self.identity, audit_topic(kind), payload)
        except BusError:
            log.warning("fleet.audit_failed", kind=kind)


def lost_entries(
    entries: list[tuple[str, SessionEntry, int]], live: set[str]
) -> dict[str, tuple[SessionEntry, int]]:
    """Per session id, the registry entry a lost node's session would be adopted from:
    none for a session a live node claims for the same principal (it runs there, or is
    being adopted; another principal's session of that id is another session); of
    several claims of nodes none live, the latest."""
    out: dict[str, tuple[SessionEntry, int]] = {}
    taken: set[tuple[str, str]] = set()
    for sid, entry, revision in entries:
        if entry.node in live:
            taken.add((entry.principal_id, sid))
        elif sid not in out or entry.at > out[sid][0].at:
            out[sid] = (entry, revision)
    return {sid: found for sid, found in out.items() if (found[0].principal_id, sid) not in taken}


def _home_of(config: Config, principal: PrincipalConfig) -> tuple[Path, int, int]:
    """The principal's home here, and the uid and gid its children run as."""
    from sage.security.runas import SessionUids

    run_as = SessionUids(config).run_as(principal)
    home = config.home_of(principal)
    if run_as is None:
        return home, os.getuid(), os.getgid()
    return home, run_as.uid, run_as.gid
