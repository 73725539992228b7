"""``astrid-emit``: the command Claude Code runs for a hook; forwards it to the bus.

It reads the hook payload JSON on stdin, takes the principal, session and
per-session token from ``ASTRID_PRINCIPAL_ID`` / ``ASTRID_SESSION_ID`` /
``ASTRID_HOOK_TOKEN``, and publishes ``{hook, payload, correlation_id,
principal_id, session_id, token, truncated?}`` on ``sage.v1.hook.<event>``
over the supervisor's socket (``ASTRID_SOCKET``, else the configured one).
The claims are checked by the supervisor (the token), not trusted.

It always exits 0, and soon: Claude reads a hook's exit 2 as "block the
action" and any other non-zero status as a hook error, so a hook must never
hang or break Claude, whatever its input and even when the supervisor is
down or hung.  Bounds:

- stdin: read for at most :data:`STDIN_DEADLINE` seconds and
  :data:`STDIN_LIMIT` bytes; an input cut by either, or whose JSON is over
  :data:`PAYLOAD_LIMIT` bytes, is not sent: ``payload`` is null and
  ``truncated`` true (the hook still counts as fired).  Input that is not
  JSON (binary, nested past the decoder's depth) is sent as a string.
- the bus: :data:`DEADLINE` seconds to connect, say hello and publish.
- everything: a watchdog ends the process with status 0 after
  :data:`HARD_DEADLINE` seconds, whatever is stuck.

Nothing is ever written to stdout (Claude parses a hook's stdout); what went
wrong goes to stderr, one line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import anyio
import msgspec

from bus import BusClient, BusError
from sage.claude.hooks import PAYLOAD_LIMIT
from sage.config import load_config
from sage.errors import SageError

__all__ = ("DEADLINE", "HARD_DEADLINE", "STDIN_DEADLINE", "STDIN_LIMIT", "main")

DEADLINE = 2.0
"""Seconds to connect, say hello and publish."""
STDIN_DEADLINE = 2.0
"""Seconds to read the hook input (Claude writes it at once and closes stdin)."""
STDIN_LIMIT = 4 * 1024 * 1024
"""Bytes of hook input read; a longer one is not sent (``truncated``)."""
HARD_DEADLINE = 6.0
"""Seconds after which the watchdog ends the process, status 0, whatever is stuck."""
_EVENT = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _say(message: str) -> None:
    """One line on stderr, if there is one (never stdout: Claude parses it)."""
    with contextlib.suppress(OSError):
        os.write(2, (message + "\n").encode(errors="replace"))


def _watchdog(seconds: float) -> None:
    def expire() -> None:
        _say(f"astrid-emit: gave up after {seconds:g} s; nothing more sent")
        os._exit(0)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()


def _read_stdin() -> tuple[bytes, bool]:
    """The hook input and whether it was cut (too long, or stdin never ended)."""
    try:
        if sys.stdin is None or os.isatty(0):
            return b"", False
    except OSError:  # fd 0 closed
        return b"", False
    chunks: list[bytes] = []
    size = 0
    end = time.monotonic() + STDIN_DEADLINE
    try:
        while size <= STDIN_LIMIT:
            left = end - time.monotonic()
            if left <= 0:
                _say(f"astrid-emit: gave up reading stdin after {STDIN_DEADLINE:g} s")
                return b"".join(chunks), True
            readable, _, _ = select.select([0], [], [], left)
            if not readable:
                continue
            chunk = os.read(0, 1024 * 1024)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
            size += len(chunk)
    except (OSError, ValueError) as exc:
        _say(f"astrid-emit: stdin unreadable ({type(exc).__name__})")
        return b"".join(chunks), True
    return b"", True


def _decode(raw: bytes) -> Any:
    """The hook input as JSON, else as text: never raises."""
    if not raw.strip():
        return {}
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):  # not JSON, or nested too deep
        return raw.decode(errors="replace")


def _build(event: str, payload: Any, truncated: bool) -> dict[str, Any]:
    envelope: dict[str, Any] = {
        "hook": event,
        "payload": None if truncated else payload,
        "correlation_id": None,
        "principal_id": os.environ.get("ASTRID_PRINCIPAL_ID", ""),
        "session_id": os.environ.get("ASTRID_SESSION_ID", ""),
        "token": os.environ.get("ASTRID_HOOK_TOKEN", ""),
    }
    if truncated:
        envelope["truncated"] = True
    return envelope


async def _send(socket_path: str, topic: str, envelope: dict[str, Any]) -> None:
    with anyio.fail_after(DEADLINE):
        async with BusClient.connect(socket_path, role="emit", name="astrid-emit") as client:
            client.publish(topic, envelope)
            await client.flush()


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a bad command line, and Claude reads exit 2 from a hook
    as "block": a mistyped hook command must not stop a session, so say it and exit 0."""

    def error(self, message: str) -> NoReturn:
        _say(f"astrid-emit: {message}; nothing sent")
        raise SystemExit(0)


def _emit(argv: Sequence[str] | None) -> None:
    parser = _Parser(
        prog="astrid-emit",
        description="Forward a Claude Code hook (payload on stdin) to the sage bus. Always exits 0.",
    )
    parser.add_argument(
        "name",
        nargs="?",
        default=None,
        metavar="EVENT",
        help="hook event name, as the installer writes it (same as --event)",
    )
    parser.add_argument(
        "--event",
        "--topic",
        dest="event",
        default=None,
        help="hook event name (default: hook_event_name from the payload)",
    )
    parser.add_argument("--config", default=None, help="supervisor.toml (for the socket path)")
    args = parser.parse_args(argv)
    raw, cut = _read_stdin()
    event = args.event or args.name
    if event and event.startswith("sage.v1.hook."):
        event = event.removeprefix("sage.v1.hook.")
    payload = None if cut else _decode(raw)
    if not event and isinstance(payload, dict):
        event = payload.get("hook_event_name")
    if not isinstance(event, str) or not _EVENT.fullmatch(event):
        _say(f"astrid-emit: no valid hook event name ({str(event)[:80]!r}); nothing sent")
        return
    # an input the capsule would drop anyway (and the bus refuses an envelope
    # over [bus] max_payload): the hook is reported without it
    envelope = _build(event, payload, cut or len(raw) > PAYLOAD_LIMIT)
    try:
        socket_path = os.environ.get("ASTRID_SOCKET") or str(load_config(args.config).socket_path)
        anyio.run(_send, socket_path, f"sage.v1.hook.{event}", envelope)
    except (BusError, SageError, OSError, TimeoutError) as exc:
        _say(f"astrid-emit: hook {event} not delivered: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    """Always 0 (see the module's text)."""
    _watchdog(HARD_DEADLINE)
    try:
        _emit(argv)
    except SystemExit:  # --help, or a bad command line (already said)
        pass
    except BaseException as exc:  # a hook never fails Claude
        # the type only: the text could quote the input or a claim
        _say(f"astrid-emit: hook not delivered: {type(exc).__name__}")
    return 0
