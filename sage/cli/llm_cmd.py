"""``astrid llm generate|describe``: one completion from the ``llm`` capsule, in a terminal.

``generate`` subscribes to ``llm.v1.stream.sage`` before it sends the
request (so no delta is missed), keeps the events of its own request id,
prints text deltas as they come and exits with the terminal event: 0 on
``Done``, 1 with the ``Error`` message on stderr.  Ctrl-C publishes
``llm.v1.request.cancel.<request_id>`` and waits briefly for the provider
to confirm; a second Ctrl-C leaves at once.  Exit 130 when cancelled.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import uuid
from typing import Any

import anyio
import msgspec

from bus import BusClient, NoResponders, RemoteSubscription
from sage import replies
from sage.cli._commands import summary
from sage.cli._common import add_common
from sage.cli._connect import config_of, connect, print_json
from sage.errors import SageError
from sage.replies import ReplyError

__all__ = ("register",)

GENERATE = "llm.v1.request.generate.sage"
STREAM = "llm.v1.stream.sage"
DESCRIBE = "llm.v1.request.describe"
ACCEPT_DEADLINE = 10.0
CANCEL_GRACE = 5.0
"""Seconds to wait for the provider's ``cancelled`` after a Ctrl-C."""
_NO_PROVIDER = "no completion provider is running (is `llm` in supervisor.capsules?)"


def register(sub: Any) -> None:
    group = sub.add_parser(
        "llm",
        help=summary("llm"),
        description=(
            "Ask the supervisor's completion provider (the `llm` capsule) for one"
            " completion. The API key is the principal's own (astrid sage install) or the"
            " operator's; model and max_tokens default to [llm] in supervisor.toml."
        ),
    )
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)

    generate = commands.add_parser(
        "generate",
        help="stream a completion of PROMPT to the terminal",
        description=(
            "Send PROMPT ('-' reads it from stdin) as one user message and print the"
            " reply as it streams. Exit 0 when it is done, 1 with the provider's error"
            " message, 130 when cancelled with Ctrl-C (which asks the provider to stop)."
        ),
        epilog='Example: astrid llm generate --model claude-haiku-4-5 "Name three rivers."',
    )
    generate.add_argument("prompt", metavar="PROMPT", help="the user message ('-': stdin)")
    generate.add_argument("--model", help="a model the provider offers (see `astrid llm describe`)")
    generate.add_argument("--system", metavar="TEXT", help="a system prompt")
    generate.add_argument("--max-tokens", type=int, help="most tokens to generate")
    generate.add_argument(
        "--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)"
    )
    generate.add_argument(
        "--principal",
        default=None,
        help="act for this principal (its key, its stream); default: the one principal"
        " your uid is listed under, if exactly one",
    )
    add_common(generate)
    generate.set_defaults(handler=_generate)

    describe = commands.add_parser(
        "describe",
        help="show the provider: models, defaults, context window, topics",
        description="Ask the provider for its entry (llm.v1.request.describe) and print it.",
    )
    describe.add_argument("--principal", default=None, help="act for this principal")
    add_common(describe)
    describe.set_defaults(handler=_describe)


async def _describe(args: argparse.Namespace) -> int:
    _own_principal(args)
    async with connect(args) as client:
        try:
            reply = await client.request(DESCRIBE, {}, deadline=ACCEPT_DEADLINE)
        except NoResponders:
            raise SageError(_NO_PROVIDER) from None
    data: dict[str, Any] = msgspec.json.decode(reply.payload)
    if args.json:
        print_json(data)
        return 0
    for entry in data.get("providers", []):
        print(f"provider        {entry.get('id')}  ({entry.get('name', '')})")
        print(f"models          {', '.join(entry.get('models', []))}")
        print(f"default model   {entry.get('default_model')}")
        print(f"max_tokens      {entry.get('max_tokens')}")
        print(f"context window  {entry.get('context_window')}")
    return 0


