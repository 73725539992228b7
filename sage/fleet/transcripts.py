"""A session's conversation as the fleet keeps it: where the CLI writes it, and reading and
writing it without following a principal's links (docs/fleet.md, "Failover").

The CLI keeps a session's conversation as a JSONL transcript under the
principal's home (where: :mod:`sage.claude.conversation`).  After each finished turn a node with ``[sessions]
resume = true`` puts that file into the ``sage_transcripts`` key-value bucket under
keys of its own name (:func:`chunk_key`, :func:`meta_key`: ``<node>.<sid>.<i>`` for
each :data:`CHUNK_BYTES` of it, then ``<node>.<sid>.meta``, a :class:`TranscriptMeta`
with the chunks' count and digest), so a node's user writes its own copies only and
an adopter reads the copy of the node it takes the session from
(sage/fleet/transcript_store.py); the adopter writes it back under the principal's
home there before ``claude --resume``.

The home and everything in it belong to the principal's children, so a
hostile principal may have put a link, a FIFO or a huge file where the
transcript should be.  :func:`read_transcript` opens each folder from the home
down with ``O_NOFOLLOW`` and the file with ``O_NOFOLLOW | O_NONBLOCK``, takes only
a regular file owned by the children's uid and at most ``limit`` bytes;
:func:`restore_transcript` writes through :func:`sage.claude.homes.write_in_home`
(no link followed, the file new and renamed into place, 0600, the child's).
Every id and path that comes from the bucket is checked here first
(:func:`check_meta`, :func:`transcript_rel`).
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import msgspec

from sage.claude.conversation import TranscriptRefused, escape_cwd, transcript_rel
from sage.config import MODEL_PATTERN, NAME_PATTERN

__all__ = (
    "CHUNK_BYTES",
    "TRANSCRIPTS",
    "TRANSCRIPTS_STREAM",
    "TranscriptMeta",
    "TranscriptRefused",
    "check_meta",
    "chunk_key",
    "escape_cwd",
    "meta_key",
    "read_transcript",
    "restore_transcript",
    "transcript_rel",
)

TRANSCRIPTS = "sage_transcripts"
"""The key-value bucket of the replicated transcripts: ``<node>.<sid>.<part>``."""
TRANSCRIPTS_STREAM = f"KV_{TRANSCRIPTS}"
CHUNK_BYTES = 256 * 1024
"""A transcript is stored in values of at most this many bytes (the bucket takes no
larger message: NATS's ``max_payload`` is 1 MiB by default)."""


def chunk_key(node: str, sid: str, index: int) -> str:
    """The key of ``node``'s ``index``-th chunk of ``sid``'s transcript (checked names)."""
    return f"{node}.{sid}.{index}"


def meta_key(node: str, sid: str) -> str:
    """The key of ``node``'s description of its copy of ``sid``'s transcript, written
    after its chunks: a copy is whole once this names them."""
    return f"{node}.{sid}.meta"


_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
_NAME = re.compile(NAME_PATTERN)
_MODEL = re.compile(MODEL_PATTERN)
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


class TranscriptMeta(msgspec.Struct, frozen=True, kw_only=True):
    """What a resume on another node needs besides the transcript (the object's description)."""

    session_id: str
    principal_id: str
    claude_session: str
    cwd: str
    """The working folder the spawn chose (resolved); empty: the principal's home."""
    model: str
    node: str
    """The node that put it."""
    turns: int
    size: int
    cost_usd: float = 0.0
    """Of the session so far (older replicas: 0)."""
    started_at: float = 0.0
    """When the session was spawned (older replicas: 0, the adopter's now)."""
    chunks: int = 0
    """How many values of at most :data:`CHUNK_BYTES` hold it (``<node>.<sid>.0`` on)."""
    sha256: str = ""
    """The hex digest of the whole transcript: chunks of a later copy read meanwhile
    do not pass for this one."""

    def encode(self) -> str:
        return msgspec.json.encode(self).decode()


def check_meta(sid: str, principal_id: str, text: str | None) -> TranscriptMeta:
    """The object's description decoded, if it is about ``sid`` of ``principal_id`` and
    every field is what a spawn could have chosen; else TranscriptRefused."""
    try:
        meta = msgspec.json.decode((text or "").encode(), type=TranscriptMeta)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TranscriptRefused(f"transcript of {sid!r}: unusable description ({exc})") from None
    if meta.session_id != sid or meta.principal_id != principal_id:
        raise TranscriptRefused(
            f"transcript of {sid!r}: it says session {meta.session_id!r} of {meta.principal_id!r}"
        )
    if not _UUID.match(meta.claude_session):
        raise TranscriptRefused(f"transcript of {sid!r}: claude_session is not a uuid")
    if meta.cwd and (
        not os.path.isabs(meta.cwd) or "\0" in meta.cwd or ".." in meta.cwd.split("/")
    ):
        raise TranscriptRefused(f"transcript of {sid!r}: cwd {meta.cwd[:200]!r} is not a folder")
    if meta.model and not _MODEL.match(meta.model):
        raise TranscriptRefused(f"transcript of {sid!r}: model is not a model name")
    if not _NAME.match(meta.node) or meta.turns < 0 or meta.size < 0:
        raise TranscriptRefused(f"transcript of {sid!r}: node, turns or size unusable")
    if meta.chunks != -(-meta.size // CHUNK_BYTES) or not _SHA256.match(meta.sha256):
        raise TranscriptRefused(f"transcript of {sid!r}: chunks or digest unusable")
    if not (0 <= meta.cost_usd <= 1e9) or not (0 <= meta.started_at <= time.time() + 60):
        raise TranscriptRefused(f"transcript of {sid!r}: cost or start time unusable")
    return meta


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def read_transcript(home: Path, rel: Path, owner: int, limit: int) -> bytes:
    """The transcript at ``home/rel``: a regular file owned by ``owner`` of at most
    ``limit`` bytes, reached without following a link; else TranscriptRefused
    (FileNotFoundError: there is none yet)."""
    where = home / rel
    fds: list[int] = []
    try:
        try:
            fds.append(os.open(home, _DIR_FLAGS))
            for part in rel.parts[:-1]:
                fds.append(os.open(part, _DIR_FLAGS, dir_fd=fds[-1]))
            fd = os.open(
                rel.parts[-1],
                os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                dir_fd=fds[-1],
            )
        except FileNotFoundError:
            raise
        except OSError as exc:  # ELOOP: a link; ENOTDIR: a file where a folder should be
            raise TranscriptRefused(f"{where}: not opened ({exc.strerror})") from None
        fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TranscriptRefused(f"{where}: not a regular file")
        if st.st_uid != owner:
            raise TranscriptRefused(f"{where}: owned by uid {st.st_uid}, not {owner}")
        if st.st_size > limit:
            raise TranscriptRefused(f"{where}: {st.st_size} bytes, over the {limit} allowed")
        chunks: list[bytes] = []
        got = 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > limit:  # it grew while read
            raise TranscriptRefused(f"{where}: over the {limit} bytes allowed")
        return b"".join(chunks)
    finally:
        for fd in reversed(fds):
            os.close(fd)


def restore_transcript(home: Path, rel: Path, data: bytes, uid: int, gid: int) -> None:
    """Write ``data`` at ``home/rel`` (0600, ``uid:gid``), folders made without following a
    link; the home must be there already and not be a link."""
    from sage.claude.homes import write_in_home

    if rel.is_absolute() or ".." in rel.parts or len(rel.parts) != 4:
        raise TranscriptRefused(f"{rel}: not a transcript path")
    try:
        write_in_home(home, rel, data, uid, gid, mode=0o600)
    except OSError as exc:
        raise TranscriptRefused(f"{home / rel}: not written ({exc.strerror or exc})") from None
