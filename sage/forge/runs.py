"""Run ids, run manifests, x-redact masking, the runs folder's caps, artifact pages.

``runs/<run_id>/run_manifest.json`` per call (cache hits included), with
``artifacts/`` next to it for the sandbox's stdout spill.  Inputs go in with
every ``x-redact: true`` property (nested objects and array items too)
replaced by ``"<redacted>"``.

Retention (:meth:`RunStore.enforce`, after every run is written): a
principal's runs may hold ``[forge] runs_max_bytes_per_principal`` bytes,
the whole folder ``runs_max_bytes``.  A principal over its quota loses its
own oldest runs first; a folder over its cap then loses the oldest run of
the principal holding the most bytes, again and again, so one principal's
flood of spilling calls never evicts a quieter principal's runs.  A run in
use (being written, its manifest just written, or an artifact being read)
is never pruned.  Each pass that removed something is one ``runs_pruned``
audit entry ``{reason, count, bytes, principals: [{principal, count,
bytes}], total_bytes, ...}``.  Sizes are the files' apparent sizes.
"""

from __future__ import annotations

import base64
import contextlib
import os
import re
import shutil
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from sage.errors import ForgeError
from sage.files import private_dir, write_replace
from sage.redaction import REDACTED

__all__ = (
    "ARTIFACT",
    "PAGE_DEFAULT",
    "PAGE_MAX",
    "RunInfo",
    "RunStore",
    "mask_input",
    "new_run_id",
)

RUN_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "_" + os.urandom(4).hex()


def mask_input(schema: Any, value: Any) -> Any:
    """``value`` with the schema's ``x-redact: true`` fields replaced."""
    if not isinstance(schema, dict):
        return value
    if schema.get("x-redact") is True:
        return REDACTED
    if isinstance(value, dict):
        props = schema.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = schema.get("additionalProperties")
        return {
            k: mask_input(props.get(k, extra if isinstance(extra, dict) else None), v)
            for k, v in value.items()
        }
    if isinstance(value, list):
        items = schema.get("items")
        return [mask_input(items, v) for v in value]
    return value


ARTIFACT = "full_stdout.bin"
"""The one artifact a run keeps: its whole stdout, when it passed the output cap."""
PAGE_DEFAULT = 16 * 1024
"""Bytes of an artifact one ``read_artifact`` page holds when the call names no limit."""
PAGE_MAX = 32 * 1024
"""Bytes one page holds at most (a larger limit is clamped): a page is one tool result,
and Claude Code cuts a tool result past 25000 tokens (``MAX_MCP_OUTPUT_TOKENS``); 32 KiB
is at most 64 Ki characters as JSON text (see :func:`decode_page`), 44 Ki as base64."""
_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""Characters JSON spells as six (``\u0000``): a page holding one goes as base64."""

Emit = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class RunInfo:
    """One run folder as the retention sees it."""

    run_id: str
    principal: str | None
    session_id: str | None
    bytes: int
    mtime: float
    """When its manifest was written (the folder's mtime for a run without one)."""

    def row(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "principal_id": self.principal,
            "session_id": self.session_id,
            "bytes": self.bytes,
        }


def _tree_bytes(path: Path) -> int:
    """Apparent bytes of the files under ``path`` (symlinks not followed)."""
    total = 0
    for folder, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(folder, name))
                if stat.S_ISREG(st.st_mode):
                    total += st.st_size
    return total


def _by_principal(runs: list[RunInfo]) -> list[dict[str, Any]]:
    count: Counter[str | None] = Counter()
    size: Counter[str | None] = Counter()
    for run in runs:
        count[run.principal] += 1
        size[run.principal] += run.bytes
    return [{"principal": p, "count": count[p], "bytes": size[p]} for p in count]


def decode_page(data: bytes, *, at_end: bool) -> tuple[str, str, int]:
    """``(text, encoding, bytes used)`` of one page of an artifact.

    UTF-8 text without control characters (tab, CR and LF aside) comes back
    as text (``encoding: "utf-8"``); a character cut by the page's end is
    left for the next page (fewer bytes used).  Anything else (binary, a page
    that starts inside a character, control characters) is base64
    (``encoding: "base64"``) of the whole page.
    """
    text: str | None = None
    used = len(data)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        cut = exc.start
        cut_at_end = cut > 0 and cut >= len(data) - 3  # a character the page end cut
        if not at_end and exc.reason == "unexpected end of data" and cut_at_end:
            try:
                text, used = data[:cut].decode("utf-8"), cut
            except UnicodeDecodeError:
                text = None
    if text is not None and not _CONTROLS.search(text):
        return text, "utf-8", used
    return base64.b64encode(data).decode("ascii"), "base64", len(data)


