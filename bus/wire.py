"""The bus wire protocol over a stream socket, sans-IO.

A frame is a 4-byte big-endian length followed by that many bytes of JSON,
one object tagged by its ``t`` field.  :class:`FrameReader` turns received
bytes into frame bodies; a frame whose length is over the hard limit is
reported and its body skipped as it arrives, so the connection survives.
Decoding a body yields a typed frame or raises :class:`FrameError` whose
code says what was wrong (``bad_frame``, ``unknown_type``).

Client -> server: Hello (first), Pub, Sub, Unsub, Req, Reply, Ping.
Server -> client: Welcome, Msg, Result, Ok, Err, Pong.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Literal

import msgspec

from bus.envelope import Envelope, WireEnvelope
from bus.errors import FrameError

__all__ = (
    "PROTOCOL_VERSION",
    "ClientFrame",
    "Err",
    "FrameReader",
    "FrameTooLarge",
    "Hello",
    "Msg",
    "Ok",
    "Ping",
    "Pong",
    "Pub",
    "Reply",
    "Req",
    "Result",
    "Role",
    "ServerFrame",
    "Sub",
    "Unsub",
    "Welcome",
    "check_payload",
    "decode_client_frame",
    "decode_server_frame",
    "encode",
    "encode_into",
    "encode_msg_into",
    "frame_limit",
)

PROTOCOL_VERSION = 1
_LEN = struct.Struct(">I")
HEADER_SIZE = _LEN.size

Role = Literal["cli", "capsule", "emit"]


class _Frame(msgspec.Struct, tag_field="t", omit_defaults=True, forbid_unknown_fields=False):
    pass


# -- client -> server --------------------------------------------------------


class Hello(_Frame, tag="hello"):
    role: str
    version: int = PROTOCOL_VERSION
    name: str | None = None
    """Free-form client name, for logs (never used for identity)."""
    principal: str | None = None
    """The principal to act for; checked against the peer's uid."""


class Pub(_Frame, tag="pub"):
    topic: str
    payload: msgspec.Raw
    cid: str | None = None
    obo: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    """On behalf of this principal: honoured only for a publisher without one
    (a capsule worker, an admin); see :meth:`bus.broker.Bus.publish_raw`."""


class Sub(_Frame, tag="sub"):
    sid: int
    pattern: str


class Unsub(_Frame, tag="unsub"):
    sid: int


class Req(_Frame, tag="req"):
    rid: int
    topic: str
    payload: msgspec.Raw
    timeout: float | None = None


class Reply(_Frame, tag="reply"):
    to: str
    payload: msgspec.Raw


class Ping(_Frame, tag="ping"):
    n: int = 0


ClientFrame = Hello | Pub | Sub | Unsub | Req | Reply | Ping


# -- server -> client --------------------------------------------------------


class Welcome(_Frame, tag="welcome"):
    uid: int
    source: str
    principal: str | None
    principals: list[str]
    max_payload: int
    max_frame: int
    version: int = PROTOCOL_VERSION


class Msg(_Frame, tag="msg"):
    sid: int
    env: WireEnvelope


class Result(_Frame, tag="result"):
    rid: int
    env: WireEnvelope | None = None
    code: str | None = None
    message: str | None = None


class Ok(_Frame, tag="ok"):
    sid: int


class Err(_Frame, tag="err"):
    code: str
    message: str
    sid: int | None = None
    """The subscription the error is about, if any."""
    fatal: bool = False
    """The server closes the connection after a fatal error."""


class Pong(_Frame, tag="pong"):
    n: int = 0


ServerFrame = Welcome | Msg | Result | Ok | Err | Pong

_encoder = msgspec.json.Encoder()
_client_decoder = msgspec.json.Decoder(ClientFrame)
_server_decoder = msgspec.json.Decoder(ServerFrame)


FRAME_OVERHEAD = 64 * 1024
"""Room in a frame for everything but the payload."""


def frame_limit(max_payload: int) -> int:
    """The hard frame limit for a bus whose payloads may be ``max_payload`` bytes."""
    return max_payload + FRAME_OVERHEAD


def encode(frame: _Frame) -> bytes:
    """One frame: length prefix and JSON body."""
    body = _encoder.encode(frame)
    return _LEN.pack(len(body)) + body


def encode_into(frame: _Frame, buffer: bytearray) -> None:
    """Append one frame to ``buffer`` (no intermediate copies of the body)."""
    start = len(buffer)
    buffer.extend(b"\0\0\0\0")
    _encoder.encode_into(frame, buffer, -1)
    _LEN.pack_into(buffer, start, len(buffer) - start - HEADER_SIZE)


class _EnvelopeMeta(msgspec.Struct, omit_defaults=True, gc=False):
    """An envelope's fields but the payload, for splicing the payload in as raw JSON."""

    id: int
    topic: str
    source: str
    principal: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    ts: float = 0.0


