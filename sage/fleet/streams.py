"""Every JetStream stream the fleet uses, the configuration each must have, and the check.

A node's NATS user may publish only on its own subjects (sage/fleet/permissions.py),
but subject permissions cannot see a header: on a stream that allows rollups one
message with ``Nats-Rollup: all`` on a node's own key erases every other node's keys.
So every stream is created here, never by nats-py's defaults (which allow rollups and
purges), with what the server must enforce for the permissions to mean anything:

- **no rollups** (``allow_rollup_hdrs`` false): no publish removes another message;
- **no purge, no message delete** (``deny_purge``, ``deny_delete``): the API calls are
  refused by the stream itself, whatever a user's permissions say; once set, no update
  can clear them (the server refuses "can not cancel deny purge"), and a stream that
  denies purges cannot allow rollups again ("roll-ups require the purge permission");
- **limits retention with no limits** but the per-subject one of a bucket (one value a
  key): a work-queue or interest stream, or a ``max_msgs``, ``max_bytes`` or ``max_age``,
  would let traffic on one's own subjects push the others' messages out;
- **file storage** and at least the configured replicas; not sealed, acked, no mirror or
  sources, no subject transform or republish (the server would publish on subjects no
  node's permissions allow), no message schedules or counters; exactly its subjects.

A node may create a stream (its user has the create call, with any configuration), so a
rogue node could create one first with weak settings: :func:`unsafe` names every setting
of a found configuration that is weaker than :data:`STREAMS` wants, and the node that
finds one does not start (``fleet_stream_unsafe``, sage/fleet/member.py, with the fix).
Nothing here touches a socket; :func:`stream_config` builds nats-py's configuration.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sage.fleet.permissions import AUDIT_STREAM, BUCKET, TOOLS_BUCKET
from sage.fleet.routes import CLAIMS, REGISTRY
from sage.fleet.transcripts import CHUNK_BYTES, TRANSCRIPTS

__all__ = (
    "STREAMS",
    "Kind",
    "StreamSpec",
    "Unsafe",
    "describe_unsafe",
    "spec_of",
    "stream_config",
    "unsafe",
)


class Kind(enum.Enum):
    BUCKET = "bucket"  # a key-value bucket: one value a key (the last)
    LOG = "log"  # the audit stream: every message kept


@dataclass(frozen=True)
class StreamSpec:
    """One stream the fleet uses: its name, subjects, kind and value bound."""

    name: str
    subjects: tuple[str, ...]
    kind: Kind
    bucket: str = ""
    """The key-value bucket it backs (``KV_<bucket>``); "" for the audit log."""
    max_msg_size: int = -1
    """The largest message it takes (-1: the server's ``max_payload``)."""
    direct: bool = True
    """Reads served by any replica (a bucket read for a decision, the transcripts, asks
    the leader instead: ``False``)."""

    @property
    def per_subject(self) -> int:
        return 1 if self.kind is Kind.BUCKET else -1


def _bucket(bucket: str, **extra: Any) -> StreamSpec:
    return StreamSpec(
        name=f"KV_{bucket}",
        subjects=(f"$KV.{bucket}.>",),
        kind=Kind.BUCKET,
        bucket=bucket,
        **extra,
    )


STREAMS: tuple[StreamSpec, ...] = (
    _bucket(BUCKET),
    _bucket(REGISTRY),
    _bucket(CLAIMS),
    _bucket(TOOLS_BUCKET),
    _bucket(TRANSCRIPTS, max_msg_size=CHUNK_BYTES + 1024, direct=False),
    StreamSpec(
        name=AUDIT_STREAM,
        subjects=tuple(f"sage.audit.*.{what}" for what in ("entry", "checkpoint", "key")),
        kind=Kind.LOG,
    ),
)
"""Every stream of the fleet, created by the first node that needs it and checked by
every node at its start."""


def spec_of(name: str) -> StreamSpec:
    """The spec of the stream (or of the bucket) ``name``."""
    for spec in STREAMS:
        if name in (spec.name, spec.bucket):
            return spec
    raise KeyError(name)


def stream_config(spec: StreamSpec, replicas: int) -> Any:
    """nats-py's configuration of ``spec`` as this node creates it."""
    from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

    return StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.LIMITS,
        max_consumers=-1,
        max_msgs=-1,
        max_bytes=-1,
        max_age=0,
        max_msgs_per_subject=spec.per_subject,
        max_msg_size=spec.max_msg_size,
        discard=DiscardPolicy.NEW if spec.kind is Kind.BUCKET else DiscardPolicy.OLD,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=120.0,
        allow_rollup_hdrs=False,
        deny_delete=True,
        deny_purge=True,
        allow_direct=spec.direct,
        allow_msg_ttl=False,
    )


