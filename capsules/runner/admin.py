"""Principal administration: settings, install, the principals listing, identity, allow rules.

The requests ``sage.v1.request.settings.set``, ``sage.v1.request.install``
and ``sage.v1.request.principals`` are answered here (the runner subscribes
and routes them); so is the settings side of the session runner: the
principal as configured with its stored settings in force
(:meth:`Admin.principal`), its stored API key, its allow rules.

A caller acts only for its own principal, an admin for any.  The changes of
one principal (settings, install, allow rules) run one at a time under its
lock; the files are rewritten by the installer capsule first, so a failed
relink leaves the settings as they were.  Every change is audited
(``settings_changed``, ``allow_rules_changed``, ``identity_changed``).

The class gets what it needs explicitly: the capsule's context (config,
state store, bus), publish and audit callables, and two callbacks into the
session side (how many sessions a principal has; respawn a principal's
live sessions after its identity changed).
"""

from __future__ import annotations

import hashlib
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from bus import Envelope
from capsules.runner import principals
from capsules.runner.approvals import self_rule_refusal, valid_rule
from capsules.runner.claude_process import SessionError
from capsules.runner.messages import (
    InstallComplete,
    InstallRequest,
    InstallStatus,
    SettingsPatch,
)
from capsules.runner.outbox import Audit, Publish
from capsules.runner.principals import PrincipalSettings, SettingsError
from sage.capsule.context import CapsuleContext
from sage.claude.homes import INSTALL_MARKER, install_current
from sage.config import NAME_PATTERN, Config, PrincipalConfig
from sage.contract.sessions import INSTALL_STATUS_TOPIC
from sage.errors import SageError
from sage.security.secrets import (
    API_KEY,
    SecretError,
    SecretStore,
    check_value,
    principal_namespace,
)

__all__ = ("INSTALL_DEADLINE", "Admin")

log = structlog.get_logger("sage.runner")

INSTALL_DEADLINE = 30.0
"""Seconds the installer has to answer an install or relink."""


