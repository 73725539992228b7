"""`make transcripts` works: a fresh recording from the real CLI decodes as the
committed golden transcripts do, with nothing unknown and no host path left."""

from __future__ import annotations

from pathlib import Path

import pytest

from sage.claude.binary import read_claude_version
from sage.claude.protocol import StreamDecoder
from tests.e2e.record import HOME, STANDIN, normalize, record
from tests.support.transcripts import EXPECTED_KINDS, PINNED, REFERENCE


@pytest.mark.anyio
async def test_a_fresh_recording_decodes_like_the_committed_one(
    claude_bin: Path, tmp_path: Path
) -> None:
    pinned = await read_claude_version(claude_bin) == PINNED  # others may order lines otherwise
    out = await record(claude_bin, tmp_path / "out")
    names = sorted(p.name for p in out.glob("*.jsonl"))
    assert set(EXPECTED_KINDS) <= set(names)
    if pinned:
        assert names == sorted(EXPECTED_KINDS) == sorted(p.name for p in REFERENCE.glob("*.jsonl"))
    for name in names:
        data = (out / name).read_bytes()
        assert b"/tmp/sage-record-" not in data
        assert str(tmp_path).encode() not in data
        decoder = StreamDecoder()
        kinds = [e.kind for e in decoder.feed(data) + decoder.eof()]
        assert "system/init" in kinds, name
        assert decoder.counters.invalid == 0, name
        if pinned:
            assert kinds == EXPECTED_KINDS[name], name
            assert decoder.counters.unknown == 0, name


def test_normalize_rewrites_home_and_standin(tmp_path: Path) -> None:
    raw = f'{{"cwd":"{tmp_path}","u":"http://127.0.0.1:4711/v1","x":"127.0.0.1:47110"}}'
    out = normalize(raw.encode(), tmp_path, 4711)
    assert out == f'{{"cwd":"{HOME}","u":"http://{STANDIN}/v1","x":"127.0.0.1:47110"}}\n'.encode()
