"""Principals' homes and keys, shared by the runner, the installer and the llm capsule.

:func:`unsafe_home` says why a home must not be used (the ``claude`` child
reads settings, command hooks included, from it); :func:`write_in_home`
writes a file in a home another uid owns, atomically, never through a link; :func:`read_api_key` finds the
operator's Anthropic key (a principal's own key is in :mod:`sage.security.secrets`).
"""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path
from typing import Any

import msgspec

from sage import files
from sage.config import Config
from sage.errors import ConfigError

__all__ = (
    "API_KEY_CREDENTIAL",
    "HOME_ARTIFACTS",
    "INSTALL_MARKER",
    "USER_CONFIG",
    "answered_config",
    "can_run",
    "install_current",
    "own_home",
    "read_api_key",
    "unreachable",
    "unsafe_home",
    "write_in_home",
)

API_KEY_CREDENTIAL = "anthropic-api-key"
INSTALL_MARKER = Path(".astrid") / "install.json"
"""Where the installer says what it wrote into a home (relative to the home)."""
HOME_ARTIFACTS = 2
"""The version of what the installer writes into a home; a home installed with an older
one is installed again before its next session (2: command hooks for ``repl``
principals only, headless sessions' hooks in-band)."""


def install_current(home: Path) -> bool:
    """Whether ``home`` was installed with the artifacts of this version (its marker
    names :data:`HOME_ARTIFACTS`); a missing or unreadable marker: no."""
    try:
        marker = msgspec.json.decode((home / INSTALL_MARKER).read_bytes())
    except (OSError, msgspec.DecodeError):
        return False
    return isinstance(marker, dict) and marker.get("artifact_version") == HOME_ARTIFACTS


def read_api_key(config: Config, environ: dict[str, str] | None = None) -> str | None:
    """The API key for ``api_key`` principals, from the first place that has one."""
    env = os.environ if environ is None else environ
    candidates: list[Path] = []
    if config.claude.api_key_file:
        candidates.append(config._resolve(config.claude.api_key_file))
    if env.get("CREDENTIALS_DIRECTORY"):
        candidates.append(Path(env["CREDENTIALS_DIRECTORY"]) / API_KEY_CREDENTIAL)
    for path in candidates:
        try:
            key = path.read_text().strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from exc
        if key:
            return key
    key = env.get("ANTHROPIC_API_KEY", "").strip()
    return key or None


