"""The sans-IO audit chain: canonical bytes, linking, and every failure the verifier reports."""

from __future__ import annotations

import hashlib
import itertools
import struct

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sage.audit import (
    GENESIS_HASH,
    REDACTED,
    ChainBuilder,
    CheckpointRow,
    Entry,
    FailureKind,
    checkpoint_message,
    encode_entry,
    encode_payload,
    entry_hash,
    redact,
    verify_chain,
)
from sage.audit import chain as chain_module
from sage.errors import AuditError

KEY = Ed25519PrivateKey.generate()
PUB = KEY.public_key()

Row = tuple[int, int, str, str, str, bytes, bytes, bytes]


def build(n: int, *, start_ts: int = 1_000) -> list[Entry]:
    builder = ChainBuilder()
    return [
        builder.link(
            start_ts + i, f"sage.v1.audit.k{i % 3}", "alice", "s1", encode_payload({"i": i})
        )
        for i in range(n)
    ]


def rows_of(entries: list[Entry]) -> list[Row]:
    return [e.as_row() for e in entries]


def sign(entries: list[Entry], size: int, key: Ed25519PrivateKey = KEY) -> CheckpointRow:
    head = entries[size - 1].hash
    return (size, head, key.sign(checkpoint_message(size, head)), 0)


def test_canonical_layout_is_exactly_as_documented() -> None:
    """The encoding is prefix, u64 seq, i64 ts, four length-prefixed fields, prev_hash."""
    prev = bytes(range(32))
    got = encode_entry(7, -5, "kind", "pr", "", b'{"a":1}', prev)
    want = (
        b"sage.audit.entry.v1\x00"
        + struct.pack(">Qq", 7, -5)
        + struct.pack(">I", 4)
        + b"kind"
        + struct.pack(">I", 2)
        + b"pr"
        + struct.pack(">I", 0)
        + struct.pack(">I", 7)
        + b'{"a":1}'
        + prev
    )
    assert got == want
    assert entry_hash(7, -5, "kind", "pr", "", b'{"a":1}', prev) == hashlib.sha256(want).digest()


def test_length_prefixes_stop_field_shifting() -> None:
    """Moving bytes from one text field into its neighbour changes the hash."""
    a = entry_hash(1, 0, "ab", "c", "", b"{}", GENESIS_HASH)
    b = entry_hash(1, 0, "a", "bc", "", b"{}", GENESIS_HASH)
    assert a != b


