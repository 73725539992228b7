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
