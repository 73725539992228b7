"""Installing a third-party capsule: check the folder, copy it, have the supervisor run it.

:func:`check_capsule` says everything that is wrong with a capsule folder at
once: the manifest (:func:`~sage.capsule.manifest.load_manifest`), the entry (it is
imported in a child Python, so a broken module cannot hurt the caller), the
SDK tools it declares, and whether the manifest's patterns cover the topics
those tools need (:func:`sage.capsule.sdk.required_patterns`).  :func:`install`
copies a good folder to ``<state_dir>/capsules/<name>/`` (a temporary copy
renamed into place, made readable but not writable by the capsule's
uid).  Installed capsules always run as out-of-process workers
(:func:`worker_manifest`), sandboxed (:mod:`sage.daemon.workers`), from that
folder, at every start of the supervisor, and at once when ``astrid
capsule install`` asks a running one (``sage.v1.request.capsule.load``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec

from bus.acl import pattern_covers
from sage.capsule.manifest import CapsuleManifest, WorkerSpec, load_manifest
from sage.capsule.privileges import Privilege, privileges
from sage.daemon.workers import (
    PASSED_ENV,
    SANDBOX_ENV,
    WorkerSandbox,
    sandbox_command,
    sandbox_uid,
)
from sage.errors import ConfigError, SageError
from sage.security.bwrap import probe_bwrap
from sage.security.uids import SandboxUids

__all__ = (
    "CapsuleCheck",
    "check_capsule",
    "install",
    "installed_folders",
    "package_name",
    "worker_manifest",
)

CHECK_TIMEOUT = 30.0
_NOT_COPIED = ("__pycache__", "*.pyc", ".git")
BUILT_IN = frozenset({"echo", "runner", "tools", "greeter", "hooks", "forge", "installer", "llm"})

_PROBE = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
entry, name = sys.argv[2], sys.argv[3]
module_name, _, attr = entry.partition(":")
out = {"tools": [], "publish": [], "subscribe": []}
try:
    module = importlib.import_module(module_name)
    if attr:
        target = getattr(module, attr)
    else:
        from sage.capsule.sdk import Capsule
        target = Capsule.from_module(module)
    from sage.capsule.sdk import Capsule, required_patterns
    if isinstance(target, Capsule):
        out["tools"] = [t["name"] for t in target.describe()["tools"]]
        out["publish"], out["subscribe"] = required_patterns(target, name)
    elif not callable(target):
        raise TypeError(f"{entry} is neither a sage.capsule.sdk Capsule nor an async function")
except Exception as exc:
    out = {"error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


@dataclass
class CapsuleCheck:
    folder: Path
    manifest: CapsuleManifest | None = None
    tools: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    privileged: list[Privilege] = field(default_factory=list)
    """Patterns of the manifest that reach beyond the capsule's own tools."""

    @property
    def ok(self) -> bool:
        return not self.problems


def check_capsule(folder: Path, *, uids: SandboxUids | None = None) -> CapsuleCheck:
    """Everything wrong with ``folder`` as a capsule (``problems`` empty: good).

    The entry is imported in the sandbox its worker will run in (:func:`_probe`),
    as the capsule's uid from ``uids`` when the caller is root.
    """
    folder = folder.resolve()
    check = CapsuleCheck(folder)
    try:
        manifest = load_manifest(folder)
    except ConfigError as exc:
        check.problems.append(str(exc))
        return check
    check.manifest = manifest
    check.privileged = privileges(
        manifest.name, manifest.publish.patterns, manifest.subscribe.patterns
    )
    if manifest.name in BUILT_IN:
        check.problems.append(f"the name {manifest.name!r} is taken by a built-in capsule")
    entry = manifest.package.entry
    if manifest.worker is None:
        top = entry.partition(":")[0].split(".")[0]
        if not top.isidentifier():
            check.problems.append(f"package.entry {entry!r} does not name a Python module")
            return check
        probe = _probe(folder, manifest, uids)
        if "error" in probe:
            check.problems.append(f"cannot load {entry!r}: {probe['error']}")
            return check
        check.tools = list(probe["tools"])
        for kind, have in (
            ("publish", manifest.publish.patterns),
            ("subscribe", manifest.subscribe.patterns),
        ):
            for needed in probe[kind]:
                if not any(pattern_covers(p, needed) for p in have):
                    check.problems.append(f"[{kind}] patterns must include {needed!r}")
    return check


def package_name(manifest: CapsuleManifest) -> str:
    """The folder an installed capsule lives in: its entry's top-level module (the folder
    is that Python package), or, for a capsule with its own ``[worker]``, its name."""
    if manifest.worker is not None:
        return manifest.name
    return manifest.package.entry.partition(":")[0].split(".")[0]


