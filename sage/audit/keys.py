"""The audit signing key: created once, kept private, its public half exported.

This module owns the Ed25519 key that signs audit checkpoints.  On first
start :func:`load_signing_key` writes ``<keys_dir>/audit_ed25519.pem``
(PKCS#8 PEM, unencrypted) with mode 0600 inside a 0700 directory: the key is
written to a temporary file opened with ``O_CREAT | O_EXCL`` and mode 0600,
fsynced, then hard-linked into place, so the file is never visible
half-written nor readable by others for an instant, and two starters racing
end up with one key.  Next to it goes ``audit_ed25519.pub`` (the public key,
PEM, 0644) for verifiers that cannot read the private key.  A key file that
group or other can read, or that another user owns, is refused with an
:class:`~sage.errors.AuditError` naming the fix.  The public key is exported
as PEM and as raw base64 (32 bytes) for ``astrid audit pubkey``.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Final

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from sage.errors import AuditError
from sage.files import ensure_private_dir, read_private, write_new, write_replace

__all__ = (
    "KEY_FILENAME",
    "PUBLIC_KEY_FILENAME",
    "load_public_key",
    "load_signing_key",
    "parse_public_key",
    "public_key_pem",
    "public_key_raw_b64",
)

KEY_FILENAME: Final = "audit_ed25519.pem"
PUBLIC_KEY_FILENAME: Final = "audit_ed25519.pub"


def _ensure_dir(keys_dir: Path) -> None:
    ensure_private_dir(keys_dir, error=lambda message: AuditError(f"keys directory: {message}"))


def _read_private(path: Path) -> bytes:
    return read_private(path, what="audit key", error=AuditError)


def _decode_private(path: Path, data: bytes) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise AuditError(f"{path}: not a PEM private key: {exc}") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise AuditError(f"{path}: not an Ed25519 key")
    return key


def load_signing_key(keys_dir: Path, *, create: bool = True) -> Ed25519PrivateKey:
    """Load ``<keys_dir>/audit_ed25519.pem``; on first start (``create``) make it, 0600 in 0700."""
    path = keys_dir / KEY_FILENAME
    if create:
        _ensure_dir(keys_dir)
    try:
        existing = _decode_private(path, _read_private(path))
    except FileNotFoundError as exc:
        if not create:
            raise AuditError(
                f"{path}: no audit key (the supervisor creates it on first start)"
            ) from exc
    else:
        if create:
            _write_public(keys_dir, existing.public_key(), replace=False)
        return existing
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    try:
        created = write_new(path, pem)
    except OSError as exc:
        raise AuditError(f"{path}: cannot write the audit key: {exc.strerror}") from exc
    if not created:  # another process won the race; use its key
        return load_signing_key(keys_dir, create=False)
    _write_public(keys_dir, key.public_key(), replace=True)
    return key


def _write_public(keys_dir: Path, key: Ed25519PublicKey, *, replace: bool) -> None:
    pub_path = keys_dir / PUBLIC_KEY_FILENAME
    if not replace and pub_path.exists():
        return
    try:
        write_replace(pub_path, public_key_pem(key).encode(), mode=0o644)
    except OSError as exc:
        raise AuditError(f"{pub_path}: cannot write the public key: {exc.strerror}") from exc


def load_public_key(keys_dir: Path) -> Ed25519PublicKey:
    """The verifying key: from the private key when readable, else ``audit_ed25519.pub``."""
    if (keys_dir / KEY_FILENAME).exists():
        try:
            return load_signing_key(keys_dir, create=False).public_key()
        except AuditError:
            if not (keys_dir / PUBLIC_KEY_FILENAME).exists():
                raise
    pub_path = keys_dir / PUBLIC_KEY_FILENAME
    try:
        data = pub_path.read_bytes()
    except FileNotFoundError as exc:
        raise AuditError(
            f"{keys_dir}: no audit key (the supervisor creates it on first start)"
        ) from exc
    except OSError as exc:
        raise AuditError(f"{pub_path}: cannot read: {exc.strerror}") from exc
    return parse_public_key(data, source=str(pub_path))


def parse_public_key(data: bytes | str, *, source: str = "public key") -> Ed25519PublicKey:
    """Parse an Ed25519 public key given as PEM or as raw base64 (32 bytes)."""
    raw = data.encode() if isinstance(data, str) else data
    text = raw.strip()
    if text.startswith(b"-----BEGIN"):
        try:
            key = serialization.load_pem_public_key(text)
        except (ValueError, TypeError) as exc:
            raise AuditError(f"{source}: not a PEM public key: {exc}") from exc
        if not isinstance(key, Ed25519PublicKey):
            raise AuditError(f"{source}: not an Ed25519 public key")
        return key
    try:
        decoded = base64.b64decode(text, validate=True)
        return Ed25519PublicKey.from_public_bytes(decoded)
    except (binascii.Error, ValueError) as exc:
        raise AuditError(f"{source}: not an Ed25519 public key (PEM or base64)") from exc


def public_key_pem(key: Ed25519PublicKey) -> str:
    """The public key as SubjectPublicKeyInfo PEM."""
    return key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()


def public_key_raw_b64(key: Ed25519PublicKey) -> str:
    """The 32 raw public key bytes, base64."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode()
