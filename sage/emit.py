"""``astrid-emit``: the command Claude Code runs for a hook; forwards it to the bus.

It reads the hook payload JSON on stdin, takes the principal, session and
per-session token from ``ASTRID_PRINCIPAL_ID`` / ``ASTRID_SESSION_ID`` /
``ASTRID_HOOK_TOKEN``, and publishes ``{hook, payload, correlation_id,
principal_id, session_id, token}`` on ``sage.v1.hook.<event>`` over the
supervisor's socket (``ASTRID_SOCKET``, else the configured one).  It gives
up after two seconds and always exits 0: a hook must never hang or break
Claude, even when the supervisor is down.  The claims are checked by the
supervisor (the token), not trusted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import anyio
import msgspec

from bus.client import BusClient
from bus.errors import BusError
from sage.config import load_config
from sage.errors import SageError

__all__ = ("main",)

DEADLINE = 2.0
_EVENT = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _build(event: str, raw: bytes) -> dict[str, Any]:
    try:
        payload: Any = msgspec.json.decode(raw) if raw.strip() else {}
    except msgspec.DecodeError:
        payload = raw.decode(errors="replace")
    return {
        "hook": event,
        "payload": payload,
        "correlation_id": None,
        "principal_id": os.environ.get("ASTRID_PRINCIPAL_ID", ""),
        "session_id": os.environ.get("ASTRID_SESSION_ID", ""),
        "token": os.environ.get("ASTRID_HOOK_TOKEN", ""),
    }


async def _send(socket_path: str, topic: str, envelope: dict[str, Any]) -> None:
    with anyio.fail_after(DEADLINE):
        async with BusClient.connect(socket_path, role="emit", name="astrid-emit") as client:
            client.publish(topic, envelope)
            await client.flush()


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on a bad command line, and Claude reads exit 2 from a hook
    as "block": a mistyped hook command must not stop a session, so say it and exit 0."""

    def error(self, message: str) -> NoReturn:
        print(f"astrid-emit: {message}; nothing sent", file=sys.stderr)
        raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
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
    raw = sys.stdin.buffer.read(4 * 1024 * 1024) if not sys.stdin.isatty() else b""
    envelope = _build("", raw)
    event = args.event or args.name
    if event and event.startswith("sage.v1.hook."):
        event = event.removeprefix("sage.v1.hook.")
    if not event and isinstance(envelope["payload"], dict):
        event = envelope["payload"].get("hook_event_name")
    if not isinstance(event, str) or not _EVENT.fullmatch(event):
        print(f"astrid-emit: no valid hook event name ({event!r}); nothing sent", file=sys.stderr)
        return 0
    envelope["hook"] = event
    try:
        socket_path = os.environ.get("ASTRID_SOCKET") or str(load_config(args.config).socket_path)
        anyio.run(_send, socket_path, f"sage.v1.hook.{event}", envelope)
    except (BusError, SageError, OSError, TimeoutError) as exc:
        print(f"astrid-emit: hook {event} not delivered: {exc}", file=sys.stderr)
    return 0