class RunStore:
    """``runs/``: manifests, artifacts, their retention and paged reads.

    The index of run folders (per principal, oldest first) is built from the
    disk at the first write or prune and kept up to date by this process;
    :meth:`prune` builds it again, so runs removed by hand are forgotten.
    """

    def __init__(self, directory: Path, emit: Emit | None = None) -> None:
        self.directory = directory
        self.emit: Emit = emit if emit is not None else (lambda event, payload: None)
        self._lock = threading.RLock()
        self._busy: Counter[str] = Counter()
        self._runs: dict[str | None, dict[str, RunInfo]] | None = None
        self._usage: Counter[str | None] = Counter()
        self._total = 0

    def artifacts(self, run_id: str) -> Path:
        return private_dir(self.directory / run_id / "artifacts")

    @contextlib.contextmanager
    def using(self, run_id: str) -> Iterator[None]:
        """While inside, the run is in use: no pruning removes it."""
        with self._lock:
            self._busy[run_id] += 1
        try:
            yield
        finally:
            with self._lock:
                self._busy[run_id] -= 1
                if self._busy[run_id] <= 0:
                    del self._busy[run_id]

    def write(self, run_id: str, manifest: dict[str, Any], *, durable: bool = True) -> Path:
        """Write the manifest; ``durable=False`` skips the fsyncs (see ``write_replace``).

        The run joins the retention's index (its size is its folder's).
        """
        path = self.directory / run_id / "run_manifest.json"
        write_replace(path, msgspec.json.format(msgspec.json.encode(manifest)), durable=durable)
        principal = manifest.get("principal_id")
        session = manifest.get("session_id")
        with self._lock:
            if self._runs is not None:
                self._forget(run_id)
                self._add(
                    RunInfo(
                        run_id,
                        principal if isinstance(principal, str) else None,
                        session if isinstance(session, str) else None,
                        _tree_bytes(self.directory / run_id),
                        time.time(),
                    )
                )
        return path

    def read(self, run_id: str) -> dict[str, Any] | None:
        if not RUN_ID_RE.match(run_id):
            return None
        try:
            data = msgspec.json.decode((self.directory / run_id / "run_manifest.json").read_bytes())
        except (OSError, msgspec.DecodeError):
            return None
        return data if isinstance(data, dict) else None

    def recent(
        self, name: str | None = None, limit: int = 20, *, principal: str | None = None
    ) -> list[dict[str, Any]]:
        """Summaries, newest first; of one tool and one principal when given."""
        if not self.directory.is_dir():
            return []
        out: list[dict[str, Any]] = []
        for run in sorted(self.directory.iterdir(), reverse=True):
            manifest = self.read(run.name)
            if manifest is None or (name is not None and manifest.get("tool") != name):
                continue
            if principal is not None and manifest.get("principal_id") != principal:
                continue
            out.append(
                {
                    k: manifest.get(k)
                    for k in (
                        "run_id",
                        "tool",
                        "scope",
                        "principal_id",
                        "session_id",
                        "ok",
                        "duration_ms",
                        "cache",
                    )
                }
            )
            if len(out) >= limit:
                break
        with self._lock:
            self._load()
            for row in out:
                info = self._find(str(row["run_id"]))
                row["bytes"] = None if info is None else info.bytes
        return out

    def usage(self, principal: str | None = None) -> dict[str, Any]:
        """Bytes and runs held, in all and per principal (one principal's when given)."""
        with self._lock:
            self._load()
            assert self._runs is not None
            rows = [
                {"principal": p, "count": len(runs), "bytes": self._usage[p]}
                for p, runs in self._runs.items()
                if runs and (principal is None or p == principal)
            ]
        return {"total_bytes": sum(r["bytes"] for r in rows), "principals": rows}

    # -- the index ---------------------------------------------------------------

    def _load(self, *, again: bool = False) -> None:
        """Build the index from the disk (once, or ``again``); the caller holds the lock."""
        if self._runs is not None and not again:
            return
        found: list[RunInfo] = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            entries = []
        for entry in entries:
            if not RUN_ID_RE.match(entry.name) or not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            manifest = self.read(entry.name) or {}
            try:
                mtime = os.lstat(path / "run_manifest.json").st_mtime
            except OSError:  # a run being written, or one a crash cut short
                try:
                    mtime = entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    continue
            principal = manifest.get("principal_id")
            session = manifest.get("session_id")
            found.append(
                RunInfo(
                    entry.name,
                    principal if isinstance(principal, str) else None,
                    session if isinstance(session, str) else None,
                    _tree_bytes(path),
                    mtime,
                )
            )
        self._runs, self._usage, self._total = {}, Counter(), 0
        for info in sorted(found, key=lambda r: (r.mtime, r.run_id)):
            self._add(info)

    def _add(self, info: RunInfo) -> None:
        assert self._runs is not None
        self._runs.setdefault(info.principal, {})[info.run_id] = info
        self._usage[info.principal] += info.bytes
        self._total += info.bytes

    def _find(self, run_id: str) -> RunInfo | None:
        assert self._runs is not None
        for runs in self._runs.values():
            if run_id in runs:
                return runs[run_id]
        return None

    def _forget(self, run_id: str) -> RunInfo | None:
        info = self._find(run_id)
        if info is not None:
            assert self._runs is not None
            del self._runs[info.principal][run_id]
            self._usage[info.principal] -= info.bytes
            self._total -= info.bytes
        return info

    def _oldest(self, principal: str | None) -> RunInfo | None:
        """The principal's oldest run not in use."""
        assert self._runs is not None
        for run_id, info in self._runs.get(principal, {}).items():
            if run_id not in self._busy:
                return info
        return None

    def _remove(self, info: RunInfo) -> bool:
        """Delete a run's folder and forget it; False if some of it stayed."""
        self._forget(info.run_id)
        path = self.directory / info.run_id
        shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)

    def _audit(self, reason: str, removed: list[RunInfo], failed: int, **extra: Any) -> None:
        if not removed:
            return
        payload: dict[str, Any] = {
            "reason": reason,
            "count": len(removed),
            "bytes": sum(r.bytes for r in removed),
            "principals": _by_principal(removed),
            "total_bytes": self._total,
            **extra,
        }
        if failed:
            payload["failed"] = failed
        self.emit("runs_pruned", payload)

    # -- retention -------------------------------------------------------------

    def enforce(self, max_bytes: int, quota: int) -> None:
        """Prune to the caps: each principal to ``quota``, then the folder to ``max_bytes``."""
        with self._lock:
            self._load()
            assert self._runs is not None
            removed: list[RunInfo] = []
            failed = 0
            for principal in list(self._runs):
                while self._usage[principal] > quota:
                    oldest = self._oldest(principal)
                    if oldest is None:
                        break
                    removed.append(oldest)
                    failed += not self._remove(oldest)
            self._audit("principal_quota", removed, failed, quota=quota)
            removed, failed = [], 0
            while self._total > max_bytes:
                heaviest = [(self._usage[p], p) for p in self._runs if self._oldest(p) is not None]
                if not heaviest:
                    break
                _, principal = max(heaviest, key=lambda up: up[0])
                oldest = self._oldest(principal)
                assert oldest is not None
                removed.append(oldest)
                failed += not self._remove(oldest)
            self._audit("total_cap", removed, failed, max_bytes=max_bytes)

    def prune(
        self,
        *,
        principal: str | None = None,
        older_than: float | None = None,
        keep_bytes: int | None = None,
        dry_run: bool = False,
        by: str | None = None,
    ) -> list[RunInfo]:
        """An operator's prune: runs (of ``principal``, else all) older than ``older_than``
        seconds, then the oldest until the rest hold at most ``keep_bytes``; what went
        (or would go, ``dry_run``).  Runs in use are kept."""
        if older_than is None and keep_bytes is None:
            raise ForgeError("bad_request", "give older_than, keep_bytes or both")
        if older_than is not None and older_than < 0:
            raise ForgeError("bad_request", "older_than must be 0 or more seconds")
        if keep_bytes is not None and keep_bytes < 0:
            raise ForgeError("bad_request", "keep_bytes must be 0 or more")
        with self._lock:
            self._load(again=True)
            assert self._runs is not None
            chosen = sorted(
                (
                    info
                    for p, runs in self._runs.items()
                    if principal is None or p == principal
                    for info in runs.values()
                ),
                key=lambda r: (r.mtime, r.run_id),
            )
            held = sum(r.bytes for r in chosen)
            now = time.time()
            going: list[RunInfo] = []
            for info in chosen:
                if info.run_id in self._busy:
                    continue
                old = older_than is not None and now - info.mtime > older_than
                big = keep_bytes is not None and held > keep_bytes
                if old or big:
                    going.append(info)
                    held -= info.bytes
            if dry_run:
                return going
            failed = sum(not self._remove(info) for info in going)
            self._audit(
                "manual",
                going,
                failed,
                by=by,
                principal=principal,
                older_than=older_than,
                keep_bytes=keep_bytes,
            )
            return going

    # -- artifacts -------------------------------------------------------------

    def read_page(self, run_id: str, offset: int, limit: int) -> dict[str, Any]:
        """One page of the run's stdout artifact (the caller checked that it may read it)."""
        path = self.directory / run_id / "artifacts" / ARTIFACT
        with self.using(run_id):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                raise ForgeError(
                    "no_artifact", f"run {run_id!r} kept no artifact (its output fit the cap)"
                ) from None
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    raise ForgeError("no_artifact", f"run {run_id!r} kept no artifact")
                total = st.st_size
                data = os.pread(fd, limit, offset) if offset < total else b""
            finally:
                os.close(fd)
        text, encoding, used = decode_page(data, at_end=offset + len(data) >= total)
        next_offset = min(offset, total) + used
        return {
            "run_id": run_id,
            "offset": offset,
            "next_offset": next_offset,
            "eof": next_offset >= total,
            "total_bytes": total,
            "bytes": used,
            "encoding": encoding,
            "text": text,
        }
