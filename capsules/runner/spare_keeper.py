"""The thin shell of the warm spares: starts, watches, hands over and stops them.

:class:`SpareKeeper` asks the pool (:mod:`capsules.runner.spares`) what to do
and does it: it starts a spare ``claude`` child for each eligible principal
short of ``[sessions] spares`` (an installed headless principal, the binary
usable), discards the ones that died or passed ``[sessions] spare_max_age``,
and hands one to a spawn (:meth:`claim`).  A failed start is retried after a
pause that doubles up to a minute.

An untaken spare is served by a :class:`SpareHost`, not by the runner: it
answers the CLI's MCP handshake (the tool list of its principal), keeps the
``init`` event for the spawn that takes it, and refuses the rest; nothing is
published for it.  Its hook token is minted for its session id but not
stored (``hook_tokens``) until a spawn takes it, so the hooks capsule refuses
every hook an untaken spare might send (``unknown_or_ended_session``).

Each spare's process runs as a task of the runner's task group, next to the
sessions, so the supervisor's stop cancels it like a session (the child is
stopped, at most 1 s per step; the death signal covers a crash).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import structlog

from capsules.runner.admin import Admin
from capsules.runner.approvals import Verdict
from capsules.runner.claude_process import ClaudeProcess, Ending, EndReason, Host
from capsules.runner.command import Launch, remove_session_files
from capsules.runner.errors import SessionError
from capsules.runner.launcher import Launcher
from capsules.runner.mcp import McpServer
from capsules.runner.principals import SettingsError
from capsules.runner.sessions import Session, SessionRecord, new_session_id
from capsules.runner.spares import DEFAULT_KIND, Kind, Spare, SparePool, SpareState, inputs_of
from capsules.runner.workplace import chosen_model, work_folder
from sage.capsule.context import CapsuleContext
from sage.claude.homes import install_current
from sage.claude.protocol import CanUseToolRequest, HookCallbackRequest, McpMessageRequest
from sage.config import Config, PrincipalConfig, SpareKind
from sage.errors import SageError

__all__ = ("SpareHost", "SpareKeeper", "Warm")

log = structlog.get_logger("sage.runner")

IDLE_WAKE = 30.0
"""Seconds the keeper sleeps at most between two looks at the pool."""


class SpareHost:
    """The :class:`~capsules.runner.claude_process.Host` of a spare nobody took yet."""

    def __init__(self, mcp: McpServer, ready: Callable[[], None]) -> None:
        self.mcp = mcp
        self.init: dict[str, Any] | None = None
        self._ready = ready

    def event(self, proc: ClaudeProcess, name: str, payload: dict[str, Any]) -> None:
        if name == "init":  # published by the spawn that takes the spare
            self.init = payload
            self._ready()
        else:  # an untaken spare tells users nothing
            log.info("spare.event_dropped", session_id=proc.session_id, name=name)

    async def mcp_message(self, proc: ClaudeProcess, request: McpMessageRequest) -> Any:
        return await self.mcp.handle(proc, request)

    async def can_use_tool(self, proc: ClaudeProcess, request: CanUseToolRequest) -> Verdict:
        return Verdict(False, "this session has not been taken by a spawn")

    async def hook_callback(
        self, proc: ClaudeProcess, request: HookCallbackRequest
    ) -> dict[str, Any]:
        raise SessionError("not_taken", "this session has not been taken by a spawn")


@dataclass(eq=False)
class Warm:
    """What the keeper holds of a spare: its session-to-be, launch, process and end."""

    session: Session
    launch: Launch | None = None
    proc: ClaudeProcess | None = None
    host: SpareHost | None = None
    ending: Ending | None = None
    ended: anyio.Event = field(default_factory=anyio.Event)


class SpareKeeper:
    """Keeps ``[sessions] spares`` warm ``claude`` children per eligible principal."""

    def __init__(
        self,
        ctx: CapsuleContext,
        admin: Admin,
        launcher: Launcher,
        mcp: McpServer,
        *,
        hooks: dict[str, list[Any]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ctx = ctx
        self.admin = admin
        self.launcher = launcher
        self.mcp = mcp
        self.hooks = hooks
        # sized from the config in force at each look (_tend): a reload applies
        self.pool: SparePool[Warm] = SparePool(0, 600.0, clock)
        self.clock = clock
        self._tg: anyio.abc.TaskGroup | None = None
        self._wake = anyio.Event()
        self._refused: set[tuple[str, SpareKind]] = set()  # kinds logged as refused

    @property
    def config(self) -> Config:
        return self.ctx.config

    # -- the loop -------------------------------------------------------------

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Keep the pool full until cancelled; each spare runs as a task of ``tg``."""
        self._tg = tg
        try:
            while True:
                self._wake = anyio.Event()
                self._tend()
                with anyio.move_on_after(self._pause()):
                    await self._wake.wait()
        finally:
            for spare in self.pool.close():
                self._stop(spare)

    def wake(self) -> None:
        self._wake.set()

    def _tend(self) -> None:
        """One look at the pool: settle the config, drop the old, start the missing."""
        pool = self.pool
        pool.per_principal = self.config.sessions.spares
        pool.max_age = self.config.sessions.spare_max_age
        for spare in pool.expired():
            self._stop(spare)
        eligible = self.eligible()
        targets = {name: self.kinds(principal) for name, principal in eligible.items()}
        for spare in pool.surplus(targets):
            self._stop(spare)
        for name, kind in pool.wanted(targets):
            self._start(eligible[name], kind)

    def _pause(self) -> float:
        now = self.clock()
        due = self.pool.next_look()
        return max(0.01, min(now + IDLE_WAKE, due if due is not None else now + IDLE_WAKE) - now)

    def eligible(self) -> dict[str, PrincipalConfig]:
        """The principals that get spares: headless, installed (or no ``installer``
        capsule is configured: the operator keeps homes), settings readable; none
        without a binary."""
        if self.pool.per_principal == 0 or self.launcher.binary is None:
            return {}
        installer = self.admin.installer_configured()
        out: dict[str, PrincipalConfig] = {}
        for base in self.config.principals:
            try:
                principal = self.admin.principal(base.name)
            except SettingsError:
                continue
            if principal is None or principal.interaction_mode != "headless":
                continue
            if installer and not install_current(self.config.home_of(principal)):
                continue
            out[principal.name] = principal
        return out

    def kinds(self, principal: PrincipalConfig) -> list[Kind]:
        """The kinds of spare ``principal`` gets: the default one, then its
        ``spare_kinds`` as a spawn would resolve them; a kind the spawn would refuse
        (a folder outside the roots or missing, a model not allowed) is left out and
        logged once."""
        out: list[Kind] = [DEFAULT_KIND]
        home = self.config.home_of(principal)
        for asked in principal.spare_kinds:
            try:
                kind = (
                    work_folder(principal, home, asked.cwd or None),
                    chosen_model(principal, asked.model or None),
                )
            except SessionError as exc:
                if (principal.name, asked) not in self._refused:
                    self._refused.add((principal.name, asked))
                    log.warning(
                        "spare.kind_refused",
                        principal_id=principal.name,
                        cwd=asked.cwd,
                        model=asked.model,
                        error=str(exc),
                    )
                continue
            if kind not in out:
                out.append(kind)
        return out

    # -- one spare ------------------------------------------------------------

    def _start(self, principal: PrincipalConfig, kind: Kind = DEFAULT_KIND) -> None:
        """Put a new spare of ``kind`` in the pool (``starting``) and start its task."""
        assert self._tg is not None
        cwd, model = kind
        sid = new_session_id()
        record = SessionRecord(
            session_id=sid,
            principal_id=principal.name,
            claude_session=str(uuid.uuid4()),
            cwd=cwd,
            model=model,
        )
        warm = Warm(Session(record, principal))
        spare = Spare(
            session_id=sid,
            claude_session=record.claude_session,
            principal_id=principal.name,
            cwd=cwd,
            model=model,
            born=self.clock(),
            handle=warm,
        )
        self.pool.add(spare)
        self._tg.start_soon(self._keep, spare)

    async def _keep(self, spare: Spare[Warm]) -> None:
        """The life of one spare: prepare, start, wait; clean up when nobody took it."""
        warm = spare.handle
        try:
            try:
                launch = await self.launcher.prepare(warm.session, resume=False, spare=True)
            except (SageError, OSError) as exc:
                if self.pool.discard(spare, "launch_failed"):
                    self._failed(spare, str(exc))
                return
            binary = self.launcher.binary
            assert binary is not None
            warm.launch = launch

            def ready() -> None:
                if self.pool.ready(spare, inputs_of(launch, binary)):
                    log.info(
                        "spare.ready", session_id=spare.session_id, principal_id=spare.principal_id
                    )

            warm.host = SpareHost(self.mcp, ready)
            warm.proc = proc = ClaudeProcess.within(
                self.config.limits,
                spare.session_id,
                spare.principal_id,
                launch,
                warm.host,
                hooks=self.hooks,
            )
            if spare.state is SpareState.DISCARDED:
                return  # the pool closed or dropped it while it was prepared
            try:
                warm.ending = await proc.run()
            except (SageError, OSError) as exc:
                if self.pool.discard(spare, "start_failed"):
                    self._failed(spare, str(exc))
                return
            except Exception as exc:  # a bug must not take the runner and its sessions down
                log.exception("spare.failed", session_id=spare.session_id)
                if self.pool.discard(spare, "failed"):
                    self._failed(spare, type(exc).__name__)
                return
            if self.pool.discard(spare, "died"):
                log.warning(
                    "spare.died",
                    session_id=spare.session_id,
                    reason=warm.ending.reason,
                    stderr_tail=warm.ending.stderr_tail[-500:],
                )
                self._failed(spare, warm.ending.reason)
        finally:
            warm.ended.set()
            if spare.state is not SpareState.CLAIMED:  # a taken spare's files are its session's
                remove_session_files(self.config, spare.session_id)
            self.pool.left(spare)  # its place may be filled now, not while it stopped
            self.wake()

    def _failed(self, spare: Spare[Warm], error: str) -> None:
        pause = self.pool.failed(spare.principal_id, spare.kind)
        log.warning(
            "spare.start_failed",
            principal_id=spare.principal_id,
            cwd=spare.cwd,
            model=spare.model,
            error=error,
            retry_in=pause,
        )

    def _stop(self, spare: Spare[Warm]) -> None:
        """End a spare that left the pool unused (its task cleans up)."""
        log.info("spare.discarded", session_id=spare.session_id, reason=spare.reason)
        proc = spare.handle.proc
        if proc is not None:
            proc.end(EndReason.STOPPED)

    # -- the spawn's side -------------------------------------------------------------

    def claim(self, principal_id: str, cwd: str, model: str) -> Spare[Warm] | None:
        """A ready spare for a spawn of ``principal_id`` in ``cwd`` with ``model``; it
        leaves the pool now.  The keeper starts the next one when the spawn wakes it
        (:meth:`wake`, once the session has its child): a CLI starting meanwhile would
        compete with the hand-over for the CPU."""
        return self.pool.claim(principal_id, cwd, model)

    def check(self, spare: Spare[Warm], launch: Launch) -> bool:
        """Whether ``launch`` (a spawn's, for the spare's ids) matches what the spare
        was started with, and the spare still runs; else it is stopped (stale)."""
        warm = spare.handle
        binary = self.launcher.binary
        alive = warm.proc is not None and not warm.ended.is_set()
        if alive and binary is not None and self.pool.matches(spare, inputs_of(launch, binary)):
            return True
        self.drop(spare, "stale" if alive else "died")
        return False

    def drop(self, spare: Spare[Warm], reason: str) -> None:
        """Stop a claimed spare that will not be used, and remove its files."""
        log.info("spare.dropped", session_id=spare.session_id, reason=reason)
        spare.reason = reason
        if spare.handle.proc is not None:
            spare.handle.proc.end(EndReason.STOPPED)
        # a spawn that goes on cold under the spare's id writes its own files again
        remove_session_files(self.config, spare.session_id)

    @staticmethod
    def hand_over(spare: Spare[Warm], host: Host) -> dict[str, Any]:
        """The spare's process now answers to ``host`` (the runner); its ``init`` payload."""
        warm = spare.handle
        assert warm.proc is not None
        assert warm.host is not None
        assert warm.host.init is not None
        warm.proc.host = host
        warm.proc.started_at = time.time()  # the session's age, not the spare's
        return dict(warm.host.init)

    def stale(self, principal_id: str) -> None:
        """``principal_id``'s identity changed: its spares go, new ones start."""
        for spare in self.pool.stale(principal_id):
            self._stop(spare)
        self.wake()

    def procs(self) -> list[ClaudeProcess]:
        """The processes of the spares waiting (the tool list changed: tell them too)."""
        return [
            s.handle.proc
            for s in self.pool.spares()
            if s.handle.proc is not None and s.state is SpareState.READY
        ]
