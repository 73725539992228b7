"""The sans-IO wire protocol: frame round-trips, FrameReader chunking and limits."""

from __future__ import annotations

import itertools
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.envelope import WireEnvelope
from bus.errors import FrameError
from bus.wire import (
    Err,
    FrameReader,
    FrameTooLarge,
    Hello,
    Msg,
    Ok,
    Ping,
    Pong,
    Pub,
    Reply,
    Req,
    Result,
    Sub,
    Unsub,
    Welcome,
    decode_client_frame,
    decode_server_frame,
    encode,
    encode_into,
)

_ENV = WireEnvelope(7, "a.b", msgspec.Raw(b'{"k":[1,2]}'), "cli:alice", "alice", "c1", "tok", 1.5)

CLIENT_FRAMES = [
    Hello(role="cli"),
    Hello(role="capsule", version=1, name="web", principal="bob"),
    Pub("a.b", msgspec.Raw(b'{"x":1}')),
    Pub("a.b", msgspec.Raw(b"null"), cid="corr-1"),
    Sub(3, "a.*"),
    Unsub(3),
    Req(4, "svc.echo", msgspec.Raw(b"[1,2,3]")),
    Req(5, "svc.echo", msgspec.Raw(b'"s"'), timeout=0.25),
    Reply("tok-xyz", msgspec.Raw(b'{"ok":true}')),
    Ping(),
    Ping(9),
]

SERVER_FRAMES = [
    Welcome(
        uid=1000, source="cli:1000", principal=None, principals=[], max_payload=10, max_frame=20
    ),
    Welcome(uid=0, source="s", principal="p", principals=["p", "q"], max_payload=1, max_frame=2),
    Msg(3, _ENV),
    Msg(4, WireEnvelope(1, "x", msgspec.Raw(b"1"), "src")),
    Result(4, env=_ENV),
    Result(5, code="no_responders", message="nobody"),
    Ok(3),
    Err("bad_topic", "nope"),
    Err("not_authorized", "go away", sid=2, fatal=True),
    Pong(),
    Pong(11),
]


def _same(a: object, b: object) -> bool:
    """Struct equality with Raw payloads compared by their bytes."""
    return type(a) is type(b) and msgspec.json.encode(a) == msgspec.json.encode(b)


@pytest.mark.parametrize("frame", CLIENT_FRAMES, ids=repr)
def test_client_frames_round_trip(frame: object) -> None:
    """Every client frame type decodes back to an equal frame after encode()."""
    data = encode(frame)  # type: ignore[arg-type]
    (size,) = struct.unpack(">I", data[:4])
    assert size == len(data) - 4
    assert _same(decode_client_frame(data[4:]), frame)


@pytest.mark.parametrize("frame", SERVER_FRAMES, ids=repr)
def test_server_frames_round_trip(frame: object) -> None:
    """Every server frame type decodes back to an equal frame after encode()."""
    data = encode(frame)  # type: ignore[arg-type]
    assert _same(decode_server_frame(data[4:]), frame)


def test_encode_into_appends_same_bytes_as_encode() -> None:
    """encode_into appends exactly encode()'s bytes after what the buffer holds."""
    buf = bytearray(b"prefix")
    for frame in CLIENT_FRAMES:
        encode_into(frame, buf)
    assert bytes(buf) == b"prefix" + b"".join(encode(f) for f in CLIENT_FRAMES)


def test_payload_is_embedded_json_not_a_string() -> None:
    """A Pub's payload travels as raw embedded JSON, not a quoted string."""
    assert b'"payload":{"x":1}' in encode(Pub("a", msgspec.Raw(b'{"x":1}')))


def test_server_frame_is_not_a_client_frame() -> None:
    """A server-only frame type is an unknown type to the client decoder."""
    with pytest.raises(FrameError) as info:
        decode_client_frame(encode(Pong(1))[4:])
    assert info.value.code == "unknown_type"


@pytest.mark.parametrize(
    "body", [b"{", b"not json", b'{"t":"pub","topic":"a","payload":{bad}}', b"\xff\xfe"]
)
def test_malformed_json_is_bad_frame(body: bytes) -> None:
    """Bodies that are not JSON raise FrameError with code bad_frame."""
    with pytest.raises(FrameError) as info:
        decode_client_frame(body)
    assert info.value.code == "bad_frame"


@pytest.mark.parametrize(
    "body", [b"[1]", b'{"t":"hello"}', b'{"t":"sub","sid":"x","pattern":"a"}', b"5"]
)
def test_invalid_frame_shape_is_bad_frame(body: bytes) -> None:
    """JSON of the wrong shape (missing or mistyped fields) raises bad_frame."""
    with pytest.raises(FrameError) as info:
        decode_client_frame(body)
    assert info.value.code == "bad_frame"


@pytest.mark.parametrize("body", [b'{"t":"nope"}', b'{"role":"cli"}', b'{"t":5}'])
def test_unknown_type_is_unknown_type(body: bytes) -> None:
    """An unknown or missing 't' raises FrameError with code unknown_type."""
    with pytest.raises(FrameError) as info:
        decode_client_frame(body)
    assert info.value.code == "unknown_type"
    with pytest.raises(FrameError) as info2:
        decode_server_frame(body)
    assert info2.value.code == "unknown_type"


def test_unknown_fields_are_ignored() -> None:
    """Extra fields (a newer peer) do not make a frame invalid."""
    frame = decode_client_frame(b'{"t":"ping","n":3,"future":true}')
    assert frame == Ping(3)


