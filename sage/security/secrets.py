"""The secret store: principals' API keys and forge vault secrets, encrypted at rest.

Values live in ``<state_dir>/secrets.db`` (SQLite, 0600), each sealed with
AES-256-GCM under one 32-byte key.  The key comes from systemd's
``$CREDENTIALS_DIRECTORY/sage-secrets-key`` (``LoadCredential=``), from
``secrets.key_file``, or else from ``<state_dir>/keys/secrets.key``, which is
made on first use (0600, inside the 0700 keys folder).  Each value is bound
to its place: the associated data is ``namespace\\0name``, so a sealed value
copied to another row does not open.

Namespaces name the owner: ``principal:<name>`` for a principal's secrets
(``anthropic_api_key``), ``forge`` for the forge vault.  Values under 8
characters (too short to redact from outputs) and empty values are
never stored.  Nothing here logs, and :class:`SecretError` messages never
hold a value.  The store is small and synchronous (sqlite3, one short
transaction per call), so the CLI, capsules and workers share it safely.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets as _random
import sqlite3
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from sage.config import Config
from sage.errors import SageError
from sage.files import read_private, write_new

__all__ = (
    "API_KEY",
    "CREDENTIAL_NAME",
    "KEY_FILENAME",
    "SecretError",
    "SecretStore",
    "check_value",
    "principal_namespace",
)

KEY_FILENAME: Final = "secrets.key"
CREDENTIAL_NAME: Final = "sage-secrets-key"
API_KEY: Final = "anthropic_api_key"
"""The name of a principal's Anthropic API key in its namespace."""
MAX_VALUE: Final = 64 * 1024
MIN_VALUE: Final = 8
"""Shorter values are refused: outputs could not be redacted of them without
mangling ordinary text (sage/redaction.py)."""
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}\Z")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS secrets (
    namespace TEXT NOT NULL,
    name TEXT NOT NULL,
    nonce BLOB NOT NULL,
    sealed BLOB NOT NULL,
    updated_at REAL NOT NULL,
    PRIMARY KEY (namespace, name)
)
"""


class SecretError(SageError):
    """The secret store could not be opened, or a value could not be stored or read."""

    code = "secret_store_failed"


def principal_namespace(principal: str) -> str:
    return f"principal:{principal}"


def _check(namespace: str, name: str) -> None:
    for what, value in (("namespace", namespace), ("name", name)):
        if not _NAME.match(value):
            raise SecretError(f"secret {what} {value!r} is not [A-Za-z0-9_.:-]{{1,128}}")


def _read_key_file(path: Path, *, strict_owner: bool) -> bytes:
    data = read_private(
        path, what="secrets key", error=SecretError, check_owner=strict_owner, limit=4096
    )
    key = data.strip() if len(data) != 32 else data
    if len(key) == 64:  # hex, as `systemd-creds` users often write it
        with contextlib.suppress(ValueError):
            key = bytes.fromhex(key.decode())
    if len(key) != 32:
        raise SecretError(f"{path}: the secrets key must be 32 bytes (or 64 hex digits)")
    return key


def _create_key_file(path: Path) -> bytes:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = AESGCM.generate_key(bit_length=256)
    if not write_new(path, key):  # another process made it first: use theirs
        return _read_key_file(path, strict_owner=True)
    return key


def load_key(config: Config, environ: Mapping[str, str] | None = None) -> bytes:
    """The store's key: systemd credential, configured file, or the state folder's own."""
    env = os.environ if environ is None else environ
    if config.secrets.key_file:
        path = config._resolve(config.secrets.key_file)
        try:
            return _read_key_file(path, strict_owner=True)
        except FileNotFoundError:
            raise SecretError(f"{path}: secrets.key_file does not exist") from None
    if env.get("CREDENTIALS_DIRECTORY"):
        path = Path(env["CREDENTIALS_DIRECTORY"]) / CREDENTIAL_NAME
        with contextlib.suppress(FileNotFoundError):
            # systemd owns the credential files (root, 0400): no owner check
            return _read_key_file(path, strict_owner=False)
    path = config.keys_dir / KEY_FILENAME
    try:
        return _read_key_file(path, strict_owner=True)
    except FileNotFoundError:
        return _create_key_file(path)


def check_value(name: str, value: str) -> None:
    """SecretError unless ``value`` may be stored as secret ``name``: not empty, at least
    :data:`MIN_VALUE` characters (shorter ones cannot be redacted from outputs), at most
    :data:`MAX_VALUE` bytes.  Callers check first when storing comes after other work
    (an install: a refused key must not follow a written home)."""
    if not value:
        raise SecretError(f"secret {name!r}: an empty value is not stored")
    if len(value) < MIN_VALUE:
        raise SecretError(
            f"secret {name!r}: shorter than {MIN_VALUE} characters (too short to redact)"
        )
    if len(value.encode()) > MAX_VALUE:
        raise SecretError(f"secret {name!r}: longer than {MAX_VALUE} bytes")


class SecretStore:
    """Sealed values by ``(namespace, name)``; see the module docstring."""

    def __init__(self, path: Path, key: bytes) -> None:
        if len(key) != 32:
            raise SecretError("the secrets key must be 32 bytes")
        self.path = path
        self._aead = AESGCM(key)
        self._made = False
        """The file and its table exist (made once per store, not on every call)."""

    @classmethod
    def open(cls, config: Config, environ: Mapping[str, str] | None = None) -> SecretStore:
        """The store of ``config``'s state folder, with its key (made on first use)."""
        return cls(config.secrets_path, load_key(config, environ))

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        if not self.path.exists():  # 0600 from the start, never sqlite's default mode
            self._made = False
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        try:
            db = sqlite3.connect(self.path, timeout=5.0)
        except sqlite3.Error as exc:
            raise SecretError(f"{self.path}: cannot open the secret store: {exc}") from exc
        try:
            with db:
                if not self._made:
                    db.execute(_SCHEMA)
                    self._made = True
                yield db
        except sqlite3.Error as exc:
            raise SecretError(f"{self.path}: secret store: {exc}") from exc
        finally:
            db.close()

    def put(self, namespace: str, name: str, value: str) -> None:
        """Store ``value`` (replacing any); empty values are refused, never stored."""
        _check(namespace, name)
        check_value(name, value)
        data = value.encode()
        nonce = _random.token_bytes(12)
        sealed = self._aead.encrypt(nonce, data, f"{namespace}\0{name}".encode())
        with self._db() as db:
            db.execute(
                "INSERT INTO secrets (namespace, name, nonce, sealed, updated_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (namespace, name) DO UPDATE SET"
                " nonce = excluded.nonce, sealed = excluded.sealed,"
                " updated_at = excluded.updated_at",
                (namespace, name, nonce, sealed, time.time()),
            )

    def get(self, namespace: str, name: str) -> str | None:
        """The value, or None when there is none; a value that does not open is an error."""
        _check(namespace, name)
        with self._db() as db:
            row = db.execute(
                "SELECT nonce, sealed FROM secrets WHERE namespace = ? AND name = ?",
                (namespace, name),
            ).fetchone()
        if row is None:
            return None
        try:
            data = self._aead.decrypt(row[0], row[1], f"{namespace}\0{name}".encode())
        except InvalidTag:
            raise SecretError(
                f"secret {name!r} in {namespace!r} does not open with this key"
                " (wrong key, or the row was tampered with)"
            ) from None
        return data.decode()

    def has(self, namespace: str, name: str) -> bool:
        _check(namespace, name)
        with self._db() as db:
            row = db.execute(
                "SELECT 1 FROM secrets WHERE namespace = ? AND name = ?", (namespace, name)
            ).fetchone()
        return row is not None

    def delete(self, namespace: str, name: str) -> bool:
        """Remove the value; False when there was none."""
        _check(namespace, name)
        with self._db() as db:
            cursor = db.execute(
                "DELETE FROM secrets WHERE namespace = ? AND name = ?", (namespace, name)
            )
        return cursor.rowcount > 0

    def names(self, namespace: str) -> list[str]:
        """Names stored in ``namespace`` (never values), sorted."""
        _check(namespace, "x")
        with self._db() as db:
            rows = db.execute(
                "SELECT name FROM secrets WHERE namespace = ? ORDER BY name", (namespace,)
            ).fetchall()
        return [row[0] for row in rows]