_last_msg: list[object] = [None, b""]


def encode_msg_into(sid: int, envelope: Envelope, buffer: bytearray) -> None:
    """Append a Msg frame for ``envelope`` (the same bytes ``encode(Msg(...))`` decodes to).

    The envelope's part of the body is built once and reused while the same
    envelope fans out to several remote subscribers; the payload's JSON text
    is spliced in as it is, never re-encoded.
    """
    if _last_msg[0] is not envelope:
        meta = _encoder.encode(
            _EnvelopeMeta(
                envelope.id,
                envelope.topic,
                envelope.source,
                envelope.principal,
                envelope.correlation_id,
                envelope.reply_to,
                envelope.ts,
            )
        )
        _last_msg[0] = envelope
        _last_msg[1] = b',"env":{"payload":' + envelope.payload + b"," + meta[1:] + b"}"
    tail: bytes = _last_msg[1]  # type: ignore[assignment]
    head = b'{"t":"msg","sid":%d' % sid
    buffer += _LEN.pack(len(head) + len(tail))
    buffer += head
    buffer += tail


def _decode(decoder: msgspec.json.Decoder[Any], body: bytes | memoryview) -> object:
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        if "at `$.t`" in text or "Object missing required field `t`" in text:
            raise FrameError(f"unknown frame type: {text}", code="unknown_type") from exc
        raise FrameError(f"invalid frame: {text}") from exc
    except msgspec.DecodeError as exc:
        raise FrameError(f"frame is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise FrameError("frame is nested too deeply") from exc


def check_payload(payload: bytes) -> None:
    """Raise FrameError ``bad_payload`` unless ``payload`` is UTF-8 (RFC 8259 JSON text is).

    The frame decoder checks a payload's JSON syntax and escapes (a lone
    surrogate such as ``"\\ud800"`` is a ``bad_frame``) but not the bytes
    inside its strings, so bytes that are not UTF-8 would pass on to every
    subscriber, whose decoding then fails.  Checked for every payload a peer
    sends (pub, req, reply)."""
    try:
        payload.decode()
    except UnicodeDecodeError as exc:
        raise FrameError(
            f"payload is not UTF-8 JSON text: {exc.reason} at byte {exc.start}", code="bad_payload"
        ) from None


_PUB_PREFIX = b'{"t":"pub",'
_MSG_PREFIX = b'{"t":"msg",'
_pub_decoder = msgspec.json.Decoder(Pub)
_msg_decoder = msgspec.json.Decoder(Msg)


def decode_client_frame(body: bytes | memoryview) -> ClientFrame:
    """One client frame; publishes as our encoder writes them take a faster, Pub-only decoder."""
    if body[:11] == _PUB_PREFIX:
        return _decode(_pub_decoder, body)  # type: ignore[return-value]
    return _decode(_client_decoder, body)  # type: ignore[return-value]


def decode_server_frame(body: bytes | memoryview) -> ServerFrame:
    """One server frame; messages as our encoder writes them take a faster, Msg-only decoder."""
    if body[:11] == _MSG_PREFIX:
        return _decode(_msg_decoder, body)  # type: ignore[return-value]
    return _decode(_server_decoder, body)  # type: ignore[return-value]


class FrameTooLarge(msgspec.Struct, frozen=True):
    """Reported by FrameReader for a frame over the limit; its body is skipped."""

    size: int
    limit: int


class FrameReader:
    """Bytes in, frame bodies out.  Pure: no I/O, no clock."""

    __slots__ = ("_buffer", "_skip", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._skip = 0

    def feed(self, data: bytes) -> list[memoryview | FrameTooLarge]:
        """Frame bodies completed by ``data``, as views into one immutable copy."""
        out: list[memoryview | FrameTooLarge] = []
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return out
            data = data[self._skip :]
            self._skip = 0
        if self._buffer:
            self._buffer.extend(data)
            whole = bytes(self._buffer)
            self._buffer.clear()
        else:
            whole = data
        view = memoryview(whole)
        pos = 0
        end = len(whole)
        limit = self.limit
        unpack = _LEN.unpack_from
        while end - pos >= HEADER_SIZE:
            (size,) = unpack(whole, pos)
            if size > limit:
                out.append(FrameTooLarge(size, limit))
                available = end - pos - HEADER_SIZE
                if available >= size:
                    pos += HEADER_SIZE + size
                    continue
                self._skip = size - available
                pos = end
                break
            start = pos + HEADER_SIZE
            if end - start < size:
                break
            pos = start + size
            out.append(view[start:pos])
        if pos < end:
            self._buffer.extend(view[pos:])
        return out

    @property
    def buffered(self) -> int:
        return len(self._buffer)