def _own_principal(args: argparse.Namespace) -> None:
    """No --principal and the caller's uid is listed under exactly one principal: act
    for it (its key, its stream), as a session of its would; an admin listed nowhere
    stays the operator."""
    if args.principal is not None:
        return
    config = config_of(args)
    listed = [p.name for p in config.principals if os.getuid() in p.uids]
    if len(listed) == 1:
        args.principal = listed[0]


async def _generate(args: argparse.Namespace) -> int:
    _own_principal(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    request_id = uuid.uuid4().hex
    payload: dict[str, Any] = {
        "request_id": request_id,
        "messages": [{"role": "user", "content": prompt}],
    }
    for name in ("model", "system", "max_tokens"):
        if getattr(args, name) is not None:
            payload[name] = getattr(args, name)
    async with connect(args) as client:
        stream = await client.subscribe(STREAM)
        try:
            reply = await client.request(GENERATE, payload, deadline=ACCEPT_DEADLINE)
        except NoResponders:
            raise SageError(_NO_PROVIDER) from None
        try:
            replies.parse(reply.payload)
        except ReplyError as refused:  # the provider's message alone, as it always was
            print(f"astrid: {refused.reply.get('message', refused.code)}", file=sys.stderr)
            return 1
        follower = _Follower(client, request_id, json_output=args.json)
        code = 130
        with anyio.move_on_after(args.timeout or None) as deadline:
            async with anyio.create_task_group() as tg:
                tg.start_soon(follower.watch_interrupts)
                code = await follower.follow(stream)
                tg.cancel_scope.cancel()
        if deadline.cancelled_caught:
            client.publish(f"llm.v1.request.cancel.{request_id}", {})
            await client.flush()
            raise SageError(f"no end of the completion within {args.timeout:g} s (cancelled)")
        return code


class _Follower:
    """Prints one request's events; turns Ctrl-C into a cancel request."""

    def __init__(self, client: BusClient, request_id: str, *, json_output: bool) -> None:
        self.client = client
        self.request_id = request_id
        self.json = json_output
        self.interrupted = False
        self.ends_with_newline = True
        self.grace: anyio.CancelScope | None = None

    async def follow(self, stream: RemoteSubscription) -> int:
        with anyio.CancelScope() as self.grace:
            async for envelope in stream:
                data = msgspec.json.decode(envelope.payload)
                if not isinstance(data, dict) or data.get("request_id") != self.request_id:
                    continue
                event = data.get("event") or {}
                if event.get("code") == "duplicate_request_id":
                    continue  # someone reused our id: that refusal is not about us
                code = self.show(data, event)
                if code is not None:
                    return code
            raise SageError("the connection ended before the completion did")
        return 130  # the provider did not confirm the cancel in time

    def show(self, data: dict[str, Any], event: dict[str, Any]) -> int | None:
        """Print one event; the exit code when it ends the request."""
        kind = event.get("type")
        out = sys.stdout
        if self.json:
            print_json(data)
        elif kind == "TextDelta":
            text = str(event.get("text", ""))
            out.write(text)
            out.flush()
            self.ends_with_newline = text.endswith("\n") if text else self.ends_with_newline
        elif kind == "ToolCallStart":
            print(f"\n[tool call {event.get('name')} ({event.get('id')})]", file=sys.stderr)
        if kind == "Done":
            if not self.json and not self.ends_with_newline:
                out.write("\n")
            return 0
        if kind == "Error":
            if not self.json and not self.ends_with_newline:
                out.write("\n")
            if event.get("code") == "cancelled":
                print("astrid: cancelled", file=sys.stderr)
                return 130
            print(f"astrid: {event.get('message', 'the completion failed')}", file=sys.stderr)
            return 1
        return None

    async def watch_interrupts(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                if self.grace is None:
                    continue
                if self.interrupted:  # a second Ctrl-C: leave now
                    self.grace.cancel()
                    return
                self.interrupted = True
                self.client.publish(f"llm.v1.request.cancel.{self.request_id}", {})
                await self.client.flush()
                self.grace.deadline = anyio.current_time() + CANCEL_GRACE
