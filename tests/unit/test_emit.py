"""astrid-emit's own pieces, without a supervisor: the frames it writes are the bus's,
the hook input goes as the bus takes it, the command line never exits 2, and it
imports nothing but the standard library's C modules (it starts for every hook)."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from bus.wire import FrameReader, Hello, Ping, Pub, decode_client_frame
from sage.claude import emit
from sage.claude.hooks import PAYLOAD_LIMIT


def _frames(data: bytes) -> list[object]:
    bodies = FrameReader(1 << 20).feed(data)
    return [decode_client_frame(bytes(b)) for b in bodies]  # type: ignore[arg-type]


def test_the_frames_are_the_wire_protocols() -> None:
    """hello (role emit), then pub and ping: what BusClient.connect, publish and flush send."""
    (hello,) = _frames(emit.HELLO)
    assert hello == Hello(role="emit", version=1, name="astrid-emit")
    env = emit.envelope("Stop", b'{"hook_event_name":"Stop"}')
    pub, ping = _frames(emit.publish_frames("sage.v1.hook.Stop", env))
    assert isinstance(pub, Pub)
    assert pub.topic == "sage.v1.hook.Stop"
    assert bytes(pub.payload) == env
    assert (pub.cid, pub.obo) == (None, None)
    assert ping == Ping(1)


def test_the_envelope_carries_the_environments_claims(monkeypatch: pytest.MonkeyPatch) -> None:
    """principal, session and token come from the child's environment, quoted as JSON."""
    monkeypatch.setenv("ASTRID_PRINCIPAL_ID", "alice")
    monkeypatch.setenv("ASTRID_SESSION_ID", 'repl-"x"')
    monkeypatch.setenv("ASTRID_HOOK_TOKEN", "t\u00e9")
    data = msgspec.json.decode(emit.envelope("Stop", b"[1]"))
    assert data == {
        "hook": "Stop",
        "payload": [1],
        "correlation_id": None,
        "principal_id": "alice",
        "session_id": 'repl-"x"',
        "token": "t\u00e9",
    }
    assert msgspec.json.decode(emit.envelope("Stop", None))["truncated"] is True


@pytest.mark.parametrize(
    ("raw", "sent"),
    [
        (b'{"hook_event_name": "Stop", "n": 1.5e3}', b'{"hook_event_name": "Stop", "n": 1.5e3}'),
        (b"  [1, 2]\n", b"  [1, 2]\n"),
        (b"", b"{}"),
        (b" \n", b"{}"),
        (b"not json", b'"not json"'),
        (b'{"a": NaN}', b'"{\\"a\\": NaN}"'),
        (b'{"a": 1} x', b'"{\\"a\\": 1} x"'),
        (b'{"a": "\\ud800"}', b'"{\\"a\\": \\"\\\\ud800\\"}"'),
        (b'{"a": "\\ud83d\\ude00"}', '{"a": "\U0001f600"}'.encode()),
        (b'"\xff"', b'"\\"\\ufffd\\""'),
        (b'{"a": "tab\there"}', b'"{\\"a\\": \\"tab\\there\\"}"'),
    ],
)
def test_the_hook_input_goes_as_its_own_json_or_as_a_string(raw: bytes, sent: bytes) -> None:
    """Valid JSON is sent as its text; what the bus would refuse (not JSON, not UTF-8,
    NaN, a lone surrogate, a raw control character) goes as a string."""
    out = emit.payload_json(raw)
    assert out == sent
    msgspec.json.decode(out)  # the bus's decoder takes it


def test_a_deeply_nested_input_goes_as_a_string() -> None:
    """Past the decoder's depth: a string (cut by the payload limit later), no crash."""
    raw = b"[" * 100_000 + b"]" * 100_000
    assert emit.payload_json(raw).startswith(b'"[[[')


def test_the_payload_limit_is_the_capsules() -> None:
    """astrid-emit leaves out what the hooks capsule would drop anyway."""
    assert emit.PAYLOAD_LIMIT == PAYLOAD_LIMIT


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["PreToolUse"], {"event": "PreToolUse", "config": None}),
        (["--event", "Stop"], {"event": "Stop", "config": None}),
        (["--topic=sage.v1.hook.Stop"], {"event": "sage.v1.hook.Stop", "config": None}),
        (["--config", "a.toml", "X"], {"event": "X", "config": "a.toml"}),
        (["--event=Y", "X"], {"event": "Y", "config": None}),
        ([], {"event": None, "config": None}),
        (["X", "--help"], None),
    ],
)
def test_the_command_line(argv: list[str], parsed: dict[str, str | None] | None) -> None:
    """argparse's options, parsed by hand (argparse costs the start milliseconds)."""
    assert emit.parse_args(argv) == parsed


@pytest.mark.parametrize("argv", [["--no-such-flag"], ["A", "B"], ["--event"], ["-x"]])
def test_a_bad_command_line_is_refused_without_an_exit(argv: list[str]) -> None:
    """Said on stderr by the caller, never exit 2 (Claude's "block")."""
    with pytest.raises(emit.BadCommandLine):
        emit.parse_args(argv)


def test_it_imports_only_the_standard_librarys_small_modules() -> None:
    """The start of every REPL hook: no msgspec, anyio, bus, config, json, re or argparse."""
    code = "import sys, sage.claude.emit; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-I", "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = set(out.stdout.split())
    for heavy in ("msgspec", "anyio", "bus", "sage.config", "json", "re", "argparse", "enum"):
        assert heavy not in loaded, heavy
    assert {"_json", "_socket"} <= loaded


def test_help_goes_to_stdout_and_exits_0() -> None:
    """``astrid-emit --help`` is for a person; it sends nothing."""
    out = subprocess.run(
        [sys.executable, "-m", "sage.claude.emit", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0
    assert out.stdout.startswith("usage: astrid-emit")
    assert json.dumps(out.stderr) == '""'
