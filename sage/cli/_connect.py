"""What the CLI commands share: loading the config and connecting to the supervisor.

:func:`connect` is the async client (anyio, asyncio) for commands that follow
events; :func:`ask` asks one question without an event loop, so a command that
needs no more (``astrid status``) does not import them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from bus.blocking import BlockingClient
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
    async with BusClient.connect(
        config.socket_path,
        role=role,
        name="astrid",
        principal=getattr(args, "principal", None),
        max_frame=frame_limit(config.bus.max_payload),
    ) as client:
        yield client


def ask(args: argparse.Namespace, topic: str, payload: Any, *, deadline: float) -> Envelope:
    """One request to the supervisor, its reply (blocking, no event loop)."""
    config = config_of(args)
    with BlockingClient.connect(
        config.socket_path,
        name="astrid",
        principal=getattr(args, "principal", None),
        max_frame=frame_limit(config.bus.max_payload),
    ) as client:
        return client.request(topic, payload, deadline=deadline)


def print_json(value: Any) -> None:
    sys.stdout.write(_json.encode(value).decode() + "\n")
    sys.stdout.flush()
