"""The fleet audit's shell: a node streams its audit log to JetStream, and the fleet is verified.

Three parts, run by the supervisor of a node in a fleet (docs/fleet.md#fleet-audit):

- :class:`AuditStreamer` takes every committed batch and checkpoint from the
  audit log (``AuditLog.on_commit`` / ``on_checkpoint``) into a bounded
  in-memory queue, and one publisher task sends them, in order, to the
  ``sage_audit`` stream (sans-IO wire format and checks: sage/fleet/audit_check.py).
  The local audit path never waits for NATS: offering is a deque append.  When
  a publish fails (NATS gone) or the queue is full, the queue is dropped (the
  full queue is logged, ``fleet.audit_queue_full``) and the publisher catches
  up from the node's own SQLite log, from the last seq the stream holds for the
  node: nothing is lost.  A publish whose ack was lost may be stored twice: the
  copies are identical, and verify takes that.  No message carries a
  ``Nats-Msg-Id``: the stream's duplicate window is one for every node, so an id a
  node could predict would let another publish it first on its own subject and
  have the server drop the genuine entry as a duplicate.
- :meth:`FleetAudit.answer_verify` answers on the node's own subject
  ``sage.fleet.<node>.audit.verify``: it verifies its local log (as ``astrid
  audit verify``) and compares every local row with what the stream holds of
  it (:func:`sage.fleet.audit_check.compare_local`).
- :meth:`FleetAudit.verify_fleet` answers ``sage.v1.request.audit.verify_fleet``
  (``astrid audit verify --fleet``): it reads the whole stream, checks every
  node's chain and checkpoint signatures against the key the node streamed,
  and asks every live node for its comparison.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import anyio
import msgspec
import structlog
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from sage import replies
from sage.audit.chain import Checkpoint, CheckpointRow, EntryRow
from sage.audit.store import read_checkpoints, read_entries, verify_audit
from sage.contract.codes import ErrorCode
from sage.errors import FleetError, FleetNotFound, FleetUnavailable, NotInFleet
from sage.fleet.audit_check import (
    Comparison,
    FleetFailure,
    StreamBook,
    StreamedCheckpoint,
    StreamedEntry,
    StreamedKey,
    compare_local,
    first_failure,
    history_gone,
    subject_of,
    verify_subject,
)
from sage.fleet.member import FleetMember, open_stream
from sage.fleet.nats_errors import code_of, describe, nats_errors
from sage.fleet.nodes import NodeState
from sage.fleet.permissions import AUDIT_STREAM
from sage.fleet.streams import spec_of

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

__all__ = ("VERIFY_FLEET_TOPIC", "AuditStreamer", "FleetAudit", "read_book", "verify_fleet_reply")

log = structlog.get_logger("sage.fleet")

VERIFY_FLEET_TOPIC: Final = "sage.v1.request.audit.verify_fleet"
QUEUE_MAX: Final = 10_000
"""Entries and checkpoints waiting for the publisher; past this, it catches up from SQLite."""
RETRY_EVERY: Final = 1.0
PUBLISH_TIMEOUT: Final = 5.0
CHUNK: Final = 500
FETCH_BATCH: Final = 256
ASK_TIMEOUT: Final = 20.0
"""Seconds a node is given to compare its local log with the stream."""
_HEADROOM: Final = 2048
"""Bytes left for headers under the server's max_payload."""

_Item = tuple[Literal["entry", "checkpoint"], tuple[Any, ...]]


