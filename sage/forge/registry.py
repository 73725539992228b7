"""The on-disk tool table, in three scopes, with shadowing and promote.

Scopes, searched in this order (the first hit shadows the rest):

- ``session``: ``<forge_dir>/sessions/<sid>/tools/<name>.json``
- ``project``: ``<home of the principal>/.astrid/forge/tools/<name>.json``
- ``user``: ``<forge_dir>/user/tools/<name>.json`` (promoted tools, for everyone)

A record is created with a temp file and ``os.link`` (an existing name:
``name_taken``, so of two concurrent forges exactly one wins) and replaced
with a temp file and ``rename``; both fsync.  Every file the forge writes is
0600 and every folder it makes 0700, whatever the umask (:func:`private_dir`,
:func:`write_new`, :func:`write_replace`): tool sources, run manifests (input,
output, stderr), policy, stats and cached results are the supervisor's only,
even when ``[socket] group`` opens the state folder to a group.  A file that does not decode as
a :class:`ToolRecord` is hidden and reported once per (path, mtime) through
``emit("registry_load_failed", {path, error})``.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from sage.errors import ForgeError

__all__ = (
    "NAME_RE",
    "RESERVED",
    "SCOPES",
    "Registry",
    "ToolRecord",
    "canonical",
    "fingerprint",
    "private_dir",
    "private_temp",
    "tighten",
    "write_new",
    "write_replace",
)

NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
SID_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}\Z")
RESERVED = frozenset({"forge_tool", "forge_list", "forge_promote", "read_artifact"})
Scope = Literal["session", "project", "user"]
SCOPES: tuple[Scope, ...] = ("session", "project", "user")


def canonical(value: Any) -> bytes:
    return msgspec.json.encode(value, order="sorted")


def fingerprint(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


class ToolRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: int = 1
    name: str
    description: str
    input_schema: dict[str, Any]
    impl: str
    runtime: Literal["python", "bash"]
    meta: dict[str, Any] = {}
    scope: Scope
    principal_id: str | None = None
    session_id: str | None = None
    created_at: str
    impl_sha256: str
    schema_fingerprint: str
    version: int | None = None
    promoted_from: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.schema_version != 1 or not NAME_RE.match(self.name):
            raise ValueError("bad name or schema_version")
        if hashlib.sha256(self.impl.encode()).hexdigest() != self.impl_sha256:
            raise ValueError("impl_sha256 does not match impl")


@dataclass(frozen=True)
class Located:
    record: ToolRecord
    path: Path


Emit = Callable[[str, dict[str, Any]], None]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(directory: Path) -> Path:
    """Make ``directory`` and its missing parents, each 0700 whatever the umask.

    Folders that exist are left as they are (see :func:`tighten`).
    """
    missing: list[Path] = []
    here = directory
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        os.chmod(path, 0o700, follow_symlinks=False)
    return directory


def tighten(root: Path) -> int:
    """Take group and other bits off everything under ``root`` (and ``root``); how many changed.

    For forge trees written before every writer was private (files 0644 in
    0755 folders); symlinks are not followed.
    """
    changed = 0
    if not os.path.isdir(root) or os.path.islink(root):
        return 0
    for folder, dirs, files in os.walk(root):
        for path in (folder, *(os.path.join(folder, n) for n in (*dirs, *files))):
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
                    continue
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700, follow_symlinks=False)
                changed += 1
            except OSError:
                continue
    return changed


def private_temp(directory: Path, name: str, data: bytes, *, durable: bool = True) -> Path:
    """A new temp file (0600) in ``directory`` (made 0700 if missing) holding ``data``."""
    private_dir(directory)
    tmp = directory / f".{name}.{os.getpid()}.{threading.get_ident()}.{os.urandom(4).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        if durable:
            os.fsync(fh.fileno())
    return tmp


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` atomically; ``ForgeError("name_taken")`` when it exists."""
    tmp = private_temp(path.parent, path.name, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ForgeError("name_taken", f"a tool named {path.stem!r} already exists") from None
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def write_replace(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` atomically: readers see the old bytes or the new, never a mix.

    ``durable`` (the default) also fsyncs the file and its folder, so the new
    bytes survive a power cut; without it they may not (a crash can lose
    the file, never tear it for a reader that runs meanwhile).
    """
    tmp = private_temp(path.parent, path.name, data, durable=durable)
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def _owned(record: ToolRecord, principal: str | None) -> bool:
    """A session tool is its forging principal's only (a payload names the session,
    the broker vouches for the principal); operators (None) see everything."""
    return record.scope != "session" or principal is None or record.principal_id == principal


class Registry:
    """Tool files under ``forge_dir`` and the principals' homes."""

    def __init__(self, forge_dir: Path, home_of: Callable[[str], Path | None], emit: Emit) -> None:
        self.forge_dir = forge_dir
        self.home_of = home_of
        self.emit = emit
        self._reported: set[tuple[str, int]] = set()
        self._lock = threading.Lock()

    def directory(self, scope: Scope, principal: str | None, session: str | None) -> Path | None:
        if scope == "user":
            return self.forge_dir / "user" / "tools"
        if scope == "session":
            if session is None or not SID_RE.match(session):
                return None
            return self.forge_dir / "sessions" / session / "tools"
        home = self.home_of(principal) if principal else None
        return None if home is None else home / ".astrid" / "forge" / "tools"

    def _load(self, path: Path) -> ToolRecord | None:
        try:
            st = path.stat()
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._report(path, 0, str(exc))
            return None
        try:
            record = msgspec.json.decode(raw, type=ToolRecord)
            if record.name != path.stem:
                raise ValueError(f"file holds {record.name!r}")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._report(path, st.st_mtime_ns, str(exc))
            return None
        return record

    def _report(self, path: Path, mtime: int, error: str) -> None:
        with self._lock:
            key = (str(path), mtime)
            if key in self._reported:
                return
            self._reported.add(key)
        self.emit("registry_load_failed", {"path": str(path), "error": error[:300]})

    def get(
        self, scope: Scope, name: str, principal: str | None, session: str | None
    ) -> Located | None:
        directory = self.directory(scope, principal, session)
        if directory is None or not NAME_RE.match(name):
            return None
        path = directory / f"{name}.json"
        record = self._load(path)
        if record is None or not _owned(record, principal):
            return None
        return Located(record, path)

    def lookup(self, name: str, principal: str | None, session: str | None) -> Located | None:
        """``name`` as the session sees it: session shadows project shadows user."""
        for scope in SCOPES:
            found = self.get(scope, name, principal, session)
            if found is not None:
                return found
        return None

    def scan(self, scope: Scope, principal: str | None, session: str | None) -> list[Located]:
        directory = self.directory(scope, principal, session)
        if directory is None or not directory.is_dir():
            return []
        out = []
        for path in sorted(directory.glob("*.json")):
            record = self._load(path)
            if record is not None and _owned(record, principal):
                out.append(Located(record, path))
        return out

    def visible(self, principal: str | None, session: str | None) -> list[Located]:
        seen: dict[str, Located] = {}
        for scope in SCOPES:
            for located in self.scan(scope, principal, session):
                seen.setdefault(located.record.name, located)
        return [seen[name] for name in sorted(seen)]

    def create(self, record: ToolRecord) -> Path:
        directory = self.directory(record.scope, record.principal_id, record.session_id)
        if directory is None:
            raise ForgeError("bad_scope", f"no {record.scope} scope for this caller")
        path = directory / f"{record.name}.json"
        write_new(path, msgspec.json.format(msgspec.json.encode(record)))
        return path

    def promote(self, source: ToolRecord, *, force: bool) -> ToolRecord:
        """Copy ``source`` into the user scope with a version stamp."""
        directory = self.forge_dir / "user" / "tools"
        path = directory / f"{source.name}.json"
        with self._lock:
            current = self._load(path)
            if current is not None and current.impl_sha256 != source.impl_sha256 and not force:
                raise ForgeError(
                    "promote_conflict",
                    f"{source.name!r} is already promoted with a different impl"
                    f" (version {current.version}); pass force to replace it",
                )
            version = 1 if current is None else (current.version or 0) + 1
            promoted = msgspec.structs.replace(
                source,
                scope="user",
                session_id=None,
                version=version,
                promoted_from={
                    "scope": source.scope,
                    "principal_id": source.principal_id,
                    "session_id": source.session_id,
                },
            )
            write_replace(path, msgspec.json.format(msgspec.json.encode(promoted)))
        return promoted

    def remove(self, scope: Scope, name: str, principal: str | None, session: str | None) -> bool:
        directory = self.directory(scope, principal, session)
        if directory is None or not NAME_RE.match(name):
            return False
        try:
            (directory / f"{name}.json").unlink()
        except FileNotFoundError:
            return False
        return True

    def all_records(self) -> list[Located]:
        """Every readable record in every scope (for operators)."""
        out = self.scan("user", None, None)
        sessions = self.forge_dir / "sessions"
        if sessions.is_dir():
            for sdir in sorted(sessions.iterdir()):
                out += self.scan("session", None, sdir.name)
        return out