def _probe(
    folder: Path, manifest: CapsuleManifest, uids: SandboxUids | None
) -> dict[str, list[str] | str]:
    """Import the entry in a child Python, in the sandbox the worker will run in.

    Its import-time code is someone else's: it runs on a copy of the folder
    made as :func:`install` makes it (the same files, the same modes), in
    bubblewrap (:func:`sage.daemon.workers.sandbox_command`), as the capsule's own
    uid when the caller is root, with the worker's minimal environment and
    the network only if the manifest declares it; never as the caller.
    """
    import tempfile

    entry, name = manifest.package.entry, manifest.name
    top = entry.partition(":")[0].split(".")[0]
    tools = anyio.run(probe_bwrap)
    if not tools.ok:
        return {"error": f"no working bubblewrap sandbox to import it in: {tools.reason}"}
    sandbox = WorkerSandbox(uids=uids, network=manifest.sandbox.network)
    env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
    env.update(SANDBOX_ENV)
    with tempfile.TemporaryDirectory(prefix="capsule-check-") as tmp:
        root = Path(tmp) / "c"
        copy = root / top
        try:
            shutil.copytree(
                folder, copy, ignore=shutil.ignore_patterns(*_NOT_COPIED), symlinks=True
            )
            _readable(root)
            uid = sandbox_uid(sandbox, name)
            argv, fds = sandbox_command(
                tools,
                sandbox,
                argv=[sys.executable, "-c", _PROBE, str(root), entry, name],
                env=env,
                folder=root,
                uid=uid,
                workdir=copy,
            )
        except (OSError, SageError) as exc:
            return {"error": f"cannot set up its sandbox: {exc}"}
        try:
            result = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=CHECK_TIMEOUT,
                env={},
                cwd="/",
                pass_fds=fds,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"importing it took longer than {CHECK_TIMEOUT:g} s"}
        finally:
            for fd in fds:
                os.close(fd)
    lines = result.stdout.strip().splitlines()
    try:
        data: dict[str, list[str] | str] = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
        return {"error": tail[0]}
    return data


def installed_folders(state_dir: Path) -> list[Path]:
    """The installed capsules' folders, by name."""
    root = state_dir / "capsules"
    if not root.is_dir():
        return []
    # .<package>.new / .<package>.old are an install's staging, never a capsule
    return sorted(
        p for p in root.iterdir() if not p.name.startswith(".") and (p / "Capsule.toml").is_file()
    )


def worker_manifest(manifest: CapsuleManifest, folder: Path) -> CapsuleManifest:
    """An installed capsule always runs as a worker: give it one if it has none."""
    if manifest.worker is not None:
        return manifest
    spec = WorkerSpec(
        command=["python3", "-m", "sage.capsule.worker", manifest.package.entry],
        env={"PYTHONPATH": str(folder.parent)},
    )
    return msgspec.structs.replace(manifest, worker=spec)


def install(check: CapsuleCheck, state_dir: Path, *, force: bool = False) -> Path:
    """Copy a checked capsule into ``<state_dir>/capsules/<package>/``; its new folder."""
    if not check.ok or check.manifest is None:
        raise ConfigError("the capsule has problems; it was not installed")
    manifest = check.manifest
    try:
        return _copy(check.folder, manifest, state_dir / "capsules", force)
    except OSError as exc:
        raise ConfigError(f"cannot install {manifest.name}: {exc.strerror or exc}") from exc


def _copy(source: Path, manifest: CapsuleManifest, root: Path, force: bool) -> Path:
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    package = package_name(manifest)
    target = root / package
    # one installed folder per capsule name, whatever folder an older install used
    same_name = [
        f for f in installed_folders(root.parent) if _name_of(f) == manifest.name and f != target
    ]
    if (target.exists() or same_name) and not force:
        raise ConfigError(f"capsule {manifest.name!r} is installed (use --force to replace it)")
    if target.exists() and _name_of(target) not in (manifest.name, None):
        raise ConfigError(f"{target} holds another capsule ({_name_of(target)!r})")
    staging = root / f".{package}.new"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(
        source,
        staging,
        ignore=shutil.ignore_patterns(*_NOT_COPIED),
        symlinks=True,
    )
    _readable(staging)
    old = root / f".{package}.old"
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)
    for folder in same_name:
        shutil.rmtree(folder, ignore_errors=True)
    return target


def uninstall(state_dir: Path, name: str, running: Path | None = None) -> Path | None:
    """Delete the installed capsule named ``name`` (``running``, the folder it ran from,
    first) and any other installed folder of that name; the first folder deleted, or
    None if none was installed."""
    root = state_dir / "capsules"
    folders = [f for f in installed_folders(state_dir) if _name_of(f) == name]
    if running is not None and running.parent == root and running.is_dir():
        folders = [running, *(f for f in folders if f != running)]
    for folder in folders:
        shutil.rmtree(folder)
    return folders[0] if folders else None


def _readable(folder: Path) -> None:
    """Folders 0755, files 0644 (0755 if executable by their owner), symlinks untouched.

    The worker runs under a uid of its own (sage.daemon.workers): it must read its
    code but own none of it, so it cannot change it.  Nothing outside the
    copy is exposed: ``<state_dir>/capsules`` stays 0700 and the sandbox gets
    the folder from a descriptor the supervisor opened.
    """
    for here, _dirs, files in os.walk(folder):  # symlinked folders are not entered
        os.chmod(here, 0o755)
        for name in files:
            path = os.path.join(here, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                os.chmod(path, 0o755 if info.st_mode & stat.S_IXUSR else 0o644)


def _name_of(folder: Path) -> str | None:
    try:
        return load_manifest(folder).name
    except ConfigError:
        return None
