"""The on-disk tool table, in three scopes, with shadowing and promote.

Scopes, searched in this order (the first hit shadows the rest):

- ``session``: ``<forge_dir>/sessions/<sid>/tools/<name>.json``
- ``project``: ``<home of the principal>/.astrid/forge/tools/<name>.json``
- ``user``: ``<forge_dir>/user/tools/<name>.json`` (promoted tools, for everyone)

A record is created with a temp file and ``os.link`` (an existing name:
``name_taken``, so of two concurrent forges exactly one wins) and replaced
with a temp file and ``rename``; both fsync.  Every file the forge writes is
0600 and every folder it makes 0700, whatever the umask (:mod:`sage.files`): tool sources, run manifests (input,
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

from sage import files
from sage.errors import ForgeError
from sage.files import private_dir, write_replace

__all__ = (
    "NAME_RE",
    "RESERVED",
    "SCOPES",
    "Registry",
    "ToolRecord",
    "canonical",
    "fingerprint",
    "tighten",
    "write_new",
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


def tighten(root: Path) -> int:
    """Take group and other bits off everything under ``root`` (and ``root``); how many changed.

    For forge trees written before every writer was private (files 0644 in
    0755 folders); symlinks are not followed.
    """
    changed = 0
    if not os.path.isdir(root) or os.path.islink(root):
        return 0
    for folder, dirs, names in os.walk(root):
        for path in (folder, *(os.path.join(folder, n) for n in (*dirs, *names))):
            try:
                st = os.lstat(path)
                if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
                    continue
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700, follow_symlinks=False)
                changed += 1
            except OSError:
                continue
    return changed


def write_new(path: Path, data: bytes) -> None:
    """Create ``path`` atomically; ``ForgeError("name_taken")`` when it exists."""
    if not files.write_new(path, data):
        raise ForgeError("name_taken", f"a tool named {path.stem!r} already exists")


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
PROJECT_PARTS = (".astrid", "forge", "tools")
"""The project scope's folder below a principal's home."""


def open_project(home: Path, *, create: bool) -> int | None:
    """The project scope's folder of ``home``, opened one component at a time with
    ``O_NOFOLLOW``: the home may be its ``claude`` child's own (a root supervisor
    hands it over), and a link the child planted there must never turn the
    supervisor's read, write or delete into one somewhere else.  Folders made here
    (0700) belong to the home's owner.  None when it does not exist and ``create``
    is false; ``ForgeError("unsafe_home")`` for a link or a non-folder on the way."""
    if create and not os.path.lexists(home):
        private_dir(home)  # not made yet (the runner makes it at a first spawn): ours, 0700
    try:
        fd = os.open(home, _DIR_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ForgeError("unsafe_home", f"{home}: {exc.strerror}") from None
    try:
        owner = os.fstat(fd)
        for part in PROJECT_PARTS:
            if create:
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass
                else:
                    os.chown(part, owner.st_uid, owner.st_gid, dir_fd=fd, follow_symlinks=False)
            try:
                sub = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                os.close(fd)
                return None
            except OSError as exc:  # ELOOP: a link; ENOTDIR: a file
                raise ForgeError(
                    "unsafe_home", f"{home}: {part} is a link or not a folder ({exc.strerror})"
                ) from None
            os.close(fd)
            fd = sub
        return fd
    except BaseException:
        os.close(fd)
        raise


def _read_at(fd: int, name: str) -> tuple[bytes, int]:
    """A regular file's bytes and mtime, opened in folder ``fd`` without following a link."""
    file = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    try:
        st = os.fstat(file)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{name}: not a regular file")
        with os.fdopen(os.dup(file), "rb") as fh:
            return fh.read(), st.st_mtime_ns
    finally:
        os.close(file)


def _write_new_at(fd: int, name: str, data: bytes) -> None:
    """Create ``name`` in folder ``fd`` atomically, owned like the folder."""
    owner = os.fstat(fd)
    mine = owner.st_uid == os.geteuid()
    if not files.write_at(
        fd, name, data, replace=False, owner=None if mine else (owner.st_uid, owner.st_gid)
    ):
        raise ForgeError(
            "name_taken", f"a tool named {name.removesuffix('.json')!r} already exists"
        )


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

    def _load(self, path: Path, fd: int | None = None) -> ToolRecord | None:
        """The record at ``path``; with ``fd`` (a project folder) read link-safely in it."""
        try:
            if fd is not None:
                raw, mtime = _read_at(fd, path.name)
            else:
                mtime = path.stat().st_mtime_ns
                raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._report(path, 0, str(exc))
            return None
        return self._decode(path, raw, mtime)

    def _decode(self, path: Path, raw: bytes, mtime: int) -> ToolRecord | None:
        try:
            record = msgspec.json.decode(raw, type=ToolRecord)
            if record.name != path.stem:
                raise ValueError(f"file holds {record.name!r}")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self._report(path, mtime, str(exc))
            return None
        return record

    def _project(self, principal: str | None, *, create: bool) -> tuple[Path, int] | None:
        """The project folder of ``principal``'s home: its path and an open fd."""
        home = self.home_of(principal) if principal else None
        if home is None:
            return None
        fd = open_project(home, create=create)
        return None if fd is None else (home.joinpath(*PROJECT_PARTS), fd)

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
        if not NAME_RE.match(name):
            return None
        if scope == "project":
            try:
                project = self._project(principal, create=False)
            except ForgeError as exc:
                self._report(Path(str(principal)), 0, str(exc))
                return None
            if project is None:
                return None
            folder, fd = project
            try:
                record = self._load(folder / f"{name}.json", fd)
            finally:
                os.close(fd)
            return None if record is None else Located(record, folder / f"{name}.json")
        directory = self.directory(scope, principal, session)
        if directory is None:
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
        if scope == "project":
            try:
                project = self._project(principal, create=False)
            except ForgeError as exc:
                self._report(Path(str(principal)), 0, str(exc))
                return []
            if project is None:
                return []
            folder, fd = project
            try:
                names = sorted(n for n in os.listdir(fd) if n.endswith(".json"))
                found = [(folder / n, self._load(folder / n, fd)) for n in names]
            finally:
                os.close(fd)
            return [Located(r, path) for path, r in found if r is not None]
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
        data = msgspec.json.format(msgspec.json.encode(record))
        if record.scope == "project":
            project = self._project(record.principal_id, create=True)
            if project is None:
                raise ForgeError("bad_scope", "no project scope for this caller")
            folder, fd = project
            try:
                _write_new_at(fd, f"{record.name}.json", data)
            finally:
                os.close(fd)
            return folder / f"{record.name}.json"
        directory = self.directory(record.scope, record.principal_id, record.session_id)
        if directory is None:
            raise ForgeError("bad_scope", f"no {record.scope} scope for this caller")
        path = directory / f"{record.name}.json"
        write_new(path, data)
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
        if not NAME_RE.match(name):
            return False
        if scope == "project":
            project = self._project(principal, create=False)
            if project is None:
                return False
            _, fd = project
            try:
                os.unlink(f"{name}.json", dir_fd=fd)
            except FileNotFoundError:
                return False
            finally:
                os.close(fd)
            return True
        directory = self.directory(scope, principal, session)
        if directory is None:
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
