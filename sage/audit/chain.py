"""The audit chain itself: entry records, their canonical bytes, hashing, linking, verifying.

This module owns every rule that makes the audit log tamper-evident and does
no I/O (the SQLite shell in :mod:`sage.audit.store` only moves rows in and
out).  An entry's hash is the full SHA-256 of its canonical encoding, which
includes the previous entry's hash; the genesis ``prev_hash`` is 32 zero
bytes.  The canonical encoding of an entry is, byte for byte::

    b"sage.audit.entry.v1\\x00"          domain-separation prefix (20 bytes)
    seq        u64 big-endian            (8 bytes, seq >= 1)
    ts         i64 big-endian            (8 bytes, nanoseconds since the epoch)
    kind       u32 big-endian length + UTF-8 bytes
    principal  u32 big-endian length + UTF-8 bytes
    session    u32 big-endian length + UTF-8 bytes
    payload    u32 big-endian length + bytes (canonical JSON, see below)
    prev_hash  32 bytes

Every variable-length field is length-prefixed, so bytes cannot be shifted
from one field into its neighbour without changing the hash.  The payload is
the caller's object converted to JSON builtins, with obvious secrets
redacted, encoded by ``msgspec.json.encode(order="sorted")`` (sorted keys, no
whitespace), so equal objects always give equal bytes.  Redaction happens
*before* hashing: a mapping key whose words (split on ``_ - . space`` and
camelCase) include ``token``, ``secret``, ``password``, ``passwd``,
``authorization``, ``credential(s)``, ``apikey``, ``api``+``key`` or
``private``+``key`` has its value replaced by ``"<redacted>"`` at any depth
(``input_tokens`` is kept: ``tokens`` is not ``token``).  A signed
checkpoint covers the first ``size`` entries; the signed message is::

    b"sage.audit.checkpoint.v1\\x00" + u64 big-endian size + head hash (32 bytes)

:func:`verify_chain` walks stored rows and checkpoints and reports the first
failure: ``tampered`` (stored hash differs from the recomputed one),
``broken_chain`` (``prev_hash`` differs from the previous entry's hash, or
seq goes backwards), ``missing`` (a gap in seq, or a checkpoint claims more
entries than exist) or ``bad_checkpoint`` (signature invalid, or its head
differs from the entry hash at its size).  A chain rewritten wholesale with
recomputed hashes is self-consistent and is caught only by checkpoints.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Container, Iterable, Iterator
from typing import Final

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from sage.errors import AuditError
from sage.redaction import REDACTED, redact

__all__ = (
    "ENTRY_DOMAIN",
    "GENESIS_HASH",
    "REDACTED",
    "ChainBuilder",
    "Checkpoint",
    "CheckpointRow",
    "Entry",
    "EntryRow",
    "FailureKind",
    "VerifyFailure",
    "VerifyReport",
    "checkpoint_message",
    "encode_entry",
    "encode_payload",
    "entry_hash",
    "redact",
    "verify_chain",
)

ENTRY_DOMAIN: Final = b"sage.audit.entry.v1\x00"
CHECKPOINT_DOMAIN: Final = b"sage.audit.checkpoint.v1\x00"
GENESIS_HASH: Final = bytes(32)

_HEAD = struct.Struct(">Qq")
_LEN = struct.Struct(">I")
_SIZE = struct.Struct(">Q")
_U64_MAX = 2**64 - 1

EntryRow = tuple[int, int, str, str, str, bytes, bytes, bytes]
"""A stored entry: (seq, ts, kind, principal, session, payload, prev_hash, hash)."""
CheckpointRow = tuple[int, bytes, bytes, int]
"""A stored checkpoint: (size, head_hash, signature, ts)."""


class Entry(msgspec.Struct, frozen=True, kw_only=True):
    """One audit entry as stored; ``hash`` links it to every entry before it."""

    seq: int
    ts: int
    kind: str
    principal: str
    session: str
    payload: bytes
    prev_hash: bytes
    hash: bytes

    def as_row(self) -> EntryRow:
        return (
            self.seq,
            self.ts,
            self.kind,
            self.principal,
            self.session,
            self.payload,
            self.prev_hash,
            self.hash,
        )

    @classmethod
    def from_row(cls, row: EntryRow) -> Entry:
        seq, ts, kind, principal, session, payload, prev_hash, digest = row
        return cls(
            seq=seq,
            ts=ts,
            kind=kind,
            principal=principal,
            session=session,
            payload=bytes(payload),
            prev_hash=bytes(prev_hash),
            hash=bytes(digest),
        )


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    """A signature over the first ``size`` entries, whose last hash is ``head_hash``."""

    size: int
    head_hash: bytes
    signature: bytes
    ts: int

    def as_row(self) -> CheckpointRow:
        return (self.size, self.head_hash, self.signature, self.ts)


# --- canonical encoding ------------------------------------------------------------------


def encode_entry(
    seq: int, ts: int, kind: str, principal: str, session: str, payload: bytes, prev_hash: bytes
) -> bytes:
    """The canonical bytes of an entry (layout in the module docstring)."""
    k = kind.encode()
    p = principal.encode()
    s = session.encode()
    return b"".join(
        (
            ENTRY_DOMAIN,
            _HEAD.pack(seq, ts),
            _LEN.pack(len(k)),
            k,
            _LEN.pack(len(p)),
            p,
            _LEN.pack(len(s)),
            s,
            _LEN.pack(len(payload)),
            payload,
            prev_hash,
        )
    )


def entry_hash(
    seq: int, ts: int, kind: str, principal: str, session: str, payload: bytes, prev_hash: bytes
) -> bytes:
    """SHA-256 (all 32 bytes) of the canonical encoding."""
    return hashlib.sha256(
        encode_entry(seq, ts, kind, principal, session, payload, prev_hash)
    ).digest()


def checkpoint_message(size: int, head_hash: bytes) -> bytes:
    """The bytes a checkpoint signs: domain prefix, u64 size, head hash."""
    if len(head_hash) != 32:
        raise AuditError("checkpoint head hash must be 32 bytes")
    return CHECKPOINT_DOMAIN + _SIZE.pack(size) + head_hash


def _may_hold_secrets(data: bytes) -> bool:
    """False only when no secret-named key can be in ``data`` (every one has a marker)."""
    if not data.isascii():
        return True
    low = data.decode("ascii").lower()  # str search is much faster than bytes here
    return (
        "key" in low
        or "token" in low
        or "secret" in low
        or "passw" in low
        or "authorization" in low
        or "credential" in low
    )


def encode_payload(obj: object) -> bytes:
    """Canonical JSON of any msgspec-encodable object, secrets redacted (see module doc)."""
    try:
        data = msgspec.json.encode(obj, order="sorted")
        if not _may_hold_secrets(data):  # the common case: nothing to redact
            return data
        builtins = msgspec.to_builtins(obj, str_keys=True)
        return msgspec.json.encode(redact(builtins), order="sorted")
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
        raise AuditError(f"audit payload cannot be encoded: {exc}") from exc


# --- linking -----------------------------------------------------------------------------


class ChainBuilder:
    """Links new entries onto a head: assigns the next seq and the hash chain."""

    __slots__ = ("_hash", "_seq")

    def __init__(self, head_seq: int = 0, head_hash: bytes = GENESIS_HASH) -> None:
        if head_seq < 0 or len(head_hash) != 32:
            raise AuditError("invalid chain head")
        if head_seq == 0 and head_hash != GENESIS_HASH:
            raise AuditError("an empty chain has the genesis head")
        self._seq = head_seq
        self._hash = head_hash

    @property
    def head_seq(self) -> int:
        return self._seq

    @property
    def head_hash(self) -> bytes:
        return self._hash

    def link(self, ts: int, kind: str, principal: str, session: str, payload: bytes) -> Entry:
        """The next entry after the head; the head moves onto it."""
        seq = self._seq + 1
        prev = self._hash
        digest = entry_hash(seq, ts, kind, principal, session, payload, prev)
        self._seq = seq
        self._hash = digest
        return Entry(
            seq=seq,
            ts=ts,
            kind=kind,
            principal=principal,
            session=session,
            payload=payload,
            prev_hash=prev,
            hash=digest,
        )

    def reset(self, head_seq: int, head_hash: bytes) -> None:
        """Move the head back (after a batch failed to commit)."""
        self._seq = head_seq
        self._hash = head_hash


# --- verifying ---------------------------------------------------------------------------


class FailureKind(enum.StrEnum):
    TAMPERED = "tampered"
    BROKEN_CHAIN = "broken_chain"
    MISSING = "missing"
    BAD_CHECKPOINT = "bad_checkpoint"


class VerifyFailure(msgspec.Struct, frozen=True, kw_only=True):
    """The first place the chain does not hold."""

    kind: FailureKind
    seq: int
    reason: str
    entry_kind: str = ""
    """The ``kind`` field of the entry at ``seq``, when there is one."""


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a verification walked and the first failure, if any."""

    entries_checked: int
    checkpoints_checked: int
    unsigned_tail: int
    """Entries after the last valid checkpoint: only their internal links vouch for them."""
    head_seq: int
    failure: VerifyFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def _signature_ok(public_key: Ed25519PublicKey, size: int, head: bytes, sig: bytes) -> bool:
    if len(head) != 32 or not 0 <= size <= _U64_MAX:
        return False
    try:
        public_key.verify(bytes(sig), checkpoint_message(size, bytes(head)))
    except InvalidSignature:
        return False
    return True


