"""The replicated transcripts in the ``sage_transcripts`` bucket, each node's under its name.

A node's copy of a session's transcript is the values ``<node>.<sid>.0`` ..
``<node>.<sid>.<n-1>`` (each at most :data:`~sage.fleet.transcripts.CHUNK_BYTES`),
then ``<node>.<sid>.meta`` (a :class:`~sage.fleet.transcripts.TranscriptMeta` naming
the chunks' count and their digest), written in that order, so a copy is whole once
its meta names it.  A node's NATS user may write only ``$KV.sage_transcripts.<node>.>``
(sage/fleet/permissions.py): no node replaces or deletes another's copy, and a copy
a node plants under its own name is read only when that node's session is adopted
(it is that node's word, as the session is: sage/fleet/failover.py).  The stream
allows no rollup, purge or message delete (sage/fleet/streams.py); a copy goes by
delete markers on its own keys.

Reads go to the stream's leader (the bucket is made without direct gets), so an
adopter reads the last copy the lost node stored; a read that meets chunks of a later
copy (a put under way) finds the digest wrong and reads again.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import TYPE_CHECKING

import msgspec
import structlog

from sage.errors import FleetNotFound
from sage.fleet.nats_errors import nats_errors
from sage.fleet.transcripts import (
    CHUNK_BYTES,
    TRANSCRIPTS,
    TranscriptMeta,
    TranscriptRefused,
    check_meta,
    chunk_key,
    meta_key,
)

if TYPE_CHECKING:
    from nats.js.kv import KeyValue

__all__ = ("TranscriptStore",)

log = structlog.get_logger("sage.fleet.failover")

READS = 3
"""Tries of a read that meets a copy being replaced."""


class TranscriptStore:
    """This node's copies, and any node's as read (see the module docstring)."""

    def __init__(self, kv: KeyValue, node: str) -> None:
        self.kv = kv
        self.node = node
        self._chunks: dict[str, int] = {}
        """sid -> the chunks of this node's last copy put (its later chunks, past a
        shorter copy's, are deleted)."""

    async def put(self, sid: str, data: bytes, meta: TranscriptMeta) -> TranscriptMeta:
        """Store ``data`` as this node's copy of ``sid``'s transcript; the meta stored."""
        count = -(-len(data) // CHUNK_BYTES)
        meta = msgspec.structs.replace(
            meta,
            node=self.node,
            size=len(data),
            chunks=count,
            sha256=hashlib.sha256(data).hexdigest(),
        )
        before = self._chunks.get(sid)
        if before is None:
            before = await self._count(self.node, sid)
        with nats_errors(f"the {TRANSCRIPTS} bucket"):
            for index in range(count):
                chunk = data[index * CHUNK_BYTES : (index + 1) * CHUNK_BYTES]
                await self.kv.put(chunk_key(self.node, sid, index), chunk)
            await self.kv.put(meta_key(self.node, sid), meta.encode().encode())
        self._chunks[sid] = count
        for index in range(count, before):  # a shorter copy than the last
            with contextlib.suppress(FleetNotFound), nats_errors(f"the {TRANSCRIPTS} bucket"):
                await self.kv.delete(chunk_key(self.node, sid, index))
        return meta

    async def _count(self, node: str, sid: str) -> int:
        text = await self._meta_text(node, sid)
        if text is None:
            return 0
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            return max(0, msgspec.json.decode(text, type=TranscriptMeta).chunks)
        return 0

    async def _meta_text(self, node: str, sid: str) -> str | None:
        try:
            with nats_errors(f"the {TRANSCRIPTS} bucket"):
                entry = await self.kv.get(meta_key(node, sid))
        except FleetNotFound:
            return None
        return (entry.value or b"").decode(errors="replace")

    async def get(
        self, node: str, sid: str, principal_id: str, limit: int
    ) -> tuple[TranscriptMeta, bytes] | None:
        """``node``'s copy of ``sid``'s transcript, checked to be about ``sid`` of
        ``principal_id`` and at most ``limit`` bytes (else TranscriptRefused, the size
        checked before any chunk is read); None: it has none."""
        for _ in range(READS):
            text = await self._meta_text(node, sid)
            if text is None:
                return None
            meta = check_meta(sid, principal_id, text)
            if meta.size > limit:  # never fetched: a node could have put anything there
                raise TranscriptRefused(
                    f"transcript of {sid!r}: {meta.size} bytes, over the {limit} allowed"
                )
            parts: list[bytes] = []
            try:
                with nats_errors(f"the {TRANSCRIPTS} bucket"):
                    for index in range(meta.chunks):
                        entry = await self.kv.get(chunk_key(node, sid, index))
                        parts.append(bytes(entry.value or b"")[: CHUNK_BYTES + 1])
            except FleetNotFound:
                continue  # replaced or deleted meanwhile
            data = b"".join(parts)
            if len(data) == meta.size and hashlib.sha256(data).hexdigest() == meta.sha256:
                return meta, data
            log.debug("fleet.transcript_changing", session_id=sid, node=node)
        raise TranscriptRefused(
            f"transcript of {sid!r} on node {node!r}: its chunks do not match its digest"
        )

    async def delete(self, sid: str) -> None:
        """Delete this node's copy of ``sid``'s transcript (its meta first)."""
        count = self._chunks.pop(sid, None)
        if count is None:
            count = await self._count(self.node, sid)
        for key in [
            meta_key(self.node, sid),
            *(chunk_key(self.node, sid, i) for i in range(count)),
        ]:
            with contextlib.suppress(FleetNotFound), nats_errors(f"the {TRANSCRIPTS} bucket"):
                await self.kv.delete(key)
