"""A capsule's manifest, ``Capsule.toml``: what it is, what it may publish and
subscribe, and whether it runs as a worker (docs/architecture.md, "Capsules").

::

    [package]
    name = "echo"
    version = "0.1.0"
    entry = "capsules.echo:run"      # module:function, an async function (ctx)

    [publish]
    patterns = ["demo.v1.echo.>"]
    [subscribe]
    patterns = ["demo.v1.echo"]

The capsule author writes it; the supervisor (sage/daemon/capsule_host.py) and a
worker (sage/capsule/worker.py) read it with :func:`load_manifest`.
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

from bus import Acl, BusError
from sage.config import NAME_PATTERN
from sage.errors import ConfigError

__all__ = ("CapsuleManifest", "CapsuleSandbox", "WorkerSpec", "load_manifest")


class _Package(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str = msgspec.field(default="")
    version: str = "0.0.0"
    entry: str = ""
    description: str = ""


class _Patterns(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    patterns: list[str] = []


class WorkerSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[worker]``: run the capsule as a child process instead (see sage.daemon.workers)."""

    command: list[str]
    """argv; a first element with a ``/`` is relative to the capsule's folder."""
    env: dict[str, str] = {}
    """Added to the worker's minimal environment (``ASTRID_*`` names are reserved)."""


class CapsuleSandbox(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[sandbox]``: what an installed capsule's sandboxed worker may reach (sage.daemon.workers)."""

    network: bool = False
    """True: the host's network (its interfaces, DNS and TLS roots); false: a network
    namespace of its own with only a loopback interface.  Ignored for capsules that
    are not installed (built-in, or named in ``[supervisor] capsules``)."""


class CapsuleManifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    package: _Package
    publish: _Patterns = _Patterns()
    subscribe: _Patterns = _Patterns()
    worker: WorkerSpec | None = None
    sandbox: CapsuleSandbox = CapsuleSandbox()

    @property
    def name(self) -> str:
        return self.package.name


_ENTRY_PATTERN = r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$"
"""``module`` (its sage.capsule.sdk ``@tool``/``@subscribe`` functions) or ``module:function``."""


def load_manifest(folder: Path) -> CapsuleManifest:
    """Read and check ``folder/Capsule.toml``; raise ConfigError naming what is wrong."""
    path = folder / "Capsule.toml"
    try:
        manifest = msgspec.toml.decode(path.read_bytes(), type=CapsuleManifest)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not re.match(NAME_PATTERN, manifest.name):
        raise ConfigError(f"{path}: package.name must match {NAME_PATTERN}")
    worker = manifest.worker
    if worker is None and not re.match(_ENTRY_PATTERN, manifest.package.entry):
        raise ConfigError(f"{path}: package.entry must be 'module' or 'module:function'")
    if worker is not None:  # package.entry is not used: the command says what runs
        if not worker.command or not all(worker.command):
            raise ConfigError(f"{path}: worker.command must be a list of non-empty strings")
        for key in worker.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise ConfigError(f"{path}: worker.env: {key!r} is not a variable name")
            if key.startswith("ASTRID_"):
                raise ConfigError(f"{path}: worker.env: {key} is reserved (ASTRID_*)")
    try:
        Acl(manifest.publish.patterns, manifest.subscribe.patterns)
    except BusError as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    return manifest