def test_payload_encoding_is_deterministic_and_sorted() -> None:
    """Equal objects give equal bytes whatever the key order; structs encode like dicts."""

    class Point(msgspec.Struct):
        y: int
        x: int

    assert encode_payload({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == b'{"a":[1,{"c":3,"d":2}],"b":1}'
    assert encode_payload({"a": 1, "b": 2}) == encode_payload({"b": 2, "a": 1})
    assert encode_payload(Point(y=1, x=2)) == b'{"x":2,"y":1}'


def test_secrets_are_redacted_before_hashing() -> None:
    """Secret-named keys at any depth lose their value; token counts are kept."""
    payload = {
        "api_key": "k",
        "headers": {"Authorization": "Bearer x", "X-Api-Key": "y"},
        "nested": [{"password": "p", "accessToken": "t", "client_secret": "s"}],
        "usage": {"input_tokens": 3, "output_tokens": 4},
        "tokenizer": "kept",
    }
    out = redact(payload)
    assert out["api_key"] == REDACTED
    assert out["headers"] == {"Authorization": REDACTED, "X-Api-Key": REDACTED}
    assert out["nested"] == [
        {"password": REDACTED, "accessToken": REDACTED, "client_secret": REDACTED}
    ]
    assert out["usage"] == {"input_tokens": 3, "output_tokens": 4}
    assert out["tokenizer"] == "kept"
    assert b'"k"' not in encode_payload(payload)


def test_unencodable_payload_is_an_audit_error() -> None:
    """A payload msgspec cannot encode raises AuditError, not a msgspec error."""
    with pytest.raises(AuditError, match="cannot be encoded"):
        encode_payload(object())


def test_builder_links_each_entry_to_the_previous_hash() -> None:
    """seq starts at 1, the first prev_hash is genesis, each prev_hash is the previous hash."""
    entries = build(5)
    assert [e.seq for e in entries] == [1, 2, 3, 4, 5]
    assert entries[0].prev_hash == GENESIS_HASH
    for before, after in itertools.pairwise(entries):
        assert after.prev_hash == before.hash
    for e in entries:
        assert e.hash == entry_hash(
            e.seq, e.ts, e.kind, e.principal, e.session, e.payload, e.prev_hash
        )


def test_builder_resumes_from_a_head() -> None:
    """A builder given the head of an existing chain continues it seamlessly."""
    entries = build(3)
    resumed = ChainBuilder(3, entries[-1].hash)
    nxt = resumed.link(9, "k", "p", "s", b"{}")
    assert nxt.seq == 4
    assert verify_chain([*rows_of(entries), nxt.as_row()], [], PUB).ok


def test_builder_rejects_a_bad_head() -> None:
    """An empty chain must have the genesis head."""
    with pytest.raises(AuditError):
        ChainBuilder(0, b"\x01" * 32)


def test_intact_chain_verifies_with_counts() -> None:
    """An untouched chain passes; counts cover entries, checkpoints and the unsigned tail."""
    entries = build(10)
    report = verify_chain(rows_of(entries), [sign(entries, 4), sign(entries, 8)], PUB)
    assert report.ok
    assert report.entries_checked == 10
    assert report.checkpoints_checked == 2
    assert report.unsigned_tail == 2


def test_empty_chain_verifies() -> None:
    """No entries and no checkpoints is an intact (empty) log."""
    report = verify_chain([], [], PUB)
    assert report.ok
    assert report.entries_checked == 0


def test_edited_payload_is_tampered_at_its_seq() -> None:
    """Changing a stored payload is reported as tampered at that entry."""
    rows = rows_of(build(6))
    seq, ts, kind, pr, se, _payload, prev, digest = rows[3]
    rows[3] = (seq, ts, kind, pr, se, b'{"i":999}', prev, digest)
    report = verify_chain(rows, [], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.TAMPERED, 4)
    assert report.failure.entry_kind == kind
    assert report.entries_checked == 3


def test_rehashed_entry_breaks_the_chain_after_it() -> None:
    """An entry edited and rehashed on its own breaks the link of the next one."""
    entries = build(6)
    rows = rows_of(entries)
    e = entries[2]
    payload = b'{"i":"forged"}'
    forged = entry_hash(e.seq, e.ts, e.kind, e.principal, e.session, payload, e.prev_hash)
    rows[2] = (e.seq, e.ts, e.kind, e.principal, e.session, payload, e.prev_hash, forged)
    report = verify_chain(rows, [], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BROKEN_CHAIN, 4)


def test_deleted_entry_is_missing() -> None:
    """A gap in seq is reported as missing at the first absent seq."""
    rows = rows_of(build(6))
    del rows[2]
    report = verify_chain(rows, [], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.MISSING, 3)


def test_truncated_tail_under_a_checkpoint_is_missing() -> None:
    """A checkpoint covering more entries than exist reports the first missing seq."""
    entries = build(6)
    report = verify_chain(rows_of(entries)[:4], [sign(entries, 6)], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.MISSING, 5)


def test_seq_going_backwards_is_a_broken_chain() -> None:
    """A repeated seq is reported as a broken chain."""
    rows = rows_of(build(3))
    report = verify_chain([rows[0], rows[1], rows[1]], [], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BROKEN_CHAIN, 2)


def test_whole_chain_rewrite_is_caught_by_checkpoints() -> None:
    """A self-consistent rewrite passes the links but not the signed checkpoint."""
    original = build(8)
    checkpoints = [sign(original, 4), sign(original, 8)]
    builder = ChainBuilder()
    rewritten = [
        builder.link(e.ts, e.kind, e.principal, e.session, b'{"rewritten":true}') for e in original
    ]
    assert verify_chain(rows_of(rewritten), [], PUB).ok
    report = verify_chain(rows_of(rewritten), checkpoints, PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BAD_CHECKPOINT, 4)


def test_checkpoint_from_another_key_is_bad() -> None:
    """A checkpoint signed with a different key is a bad checkpoint at its size."""
    entries = build(5)
    forged = sign(entries, 3, Ed25519PrivateKey.generate())
    report = verify_chain(rows_of(entries), [forged], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.BAD_CHECKPOINT, 3)
    assert report.checkpoints_checked == 0


def test_checkpoint_of_size_zero_is_bad() -> None:
    """A checkpoint that covers no entries is rejected."""
    report = verify_chain(rows_of(build(2)), [(0, GENESIS_HASH, b"", 0)], PUB)
    assert report.failure is not None
    assert report.failure.kind is FailureKind.BAD_CHECKPOINT


def test_first_failure_wins() -> None:
    """With several problems, the one at the smallest seq is reported."""
    entries = build(8)
    rows = rows_of(entries)
    del rows[6]
    seq, ts, kind, pr, se, _p, prev, digest = rows[1]
    rows[1] = (seq, ts, kind, pr, se, b"{}", prev, digest)
    report = verify_chain(rows, [sign(entries, 8)], PUB)
    assert report.failure is not None
    assert (report.failure.kind, report.failure.seq) == (FailureKind.TAMPERED, 2)


def test_checkpoint_message_layout() -> None:
    """The signed message is the domain prefix, u64 size and the head hash."""
    head = b"\x07" * 32
    assert (
        checkpoint_message(3, head) == b"sage.audit.checkpoint.v1\x00" + struct.pack(">Q", 3) + head
    )
    with pytest.raises(AuditError):
        checkpoint_message(3, b"short")


text = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=12)
json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
entry_spec = st.tuples(st.integers(0, 2**62), text, text, text, json_value)


def _build_from(specs: list[tuple[int, str, str, str, object]]) -> list[Entry]:
    builder = ChainBuilder()
    return [builder.link(ts, k, p, s, encode_payload(obj)) for ts, k, p, s, obj in specs]


@given(specs=st.lists(entry_spec, max_size=20), every=st.integers(1, 7))
@settings(max_examples=80, deadline=None)
def test_random_chains_verify(specs: list[tuple[int, str, str, str, object]], every: int) -> None:
    """Any sequence of entries, checkpointed every few, verifies intact."""
    entries = _build_from(specs)
    checkpoints = [sign(entries, n) for n in range(every, len(entries) + 1, every)]
    report = verify_chain(rows_of(entries), checkpoints, PUB)
    assert report.ok
    assert report.entries_checked == len(entries)
    assert report.checkpoints_checked == len(checkpoints)


def _mutate(value: object, position: int, flip: int) -> object:
    if isinstance(value, bool):  # pragma: no cover - no bool fields
        raise AssertionError
    if isinstance(value, int):
        raw = bytearray(struct.pack(">q", value))
        raw[position % 8] ^= flip
        return struct.unpack(">q", bytes(raw))[0]
    if isinstance(value, str):
        if not value:
            return chr(32 + flip % 95)  # the only one-byte change: insert a byte
        i = position % len(value)
        replacement = chr(32 + (ord(value[i]) - 32 + 1 + flip % 94) % 95)
        return value[:i] + replacement + value[i + 1 :]
    assert isinstance(value, bytes)
    if not value:
        return bytes([flip])
    raw = bytearray(value)
    raw[position % len(raw)] ^= flip
    return bytes(raw)


@given(
    specs=st.lists(entry_spec, min_size=1, max_size=12),
    data=st.data(),
)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_single_byte_mutation_is_detected(
    specs: list[tuple[int, str, str, str, object]], data: st.DataObject
) -> None:
    """Changing one byte of any stored field of any entry or checkpoint fails verification."""
    entries = _build_from(specs)
    rows: list[list[object]] = [list(r) for r in rows_of(entries)]
    checkpoints: list[list[object]] = [list(sign(entries, len(entries)))]
    target = data.draw(st.sampled_from(["entry", "checkpoint"]))
    table = rows if target == "entry" else checkpoints
    row_index = data.draw(st.integers(0, len(table) - 1))
    fields = range(8) if target == "entry" else range(3)  # a checkpoint's ts is not signed
    field = data.draw(st.sampled_from(list(fields)))
    position = data.draw(st.integers(0, 10_000))
    flip = data.draw(st.integers(1, 255))
    before = table[row_index][field]
    table[row_index][field] = _mutate(before, position, flip)
    assert table[row_index][field] != before
    report = verify_chain(
        [tuple(r) for r in rows],  # type: ignore[misc]
        [tuple(c) for c in checkpoints],  # type: ignore[misc]
        PUB,
    )
    assert not report.ok


def test_verifier_does_not_need_entry_structs() -> None:
    """The verifier takes plain tuples, as a database cursor yields them."""
    assert chain_module.verify_chain(iter(rows_of(build(3))), iter([]), PUB).ok


@given(obj=json_value)
@settings(max_examples=200, deadline=None)
def test_fast_path_encoding_equals_the_redacting_path(obj: object) -> None:
    """Payloads without secret markers encode exactly as the redacting path would."""
    slow = msgspec.json.encode(redact(msgspec.to_builtins(obj, str_keys=True)), order="sorted")
    assert encode_payload(obj) == slow
    assert encode_payload({"outer": obj, "api_key": "x"}) == msgspec.json.encode(
        {"api_key": REDACTED, "outer": redact(obj)}, order="sorted"
    )


def test_public_names_resolve() -> None:
    """Every name in sage.audit.__all__ exists and is listed once."""
    import sage.audit

    names = sage.audit.__all__
    assert len(set(names)) == len(names)
    for name in names:
        assert hasattr(sage.audit, name), name
