"""The tamper-evident audit log: a hash chain in SQLite with Ed25519-signed checkpoints.

The package's public surface; the work is done in :mod:`sage.audit.chain`
(the sans-IO chain: encoding, hashing, linking, verifying),
:mod:`sage.audit.keys` (the signing key on disk) and :mod:`sage.audit.store`
(the SQLite file, the group-committing writer, read-only verify and tail).
"""

from __future__ import annotations

from sage.audit.chain import (
    GENESIS_HASH,
    REDACTED,
    ChainBuilder,
    Checkpoint,
    CheckpointRow,
    Entry,
    EntryRow,
    FailureKind,
    VerifyFailure,
    VerifyReport,
    checkpoint_message,
    encode_entry,
    encode_payload,
    entry_hash,
    redact,
    verify_chain,
)
from sage.audit.keys import (
    KEY_FILENAME,
    PUBLIC_KEY_FILENAME,
    load_public_key,
    load_signing_key,
    parse_public_key,
    public_key_pem,
    public_key_raw_b64,
)
from sage.audit.store import (
    AuditLog,
    AuditReceipt,
    LogState,
    last_seq,
    max_unsigned_for,
    tail,
    verify_audit,
)

__all__ = (
    "GENESIS_HASH",
    "KEY_FILENAME",
    "PUBLIC_KEY_FILENAME",
    "REDACTED",
    "AuditLog",
    "AuditReceipt",
    "ChainBuilder",
    "Checkpoint",
    "CheckpointRow",
    "Entry",
    "EntryRow",
    "FailureKind",
    "LogState",
    "VerifyFailure",
    "VerifyReport",
    "checkpoint_message",
    "encode_entry",
    "encode_payload",
    "entry_hash",
    "last_seq",
    "load_public_key",
    "load_signing_key",
    "max_unsigned_for",
    "parse_public_key",
    "public_key_pem",
    "public_key_raw_b64",
    "redact",
    "tail",
    "verify_audit",
    "verify_chain",
)