_STREAM_FRAMES = [
    Hello(role="cli", name="x"),
    Pub("a.b", msgspec.Raw(b'{"x":"' + b"y" * 300 + b'"}')),
    Sub(1, "a.>"),
    Ping(2),
    Req(3, "s", msgspec.Raw(b"[]"), timeout=1.0),
]
_STREAM = b"".join(encode(f) for f in _STREAM_FRAMES)
_BODIES = [encode(f)[4:] for f in _STREAM_FRAMES]


def _bodies(frames: list[memoryview | FrameTooLarge]) -> list[bytes]:
    """The bodies of ``frames`` as bytes; fails on a refused frame."""
    out = []
    for frame in frames:
        assert isinstance(frame, memoryview), frame
        out.append(bytes(frame))
    return out


def _chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, len(_STREAM)), max_size=40))
def test_reader_yields_same_frames_whatever_the_chunking(cuts: list[int]) -> None:
    """FrameReader returns the same bodies in order for any split of the byte stream."""
    reader = FrameReader(limit=4096)
    out: list[memoryview | FrameTooLarge] = []
    for chunk in _chunks(_STREAM, cuts):
        out.extend(reader.feed(chunk))
    assert _bodies(out) == _BODIES
    assert reader.buffered == 0


def test_reader_keeps_partial_frame_buffered() -> None:
    """A partial frame yields nothing until its last byte arrives."""
    data = encode(Ping(1))
    reader = FrameReader(limit=100)
    assert reader.feed(data[:2]) == []
    assert reader.feed(data[2:-1]) == []
    assert reader.buffered == len(data) - 1
    assert _bodies(reader.feed(data[-1:])) == [data[4:]]


def test_frame_at_the_limit_is_accepted() -> None:
    """A frame whose body is exactly the limit is delivered, not refused."""
    body = b'"' + b"z" * 98 + b'"'
    reader = FrameReader(limit=100)
    assert _bodies(reader.feed(struct.pack(">I", 100) + body)) == [body]


def test_oversized_frame_is_reported_and_skipped() -> None:
    """A frame over the limit is reported once and the next frame comes through intact."""
    big = b"x" * 1000
    after = encode(Ping(5))
    reader = FrameReader(limit=100)
    out = reader.feed(struct.pack(">I", len(big)) + big + after)
    assert out == [FrameTooLarge(1000, 100), after[4:]]
    assert reader.buffered == 0


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 1300), max_size=60))
def test_oversized_frame_skipped_across_many_chunks(cuts: list[int]) -> None:
    """An oversized body arriving in many chunks is skipped; the frames around it survive."""
    before, after = encode(Sub(1, "a")), encode(Ping(5))
    big = struct.pack(">I", 1200) + b"q" * 1200
    stream = before + big + after
    reader = FrameReader(limit=100)
    out: list[memoryview | FrameTooLarge] = []
    for chunk in _chunks(stream, cuts):
        out.extend(reader.feed(chunk))
    assert out == [before[4:], FrameTooLarge(1200, 100), after[4:]]
    assert reader.buffered == 0


def test_oversized_body_fed_byte_by_byte() -> None:
    """Even one byte at a time, an oversized body never reaches the buffer."""
    after = encode(Ping(1))
    stream = struct.pack(">I", 500) + b"w" * 500 + after
    reader = FrameReader(limit=20)
    out: list[memoryview | FrameTooLarge] = []
    for i in range(len(stream)):
        out.extend(reader.feed(stream[i : i + 1]))
        assert reader.buffered <= 20 + 4
    assert out == [FrameTooLarge(500, 20), after[4:]]


def test_spliced_msg_frame_decodes_like_encoded_one() -> None:
    """encode_msg_into gives a frame that decodes to the same Msg as encode(Msg(...))."""
    from bus.envelope import Envelope
    from bus.wire import Msg, decode_server_frame, encode, encode_msg_into

    envelope = Envelope(7, "demo.x", b'{"a": [1, "\\u00e9"]}', "cli:0", "alice", "c1", None, 12.5)
    buffer = bytearray()
    encode_msg_into(3, envelope, buffer)
    encode_msg_into(4, envelope, buffer)  # the same envelope to a second subscription
    reader = FrameReader(1 << 20)
    bodies = reader.feed(bytes(buffer))
    frames = [decode_server_frame(body) for body in bodies if isinstance(body, memoryview)]
    reference = decode_server_frame(encode(Msg(3, envelope.to_wire()))[4:])
    assert frames[0] == reference
    assert isinstance(frames[1], Msg)
    assert frames[1].sid == 4
    assert frames[1].env.to_envelope() == envelope


def test_fast_and_general_decoders_agree() -> None:
    """A pub or msg frame decodes the same whether "t" comes first (fast path) or not."""
    from bus.wire import Msg, Pub, decode_client_frame, decode_server_frame

    first = b'{"t":"pub","topic":"a.b","payload":{"x":[1]}}'
    later = b'{"topic":"a.b","payload":{"x":[1]},"t":"pub"}'
    assert decode_client_frame(first) == decode_client_frame(later)
    assert isinstance(decode_client_frame(first), Pub)
    msg_first = b'{"t":"msg","sid":2,"env":{"id":1,"topic":"a","payload":3,"source":"s"}}'
    msg_later = b'{"sid":2,"env":{"id":1,"topic":"a","payload":3,"source":"s"},"t":"msg"}'
    assert decode_server_frame(msg_first) == decode_server_frame(msg_later)
    assert isinstance(decode_server_frame(msg_first), Msg)


@pytest.mark.parametrize(
    "body",
    [b'{"t":"pub","topic":1,"payload":2}', b'{"t":"pub",', b'{"t":"pub","payload":1}'],
)
def test_fast_path_errors_are_frame_errors(body: bytes) -> None:
    """A broken frame on the fast path is a FrameError like any other, never a crash."""
    from bus.wire import decode_client_frame

    with pytest.raises(FrameError):
        decode_client_frame(body)
