"""sage/audit/keys.py: the audit signing key is made once (0600 in a 0700 folder,
its public half 0644 next to it), reloaded identical, refused when too open."""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sage.audit.keys import (
    KEY_FILENAME,
    PUBLIC_KEY_FILENAME,
    load_public_key,
    load_signing_key,
    parse_public_key,
    public_key_pem,
    public_key_raw_b64,
)
from sage.errors import AuditError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _raw(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )


def test_first_start_makes_a_private_key_and_its_public_half(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    old = os.umask(0)  # whatever the umask, the modes are the module's
    try:
        key = load_signing_key(keys)
    finally:
        os.umask(old)
    assert _mode(keys) == 0o700
    assert _mode(keys / KEY_FILENAME) == 0o600
    assert _mode(keys / PUBLIC_KEY_FILENAME) == 0o644
    assert (keys / PUBLIC_KEY_FILENAME).read_text() == public_key_pem(key.public_key())
    assert sorted(p.name for p in keys.iterdir()) == [KEY_FILENAME, PUBLIC_KEY_FILENAME]


def test_the_key_is_reloaded_identical(tmp_path: Path) -> None:
    first = load_signing_key(tmp_path / "keys")
    again = load_signing_key(tmp_path / "keys")
    without_create = load_signing_key(tmp_path / "keys", create=False)
    assert _raw(first) == _raw(again) == _raw(without_create)


def test_a_missing_public_half_is_written_again(tmp_path: Path) -> None:
    key = load_signing_key(tmp_path)
    (tmp_path / PUBLIC_KEY_FILENAME).unlink()
    load_signing_key(tmp_path)
    assert (tmp_path / PUBLIC_KEY_FILENAME).read_text() == public_key_pem(key.public_key())


def test_without_create_a_missing_key_is_an_error_not_a_new_key(tmp_path: Path) -> None:
    with pytest.raises(AuditError, match="no audit key"):
        load_signing_key(tmp_path, create=False)
    assert not (tmp_path / KEY_FILENAME).exists()


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_key_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    load_signing_key(tmp_path)
    (tmp_path / KEY_FILENAME).chmod(mode)
    with pytest.raises(AuditError, match="accessible by group or other"):
        load_signing_key(tmp_path)
    assert _mode(tmp_path / KEY_FILENAME) == mode  # refused, never silently fixed


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another uid")
def test_a_key_another_uid_owns_is_refused(tmp_path: Path) -> None:
    load_signing_key(tmp_path)
    os.chown(tmp_path / KEY_FILENAME, 65534, -1)
    with pytest.raises(AuditError, match="owned by uid 65534"):
        load_signing_key(tmp_path)


def test_a_symlinked_key_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    load_signing_key(real)
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o700)
    (keys / KEY_FILENAME).symlink_to(real / KEY_FILENAME)
    with pytest.raises(AuditError, match="cannot open the audit key"):
        load_signing_key(keys)


def test_a_file_that_is_not_an_ed25519_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / KEY_FILENAME
    path.write_bytes(b"not a key")
    path.chmod(0o600)
    with pytest.raises(AuditError, match="not a PEM private key"):
        load_signing_key(tmp_path)


def test_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    keys.chmod(0o777)
    with pytest.raises(AuditError, match="keys directory"):
        load_signing_key(keys)
    assert not (keys / KEY_FILENAME).exists()


def test_the_public_key_comes_from_the_private_key_or_the_pub_file(tmp_path: Path) -> None:
    key = load_signing_key(tmp_path)
    want = public_key_raw_b64(key.public_key())
    assert public_key_raw_b64(load_public_key(tmp_path)) == want
    # a verifier that cannot read the private key uses the public file
    (tmp_path / KEY_FILENAME).chmod(0o644)
    assert public_key_raw_b64(load_public_key(tmp_path)) == want
    (tmp_path / KEY_FILENAME).unlink()
    assert public_key_raw_b64(load_public_key(tmp_path)) == want
    (tmp_path / PUBLIC_KEY_FILENAME).unlink()
    with pytest.raises(AuditError, match="no audit key"):
        load_public_key(tmp_path)


def test_an_unreadable_private_key_without_a_pub_file_is_the_private_keys_error(
    tmp_path: Path,
) -> None:
    load_signing_key(tmp_path)
    (tmp_path / KEY_FILENAME).chmod(0o644)
    (tmp_path / PUBLIC_KEY_FILENAME).unlink()
    with pytest.raises(AuditError, match="accessible by group or other"):
        load_public_key(tmp_path)


def test_a_public_key_parses_from_pem_and_from_raw_base64() -> None:
    public = Ed25519PrivateKey.generate().public_key()
    raw = public_key_raw_b64(public)
    assert len(base64.b64decode(raw)) == 32
    assert public_key_raw_b64(parse_public_key(public_key_pem(public))) == raw
    assert public_key_raw_b64(parse_public_key(f"  {raw}\n")) == raw
    assert public_key_raw_b64(parse_public_key(raw.encode())) == raw


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not base64!",
        base64.b64encode(b"x" * 31).decode(),  # one byte short
        "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
    ],
)
def test_what_is_not_an_ed25519_public_key_is_refused(text: str) -> None:
    with pytest.raises(AuditError, match="from the operator"):
        parse_public_key(text, source="from the operator")
