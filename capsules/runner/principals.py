"""Principals' settings as the runner keeps them: one versioned file per principal.

``supervisor.toml`` declares a principal (its name, uids, home, identity);
the four settings an operator changes at runtime (``interaction_mode``,
``auth_mode``, ``model``, ``max_turns``) live in
``<state_dir>/principals/<name>.json``, which ``astrid sage install`` and
``astrid sage settings`` write and which wins over the file's values::

    {"schema_version": 1, "principal_id": "alice", "interaction_mode": "repl",
     "auth_mode": "api_key", "model": "", "max_turns": 0, "updated_at": 1764748800.0}

Reading is strict: a file that is not JSON, misses a field or holds a value
the config would refuse is *corrupt* (:class:`SettingsCorrupt`), and one
written by a newer sage (``schema_version`` above :data:`SCHEMA_VERSION`) is
*unsupported* (:class:`SettingsUnsupported`); either makes spawn refuse the
principal with a reason that names the file, never a silent fallback.
Older shapes are migrated: version 0 is the per-principal patch earlier
releases kept in the state store (namespace ``settings``).  Writes are
atomic (temp file, fsync, rename, 0600), so a crash leaves the old file or
the new one, never half of either.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec

from sage.config import NAME_PATTERN, PrincipalConfig
from sage.errors import SageError
from sage.files import write_replace

__all__ = (
    "FIELDS",
    "SCHEMA_VERSION",
    "PrincipalSettings",
    "SettingsCorrupt",
    "SettingsError",
    "SettingsUnsupported",
    "apply",
    "decode",
    "encode",
    "load",
    "migrate",
    "save",
    "settings_path",
    "view",
    "with_rules",
)

SCHEMA_VERSION: Final = 1
FIELDS: Final = ("interaction_mode", "auth_mode", "model", "max_turns")
MAX_FILE: Final = 64 * 1024


class SettingsError(SageError):
    """A principal's settings file cannot be used; ``code`` is the spawn rejection reason."""

    code = "settings_error"


class SettingsCorrupt(SettingsError):
    code = "settings_corrupt"


class SettingsUnsupported(SettingsError):
    code = "schema_version_unsupported"


class PrincipalSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One principal's runtime settings, as stored (schema version 1)."""

    schema_version: int = SCHEMA_VERSION
    principal_id: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    interaction_mode: Literal["headless", "repl"] = "headless"
    auth_mode: Literal["api_key", "subscription"] = "api_key"
    model: Annotated[str, msgspec.Meta(max_length=128)] = ""
    max_turns: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 0
    allow_rules: Annotated[
        list[Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_*:.-]{1,128}$")]],
        msgspec.Meta(max_length=256),
    ] = []
    """Tool-name patterns whose calls the runner allows without asking (``always``)."""
    updated_at: float = 0.0


class _Version(msgspec.Struct):
    schema_version: int = 0


def settings_path(state_dir: Path, name: str) -> Path:
    return state_dir / "principals" / f"{name}.json"


def view(principal: PrincipalConfig) -> dict[str, Any]:
    """What events and audits show of a principal's settings (never its identity text)."""
    return {field: getattr(principal, field) for field in FIELDS}


def of(principal: PrincipalConfig, stored: PrincipalSettings | None = None) -> PrincipalSettings:
    """The settings of ``principal`` as in force, keeping ``stored``'s allow rules."""
    rules = list(stored.allow_rules) if stored is not None else []
    return PrincipalSettings(principal_id=principal.name, allow_rules=rules, **view(principal))


def migrate(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """Bring an older shape up to :data:`SCHEMA_VERSION` (pure; the result still gets validated)."""
    version = raw.get("schema_version", 0)
    if version == 0:  # the state-store patch of earlier releases: only changed fields
        raw = {f: raw[f] for f in FIELDS if f in raw}
        raw.update(schema_version=1, principal_id=name)
    return raw


def decode(data: bytes, name: str, *, source: str = "settings") -> PrincipalSettings:
    """Parse a settings file strictly; raise :class:`SettingsError` saying what is wrong."""
    if len(data) > MAX_FILE:
        raise SettingsCorrupt(f"{source}: larger than {MAX_FILE} bytes")
    try:
        version = msgspec.json.decode(data, type=_Version).schema_version
        raw = msgspec.json.decode(data, type=dict[str, Any])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SettingsCorrupt(f"{source}: not a settings object: {exc}") from None
    if not isinstance(version, int) or version < 0:
        raise SettingsCorrupt(f"{source}: schema_version must be a whole number")
    if version > SCHEMA_VERSION:
        raise SettingsUnsupported(
            f"{source}: schema_version {version} is newer than this sage understands"
            f" ({SCHEMA_VERSION}); upgrade sage or rewrite it with `astrid sage install"
            f" {name} --force`"
        )
    try:
        settings = msgspec.convert(migrate(raw, name), PrincipalSettings)
    except msgspec.ValidationError as exc:
        raise SettingsCorrupt(f"{source}: {exc}") from None
    if settings.principal_id != name:
        raise SettingsCorrupt(f"{source}: holds principal {settings.principal_id!r}, not {name!r}")
    return settings


def encode(settings: PrincipalSettings) -> bytes:
    return msgspec.json.format(msgspec.json.encode(settings), indent=2) + b"\n"


def load(state_dir: Path, name: str) -> PrincipalSettings | None:
    """The stored settings, None when there are none; :class:`SettingsError` when unusable."""
    path = settings_path(state_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SettingsCorrupt(f"{path}: cannot read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        data = file.read(MAX_FILE + 1)
    return decode(data, name, source=str(path))


def save(state_dir: Path, settings: PrincipalSettings) -> None:
    """Write atomically (0600); the version written is always the current one."""
    stamped = msgspec.structs.replace(
        settings, schema_version=SCHEMA_VERSION, updated_at=time.time()
    )
    write_replace(settings_path(state_dir, settings.principal_id), encode(stamped))


def apply(base: PrincipalConfig, settings: PrincipalSettings | None) -> PrincipalConfig:
    """The principal as configured with its stored settings in force."""
    if settings is None:
        return base
    return msgspec.structs.replace(base, **{f: getattr(settings, f) for f in FIELDS})


def with_rules(current: PrincipalSettings, add: list[str], remove: list[str]) -> PrincipalSettings:
    """``current`` with allow rules added (kept once, in order) and removed."""
    rules = [r for r in current.allow_rules if r not in remove]
    rules += [r for r in dict.fromkeys(add) if r not in rules]
    try:
        return msgspec.convert(
            {**msgspec.to_builtins(current), "allow_rules": rules}, PrincipalSettings
        )
    except msgspec.ValidationError as exc:
        raise SettingsCorrupt(str(exc)) from None


def patched(current: PrincipalSettings, changes: dict[str, Any]) -> PrincipalSettings:
    """``current`` with ``changes`` (absent fields kept), validated like a stored file."""
    unknown = set(changes) - set(FIELDS)
    if unknown:
        raise SettingsCorrupt(f"unknown settings: {', '.join(sorted(unknown))}")
    merged = {**msgspec.to_builtins(current), **changes}
    try:
        return msgspec.convert(merged, PrincipalSettings)
    except msgspec.ValidationError as exc:
        raise SettingsCorrupt(str(exc)) from None
