"""The fleet audit without I/O: the streamed messages, and the checks made on them.

Each node streams its audit log to the JetStream stream ``sage_audit``
(sage/fleet/audit_stream.py is the shell): every entry on
``sage.audit.<node>.entry``, every signed checkpoint on
``...<node>.checkpoint`` and its checkpoint public key on ``...<node>.key``.
The server lets a node publish on its own three subjects only
(sage/fleet/permissions.py), so the subject names the node and the body never
does.  Bodies are JSON (bytes as base64):

- entry: ``{seq, ts, kind, principal, session, payload, prev_hash, hash}``;
  ``payload`` is null when the entry was too large for one NATS message
  (its hash is then taken as stored: the node's own comparison covers it);
- checkpoint: ``{size, head_hash, signature, ts}``;
- key: ``{key, ts}`` (the 32 raw bytes of the Ed25519 public key).

:class:`StreamBook` takes the stream's messages in stream order and gives each
node's verdict: its chain and checkpoint signatures walked by the audit's own
:func:`sage.audit.chain.verify_chain`, plus what only the stream can show (a
message that is not an entry, two different entries for one seq, a key that
changed).  :func:`compare_local` is what a node runs on its own SQLite log
against what the stream holds of it: a row altered after it was streamed
differs there, even if the chain in SQLite was rewritten and re-signed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, Literal

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from sage.audit.chain import CheckpointRow, EntryRow, entry_hash, verify_chain
from sage.config import NAME_PATTERN

__all__ = (
    "AUDIT_PREFIX",
    "AUDIT_SUBJECTS",
    "Comparison",
    "FleetFailure",
    "NodeVerdict",
    "StreamBook",
    "StreamedCheckpoint",
    "StreamedEntry",
    "StreamedKey",
    "compare_local",
    "first_failure",
    "history_gone",
    "subject_of",
    "verify_subject",
)

AUDIT_PREFIX: Final = "sage.audit"
AUDIT_SUBJECTS: Final = tuple(f"{AUDIT_PREFIX}.*.{what}" for what in ("entry", "checkpoint", "key"))
"""The stream's subjects: ``<node>`` is one token."""

Kind = Literal["entry", "checkpoint", "key"]
Where = Literal["stream", "local"]

_SUBJECT = re.compile(
    rf"^{re.escape(AUDIT_PREFIX)}\.([^.]+)\.(entry|checkpoint|key)\Z",
)
_NAME = re.compile(NAME_PATTERN)
_REASON_MAX = 300


def subject_of(node: str, kind: Kind) -> str:
    """Where ``node`` streams its entries, checkpoints or key."""
    return f"{AUDIT_PREFIX}.{node}.{kind}"


def verify_subject(node: str) -> str:
    """Where ``node`` answers a request to compare its local log with the stream."""
    return f"sage.fleet.{node}.audit.verify"


class StreamedEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    seq: int
    ts: int
    kind: str
    principal: str
    session: str
    payload: bytes | None
    """None: left out, too large for one NATS message."""
    prev_hash: bytes
    hash: bytes

    @classmethod
    def of(cls, row: EntryRow, *, with_payload: bool = True) -> StreamedEntry:
        seq, ts, kind, principal, session, payload, prev_hash, digest = row
        return cls(
            seq=seq,
            ts=ts,
            kind=kind,
            principal=principal,
            session=session,
            payload=bytes(payload) if with_payload else None,
            prev_hash=bytes(prev_hash),
            hash=bytes(digest),
        )

    def as_row(self) -> EntryRow:
        return (
            self.seq,
            self.ts,
            self.kind,
            self.principal,
            self.session,
            self.payload or b"",
            self.prev_hash,
            self.hash,
        )


