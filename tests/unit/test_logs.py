"""Logging: JSON lines on stderr, secret-named values redacted."""

from __future__ import annotations

import json

import pytest
import structlog

from sage.logs import configure_logging, redact_secrets


def test_redacts_secret_named_keys() -> None:
    """Values of token, api_key, password-like keys never reach the output."""
    event = {
        "event": "x",
        "hook_token": "abc",
        "ANTHROPIC_API_KEY": "sk-1",
        "password": "p",
        "user": "alice",
        "input_tokens": 12,
        "nested": {"privateKey": "k", "ok": 1},
    }
    out = redact_secrets(None, "info", event)
    assert out == {
        "event": "x",
        "hook_token": "<redacted>",
        "ANTHROPIC_API_KEY": "<redacted>",
        "password": "<redacted>",
        "user": "alice",
        "input_tokens": 12,
        "nested": {"privateKey": "<redacted>", "ok": 1},
    }


def test_json_lines_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """Each log call is one JSON object with level and timestamp; debug is filtered at info."""
    configure_logging("info")
    try:
        log = structlog.get_logger("t")
        log.debug("hidden")
        log.info("shown", principal="alice", token="s3cret")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1
        record = json.loads(lines[0])
        assert record["event"] == "shown"
        assert record["level"] == "info"
        assert record["principal"] == "alice"
        assert record["token"] == "<redacted>"
        assert "s3cret" not in lines[0]
        assert "timestamp" in record
    finally:
        structlog.reset_defaults()


_LOOP_ERROR = """
import asyncio
from sage.logs import configure_logging, log_loop_errors

async def main():
    log_loop_errors()
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    future.cancel()
    loop.call_soon(future.set_result, None)  # what a racing I/O callback does
    await asyncio.sleep(0.05)

configure_logging("info")
asyncio.run(main())
"""


def test_asyncio_loop_errors_are_json_log_lines() -> None:
    """An exception in a loop callback is one JSON line (asyncio.error), not a raw traceback."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", _LOOP_ERROR], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    event = json.loads(line)
    assert (event["event"], event["level"]) == ("asyncio.error", "error")
    assert "InvalidStateError" in event["error"]
    assert "InvalidStateError" in event["exception"]
    assert "Future.set_result" in event["handle"]
