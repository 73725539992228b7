"""``policy.json``: forbidden names, breakers, namespaces, sandbox overrides, ACLs.

:class:`PolicyFile` stats the file on every call (mtime, size, inode) and
re-decodes it when any of them changed.  A malformed edit keeps the last
good policy in force and is reported once per file version as
``policy_reload_failed {path, error}``; a good one as ``policy_reloaded
{path, sha256}``.  A missing file is written with :data:`DEFAULT_POLICY`.
Callers take a :class:`Policy` snapshot at the start of a call and use it
to the end: an edit mid-call applies from the next call.
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec

from sage.files import write_new

__all__ = ("DEFAULT_POLICY", "Breakers", "Policy", "PolicyFile", "SandboxOverride")


class _Strict(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class Breakers(_Strict, frozen=True, kw_only=True, forbid_unknown_fields=True):
    per_tool_rpm: int = 30
    per_session_forge_count: int = 50
    failure_threshold: int = 5
    failure_cooldown_seconds: float = 60.0


class SandboxOverride(_Strict, frozen=True, kw_only=True, forbid_unknown_fields=True):
    network: Literal["allow", "deny"] = "deny"
    loopback: Literal["allow", "deny"] = "deny"


class Policy(_Strict, frozen=True, kw_only=True, forbid_unknown_fields=True):
    forbidden_tool_names: list[str] = []
    breakers: Breakers = Breakers()
    persona_namespaces: dict[str, str] = {}
    persona_sandbox_overrides: dict[str, SandboxOverride] = {}
    persona_allowed_tools: dict[str, list[str]] = {}
    persona_secret_allow: dict[str, list[str]] = {}
    output_cap: int | None = None

    def forbidden(self, name: str) -> str | None:
        """The first glob of ``forbidden_tool_names`` matching ``name``."""
        for pattern in self.forbidden_tool_names:
            if fnmatch.fnmatchcase(name, pattern):
                return pattern
        return None

    def namespace_ok(self, principal: str | None, name: str) -> bool:
        if principal is None or principal not in self.persona_namespaces:
            return True
        return name.startswith(self.persona_namespaces[principal] + "_")

    def network_for(self, principal: str | None) -> tuple[bool, bool]:
        """(network, loopback) of ``principal``'s sandbox."""
        override = self.persona_sandbox_overrides.get(principal or "")
        if override is None or override.network != "allow":
            return False, False
        return True, override.loopback == "allow"

    def may_call(self, principal: str | None, name: str) -> bool:
        if principal is None or principal not in self.persona_allowed_tools:
            return True
        return name in self.persona_allowed_tools[principal]

    def secrets_denied(self, principal: str | None, names: list[str]) -> list[str]:
        """Names ``principal`` may not use (fail closed: no entry, none allowed)."""
        allowed = set(self.persona_secret_allow.get(principal or "", []))
        if principal is None:
            allowed = set()
        return [n for n in names if n not in allowed]

    def output_cap_for(self, configured: int) -> int:
        return (
            configured if self.output_cap is None else max(4096, min(configured, self.output_cap))
        )


DEFAULT_POLICY: dict[str, Any] = {
    "forbidden_tool_names": ["rm_*", "*_secret_*", "deploy_prod"],
    "breakers": {
        "per_tool_rpm": 30,
        "per_session_forge_count": 50,
        "failure_threshold": 5,
        "failure_cooldown_seconds": 60,
    },
    "persona_namespaces": {},
    "persona_sandbox_overrides": {},
    "persona_allowed_tools": {},
    "persona_secret_allow": {},
}

Emit = Callable[[str, dict[str, Any]], None]


class PolicyFile:
    """The policy at ``path``, reloaded when the file changed."""

    def __init__(self, path: Path, emit: Emit) -> None:
        self.path = path
        self.emit = emit
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._policy = msgspec.convert(DEFAULT_POLICY, Policy)

    def _ensure(self) -> None:
        if self.path.exists():
            return
        data = msgspec.json.format(msgspec.json.encode(DEFAULT_POLICY)) + b"\n"
        write_new(self.path, data)  # 0600, in a 0700 folder; a racer's file wins

    def current(self) -> Policy:
        """The policy in force now (reloading it first when the file changed)."""
        with self._lock:
            self._ensure()
            try:
                st = self.path.stat()
            except OSError:
                return self._policy
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return self._policy
            first = self._stamp is None
            self._stamp = stamp
            try:
                raw = self.path.read_bytes()
                policy = msgspec.json.decode(raw, type=Policy)
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.emit("policy_reload_failed", {"path": str(self.path), "error": str(exc)})
                return self._policy
            self._policy = policy
            if not first:
                digest = hashlib.sha256(raw).hexdigest()
                self.emit("policy_reloaded", {"path": str(self.path), "sha256": digest})
            return policy
