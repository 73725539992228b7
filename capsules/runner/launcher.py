"""How a session's child is prepared: which ``claude`` runs, and everything it needs.

The runner asks :meth:`Launcher.prepare` before each child of a session (its
first start, a respawn, a resume after a restart).  It decides, before any
process exists: whether the binary may run (its version against the supported
range, read once at start), whether the principal must be installed first,
which API key the child gets and whose it is, the uid it runs as, its home,
working folder and identity; then :func:`capsules.runner.command.build_launch`
writes argv and environment.  A refusal is a :class:`SessionError`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import structlog

from capsules.runner.admin import Admin
from capsules.runner.command import (
    Launch,
    build_launch,
    hash_token,
    mint_token,
    read_api_key,
    unsafe_home,
)
from capsules.runner.errors import SessionError
from capsules.runner.outbox import Audit, Event
from capsules.runner.principals import SettingsError
from capsules.runner.sessions import Session
from capsules.runner.workplace import chosen_model, work_folder
from sage.capsule.context import CapsuleContext
from sage.claude.binary import Support, Verdict, read_claude_version, resolve_claude_binary, support
from sage.claude.conversation import ConversationStart, conversation_start, has_transcript
from sage.claude.homes import unreachable, unsafe_ancestors
from sage.config import Config
from sage.errors import ConfigError, SageError
from sage.security.runas import SessionUids

__all__ = ("Launcher",)

log = structlog.get_logger("sage.runner")


class Launcher:
    """The ``claude`` binary the runner uses, and the preparation of each child."""

    def __init__(self, ctx: CapsuleContext, admin: Admin, *, audit: Audit, event: Event) -> None:
        self.ctx = ctx
        self.admin = admin
        self.audit = audit
        self.event = event
        self.binary: Path | None = None
        self.version = ""
        self.verdict: Verdict | None = None  # None: the version could not be read
        self._version_checked = anyio.Event()
        self.lease: Callable[[str], Awaitable[None]] | None = None
        """The fleet lease's gate (capsules/runner/fleet_lease.py): every child's start
        asks it first."""

    @property
    def config(self) -> Config:
        return self.ctx.config

    def resolve_binary(self) -> None:
        try:
            self.binary = resolve_claude_binary(self.config)
        except SageError as exc:
            log.error("runner.claude_missing", error=str(exc))

    async def check_version(self) -> None:
        """Read the binary's version once and judge it against the built-in range;
        audit a release newer than any tested (sessions run) or unsupported (refused)."""
        try:
            if self.binary is None:
                return
            try:
                self.version = await read_claude_version(self.binary)
            except SageError as exc:
                log.error("runner.claude_unusable", binary=str(self.binary), error=str(exc))
                return
            try:
                self.verdict = verdict = support(self.version)
            except ValueError as exc:
                log.error("runner.claude_unusable", binary=str(self.binary), error=str(exc))
                return
            log.info(
                "runner.claude",
                binary=str(self.binary),
                version=self.version,
                support=verdict.support.value,
            )
            if verdict.support is Support.UNTESTED:
                self.audit(
                    "claude_version_drift",
                    {
                        "binary": str(self.binary),
                        "version": self.version,
                        "message": verdict.message,
                    },
                )
            elif not verdict.support.allowed:
                log.error("runner.claude_unsupported", message=verdict.message)
        finally:
            self._version_checked.set()

    async def prepare(
        self, session: Session, *, resume: bool, spare: bool = False, files: bool = True
    ) -> Launch:
        """Everything a child of ``session`` needs, decided before it exists: the binary
        (refused outside the supported range), a first spawn's install, the API key and
        where it came from, the uid, the home, the identity; then argv and environment.

        For a ``spare`` (no user has the session yet) nothing is installed, published
        or audited: a refusal is only raised.  ``files=False`` decides without writing
        (the check of a spare against a spawn: its identity file stays as it is)."""
        config = self.config
        if self.lease is not None:
            await self.lease("start a claude child")
        if self.binary is None:
            raise SessionError("claude_missing", "no usable claude binary (see `astrid doctor`)")
        await self._version_checked.wait()
        verdict = self.verdict
        if verdict is None or not verdict.support.allowed:
            message = (
                f"claude {verdict.message}"
                if verdict is not None
                else f"the version of {self.binary} could not be read (see `astrid doctor`)"
            )
            if not spare:
                self.audit(
                    "claude_unsupported",
                    {
                        "principal_id": session.principal.name,
                        "session_id": session.id,
                        "binary": str(self.binary),
                        "version": self.version,
                        "support": verdict.support.value if verdict is not None else "unknown",
                        "message": message,
                    },
                )
            raise SessionError("claude_unsupported", message)
        if (
            not resume and not spare
        ):  # a first start: never without the install's deny rules and hooks
            await self.admin.install_on_first_spawn(session.principal.name, session.id)
        try:
            principal = self.admin.principal(session.principal.name) or session.principal
        except SettingsError as exc:
            raise SessionError(exc.code, str(exc)) from None
        api_key = None
        session.key_source = "none" if principal.auth_mode == "api_key" else "subscription"
        if principal.auth_mode == "api_key":
            # the principal's own key (astrid sage install); the operator's only when
            # the config says this principal may share it (operator_key = true)
            api_key = await self.admin.principal_key(principal.name)
            session.key_source = "principal" if api_key else "none"
            if api_key is None and principal.operator_key:
                try:
                    api_key = read_api_key(config)
                except ConfigError as exc:
                    raise SessionError("api_key_unreadable", str(exc)) from None
                session.key_source = "operator" if api_key else "none"
            if api_key is None and "ANTHROPIC_API_KEY" in config.claude.env:
                session.key_source = "claude.env"  # set by the operator for every child
            if session.key_source == "none" and spare:
                raise SessionError("api_key_missing", f"no API key for {principal.name!r}")
            if session.key_source == "none":
                self.event(
                    session.id,
                    "error",
                    {
                        "principal_id": principal.name,
                        "session_id": session.id,
                        "reason": "api_key_missing",
                    },
                )
                if principal.operator_key:
                    message = (
                        f"principal {principal.name!r} uses auth_mode api_key but no API key"
                        f" is stored for it (astrid sage install {principal.name}) nor"
                        " configured (claude.api_key_file, $CREDENTIALS_DIRECTORY or"
                        " $ANTHROPIC_API_KEY)"
                    )
                else:
                    message = (
                        f"principal {principal.name!r} uses auth_mode api_key but no API key"
                        f" is stored for it (astrid sage install {principal.name}); the"
                        " operator's key is used only with operator_key = true in its"
                        " [[principals]] entry"
                    )
                raise SessionError("api_key_missing", message)
        try:
            run_as = SessionUids(config).run_as(principal)
        except SageError as exc:
            raise SessionError("session_uid_unavailable", str(exc)) from None
        home = config.home_of(principal)
        problem = unsafe_home(home, None if run_as is None else run_as.uid)
        if problem is not None:
            raise SessionError("unsafe_home", problem)
        # what the spawn chose is checked again against the config in force: a respawn
        # or a resume after a reload that narrowed work_roots or models is refused
        work_folder(principal, home, session.record.cwd or None)
        chosen_model(principal, session.record.model or None)
        if session.record.cwd:  # the CLI reads .claude/ settings (hooks!) there too
            cwd, child = Path(session.record.cwd), None if run_as is None else run_as.uid
            problem = unsafe_home(cwd, child) or unsafe_ancestors(cwd, child)
            if problem is not None:
                raise SessionError("unsafe_cwd", problem)
        if resume:  # only a conversation the CLI has can be resumed (a session that
            # never spoke has none): else it starts afresh under the same id
            transcript = has_transcript(
                home,
                Path(session.record.cwd) if session.record.cwd else None,
                session.record.claude_session,
            )
            start = conversation_start(transcript=transcript, spoken=session.record.spoken)
            resume = start is ConversationStart.RESUME
        identity = principal.identity or None
        try:  # a saved identity (save_identity) wins over the config's
            saved = await self.ctx.state.get("identities", principal.name)
        except SageError:
            saved = None
        if isinstance(saved, str) and saved.strip():
            identity = saved
        token = mint_token()
        try:
            launch = build_launch(
                config,
                principal,
                session_id=session.id,
                claude_session=session.record.claude_session,
                binary=self.binary,
                token=token,
                api_key=api_key,
                identity=identity,
                resume=resume,
                run_as=run_as,
                cwd=Path(session.record.cwd) if session.record.cwd else None,
                model=session.record.model,
                files=files,
            )
        except (OSError, SageError) as exc:
            raise SessionError("spawn_failed", f"cannot prepare the session: {exc}") from None
        if run_as is not None:  # the child must reach its home and the socket by their paths
            groups = {run_as.gid, *run_as.groups}
            for path in (home, launch.cwd, config.socket_path):
                far = unreachable(path, run_as.uid, groups)
                if far is not None:
                    if files:
                        launch.identity_file.unlink(missing_ok=True)
                    raise SessionError("home_unreachable", f"{path}: {far}")
        session.token_hash = hash_token(token)
        return launch
