"""Principals' homes and keys, shared by the runner, the installer and the llm capsule.

:func:`unsafe_home` says why a home must not be used (the ``claude`` child
reads settings, command hooks included, from it); :func:`write_private`
writes a file there atomically, 0600; :func:`read_api_key` finds the
operator's Anthropic key (a principal's own key is in :mod:`sage.secrets`).
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from sage.config import Config
from sage.errors import ConfigError

__all__ = ("API_KEY_CREDENTIAL", "read_api_key", "unsafe_home", "write_private")

API_KEY_CREDENTIAL = "anthropic-api-key"


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


def unsafe_home(home: Path) -> str | None:
    """Why ``home`` must not be used, or None.

    The child runs as the supervisor's user and reads settings (command hooks!)
    from its home, so a home that someone else can write would let them run
    code as the supervisor.  A home that does not exist yet is made 0700.
    """
    uid = os.getuid()
    for path in (home, home / ".claude"):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"cannot inspect {path}: {exc.strerror}"
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symbolic link"
        if st.st_uid != uid:
            return f"{path} is owned by uid {st.st_uid}, not the supervisor's uid {uid}"
        if st.st_mode & 0o022:
            return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def write_private(path: Path, data: bytes) -> None:
    """Write ``path`` atomically (temp file, fsync, rename), mode 0600."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
