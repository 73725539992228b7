"""Decode throughput of sage.claude.protocol.StreamDecoder against json.loads + dict dispatch.

Input: every line of the golden transcripts, repeated to about 100k lines.
Ours is fed the bytes in 64 KiB chunks, so it pays for line framing too; the
reference gets the lines already split and does ``json.loads`` plus a dict
lookup on ``type``/``subtype``, the least a hand-written reader does.  A
second msgspec strategy (decode a ``{type, subtype}`` header, then the typed
decoder for that pair) is measured for comparison.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sage.claude.protocol import (
    AssistantMessage,
    ControlCancelRequest,
    ControlRequest,
    ControlResponse,
    ResultMessage,
    StreamDecoder,
    StreamEvent,
    SystemApiRetry,
    SystemInit,
    SystemStatus,
    UserMessage,
)
from tests.bench.report import Report

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "claude-code-2.1.328"
TARGET_LINES = 100_000
CHUNK = 64 * 1024
ROUNDS = 5


def _corpus() -> tuple[list[bytes], bytes]:
    lines = [
        line
        for path in sorted(REFERENCE.glob("*.jsonl"))
        for line in path.read_bytes().split(b"\n")
        if line
    ]
    reps = max(1, TARGET_LINES // len(lines))
    lines = lines * reps
    return lines, b"".join(line + b"\n" for line in lines)


def _best(fns: list[Callable[[], int]]) -> list[tuple[float, int]]:
    """Best time of each function over ROUNDS, the rounds interleaved so noise hits all alike."""
    best = [(float("inf"), 0)] * len(fns)
    for _ in range(ROUNDS):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            count = fn()
            best[i] = min(best[i], (time.perf_counter() - t0, count))
    return best


def _ours(blob: bytes) -> int:
    decoder = StreamDecoder(max_line_bytes=1 << 20)
    n = 0
    view = memoryview(blob)
    for i in range(0, len(blob), CHUNK):
        n += len(decoder.feed(bytes(view[i : i + CHUNK])))
    n += len(decoder.eof())
    return n


def _reference(lines: list[bytes]) -> int:
    handlers: dict[tuple[str, str | None], Callable[[dict[str, Any]], object]] = {
        ("system", "init"): lambda d: d,
        ("system", "api_retry"): lambda d: d,
        ("system", "status"): lambda d: d,
        ("assistant", None): lambda d: d,
        ("user", None): lambda d: d,
        ("result", "success"): lambda d: d,
        ("stream_event", None): lambda d: d,
        ("control_request", None): lambda d: d,
        ("control_response", None): lambda d: d,
    }
    n = 0
    for line in lines:
        d = json.loads(line)
        kind = d.get("type")
        sub = d.get("subtype") if kind in ("system", "result") else None
        handler = handlers.get((kind, sub))
        if handler is not None:
            handler(d)
            n += 1
    return n


class _Header(msgspec.Struct):
    type: str = ""
    subtype: str | None = None


def _header_first(lines: list[bytes]) -> int:
    header = msgspec.json.Decoder(_Header)
    typed: dict[tuple[str, str | None], msgspec.json.Decoder[Any]] = {
        ("system", "init"): msgspec.json.Decoder(SystemInit),
        ("system", "api_retry"): msgspec.json.Decoder(SystemApiRetry),
        ("system", "status"): msgspec.json.Decoder(SystemStatus),
    }
    for key, cls in (
        ("assistant", AssistantMessage),
        ("user", UserMessage),
        ("result", ResultMessage),
        ("stream_event", StreamEvent),
        ("control_request", ControlRequest),
        ("control_response", ControlResponse),
        ("control_cancel_request", ControlCancelRequest),
    ):
        typed[(key, None)] = msgspec.json.Decoder(cls)
    n = 0
    for line in lines:
        h = header.decode(line)
        sub = h.subtype if h.type == "system" else None
        dec = typed.get((h.type, sub))
        if dec is not None:
            dec.decode(line)
            n += 1
    return n


def run(report: Report) -> None:
    lines, blob = _corpus()
    mb = len(blob) / 1e6
    (t_ours, n_ours), (t_ref, n_ref), (t_hdr, n_hdr) = _best(
        [lambda: _ours(blob), lambda: _reference(lines), lambda: _header_first(lines)]
    )
    assert n_ours == n_ref == n_hdr == len(lines), (n_ours, n_ref, n_hdr, len(lines))
    ref = "json.loads+dispatch"
    report.add(
        "protocol",
        f"decode {len(lines):,} lines ({mb:.0f} MB), 64 KiB feeds",
        len(lines) / t_ours,
        "lines/s",
        reference=len(lines) / t_ref,
        reference_name=ref,
        goal=">= 5x",
    )
    report.add(
        "protocol",
        "decode throughput",
        mb / t_ours,
        "MB/s",
        reference=mb / t_ref,
        reference_name=ref,
        goal=">= 5x",
    )
    report.add(
        "protocol",
        "strategy: header then typed decoder",
        len(lines) / t_hdr,
        "lines/s",
        reference=len(lines) / t_ours,
        reference_name="tagged union (ours)",
        goal="informational",
    )