def _raw_key(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


async def read_book(
    js: JetStreamContext, subjects: list[str] | None = None, book: StreamBook | None = None
) -> StreamBook:
    """Every message of the stream (or of ``subjects``) fed to a book, through an
    ephemeral consumer of our own (no acks; deleted at the end, or by the server
    once idle)."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    book = book if book is not None else StreamBook()
    name = f"sage_audit_{secrets.token_hex(8)}"
    config = ConsumerConfig(
        name=name,
        filter_subjects=subjects,
        ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.ALL,
        inactive_threshold=60.0,
        mem_storage=True,
        num_replicas=1,
    )
    info = await js.add_consumer(AUDIT_STREAM, config)
    try:
        pending = info.num_pending or 0
        if pending:
            sub = await js.pull_subscribe_bind(consumer=name, stream=AUDIT_STREAM)
            try:
                unready = 0
                while pending:
                    try:
                        with nats_errors(f"the {AUDIT_STREAM} stream"):
                            msgs = await sub.fetch(min(FETCH_BATCH, pending), timeout=5.0)
                    except FleetUnavailable as exc:
                        # a consumer just made may not serve yet on its server: no responders
                        if not exc.not_ready:
                            raise
                        unready += 1
                        if unready > 20:
                            raise
                        await anyio.sleep(0.1)
                        continue
                    for msg in msgs:
                        meta = msg.metadata
                        book.feed(msg.subject, msg.data, meta.sequence.stream)
                        pending = meta.num_pending
            finally:
                with contextlib.suppress(FleetError), nats_errors("the consumer's unsubscribe"):
                    await sub.unsubscribe()
    finally:
        with (
            anyio.move_on_after(2.0, shield=True),
            contextlib.suppress(FleetError),
            nats_errors("the consumer's delete"),
        ):
            await js.delete_consumer(AUDIT_STREAM, name)
    return book


class AuditStreamer:
    """The node's audit entries and checkpoints, on their way to the stream."""

    def __init__(
        self,
        member: FleetMember,
        path: Path,
        public_key: Ed25519PublicKey,
        *,
        queue_max: int = QUEUE_MAX,
    ) -> None:
        self.node = member.node
        self._member = member
        self._path = path
        self._key = _raw_key(public_key)
        self._queue: deque[_Item] = deque()
        self._queue_max = queue_max
        self._wake = anyio.Event()
        self.behind = True
        """The queue does not hold all that is not streamed: catch up from SQLite first."""
        self.sent_seq = 0
        """The last entry seq the stream holds of this node, as far as we know."""
        self.sent_size = 0
        """The size of the last checkpoint streamed."""
        self.published = 0
        self.overflows = 0
        self.catch_ups = 0
        self._failing = False
        self._stream_ready = False

    # -- the audit log's side (never blocks) ----------------------------------------------

    def offer_rows(self, rows: list[EntryRow]) -> None:
        for row in rows:
            self._offer(("entry", row))

    def offer_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._offer(("checkpoint", checkpoint.as_row()))

    def _offer(self, item: _Item) -> None:
        if self.behind:  # the catch-up reads it from SQLite
            return
        if len(self._queue) >= self._queue_max:
            self.behind = True
            self.overflows += 1
            self._queue.clear()
            log.warning(
                "fleet.audit_queue_full",
                node=self.node,
                queue_max=self._queue_max,
                sent_seq=self.sent_seq,
                then="catching up from the local audit log",
            )
            self._wake.set()
            return
        self._queue.append(item)
        self._wake.set()

    def stats(self) -> dict[str, int | bool]:
        return {
            "sent_seq": self.sent_seq,
            "queued": len(self._queue),
            "published": self.published,
            "overflows": self.overflows,
            "catch_ups": self.catch_ups,
            "behind": self.behind,
        }

    # -- the publisher --------------------------------------------------------------------

    async def run(self) -> None:
        """Publish for ever; after a failure, catch up from SQLite once NATS answers."""
        while True:
            try:
                if self.behind:
                    await self._catch_up()
                elif self._queue:
                    kind, row = self._queue.popleft()
                    await self._send(kind, row)
                else:
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
            except Exception as exc:  # the publisher outlives any error: it catches up later
                self.behind = True
                self._stream_ready = False  # the stream may be gone: made again (checked)
                self._queue.clear()
                if not self._failing:
                    log.warning(
                        "fleet.audit_stream_failed",
                        node=self.node,
                        code=code_of(exc),
                        error=describe(exc),
                    )
                self._failing = True
                await anyio.sleep(RETRY_EVERY)
                continue
            if self._failing and not self.behind:
                log.info("fleet.audit_stream_resumed", node=self.node, sent_seq=self.sent_seq)
                self._failing = False

    async def _catch_up(self) -> None:
        js = self._member.jetstream
        self._queue.clear()
        self.behind = False  # from here on the queue takes what is committed
        if not self._stream_ready:  # made (or checked) at the join; made again if gone
            await open_stream(js, self._member.config, spec_of(AUDIT_STREAM))
            self._stream_ready = True
        await self._ensure_key(js)
        self.sent_seq = await self._last(js, "entry")
        self.sent_size = await self._last(js, "checkpoint")
        checkpoints: deque[CheckpointRow] = deque(
            await anyio.to_thread.run_sync(read_checkpoints, self._path, self.sent_size)
        )
        start = self.sent_seq
        while checkpoints and checkpoints[0][0] <= self.sent_seq:
            await self._send("checkpoint", checkpoints.popleft())
        while True:
            rows = await anyio.to_thread.run_sync(read_entries, self._path, self.sent_seq, CHUNK)
            for row in rows:
                await self._send("entry", row)
                while checkpoints and checkpoints[0][0] <= row[0]:
                    await self._send("checkpoint", checkpoints.popleft())
            if len(rows) < CHUNK:
                break
        self.catch_ups += 1
        log.info("fleet.audit_caught_up", node=self.node, since=start, sent_seq=self.sent_seq)

    async def _ensure_key(self, js: JetStreamContext) -> None:
        subject = subject_of(self.node, "key")
        try:
            with nats_errors(f"the {AUDIT_STREAM} stream"):
                last = await js.get_last_msg(AUDIT_STREAM, subject)
            known: bytes | None = msgspec.json.decode(last.data or b"", type=StreamedKey).key
        except FleetNotFound:
            known = None
        except (msgspec.DecodeError, msgspec.ValidationError):
            known = None
        if known == self._key:
            return
        data = msgspec.json.encode(StreamedKey(key=self._key, ts=time.time_ns()))
        await js.publish(subject, data, timeout=PUBLISH_TIMEOUT)

    async def _last(self, js: JetStreamContext, kind: Literal["entry", "checkpoint"]) -> int:
        """The last seq (entry) or size (checkpoint) the stream holds of this node."""
        try:
            with nats_errors(f"the {AUDIT_STREAM} stream"):
                last = await js.get_last_msg(AUDIT_STREAM, subject_of(self.node, kind))
        except FleetNotFound:
            return 0
        try:
            if kind == "entry":
                return msgspec.json.decode(last.data or b"", type=StreamedEntry).seq
            return msgspec.json.decode(last.data or b"", type=StreamedCheckpoint).size
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.error("fleet.audit_stream_unreadable", node=self.node, kind=kind, error=str(exc))
            return 0

    async def _send(self, kind: Literal["entry", "checkpoint"], row: tuple[Any, ...]) -> None:
        js = self._member.jetstream
        if kind == "entry":
            seq = int(row[0])
            if seq <= self.sent_seq:
                return
            if seq != self.sent_seq + 1:  # something was not queued: read it from SQLite
                self.behind = True
                return
            entry_row: EntryRow = row
            data = msgspec.json.encode(StreamedEntry.of(entry_row))
            limit = self._member.nats.max_payload - _HEADROOM
            if len(data) > limit:
                data = msgspec.json.encode(StreamedEntry.of(entry_row, with_payload=False))
                log.warning("fleet.audit_payload_left_out", node=self.node, seq=seq, limit=limit)
            await js.publish(subject_of(self.node, "entry"), data, timeout=PUBLISH_TIMEOUT)
            self.sent_seq = seq
        else:
            size = int(row[0])
            if size <= self.sent_size:
                return
            if size > self.sent_seq:
                self.behind = True
                return
            size_, head, signature, ts = row
            data = msgspec.json.encode(
                StreamedCheckpoint(
                    size=size_, head_hash=bytes(head), signature=bytes(signature), ts=ts
                )
            )
            await js.publish(subject_of(self.node, "checkpoint"), data, timeout=PUBLISH_TIMEOUT)
            self.sent_size = size
        self.published += 1


def _compare_file(path: Path, streamed: dict[int, bytes]) -> Comparison:
    def rows() -> Iterator[EntryRow]:
        after = 0
        while True:
            chunk = read_entries(path, after, CHUNK)
            yield from chunk
            if len(chunk) < CHUNK:
                return
            after = chunk[-1][0]

    return compare_local(rows(), streamed)


class FleetAudit:
    """The node's part of the fleet audit: its streamer, its answers, the fleet's verify."""

    def __init__(
        self,
        member: FleetMember,
        path: Path,
        public_key: Ed25519PublicKey,
        max_unsigned: int,
        *,
        queue_max: int = QUEUE_MAX,
    ) -> None:
        self.member = member
        self.node = member.node
        self.path = path
        self.public_key = public_key
        self.max_unsigned = max_unsigned
        self.streamer = AuditStreamer(member, path, public_key, queue_max=queue_max)

    async def run(self) -> None:
        """Stream and answer for ever."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.streamer.run)
            tg.start_soon(self.answer_verify)

    async def answer_verify(self) -> None:
        """Answer ``sage.fleet.<node>.audit.verify``, one request at a time, for ever
        (a failure of the subscription is logged and it is made again)."""
        while True:
            try:
                await self._answer_verify()
            except Exception as exc:  # the answer outlives any error: subscribed again
                log.warning(
                    "fleet.audit_verify_failed",
                    node=self.node,
                    code=code_of(exc),
                    error=describe(exc),
                )
            await anyio.sleep(RETRY_EVERY)

    async def _answer_verify(self) -> None:
        with nats_errors("the verify subscription"):
            sub = await self.member.nats.subscribe(verify_subject(self.node))
        try:
            async for msg in sub.messages:
                if not msg.reply:
                    continue
                try:
                    with nats_errors(f"the {AUDIT_STREAM} stream"):
                        comparison = await self.compare()
                    reply = replies.ok(node=self.node, **msgspec.to_builtins(comparison))
                except Exception as exc:  # each request is answered, whatever broke
                    log.warning("fleet.audit_compare_failed", node=self.node, code=code_of(exc))
                    reply = replies.error(ErrorCode.AUDIT_UNREADABLE, describe(exc), node=self.node)
                with contextlib.suppress(FleetError), nats_errors("an answer"):
                    await msg.respond(msgspec.json.encode(reply))
        finally:
            with (
                anyio.move_on_after(1.0, shield=True),
                contextlib.suppress(FleetError),
                nats_errors("the unsubscribe"),
            ):
                await sub.unsubscribe()

    async def compare(self) -> Comparison:
        """Verify the local log, and compare it with what the stream holds of this node.

        The stream is read first: what it holds was committed locally before."""
        subjects = [subject_of(self.node, k) for k in ("entry", "checkpoint", "key")]
        book = await read_book(self.member.jetstream, subjects)
        report = await anyio.to_thread.run_sync(
            lambda: verify_audit(self.path, self.public_key, max_unsigned=self.max_unsigned)
        )
        comparison = await anyio.to_thread.run_sync(
            _compare_file, self.path, book.streamed_hashes(self.node)
        )
        failures: list[FleetFailure | None] = [comparison.failure]
        if report.failure is not None:
            found = report.failure
            failures.insert(
                0,
                FleetFailure(
                    kind=str(found.kind),
                    seq=found.seq,
                    reason=found.reason,
                    entry_kind=found.entry_kind,
                    where="local",
                ),
            )
        streamed_key = book.key_of(self.node)
        if streamed_key is not None and streamed_key != _raw_key(self.public_key):
            failures.append(
                FleetFailure(
                    kind="diverged",
                    seq=0,
                    reason="the key the stream holds for this node is not its checkpoint key",
                    where="local",
                )
            )
        return msgspec.structs.replace(comparison, failure=first_failure(*failures))


def _decode_answer(data: bytes) -> Comparison | str:
    try:
        reply = replies.parse(data)
        return msgspec.convert(reply, Comparison)
    except replies.ReplyError as exc:
        return str(exc)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        return f"an answer that is not a comparison: {describe(exc)}"


async def _ask(member: FleetMember, node: str) -> Comparison | str:
    try:
        with nats_errors(f"node {node}'s comparison"), anyio.fail_after(ASK_TIMEOUT + 1.0):
            msg = await member.nats.request(verify_subject(node), b"{}", timeout=ASK_TIMEOUT)
    except FleetError as exc:
        return f"no answer: {describe(exc)}"
    return _decode_answer(msg.data)


async def verify_fleet_reply(member: FleetMember | None) -> dict[str, Any]:
    """Read the whole stream, verify every node's chain and checkpoints from it, and
    ask every live node to compare its local log with it (never raises)."""
    try:
        return await _verify_fleet(member)
    except Exception as exc:  # the supervisor's responder must outlive any surprise
        log.error("fleet.audit_verify_failed", code=code_of(exc), error=describe(exc))
        return replies.error(
            ErrorCode.INTERNAL_ERROR, f"fleet audit verify failed: {describe(exc)}"
        )


async def _verify_fleet(member: FleetMember | None) -> dict[str, Any]:
    if member is None:
        return replies.from_error(
            NotInFleet("this supervisor is not in a fleet (its config has no [fleet])")
        )
    if not member.connected:
        return replies.error(
            "fleet_unavailable", f"cannot read the {AUDIT_STREAM} stream now: NATS is not connected"
        )
    try:
        with nats_errors(f"the {AUDIT_STREAM} stream"), anyio.fail_after(60.0):
            book = await read_book(member.jetstream)
            views = await member.nodes()
    except FleetError as exc:
        return replies.error(
            ErrorCode.FLEET_UNAVAILABLE,
            f"cannot read the {AUDIT_STREAM} stream now: {describe(exc)}",
        )
    live = sorted(view.node for view in views if view.state is NodeState.LIVE)
    gone = {
        view.node: history_gone(view.node, view.state.value)
        for view in views
        if view.state is not NodeState.LIVE and view.node not in book.nodes
    }
    answers: dict[str, Comparison | str] = {}

    async def ask(node: str) -> None:
        answers[node] = await _ask(member, node)

    async with anyio.create_task_group() as tg:
        for node in live:
            tg.start_soon(ask, node)
    nodes = []
    for name in sorted(set(book.nodes) | set(live) | set(gone)):
        verdict = book.verdict(name)
        answer = answers.get(name)
        local = answer if isinstance(answer, Comparison) else None
        failure = first_failure(gone.get(name), verdict.failure, local.failure if local else None)
        nodes.append(
            {
                "node": name,
                "live": name in live,
                "ok": failure is None,
                "stream": {
                    "entries": verdict.entries,
                    "checkpoints": verdict.checkpoints,
                    "head_seq": verdict.head_seq,
                    "unsigned_tail": verdict.unsigned_tail,
                    "opaque": verdict.opaque,
                },
                "local": None
                if local is None
                else {
                    "entries": local.entries,
                    "head_seq": local.head_seq,
                    "compared": local.compared,
                    "unstreamed": local.unstreamed,
                },
                "local_error": answer if isinstance(answer, str) else None,
                "failure": None if failure is None else msgspec.to_builtins(failure),
            }
        )
    unchecked = [name for name in live if not isinstance(answers.get(name), Comparison)]
    intact = all(node["ok"] for node in nodes) and not book.strays
    return replies.ok(
        node=member.node,
        intact=intact,
        complete=not unchecked,
        messages=book.messages,
        nodes=nodes,
        strays=book.strays,
        unchecked=unchecked,
    )
