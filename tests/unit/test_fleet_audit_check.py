"""The fleet audit's sans-IO core: streamed messages in, each node's verdict out, and a
node's local rows compared with what it streamed."""

from __future__ import annotations

import msgspec
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sage.audit.chain import ChainBuilder, EntryRow, checkpoint_message, encode_payload
from sage.fleet.audit_check import (
    AUDIT_SUBJECTS,
    StreamBook,
    StreamedCheckpoint,
    StreamedEntry,
    StreamedKey,
    compare_local,
    subject_of,
)
from sage.fleet.permissions import node_permissions


def chain(n: int, start_ts: int = 1_700_000_000_000_000_000) -> list[EntryRow]:
    builder = ChainBuilder()
    return [
        builder.link(
            start_ts + i, "sage.v1.audit.x", "alice", "s1", encode_payload({"i": i})
        ).as_row()
        for i in range(n)
    ]


def raw(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def checkpoint(key: Ed25519PrivateKey, rows: list[EntryRow], size: int) -> bytes:
    head = rows[size - 1][7]
    cp = StreamedCheckpoint(
        size=size, head_hash=head, signature=key.sign(checkpoint_message(size, head)), ts=1
    )
    return msgspec.json.encode(cp)


def entry(row: EntryRow) -> bytes:
    return msgspec.json.encode(StreamedEntry.of(row))


def streamed(node: str, key: Ed25519PrivateKey, rows: list[EntryRow], every: int = 4) -> StreamBook:
    book = StreamBook()
    book.feed(subject_of(node, "key"), msgspec.json.encode(StreamedKey(key=raw(key), ts=1)), 1)
    for row in rows:
        book.feed(subject_of(node, "entry"), entry(row))
        if row[0] % every == 0:
            book.feed(subject_of(node, "checkpoint"), checkpoint(key, rows, row[0]))
    return book


def test_an_intact_stream_of_two_nodes_verifies() -> None:
    ka, kb = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    book = streamed("a", ka, chain(10))
    rows_b = chain(5, start_ts=7)
    book.feed(subject_of("b", "key"), msgspec.json.encode(StreamedKey(key=raw(kb), ts=1)))
    for row in rows_b:
        book.feed(subject_of("b", "entry"), entry(row))
    book.feed(subject_of("b", "checkpoint"), checkpoint(kb, rows_b, 5))
    assert book.nodes == ["a", "b"]
    a, b = book.verdict("a"), book.verdict("b")
    assert (a.failure, a.entries, a.checkpoints, a.head_seq, a.unsigned_tail) == (
        None,
        10,
        2,
        10,
        2,
    )
    assert (b.failure, b.entries, b.checkpoints, b.unsigned_tail) == (None, 5, 1, 0)
    assert book.strays == []


def test_a_duplicate_publish_is_harmless_but_a_different_entry_is_a_conflict() -> None:
    key = Ed25519PrivateKey.generate()
    rows = chain(6)
    book = streamed("a", key, rows)
    book.feed(subject_of("a", "entry"), entry(rows[2]), 99)  # a publish whose ack was lost
    assert book.verdict("a").failure is None
    forged = (*rows[2][:5], b'{"i":"forged"}', *rows[2][6:])
    book.feed(subject_of("a", "entry"), entry(forged), 100)
    failure = book.verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq) == ("conflict", 3)
    assert "100" in failure.reason


def test_a_tampered_streamed_entry_and_a_bad_signature_are_named_at_their_seq() -> None:
    key = Ed25519PrivateKey.generate()
    rows = chain(8)
    rows[5] = (*rows[5][:5], b'{"i":"changed"}', *rows[5][6:])
    failure = streamed("a", key, rows).verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq, failure.entry_kind) == ("tampered", 6, "sage.v1.audit.x")

    other = Ed25519PrivateKey.generate()
    book = StreamBook()
    book.feed(subject_of("a", "key"), msgspec.json.encode(StreamedKey(key=raw(key), ts=1)))
    good = chain(4)
    for row in good:
        book.feed(subject_of("a", "entry"), entry(row))
    book.feed(subject_of("a", "checkpoint"), checkpoint(other, good, 4))
    failure = book.verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq) == ("bad_checkpoint", 4)


def test_a_gap_in_the_stream_is_missing() -> None:
    key = Ed25519PrivateKey.generate()
    rows = chain(6)
    failure = streamed("a", key, rows[:2] + rows[3:], every=100).verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq) == ("missing", 3)