class StreamedCheckpoint(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    size: int
    head_hash: bytes
    signature: bytes
    ts: int

    def as_row(self) -> CheckpointRow:
        return (self.size, self.head_hash, self.signature, self.ts)


class StreamedKey(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    key: bytes
    """The 32 raw bytes of the node's Ed25519 checkpoint public key."""
    ts: int


_decoders: Final[dict[str, msgspec.json.Decoder[Any]]] = {
    "entry": msgspec.json.Decoder(StreamedEntry),
    "checkpoint": msgspec.json.Decoder(StreamedCheckpoint),
    "key": msgspec.json.Decoder(StreamedKey),
}
_U64: Final = 2**64 - 1


class FleetFailure(msgspec.Struct, frozen=True, kw_only=True):
    """The first place a node's audit does not hold, in the stream or in its local log."""

    kind: str
    """``tampered``, ``broken_chain``, ``missing``, ``bad_checkpoint`` (as ``astrid audit
    verify``), ``malformed``, ``conflict``, ``no_key``, ``key_changed`` (the stream only),
    or ``diverged`` (the local log differs from the stream)."""
    seq: int
    reason: str
    entry_kind: str = ""
    where: Where = "stream"


def history_gone(name: str, state: str) -> FleetFailure:
    """The failure of a node the fleet knows (its record in the node table, ``state``
    ``lost`` or ``stopped``) of which the stream holds nothing: its streamed history is
    gone (a purge or rollup by a user with the rights, a stream deleted and made again),
    and no live node can show its local log instead.  ``astrid audit verify --fleet``
    lists it, never leaves it out."""
    return FleetFailure(
        kind="missing",
        seq=0,
        reason=(
            f"node {name!r} is {state} and the stream holds none of its history: it was"
            " erased (purged, rolled up, or the stream made again)"
        ),
    )


def first_failure(*failures: FleetFailure | None) -> FleetFailure | None:
    """The failure at the smallest seq (the earlier argument on a tie)."""
    found = [f for f in failures if f is not None]
    return min(found, key=lambda f: f.seq) if found else None


class NodeVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """What the stream holds of one node, and its first failure."""

    node: str
    entries: int
    checkpoints: int
    head_seq: int
    unsigned_tail: int
    opaque: int
    """Entries streamed without their payload (too large): only their links are checked."""
    failure: FleetFailure | None


class _Node:
    """One node's messages as they arrive, before the chain is walked."""

    def __init__(self) -> None:
        self.rows: dict[int, EntryRow] = {}
        self.opaque: set[int] = set()
        self.checkpoints: dict[int, CheckpointRow] = {}
        self.key: bytes | None = None
        self.failure: FleetFailure | None = None
        self.head = 0

    def fail(self, kind: str, seq: int, reason: str, entry_kind: str = "") -> None:
        if self.failure is None:
            self.failure = FleetFailure(
                kind=kind, seq=seq, reason=reason[:_REASON_MAX], entry_kind=entry_kind
            )


class StreamBook:
    """The stream's messages in, each node's verdict out."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Node] = {}
        self.strays: list[str] = []
        """Messages on no node's subject: ``"<stream seq> <subject>"`` each."""
        self.messages = 0

    @property
    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def feed(self, subject: str, data: bytes, position: int = 0) -> None:
        """Take one message of the stream (``position``: its stream sequence, for reasons)."""
        self.messages += 1
        match = _SUBJECT.match(subject)
        if match is None or not _NAME.match(match.group(1)):
            if len(self.strays) < 100:
                self.strays.append(f"{position} {subject[:200]}")
            return
        name, kind = match.group(1), match.group(2)
        node = self._nodes.setdefault(name, _Node())
        try:
            decoded = _decoders[kind].decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            node.fail(
                "malformed",
                node.head + 1,
                f"stream message {position} ({len(data)} bytes) is not an audit {kind}: {exc}",
            )
            return
        if isinstance(decoded, StreamedEntry):
            self._entry(node, decoded, position)
        elif isinstance(decoded, StreamedCheckpoint):
            self._checkpoint(node, decoded, position)
        elif isinstance(decoded, StreamedKey):
            self._key(node, decoded, position)

    def _entry(self, node: _Node, entry: StreamedEntry, position: int) -> None:
        if not 1 <= entry.seq <= _U64 or not -(2**63) <= entry.ts < 2**63:
            node.fail("malformed", node.head + 1, f"stream message {position}: seq out of range")
            return
        if len(entry.hash) != 32 or len(entry.prev_hash) != 32:
            node.fail("malformed", entry.seq, f"stream message {position}: a hash is not 32 bytes")
            return
        row = entry.as_row()
        known = node.rows.get(entry.seq)
        if known is not None:
            if known != row and not (entry.seq in node.opaque and known[7] == row[7]):
                node.fail(
                    "conflict",
                    entry.seq,
                    f"stream message {position} is a second, different entry {entry.seq}",
                    entry.kind,
                )
            return
        node.rows[entry.seq] = row
        if entry.payload is None:
            node.opaque.add(entry.seq)
        node.head = max(node.head, entry.seq)

    def _checkpoint(self, node: _Node, cp: StreamedCheckpoint, position: int) -> None:
        if not 0 <= cp.size <= _U64:
            node.fail("malformed", node.head + 1, f"stream message {position}: size out of range")
            return
        known = node.checkpoints.get(cp.size)
        if known is not None and known != cp.as_row():
            node.fail(
                "conflict", cp.size, f"stream message {position} is a second, different checkpoint"
            )
            return
        node.checkpoints[cp.size] = cp.as_row()

    def _key(self, node: _Node, key: StreamedKey, position: int) -> None:
        if len(key.key) != 32:
            node.fail("malformed", node.head + 1, f"stream message {position}: not a 32-byte key")
            return
        if node.key is None:
            node.key = key.key
        elif node.key != key.key:
            node.fail(
                "key_changed",
                node.head + 1,
                f"stream message {position} names another checkpoint key than the node's first",
            )

    def streamed_hashes(self, name: str) -> dict[int, bytes]:
        """seq -> hash of every entry the stream holds of ``name``."""
        node = self._nodes.get(name)
        return {seq: row[7] for seq, row in node.rows.items()} if node else {}

    def key_of(self, name: str) -> bytes | None:
        node = self._nodes.get(name)
        return node.key if node else None

    def verdict(self, name: str) -> NodeVerdict:
        """Walk ``name``'s streamed chain and checkpoints; its first failure, if any."""
        node = self._nodes.get(name) or _Node()
        rows = [node.rows[seq] for seq in sorted(node.rows)]
        checkpoints = list(node.checkpoints.values())
        failure = node.failure
        key: Ed25519PublicKey | None = None
        if node.key is not None:
            try:
                key = Ed25519PublicKey.from_public_bytes(node.key)
            except ValueError:
                failure = first_failure(
                    failure, FleetFailure(kind="malformed", seq=0, reason="not an Ed25519 key")
                )
        if key is None and checkpoints:
            failure = first_failure(
                failure,
                FleetFailure(
                    kind="no_key",
                    seq=min(node.checkpoints),
                    reason="checkpoints were streamed but no key to verify them",
                ),
            )
        report = verify_chain(
            rows,
            checkpoints,
            key or _NO_KEY,
            opaque=node.opaque,
        )
        if report.failure is not None:
            found = report.failure
            failure = first_failure(
                failure,  # what only the stream shows (no key...) wins a tie
                FleetFailure(
                    kind=str(found.kind),
                    seq=found.seq,
                    reason=found.reason,
                    entry_kind=found.entry_kind,
                ),
            )
        return NodeVerdict(
            node=name,
            entries=len(rows),
            checkpoints=len(checkpoints),
            head_seq=node.head,
            unsigned_tail=report.unsigned_tail,
            opaque=len(node.opaque),
            failure=failure,
        )


_NO_KEY: Final = Ed25519PrivateKey.generate().public_key()
"""Stands in when a node streamed no key: it verifies no signature (``no_key`` is reported)."""


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """A node's own log compared with the stream (its answer on its verify subject)."""

    entries: int
    """Local entries checked."""
    head_seq: int
    compared: int
    """Local entries whose streamed copy was compared."""
    unstreamed: int
    """Local entries past the last one streamed (not streamed yet)."""
    failure: FleetFailure | None


def compare_local(rows: Iterable[EntryRow], streamed: Mapping[int, bytes]) -> Comparison:
    """Compare a node's local rows (in seq order) with the hashes it streamed.

    A local row is recomputed from its columns; it and its stored hash must
    both be what the stream holds for its seq.  The first seq where they part
    is a ``diverged`` failure, and so is an entry the stream holds past the
    local log's end (a gap inside the local log is the local verify's
    ``missing``)."""
    entries = head = compared = 0
    failure: FleetFailure | None = None
    for seq, ts, kind, principal, session, payload, prev_hash, digest in rows:
        entries += 1
        head = seq
        want = streamed.get(seq)
        if want is None or failure is not None:
            continue
        compared += 1
        try:
            recomputed = entry_hash(seq, ts, kind, principal, session, bytes(payload), prev_hash)
        except (UnicodeError, TypeError, ValueError, OverflowError):
            recomputed = b""
        if bytes(digest) != want:
            why = "the local entry's hash is not the one the node streamed"
        elif recomputed != want:
            why = "the local entry's contents differ from what the node streamed"
        else:
            continue
        failure = FleetFailure(kind="diverged", seq=seq, reason=why, entry_kind=kind, where="local")
    stream_end = max(streamed, default=0)
    if stream_end > head:
        beyond = min(seq for seq in streamed if seq > head)
        failure = first_failure(
            failure,
            FleetFailure(
                kind="diverged",
                seq=beyond,
                reason=f"the stream holds entry {beyond} but the local log ends at {head}",
                where="local",
            ),
        )
    unstreamed = max(0, head - stream_end)
    return Comparison(
        entries=entries, head_seq=head, compared=compared, unstreamed=unstreamed, failure=failure
    )