def verify_chain(
    rows: Iterable[EntryRow],
    checkpoints: Iterable[CheckpointRow],
    public_key: Ed25519PublicKey,
    *,
    max_unsigned: int | None = None,
    opaque: Container[int] = (),
) -> VerifyReport:
    """Walk ``rows`` (ordered by seq) and ``checkpoints``; report the first failure.

    Checkpoints are checked in order of size, each right after the entry at
    its size, so the failure reported is the one with the smallest seq.
    ``max_unsigned`` is the most entries the writer's policy can leave after
    the last checkpoint (even after a crash); a longer unsigned tail means
    checkpoints were removed (e.g. to rewrite the chain) and is reported as
    ``bad_checkpoint`` at the first entry past what the policy allows.
    ``opaque`` names the seqs whose contents the caller does not hold (the fleet's
    stream leaves out a payload too large for NATS): their stored hash is taken as
    it is, and only their links are checked.
    """
    pending: Iterator[CheckpointRow] = iter(sorted(checkpoints, key=lambda c: c[0]))
    cp = next(pending, None)
    sha256 = hashlib.sha256
    head_pack = _HEAD.pack
    len_pack = _LEN.pack
    domain = ENTRY_DOMAIN
    expected = 1
    prev = GENESIS_HASH
    checked = 0
    cps_checked = 0
    signed_upto = 0
    kind = ""

    def report(failure: VerifyFailure | None) -> VerifyReport:
        return VerifyReport(
            entries_checked=checked,
            checkpoints_checked=cps_checked,
            unsigned_tail=checked - signed_upto,
            head_seq=checked,
            failure=failure,
        )

    if cp is not None and cp[0] <= 0:
        return report(
            VerifyFailure(
                kind=FailureKind.BAD_CHECKPOINT, seq=cp[0], reason="checkpoint covers no entries"
            )
        )

    for seq, ts, kind, principal, session, payload, prev_hash, digest in rows:
        if seq != expected:
            if seq > expected:
                return report(
                    VerifyFailure(
                        kind=FailureKind.MISSING,
                        seq=expected,
                        reason=f"entries {expected}..{seq - 1} are missing",
                    )
                )
            return report(
                VerifyFailure(
                    kind=FailureKind.BROKEN_CHAIN,
                    seq=seq,
                    reason=f"seq {seq} appears after {expected - 1}",
                    entry_kind=kind,
                )
            )
        if opaque and seq in opaque:  # contents not held: its links still are checked
            recomputed = digest
        else:
            try:
                k = kind.encode()
                p = principal.encode()
                s = session.encode()
                recomputed = sha256(
                    b"".join(
                        (
                            domain,
                            head_pack(seq, ts),
                            len_pack(len(k)),
                            k,
                            len_pack(len(p)),
                            p,
                            len_pack(len(s)),
                            s,
                            len_pack(len(payload)),
                            payload,
                            prev_hash,
                        )
                    )
                ).digest()
            except (struct.error, UnicodeError, TypeError):
                recomputed = b""
        if recomputed != digest:
            return report(
                VerifyFailure(
                    kind=FailureKind.TAMPERED,
                    seq=seq,
                    reason="stored hash differs from the hash of the entry's contents",
                    entry_kind=kind,
                )
            )
        if prev_hash != prev:
            return report(
                VerifyFailure(
                    kind=FailureKind.BROKEN_CHAIN,
                    seq=seq,
                    reason="prev_hash differs from the previous entry's hash",
                    entry_kind=kind,
                )
            )
        prev = digest
        checked = seq
        expected = seq + 1
        while cp is not None and cp[0] == seq:
            size, head, sig, _ts = cp
            if head != digest:
                return report(
                    VerifyFailure(
                        kind=FailureKind.BAD_CHECKPOINT,
                        seq=size,
                        reason="checkpoint head differs from the entry hash at its size",
                        entry_kind=kind,
                    )
                )
            if not _signature_ok(public_key, size, head, sig):
                return report(
                    VerifyFailure(
                        kind=FailureKind.BAD_CHECKPOINT,
                        seq=size,
                        reason="checkpoint signature is not valid for this public key",
                        entry_kind=kind,
                    )
                )
            cps_checked += 1
            signed_upto = size
            cp = next(pending, None)

    if cp is not None:
        return report(
            VerifyFailure(
                kind=FailureKind.MISSING,
                seq=checked + 1,
                reason=f"a checkpoint covers {cp[0]} entries but only {checked} exist",
            )
        )
    if max_unsigned is not None and checked - signed_upto > max_unsigned:
        return report(
            VerifyFailure(
                kind=FailureKind.BAD_CHECKPOINT,
                seq=signed_upto + max_unsigned + 1,
                reason=(
                    f"{checked - signed_upto} entries after the last checkpoint, but the policy"
                    f" signs at least every {max_unsigned}: checkpoints are missing"
                ),
            )
        )
    return report(None)