def test_malformed_huge_and_stray_messages_are_reported_not_raised() -> None:
    key = Ed25519PrivateKey.generate()
    rows = chain(3)
    book = streamed("a", key, rows, every=100)
    book.feed(subject_of("a", "entry"), b"\xff" * 2_000_000, 41)
    book.feed(subject_of("a", "entry"), b'{"seq": 4}', 42)
    book.feed(subject_of("a", "checkpoint"), b"[" * 100_000, 43)
    book.feed("sage.audit.a.other", b"{}", 44)
    book.feed("sage.audit.bad name.entry", b"{}", 45)
    failure = book.verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq) == ("malformed", 4)
    assert "stream message 41" in failure.reason
    assert len(failure.reason) <= 300
    assert book.strays == ["44 sage.audit.a.other", "45 sage.audit.bad name.entry"]


def test_checkpoints_without_a_key_and_a_changed_key_fail() -> None:
    key = Ed25519PrivateKey.generate()
    rows = chain(4)
    book = StreamBook()
    for row in rows:
        book.feed(subject_of("a", "entry"), entry(row))
    book.feed(subject_of("a", "checkpoint"), checkpoint(key, rows, 4))
    failure = book.verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq) == ("no_key", 4)

    book = streamed("a", key, rows)
    other = msgspec.json.encode(StreamedKey(key=raw(Ed25519PrivateKey.generate()), ts=2))
    book.feed(subject_of("a", "key"), other, 9)
    failure = book.verdict("a").failure
    assert failure is not None
    assert failure.kind == "key_changed"


def test_an_entry_streamed_without_its_payload_is_checked_by_its_links() -> None:
    key = Ed25519PrivateKey.generate()
    rows = chain(5)
    book = StreamBook()
    book.feed(subject_of("a", "key"), msgspec.json.encode(StreamedKey(key=raw(key), ts=1)))
    for row in rows:
        body = StreamedEntry.of(row, with_payload=row[0] != 3)
        book.feed(subject_of("a", "entry"), msgspec.json.encode(body))
    book.feed(subject_of("a", "checkpoint"), checkpoint(key, rows, 5))
    verdict = book.verdict("a")
    assert (verdict.failure, verdict.opaque) == (None, 1)
    # a forged prev_hash on the opaque entry still breaks the chain
    book = StreamBook()
    forged = (*rows[2][:6], bytes(32), rows[2][7])
    for row in (*rows[:2], forged):
        body = StreamedEntry.of(row, with_payload=row[0] != 3)
        book.feed(subject_of("a", "entry"), msgspec.json.encode(body))
    failure = book.verdict("a").failure
    assert failure is not None
    assert (failure.kind, failure.seq) == ("broken_chain", 3)


def test_compare_local_finds_a_row_altered_after_it_was_streamed() -> None:
    rows = chain(10)
    hashes = {row[0]: row[7] for row in rows[:8]}
    same = compare_local(rows, hashes)
    assert (same.failure, same.entries, same.head_seq, same.compared, same.unstreamed) == (
        None,
        10,
        10,
        8,
        2,
    )
    altered = list(rows)
    altered[4] = (*rows[4][:5], b'{"i":"rewritten"}', *rows[4][6:])
    found = compare_local(altered, hashes).failure
    assert found is not None
    assert (found.kind, found.seq, found.where) == ("diverged", 5, "local")
    assert "contents" in found.reason
    # the whole chain rewritten from seq 5 with recomputed hashes (and re-signed)
    builder = ChainBuilder(4, rows[3][7])
    rewritten = rows[:4] + [
        builder.link(r[1], r[2], r[3], r[4], b'{"i":"new"}').as_row() for r in rows[4:]
    ]
    found = compare_local(rewritten, hashes).failure
    assert found is not None
    assert (found.seq, found.kind) == (5, "diverged")
    assert "hash" in found.reason


def test_compare_local_finds_a_stream_longer_than_the_local_log() -> None:
    rows = chain(6)
    hashes = {row[0]: row[7] for row in rows}
    found = compare_local(rows[:4], hashes).failure
    assert found is not None
    assert (found.kind, found.seq) == ("diverged", 5)
    assert "local log ends at 4" in found.reason


def test_a_node_may_publish_its_own_audit_subjects_only() -> None:
    perms = node_permissions("a")
    audit = [p for p in perms["publish"]["allow"] if p.startswith("sage.audit.")]
    assert audit == [
        subject_of("a", "entry"),
        subject_of("a", "checkpoint"),
        subject_of("a", "key"),
    ]
    # no purge of any stream, the audit stream's least
    purges = [p for p in perms["publish"]["allow"] if p.startswith("$JS.API.STREAM.PURGE")]
    assert purges == []
    assert all("MSG.DELETE" not in p and "UPDATE" not in p for p in perms["publish"]["allow"])
    # its own verify requests only (the rest of the list: test_fleet's permissions test)
    verify = [p for p in perms["subscribe"]["allow"] if p.endswith(".audit.verify")]
    assert verify == ["sage.fleet.a.audit.verify"]
    assert perms["allow_responses"] is True
    assert AUDIT_SUBJECTS == (
        "sage.audit.*.entry",
        "sage.audit.*.checkpoint",
        "sage.audit.*.key",
    )
