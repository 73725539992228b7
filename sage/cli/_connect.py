"""What the CLI commands share: loading the config and connecting to the supervisor."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from bus import BusClient, ConnectionLost
from bus.wire import frame_limit
from sage.config import Config, load_config

_json = msgspec.json.Encoder()


def config_of(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace, *, role: str = "cli") -> AsyncIterator[BusClient]:
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
        except ConnectionLost:
            if config.socket_path.exists():
                raise
            raise ConnectionLost(  # the config is the likelier cause: name it
                f"no supervisor socket at {config.socket_path} (from {_named(args)}):"
                " no supervisor runs with that config; start one (astrid supervisor run"
                " --config FILE), or use the config it runs with: every astrid command"
                " needs the supervisor's (--config FILE or ASTRID_CONFIG)"
            ) from None
        yield client


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