class Admin:
    """The principals' administration; see the module docstring."""

    def __init__(
        self,
        ctx: CapsuleContext,
        *,
        publish: Publish,
        audit: Audit,
        sessions_of: Callable[[str], int],
        refresh_identity: Callable[[str], None],
    ) -> None:
        self.ctx = ctx
        self._publish = publish
        self.audit = audit
        self._sessions_of = sessions_of
        """How many sessions the principal has now (the principals listing shows it)."""
        self._refresh_identity = refresh_identity
        """Respawn the principal's live sessions with the identity now in force."""
        self._locks: dict[str, anyio.Lock] = {}
        """One per principal: installs and settings changes of a principal run one at a time."""
        self._secrets: SecretStore | None = None

    @property
    def config(self) -> Config:
        return self.ctx.config

    async def migrate_settings(self) -> None:
        """Move the state-store patches of earlier releases (schema 0) into settings files."""
        store, state_dir = self.ctx.state, self.config.state_dir
        for name, value in await store.items("settings"):
            if isinstance(value, dict) and self.config.principal(name) is not None:
                try:
                    if principals.load(state_dir, name) is None:
                        data = msgspec.json.encode(value)
                        principals.save(state_dir, principals.decode(data, name))
                        log.info("runner.settings_migrated", principal_id=name)
                except (SettingsError, OSError) as exc:
                    log.error("runner.settings_not_migrated", principal_id=name, error=str(exc))
                    continue
            await store.delete("settings", name)

    def principal(self, name: str) -> PrincipalConfig | None:
        """The principal as configured, with its stored settings in force.

        None when no principal of that name is configured; raises
        :class:`SettingsError` when its settings file is corrupt or too new."""
        base = self.config.principal(name)
        if base is None:
            return None
        return principals.apply(base, principals.load(self.config.state_dir, name))

    def _configured(self, request: Envelope, name: str) -> PrincipalConfig:
        if re.match(NAME_PATTERN, name) is None:
            raise SessionError("invalid_principal", "principal ids are 1-64 of [A-Za-z0-9_-]")
        if request.principal not in (None, name):
            raise SessionError("not_authorized", f"you may not act for principal {name!r}")
        base = self.config.principal(name)
        if base is None:
            raise SessionError(
                "unknown_principal",
                f"no principal {name!r} is configured (declare it under [[principals]]"
                " in supervisor.toml)",
            )
        return base

    def lock(self, name: str) -> anyio.Lock:
        return self._locks.setdefault(name, anyio.Lock())

    def secrets(self) -> SecretStore:
        if self._secrets is None:
            self._secrets = SecretStore.open(self.config)
        return self._secrets

    async def principal_key(self, name: str) -> str | None:
        """The principal's stored key; read in a thread (SQLite), as the llm capsule does."""
        store = self.secrets()
        try:
            return await anyio.to_thread.run_sync(store.get, principal_namespace(name), API_KEY)
        except SecretError as exc:
            raise SessionError("api_key_unreadable", str(exc)) from None

    async def _installer(
        self, topic: str, name: str, settings: PrincipalSettings, *, force: bool = False
    ) -> InstallComplete | None:
        """Ask the installer to (re)write ``name``'s files; None when the config runs no
        installer, or it is not subscribed now.

        Its steps are relayed to the principal's users on
        ``sage.v1.event.install.status``; the answer is the one
        ``install.complete`` with this request's id."""
        # the config says whether there is an installer: a wildcard subscriber (an admin's
        # `astrid bus sub '>'`) would look like one on the bus and make us wait for nothing
        if not self.installer_configured() or not self.ctx.bus.has_subscribers(topic):
            return None
        rid = uuid.uuid4().hex
        config = {f: getattr(settings, f) for f in principals.FIELDS}
        payload: dict[str, Any] = {"principal_id": name, "request_id": rid, "config": config}
        if force:
            payload["force"] = True

        def complete(envelope: Envelope) -> InstallComplete | None:
            kind = envelope.topic.rsplit(".", 1)[1]
            try:
                if kind == "status":
                    step = msgspec.json.decode(envelope.payload, type=InstallStatus)
                    if step.request_id == rid:
                        self._publish(
                            INSTALL_STATUS_TOPIC,
                            {"principal_id": name, "request_id": rid, "step": step.step},
                            name,
                        )
                elif kind == "complete":
                    done = msgspec.json.decode(envelope.payload, type=InstallComplete)
                    if done.request_id == rid:
                        return done
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass
            return None

        answer = await self.ctx.ask(
            "sage.v1.install.*",
            lambda: self._publish(topic, payload, name),
            complete,
            deadline=INSTALL_DEADLINE,
        )
        if answer is not None:
            return answer
        raise SessionError(
            "install_timeout", f"the installer did not finish {name!r} in {INSTALL_DEADLINE:g} s"
        )

    def _changed(self, name: str, before: PrincipalConfig, after: PrincipalConfig) -> None:
        previous, new = principals.view(before), principals.view(after)
        if previous == new:
            return
        self._publish(
            "sage.v1.settings.changed",
            {"principal_id": name, "config": new, "schema_version": principals.SCHEMA_VERSION},
        )
        self.audit(
            "settings_changed",
            {"principal_id": name, "previous_config": previous, "new_config": new},
        )

    async def set_settings(self, request: Envelope) -> dict[str, Any]:
        """``sage.v1.request.settings.set``: change settings (relinking the files),
        allow rules or the identity of a principal."""
        patch = msgspec.json.decode(request.payload, type=SettingsPatch)
        name = patch.principal_id
        base = self._configured(request, name)
        changes = {f: getattr(patch, f) for f in principals.FIELDS if getattr(patch, f) is not None}
        add, remove = list(patch.allow_add or ()), list(patch.allow_remove or ())
        bad = [r for r in add + remove if not valid_rule(r)]
        if bad:
            raise SessionError("bad_request", f"not a tool-name pattern: {', '.join(bad)}")
        if not changes and not add and not remove and patch.identity is None:
            raise SessionError("bad_request", "the patch changes nothing")
        self._may_add(name, add, request.principal)  # before anything else changes
        if patch.identity is not None:
            await self.set_identity(name, patch.identity)
        if not changes:  # only allow rules or the identity: no files to rewrite
            rules = await self.change_rules(
                name, add=add, remove=remove, requester=request.principal
            )
            view = principals.view(self.principal(name) or base)
            return {
                "ok": True,
                "principal_id": name,
                "config": view,
                "allow_rules": rules,
                "relinked": False,
                "changed": [],
            }
        async with self.lock(name):
            try:
                stored = principals.load(self.config.state_dir, name)
                before = principals.apply(base, stored)
                new = principals.patched(principals.of(before, stored), changes)
            except SettingsError as exc:
                raise SessionError(exc.code, str(exc)) from None
            # the files first: a failed relink leaves the settings as they were
            done = await self._installer("sage.v1.install.relink", name, new)
            if done is not None and not done.success:
                raise SessionError("relink_failed", done.error or "the installer failed")
            self._save(new, "settings")
            after = principals.apply(base, new)
            self._changed(name, before, after)
        rules = await self.change_rules(name, add=add, remove=remove, requester=request.principal)
        return {
            "ok": True,
            "principal_id": name,
            "config": principals.view(after),
            "allow_rules": rules,
            "relinked": done is not None,
            "changed": done.changed if done is not None else [],
        }

    async def install(self, request: Envelope) -> dict[str, Any]:
        """``sage.v1.request.install``: have the installer write a principal's files,
        store its API key and save its settings."""
        req = msgspec.json.decode(request.payload, type=InstallRequest)
        name = req.principal_id
        base = self._configured(request, name)
        changes = {f: getattr(req, f) for f in principals.FIELDS if getattr(req, f) is not None}
        key = (req.api_key or "").strip()  # empty: nothing to store
        async with self.lock(name):
            try:
                stored = principals.load(self.config.state_dir, name)
            except SettingsError as exc:
                if not req.force:
                    raise SessionError(
                        exc.code, f"{exc} (`astrid sage install {name} --force` rewrites it)"
                    ) from None
                stored = None
            before = principals.apply(base, stored)
            try:
                new = principals.patched(principals.of(before, stored), changes)
            except SettingsError as exc:
                raise SessionError("bad_request", str(exc)) from None
            if key and new.auth_mode != "api_key":
                raise SessionError("bad_request", "an API key is only used with auth_mode api_key")
            try:  # before the installer writes anything: a refused key changes nothing
                if key:
                    check_value(API_KEY, key)
            except SecretError as exc:
                raise SessionError("bad_request", str(exc)) from None
            done = await self._installer("sage.v1.install.run", name, new, force=req.force)
            if done is None:
                raise SessionError(
                    "installer_unavailable",
                    'no installer capsule is running (add "installer" to supervisor.capsules)',
                )
            if not done.success:
                raise SessionError("install_failed", done.error or "the installer failed")
            namespace = principal_namespace(name)
            try:
                store = self.secrets()
                if key:
                    await anyio.to_thread.run_sync(store.put, namespace, API_KEY, key)
                key_stored = await anyio.to_thread.run_sync(store.has, namespace, API_KEY)
            except SecretError as exc:
                raise SessionError("secret_store_failed", str(exc)) from None
            self._save(new, "settings")
            after = principals.apply(base, new)
            self._changed(name, before, after)
        return {
            "ok": True,
            "principal_id": name,
            "home_path": done.home_path,
            "config": principals.view(after),
            "changed": done.changed,
            "key_stored": key_stored,
        }

    def installer_configured(self) -> bool:
        """Whether the config runs the built-in installer capsule (asked of the config,
        not the bus: any wildcard subscriber would look like an installer there)."""
        return any(Path(entry).name == "installer" for entry in self.config.supervisor.capsules)

    def _save(self, settings: PrincipalSettings, what: str) -> None:
        """Keep ``settings`` (the principal's file); ``state_error`` if it cannot be written."""
        try:
            principals.save(self.config.state_dir, settings)
        except OSError as exc:
            raise SessionError("state_failed", f"the {what} were not saved: {exc}") from None

    async def install_on_first_spawn(self, name: str, session_id: str) -> bool:
        """Have the installer write ``name``'s home when it never did (no install marker)
        or did with older artifacts (a session must not run without the deny rules and
        hooks the install writes, nor keep command hooks an upgrade moved in-band).

        True when it installed now.  Nothing to do (False) when the home is installed,
        or when no installer capsule runs: then the operator keeps homes themselves."""
        base = self.config.principal(name)
        if base is None or not self.installer_configured():
            return False  # no installer in the config: the operator keeps homes
        async with self.lock(name):
            home = self.config.home_of(base)
            if await anyio.to_thread.run_sync(install_current, home):
                return False
            try:
                stored = principals.load(self.config.state_dir, name)
            except SettingsError as exc:
                raise SessionError(exc.code, str(exc)) from None
            settings = principals.of(principals.apply(base, stored), stored)
            done = await self._installer("sage.v1.install.run", name, settings)
            if done is None:
                # configured but not serving (crashed, restarting, not up yet): refuse
                # rather than run a session without the install's deny rules and hooks
                self.audit(
                    "principal_install_unavailable",
                    {"principal_id": name, "session_id": session_id},
                )
                raise SessionError(
                    "installer_unavailable",
                    f"principal {name!r} needs its home installed and the installer capsule is"
                    " not serving now (see `astrid capsule list`); try again, or run"
                    f" `astrid sage install {name}`",
                )
            if not done.success:
                self.audit(
                    "principal_install_failed",
                    {"principal_id": name, "session_id": session_id, "error": done.error},
                )
                raise SessionError(
                    "install_failed",
                    f"principal {name!r} needs its home installed and installing it failed:"
                    f" {done.error or 'the installer failed'} (try `astrid sage install {name}`)",
                )
            self._save(settings, "settings")
        self.audit(
            "principal_installed",
            {
                "principal_id": name,
                "session_id": session_id,
                "home_path": done.home_path,
                "changed": done.changed,
                "source": "first_spawn",
            },
        )
        return True

    async def list_principals(self, request: Envelope) -> dict[str, Any]:
        """``sage.v1.request.principals``: the principals the caller may see, each with
        its settings, install marker, key and sessions."""
        rows: list[dict[str, Any]] = []
        for base in self.config.principals:
            if request.principal not in (None, base.name):
                continue
            home = self.config.home_of(base)
            row: dict[str, Any] = {"principal_id": base.name, "uids": base.uids, "home": str(home)}
            try:
                row.update(principals.view(self.principal(base.name) or base), settings="ok")
            except SettingsError as exc:
                row.update(principals.view(base), settings=exc.code, settings_error=str(exc))
            row["installed"] = False
            try:
                marker = msgspec.json.decode((home / INSTALL_MARKER).read_bytes())
            except (OSError, msgspec.DecodeError):
                marker = None
            if isinstance(marker, dict):
                row.update(
                    installed=True,
                    installed_at=marker.get("installed_at"),
                    artifact_version=marker.get("artifact_version"),
                )
            try:
                store = self.secrets()
                row["key_stored"] = await anyio.to_thread.run_sync(
                    store.has, principal_namespace(base.name), API_KEY
                )
            except SecretError:
                row["key_stored"] = None  # the store cannot be read: say so, not "no"
            row["operator_key"] = base.operator_key
            row["allow_rules"] = self.allow_rules(base.name)
            row["sessions"] = self._sessions_of(base.name)
            rows.append(row)
        return {"ok": True, "principals": rows}

    async def set_identity(self, name: str, text: str) -> None:
        """Keep ``text`` as the principal's identity (``""``: back to the config's), audit
        the change by digest, and respawn its live sessions so they take it up."""
        try:
            old = await self.ctx.state.get("identities", name)
            if text.strip():
                await self.ctx.state.put("identities", name, text)
            else:
                await self.ctx.state.delete("identities", name)
        except SageError as exc:
            raise SessionError("state_failed", f"the identity was not saved: {exc}") from None

        def digest(value: Any) -> str | None:
            if not isinstance(value, str) or not value.strip():
                return None
            return hashlib.sha256(value.encode()).hexdigest()

        self.audit(
            "identity_changed",
            {"principal_id": name, "before_sha256": digest(old), "after_sha256": digest(text)},
        )
        self._refresh_identity(name)

    def _may_add(self, name: str, add: list[str], requester: str | None) -> None:
        """A principal giving itself rules gets only what ``[limits] self_allow_rules``
        lets it; an admin (no principal) any."""
        if requester is None or not add:
            return
        why = self_rule_refusal(name, add, self.config.limits.self_allow_rules)
        if why is not None:
            raise SessionError("rule_not_allowed", why)

    async def change_rules(
        self, name: str, *, add: list[str], remove: list[str], requester: str | None
    ) -> list[str]:
        """Change a principal's allow rules through the settings path (saved, audited); the
        one writer of rules, so every path obeys ``[limits] self_allow_rules``."""
        self._may_add(name, add, requester)
        base = self.config.principal(name)
        if base is None:
            raise SessionError("unknown_principal", f"no principal {name!r} is configured")
        async with self.lock(name):
            try:
                stored = principals.load(self.config.state_dir, name)
                current = stored or principals.of(base)
                new = principals.with_rules(current, add, remove)
            except SettingsError as exc:
                raise SessionError(exc.code, str(exc)) from None
            self._save(new, "rules")
            self.audit(
                "allow_rules_changed",
                {
                    "principal_id": name,
                    "before": list(current.allow_rules),
                    "after": list(new.allow_rules),
                },
            )
        return list(new.allow_rules)

    def allow_rules(self, principal: str) -> list[str]:
        """The principal's allow rules (none when its settings file is unusable)."""
        try:
            stored = principals.load(self.config.state_dir, principal)
        except SettingsError:
            return []  # a corrupt file allows nothing more
        return list(stored.allow_rules) if stored is not None else []
