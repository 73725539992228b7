"""The secret store: sealed at rest, bound to its row, keys from the right place."""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import pytest

from sage.config import Config, SecretsConfig, SupervisorConfig
from sage.security.secrets import SecretError, SecretStore, load_key


def _config(tmp_path: Path, **secrets: str) -> Config:
    return Config(
        supervisor=SupervisorConfig(state_dir=str(tmp_path / "state")),
        secrets=SecretsConfig(**secrets),
        base_dir=str(tmp_path),
    )


def test_values_round_trip_and_are_not_stored_in_clear(tmp_path: Path) -> None:
    store = SecretStore.open(_config(tmp_path), environ={})
    store.put("principal:alice", "anthropic_api_key", "sk-ant-very-secret-value")
    assert store.get("principal:alice", "anthropic_api_key") == "sk-ant-very-secret-value"
    assert store.get("principal:bob", "anthropic_api_key") is None
    assert store.names("principal:alice") == ["anthropic_api_key"]
    assert store.has("principal:alice", "anthropic_api_key")
    raw = store.path.read_bytes()
    assert b"very-secret" not in raw
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    key_file = tmp_path / "state" / "keys" / "secrets.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert store.delete("principal:alice", "anthropic_api_key")
    assert not store.delete("principal:alice", "anthropic_api_key")
    assert store.get("principal:alice", "anthropic_api_key") is None


def test_empty_values_are_refused(tmp_path: Path) -> None:
    store = SecretStore.open(_config(tmp_path), environ={})
    with pytest.raises(SecretError, match="empty"):
        store.put("forge", "TOKEN", "")
    assert store.names("forge") == []


def test_a_sealed_value_moved_to_another_row_does_not_open(tmp_path: Path) -> None:
    store = SecretStore.open(_config(tmp_path), environ={})
    store.put("principal:alice", "anthropic_api_key", "alice-key-0001")
    store.put("principal:bob", "anthropic_api_key", "bob-key-0002")
    db = sqlite3.connect(store.path)
    with db:
        nonce, sealed = db.execute(
            "SELECT nonce, sealed FROM secrets WHERE namespace = 'principal:alice'"
        ).fetchone()
        db.execute(
            "UPDATE secrets SET nonce = ?, sealed = ? WHERE namespace = 'principal:bob'",
            (nonce, sealed),
        )
    db.close()
    with pytest.raises(SecretError, match="does not open") as info:
        store.get("principal:bob", "anthropic_api_key")
    assert "alice-key" not in str(info.value)


def test_values_too_short_to_redact_are_refused(tmp_path: Path) -> None:
    store = SecretStore.open(_config(tmp_path), environ={})
    with pytest.raises(SecretError, match="too short"):
        store.put("forge", "PIN", "1234")


def test_a_wrong_key_does_not_open_and_says_so(tmp_path: Path) -> None:
    config = _config(tmp_path)
    SecretStore.open(config, environ={}).put("forge", "TOKEN", "value-long-enough")
    other = SecretStore(config.secrets_path, os.urandom(32))
    with pytest.raises(SecretError, match="wrong key"):
        other.get("forge", "TOKEN")


def test_key_from_systemd_credentials(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "sage-secrets-key").write_text(os.urandom(32).hex() + "\n")
    config = _config(tmp_path)
    key = load_key(config, environ={"CREDENTIALS_DIRECTORY": str(creds)})
    assert key.hex() == (creds / "sage-secrets-key").read_text().strip()
    assert not (tmp_path / "state" / "keys" / "secrets.key").exists()


def test_a_readable_key_file_is_refused(tmp_path: Path) -> None:
    key_file = tmp_path / "k"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        load_key(_config(tmp_path, key_file=str(key_file)), environ={})
    key_file.chmod(0o600)
    assert len(load_key(_config(tmp_path, key_file=str(key_file)), environ={})) == 32


def test_names_with_path_tricks_are_refused(tmp_path: Path) -> None:
    store = SecretStore.open(_config(tmp_path), environ={})
    for bad in ("../x", "a b", "", "x" * 129):
        with pytest.raises(SecretError):
            store.put("forge", bad, "value-long-enough")


def test_a_vault_deleted_under_a_live_store_comes_back_0600(tmp_path: Path) -> None:
    """The table is made once per store, but a vanished file is made again, private."""
    store = SecretStore(tmp_path / "vault" / "secrets.db", b"k" * 32)
    store.put("forge", "API_KEY", "value-long-enough")
    (tmp_path / "vault" / "secrets.db").unlink()
    assert store.get("forge", "API_KEY") is None
    store.put("forge", "API_KEY", "another-long-value")
    assert store.get("forge", "API_KEY") == "another-long-value"
    assert (tmp_path / "vault" / "secrets.db").stat().st_mode & 0o777 == 0o600