def unsafe_home(home: Path, owner: int | None = None) -> str | None:
    """Why ``home`` must not be used, or None.

    The child reads settings (command hooks!) from its home and runs them as
    its own uid: ``owner`` when the supervisor is root (sage/security/runas.py), else
    the supervisor's.  A home someone else could write would let them run code
    as that uid.  A home that does not exist yet is made 0700; one the
    supervisor owns is handed to ``owner`` (:func:`own_home`).
    """
    uid = os.getuid()
    allowed = {uid} if owner is None else {uid, owner}
    whose = "the supervisor's" if owner is None else "the principal's children's"
    for path in (home, home / ".claude"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"cannot inspect {path}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if st.st_uid not in allowed:
            want = uid if owner is None else owner
            return f"{path} is owned by uid {st.st_uid}, not {whose} uid {want}"
        if st.st_mode & 0o022:
            return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def unsafe_ancestors(path: Path, owner: int | None = None) -> str | None:
    """Why a folder above ``path`` lets someone else swap ``path`` for another, or None.

    Each folder from ``/`` down to ``path``'s parent must be owned by root, the
    supervisor or ``owner`` (the child's uid), and writable by no one else; a
    sticky folder others may write (``/tmp``) is fine when the next folder down
    is one of ours (the sticky bit stops others renaming it).  Else whoever may
    write there could rename a folder of theirs into place between the check
    and the child's ``chdir``, with their ``.claude/`` settings in it.
    """
    allowed = {0, os.getuid()} | ({owner} if owner is not None else set())
    parts = Path(os.path.abspath(path)).parts
    for depth in range(1, len(parts)):
        here = Path(*parts[:depth])
        below = Path(*parts[: depth + 1])
        try:
            st = here.lstat()
        except OSError as exc:
            return f"cannot inspect {here}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{here} is a symbolic link"
        if st.st_uid not in allowed:
            return f"{here} is owned by uid {st.st_uid}, who could swap {below} for another"
        if st.st_mode & 0o022:
            try:
                ours = below.lstat().st_uid in allowed
            except OSError as exc:
                return f"cannot inspect {below}: {exc.strerror}"
            if not (st.st_mode & stat.S_ISVTX and ours):
                return (
                    f"{here} is writable by group or others (mode {st.st_mode & 0o7777:o}):"
                    f" they could swap {below} for another"
                )
    return None


def own_home(home: Path, uid: int, gid: int, *, homes_dir: Path | None = None) -> None:
    """Make ``home`` the child's: owned by ``uid:gid``, mode 0700 (supervisor root).

    A missing home is made; ``homes_dir`` (the default homes' folder, sage's own
    in the state folder) is made and set 0711 so that the child can pass
    through it, never list it.  A home the supervisor owns (made before its
    children ran as their own uids, or just now) is handed over whole, links
    not followed: nobody else could write in it, so nothing in it is foreign.
    Call after :func:`unsafe_home` said yes.
    """
    if homes_dir is not None:
        homes_dir.mkdir(mode=0o711, parents=True, exist_ok=True)
        os.chmod(homes_dir, 0o711)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = home.lstat()
    if stat.S_ISLNK(st.st_mode):  # pragma: no cover - unsafe_home refused it first
        raise OSError(f"{home} is a symbolic link")
    if st.st_uid == os.getuid() and uid != st.st_uid:
        for folder, dirs, files in os.walk(home):  # never follows links into folders
            for name in (*dirs, *files):
                os.lchown(os.path.join(folder, name), uid, gid)
        os.lchown(home, uid, gid)
    os.chmod(home, 0o700)


def unreachable(path: Path, uid: int, gids: set[int]) -> str | None:
    """Why ``uid`` (with groups ``gids``) cannot pass through the folders above ``path``."""
    for folder in reversed(path.parents):
        try:
            st = os.stat(folder)
        except OSError as exc:
            return f"cannot inspect {folder}: {exc.strerror}"
        if not _may_execute(st, uid, gids, folder):
            return (
                f"uid {uid} cannot pass through {folder} (mode {st.st_mode & 0o777:o},"
                f" owner {st.st_uid}:{st.st_gid})"
            )
    return None


def can_run(path: Path, uid: int, gids: set[int]) -> bool:
    """May ``uid`` (with groups ``gids``) execute ``path`` (links resolved)?"""
    real = Path(os.path.realpath(path))
    if unreachable(real, uid, gids) is not None:
        return False
    try:
        st = os.stat(real)
    except OSError:
        return False
    return _may_execute(st, uid, gids, real)


def _may_execute(st: os.stat_result, uid: int, gids: set[int], path: Path) -> bool:
    """The execute (search, for a folder) bit that applies to ``uid`` and ``gids``, with
    the POSIX ACL's group entries when ``path`` has one (bus.unix.grant_group)."""
    if st.st_uid == uid:
        return bool(st.st_mode & stat.S_IXUSR)
    acl = _acl_entries(path)
    if acl:
        users = {ident: perm for tag, perm, ident in acl if tag == 0x02}
        mask = next((perm for tag, perm, _ in acl if tag == 0x10), 7)
        if uid in users:
            return bool(users[uid] & mask & 1)
        groups = [  # the file's group entry, and the named groups the caller is in
            perm
            for tag, perm, ident in acl
            if (tag == 0x04 and st.st_gid in gids) or (tag == 0x08 and ident in gids)
        ]
        if groups:
            return any(perm & mask & 1 for perm in groups)
        return bool(st.st_mode & stat.S_IXOTH)
    if st.st_gid in gids:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _acl_entries(path: Path) -> list[tuple[int, int, int]]:
    """The (tag, perm, id) entries of ``path``'s POSIX access ACL; none without one."""
    try:
        raw = os.getxattr(path, "system.posix_acl_access")
    except OSError:
        return []
    return [struct.unpack_from("<HHI", raw, at) for at in range(4, len(raw) - 7, 8)]


def write_in_home(
    home: Path, rel: Path, data: bytes, uid: int, gid: int, *, mode: int = 0o600
) -> None:
    """Write ``home/rel`` as :func:`sage.files.write_replace` does, owned by ``uid:gid`` (root only).

    The home is the child's, so the supervisor never follows a link in it: each
    folder is opened with ``O_NOFOLLOW`` from the home down (made 0700 and
    given to the child when missing or the supervisor's), and the file is a
    new one, renamed over the old name (a link there is replaced, never
    written through).
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(home, flags)
    try:
        for part in rel.parts[:-1]:
            try:
                os.mkdir(part, 0o700, dir_fd=fd)
            except FileExistsError:
                pass
            else:
                os.chown(part, uid, gid, dir_fd=fd, follow_symlinks=False)
            try:
                sub = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                raise OSError(exc.errno, f"{home / part}: not a folder of the home") from None
            os.close(fd)
            fd = sub
            if os.fstat(fd).st_uid == os.getuid() != uid:  # made by the supervisor (the forge)
                os.fchown(fd, uid, gid)
        files.write_at(fd, rel.parts[-1], data, replace=True, owner=(uid, gid), mode=mode)
    finally:
        os.close(fd)


USER_CONFIG = Path(".claude.json")
"""Claude Code's own user config in a home (``$HOME/.claude.json``): its answers to the
questions an interactive start asks (onboarding, trusting the folder, using a key)."""


MCP_SERVERS = ("sage", "forge")
"""The servers the installer's ``.mcp.json`` names (``astrid mcp serve``)."""


def answered_config(current: bytes | None, home: Path, api_key: str | None = None) -> bytes:
    """``current`` (the home's ``.claude.json``, None or unreadable: a new one) with the
    questions of an interactive start answered: onboarding done, ``home`` trusted, its
    ``.mcp.json`` servers (sage's own) enabled, and
    ``api_key`` (when given) accepted as Claude Code records it, by its last 20
    characters, so Enter on its "use this key?" (default no) cannot drop it.  Every
    other key of the file is kept: the CLI writes its own state there."""
    try:
        data: Any = msgspec.json.decode(current) if current else {}
    except msgspec.DecodeError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    data["hasCompletedOnboarding"] = True
    projects: dict[str, Any] = data.get("projects") or {}
    if not isinstance(projects, dict):
        projects = {}
    project: dict[str, Any] = projects.get(str(home)) or {}
    if not isinstance(project, dict):
        project = {}
    servers = project.get("enabledMcpjsonServers")
    servers = [s for s in servers if isinstance(s, str)] if isinstance(servers, list) else []
    projects[str(home)] = {
        **project,
        "hasTrustDialogAccepted": True,
        # the installer's .mcp.json servers, sage's own: not a question for the user
        "enabledMcpjsonServers": [*servers, *(s for s in MCP_SERVERS if s not in servers)],
    }
    data["projects"] = projects
    if api_key:
        responses = data.get("customApiKeyResponses")
        responses = responses if isinstance(responses, dict) else {}
        approved = [k for k in responses.get("approved", []) if isinstance(k, str)]
        tail = api_key.strip()[-20:]
        rejected = [k for k in responses.get("rejected", []) if isinstance(k, str) and k != tail]
        data["customApiKeyResponses"] = {
            **responses,
            "approved": approved if tail in approved else [*approved, tail],
            "rejected": rejected,
        }
    return msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n"
