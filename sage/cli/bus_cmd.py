"""``astrid bus pub|sub|request``: the topic bus from a terminal."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import msgspec

from bus import BusError, Envelope
from sage.cli._commands import summary
from sage.cli._common import add_common
from sage.cli._connect import connect, print_json
from sage.errors import SageError


def register(sub: Any) -> None:
    group = sub.add_parser("bus", help=summary("bus"))
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)

    pub = commands.add_parser(
        "pub",
        help="publish one message",
        description="Publish PAYLOAD (JSON; '-' reads it from stdin) on TOPIC. Exit 1 if refused.",
    )
    pub.add_argument("topic", metavar="TOPIC", help="a concrete topic, e.g. demo.hello")
    pub.add_argument(
        "payload", metavar="PAYLOAD", nargs="?", default="{}", help="JSON payload (default {})"
    )
    pub.add_argument(
        "--principal", default=None, help="act for this principal (must be allowed for your uid)"
    )
    add_common(pub)
    pub.set_defaults(handler=_pub)

    sub_ = commands.add_parser(
        "sub",
        help="print matching envelopes as JSON lines",
        description="Subscribe to PATTERN ('*' one token, '>' the rest) and print each envelope as one JSON line.",
    )
    sub_.add_argument("pattern", metavar="PATTERN", help="e.g. 'demo.>'")
    sub_.add_argument("-n", "--count", type=int, default=0, help="exit after N envelopes")
    sub_.add_argument("--principal", default=None, help="act for this principal")
    add_common(sub_, json_output=False)
    sub_.set_defaults(handler=_sub)

    req = commands.add_parser(
        "request",
        help="send a request and print the reply",
        description="Publish a request on TOPIC and print the first reply's payload as JSON.",
    )
    req.add_argument("topic", metavar="TOPIC")
    req.add_argument("payload", metavar="PAYLOAD", nargs="?", default="{}")
    req.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    req.add_argument("--principal", default=None, help="act for this principal")
    add_common(req)
    req.set_defaults(handler=_request)


def _payload(text: str) -> bytes:
    data = sys.stdin.buffer.read() if text == "-" else text.encode()
    try:
        msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise SageError(f"payload is not valid JSON: {exc}") from None
    return data.strip()


async def _pub(args: argparse.Namespace) -> int:
    payload = _payload(args.payload)
    async with connect(args) as client:
        client.publish_raw(args.topic, payload)
        await client.flush()
    if args.json:
        print_json({"ok": True, "topic": args.topic})
    return 0


def envelope_line(envelope: Envelope) -> str:
    """One envelope as a JSON line, whatever its payload.

    The server refuses payloads that are not UTF-8 JSON text, but an
    in-process publisher is not checked: such a payload is printed as a
    string (undecodable bytes as U+FFFD) with ``"bad_payload": true``, so one
    bad envelope never ends a ``sub`` nor breaks its JSON lines."""
    try:
        envelope.payload.decode()
        msgspec.json.decode(envelope.payload)
    except (UnicodeDecodeError, msgspec.DecodeError, RecursionError):
        fields = {
            "id": envelope.id,
            "topic": envelope.topic,
            "payload": envelope.payload.decode(errors="replace"),
            "bad_payload": True,
            "source": envelope.source,
            "principal": envelope.principal,
            "correlation_id": envelope.correlation_id,
            "reply_to": envelope.reply_to,
            "ts": envelope.ts,
        }
        return msgspec.json.encode({k: v for k, v in fields.items() if v is not None}).decode()
    return msgspec.json.encode(envelope.to_wire()).decode()


async def _sub(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        subscription = await client.subscribe(args.pattern)
        seen = 0
        out = sys.stdout
        try:
            async for envelope in subscription:
                out.write(envelope_line(envelope) + "\n")
                out.flush()
                seen += 1
                if args.count and seen >= args.count:
                    break
        except BusError as exc:
            raise SageError(f"subscription ended: {exc}") from exc
    return 0


async def _request(args: argparse.Namespace) -> int:
    payload = _payload(args.payload)
    async with connect(args) as client:
        reply = await client.request_raw(args.topic, payload, deadline=args.timeout)
    if args.json:
        sys.stdout.write(envelope_line(reply) + "\n")
    else:
        sys.stdout.write(reply.payload.decode(errors="replace") + "\n")
    return 0
