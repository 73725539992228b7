"""The envelope: one published message as every subscriber sees it.

``payload`` holds the JSON text the publisher sent, as bytes, so the bus
never re-encodes it on the way to a remote subscriber; :class:`WireEnvelope`
is the same record with the payload embedded as raw JSON for the wire.
``source`` and ``principal`` are set by the bus from the publisher's verified
identity, never taken from the sender.  Envelope ids are a per-process
sequence; requests carry a separate random ``reply_to`` token.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

__all__ = ("Envelope", "WireEnvelope")

T = TypeVar("T")


class Envelope(msgspec.Struct, frozen=True, gc=False):
    id: int
    topic: str
    payload: bytes
    """The payload's JSON text."""
    source: str
    principal: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    """Set on requests: the token a responder answers with (see Bus.reply)."""
    ts: float = 0.0
    """Seconds since the epoch, when the bus accepted it."""

    def data(self) -> Any:
        """The payload decoded into Python objects."""
        return msgspec.json.decode(self.payload)

    def decode(self, type: type[T]) -> T:
        """The payload decoded into ``type`` (raises msgspec.ValidationError)."""
        return msgspec.json.decode(self.payload, type=type)

    def to_wire(self) -> WireEnvelope:
        return WireEnvelope(
            self.id,
            self.topic,
            msgspec.Raw(self.payload),
            self.source,
            self.principal,
            self.correlation_id,
            self.reply_to,
            self.ts,
        )


class WireEnvelope(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """An envelope as it is encoded: the payload is embedded JSON, not a string."""

    id: int
    topic: str
    payload: msgspec.Raw
    source: str
    principal: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    ts: float = 0.0

    def to_envelope(self) -> Envelope:
        return Envelope(
            self.id,
            self.topic,
            bytes(self.payload),
            self.source,
            self.principal,
            self.correlation_id,
            self.reply_to,
            self.ts,
        )
