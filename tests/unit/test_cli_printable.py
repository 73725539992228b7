"""What reaches the operator's terminal from others' text cannot drive the terminal."""

from __future__ import annotations

import pytest

from sage.cli import main
from sage.cli._common import printable


def test_controls_are_shown_not_obeyed() -> None:
    assert printable("a\x1b[2Kb\rc\nd\te\x7f\x9b") == "a\\x1b[2Kb\\x0dc\\x0ad\\x09e\\x7f\\x9b"
    assert printable("line\n\tindented\x1b]0;title\x07", lines=True) == (
        "line\n\tindented\\x1b]0;title\\x07"
    )
    assert printable("plain, ünïcode ✓") == "plain, ünïcode ✓"
    assert printable(42) == "42"


def test_an_error_line_is_printed_escaped(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--config", "/nonexistent/\x1b[2K\x1b]0;pwned\x07.toml"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert "\\x1b[2K" in err


class _FleetClient:
    """The local supervisor's router, answering a spawn with what another node said."""

    def __init__(self, reply: dict[str, object]) -> None:
        self.reply = reply

    async def request(self, topic: str, payload: object, deadline: float) -> object:
        import json
        from types import SimpleNamespace

        assert topic == "sage.v1.request.fleet.spawn"
        return SimpleNamespace(payload=json.dumps(self.reply).encode())


def _answered(monkeypatch: pytest.MonkeyPatch, reply: dict[str, object]) -> None:
    import contextlib
    from collections.abc import AsyncIterator

    from sage.cli import sage_cmd

    @contextlib.asynccontextmanager
    async def connect(args: object) -> AsyncIterator[_FleetClient]:
        yield _FleetClient(reply)

    monkeypatch.setattr(sage_cmd, "connect", connect)


HOSTILE = "\x1b]0;pwned\x07\x1b[2K\rall is well"


def test_another_nodes_warning_and_refusals_are_printed_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A spawn's warning and a placement_failed's reasons come from other nodes: shown
    with their controls escaped, never obeyed."""
    placed = {"ok": True, "session_id": "s1", "node": "b", "placed": True, "warning": HOSTILE}
    _answered(monkeypatch, placed)
    assert main(["sage", "spawn", "alice", "--node", "any"]) == 0
    out = capsys.readouterr()
    assert out.out == "s1\n"
    assert "\x1b" not in out.err
    assert "\r" not in out.err
    assert "astrid: \\x1b]0;pwned\\x07\\x1b[2K\\x0dall is well\n" in out.err

    refused = f"no node of the fleet may take a session of 'alice' (b: host_full: {HOSTILE})"
    _answered(monkeypatch, {"ok": False, "error": "placement_failed", "message": refused})
    assert main(["sage", "spawn", "alice", "--node", "any"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err
    assert "(b: host_full: \\x1b]0;pwned\\x07" in err


def test_another_nodes_listing_rows_are_printed_escaped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fleet-wide listing: rows, end reasons and the warning of other nodes."""
    from sage.cli import sage_cmd

    row = {
        "session_id": "s1",
        "principal_id": "alice",
        "node": f"b{HOSTILE}",
        "state": "ended",
        "reason": HOSTILE,
        "turns": HOSTILE,
        "started_at": 0.0,
    }
    listing = {"ok": True, "sessions": [row], "warning": HOSTILE}

    class Client(_FleetClient):
        async def request(self, topic: str, payload: object, deadline: float) -> object:
            import json
            from types import SimpleNamespace

            return SimpleNamespace(payload=json.dumps(self.reply).encode())

    import contextlib

    @contextlib.asynccontextmanager
    async def connect(args: object):  # type: ignore[no-untyped-def]
        yield Client(listing)

    monkeypatch.setattr(sage_cmd, "connect", connect)
    assert main(["sage", "sessions", "--all"]) == 0
    out = capsys.readouterr()
    assert "\x1b" not in out.out + out.err
    assert "\r" not in out.out + out.err
    assert out.out.count("\\x1b]0;pwned") == 3
    assert "astrid: \\x1b]0;pwned" in out.err