@dataclass(frozen=True)
class Unsafe:
    """One setting of a found stream weaker than the fleet needs."""

    setting: str
    found: str
    wanted: str
    fix: str
    """How the NATS admin mends it: an edit (``nats stream edit`` flags), or the stream
    removed and made again by the next node that starts (its content is lost)."""
    why: str


def _value(config: Any, name: str) -> Any:
    value = getattr(config, name, None)
    return getattr(value, "value", value)  # an enum's value


def _unlimited(value: Any) -> bool:
    return value in (None, -1, 0, 0.0)


RECREATE = (
    "remove it as the NATS admin (nats stream rm {name}) and start a node, which makes it again"
)


def unsafe(spec: StreamSpec, config: Any, replicas: int) -> list[Unsafe]:
    """Every setting of ``config`` (nats-py's StreamConfig of a found stream) weaker than
    ``spec`` wants, with at least ``replicas``; empty when the stream is safe."""
    found: list[Unsafe] = []
    recreate = RECREATE.format(name=spec.name)

    def edit(flag: str) -> str:
        return f"nats stream edit {spec.name} {flag}"

    def want(ok: bool, setting: str, wanted: str, fix: str, why: str) -> None:
        if not ok:
            value = _value(config, setting)
            found.append(Unsafe(setting, repr(value), wanted, fix, why))

    want(
        sorted(_value(config, "subjects") or []) == sorted(spec.subjects),
        "subjects",
        repr(list(spec.subjects)),
        recreate,
        "other subjects than the fleet's",
    )
    want(
        not _value(config, "allow_rollup_hdrs"),
        "allow_rollup_hdrs",
        "False",
        edit("--no-allow-rollup"),
        "one message with Nats-Rollup on a node's own subject erases the others' messages",
    )
    want(
        bool(_value(config, "deny_purge")),
        "deny_purge",
        "True",
        edit("--deny-purge"),
        "a purge erases every node's messages",
    )
    want(
        bool(_value(config, "deny_delete")),
        "deny_delete",
        "True",
        edit("--deny-delete"),
        "a message delete erases another node's message",
    )
    want(
        _value(config, "retention") in (None, "limits"),
        "retention",
        "'limits'",
        recreate,
        "a work-queue or interest stream drops messages once read",
    )
    for limit in ("max_msgs", "max_bytes", "max_age"):
        flag = limit.replace("_", "-")
        want(
            _unlimited(_value(config, limit)),
            limit,
            "-1 (none)",
            edit(f"--{flag}=-1"),
            "one node's traffic pushes the others' messages out",
        )
    per_subject = _value(config, "max_msgs_per_subject")
    want(
        _unlimited(per_subject) if spec.kind is Kind.LOG else (per_subject or 0) >= 1,
        "max_msgs_per_subject",
        "-1 (none)" if spec.kind is Kind.LOG else ">= 1",
        edit("--max-msgs-per-subject=" + ("-1" if spec.kind is Kind.LOG else "1")),
        "a node's later messages push its earlier ones out",
    )
    want(
        _value(config, "storage") in (None, "file"),
        "storage",
        "'file'",
        recreate,
        "memory storage is lost when the servers restart",
    )
    want(
        (_value(config, "num_replicas") or 1) >= replicas,
        "num_replicas",
        f">= {replicas}",
        edit(f"--replicas {replicas}"),
        "fewer copies than [fleet] replicas: the loss of a server loses it",
    )
    want(not _value(config, "sealed"), "sealed", "False", recreate, "a sealed stream takes nothing")
    want(
        not _value(config, "no_ack"),
        "no_ack",
        "False",
        recreate,
        "no publish is acknowledged, so none is known stored",
    )
    for source in ("mirror", "sources", "subject_transform", "republish"):
        want(
            not _value(config, source),
            source,
            "None",
            recreate,
            "the server itself writes or publishes messages no node's permissions allow",
        )
    for feature in ("allow_msg_schedules", "allow_msg_counter"):
        want(
            not _value(config, feature),
            feature,
            "False",
            recreate,
            "the server itself writes messages no node's permissions allow",
        )
    return found


def describe_unsafe(spec: StreamSpec, found: Iterable[Unsafe]) -> str:
    """One line naming each weak setting of ``spec``'s stream, and the fix."""
    items = list(found)
    settings = "; ".join(f"{u.setting} is {u.found}, wants {u.wanted} ({u.why})" for u in items)
    fixes: list[str] = []
    for u in items:
        if u.fix not in fixes:
            fixes.append(u.fix)
    return f"stream {spec.name} is weaker than the fleet needs: {settings}; fix: {'; '.join(fixes)}"
