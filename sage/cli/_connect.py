"""What the CLI commands share: loading the config and connecting to the supervisor."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from bus import BusClient
from bus.wire import frame_limit
from sage.config import Config, load_config

_json = msgspec.json.Encoder()


def config_of(args: argparse.Namespace) -> Config:
    return load_config(getattr(args, "config", None))


@contextlib.asynccontextmanager
async def connect(args: argparse.Namespace, *, role: str = "cli") -> AsyncIterator[BusClient]:
    config = config_of(args)
    async with BusClient.connect(
        config.socket_path,
        role=role,
        name="astrid",
        principal=getattr(args, "principal", None),
        max_frame=frame_limit(config.bus.max_payload),
    ) as client:
        yield client


def print_json(value: Any) -> None:
    sys.stdout.write(_json.encode(value).decode() + "\n")
    sys.stdout.flush()
