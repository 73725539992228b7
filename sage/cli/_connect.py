"""What the CLI commands share: loading the config and connecting to the supervisor.

:func:`connect` is the async client (anyio, asyncio) for commands that follow
events; :func:`ask` asks one question without an event loop, so a command that
needs no more (``astrid status``) does not import them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

from bus.blocking import BlockingClient
from bus.errors import ConnectionLost
from bus.wire import frame_limit
from sage.config import Config, load_config

if TYPE_CHECKING:
    from bus import BusClient, Envelope

_json = msgspec.json.Encoder()


def config_of(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace, *, role: str = "cli") -> AsyncIterator[BusClient]:
    from bus.client import BusClient  # anyio: only for the commands that use it

    config = config_of(args)
    async with contextlib.AsyncExitStack() as stack:
        try:
            client = await stack.enter_async_context(
                BusClient.connect(
                    config.socket_path,
                    role=role,
                    name="astrid",
                    principal=getattr(args, "principal", None),
                    max_frame=frame_limit(config.bus.max_payload),
                )
            )
        except ConnectionLost as exc:
            raise _no_socket(args, config) or exc from None
        yield client


@contextlib.contextmanager
def blocking(args: argparse.Namespace) -> Iterator[BlockingClient]:
    """The blocking client (no event loop), connected as ``args`` say."""
    config = config_of(args)
    with contextlib.ExitStack() as stack:
        try:
            client = stack.enter_context(
                BlockingClient.connect(
                    config.socket_path,
                    name="astrid",
                    principal=getattr(args, "principal", None),
                    max_frame=frame_limit(config.bus.max_payload),
                )
            )
        except ConnectionLost as exc:
            raise _no_socket(args, config) or exc from None
        yield client


def ask(args: argparse.Namespace, topic: str, payload: Any, *, deadline: float) -> Envelope:
    """One request to the supervisor, its reply (blocking, no event loop)."""
    with blocking(args) as client:
        return client.request(topic, payload, deadline=deadline)


def _no_socket(args: argparse.Namespace, config: Config) -> ConnectionLost | None:
    """A missing socket names the config it came from (the likelier cause than a
    supervisor that is down); None when the socket is there."""
    if config.socket_path.exists():
        return None
    return ConnectionLost(
        f"no supervisor socket at {config.socket_path} (from {_named(args)}):"
        " no supervisor runs with that config; start one (astrid supervisor run"
        " --config FILE), or use the config it runs with: every astrid command"
        " needs the supervisor's (--config FILE or ASTRID_CONFIG)"
    )


def _named(args: argparse.Namespace) -> str:
    """Which config the command read, as the user gave it."""
    if getattr(args, "config", None):
        return f"--config {args.config}"
    if os.environ.get("ASTRID_CONFIG"):
        return f"ASTRID_CONFIG={os.environ['ASTRID_CONFIG']}"
    return "the embedded defaults (no --config, no ASTRID_CONFIG)"


def print_json(value: Any) -> None:
    sys.stdout.write(_json.encode(value).decode() + "\n")
    sys.stdout.flush()
