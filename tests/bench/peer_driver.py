"""A contender of bench_peer in a process of its own, so its memory is its own.

``python -m tests.bench.peer_driver KIND --binary B --url U --home H [--socket S]
--sessions N --turns T`` runs N sessions at once (``bare``, ``sdk`` or ``sage``:
:mod:`tests.bench.peers`), each T turns of "hi" one after the other, and prints
``{"wall": seconds, "turns": n}`` on one line.  ``--idle``: one session, one
turn, then ``{"rss_kib": ...}`` of this process (the program's own memory with
a session up: for the SDK, its Python process), and it waits for stdin to
close before it ends the session.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio

from tests.bench.peers import BareSession, SageSession, SdkSession
from tests.support.procs import rss_kib


@contextlib.asynccontextmanager
async def _session(args: argparse.Namespace, client: Any, n: int) -> AsyncIterator[Any]:
    home = Path(args.home) / f"s{n}"
    home.mkdir(parents=True, exist_ok=True)
    if args.kind == "bare":
        async with BareSession.open(Path(args.binary), args.url, home) as bare:
            yield bare
    elif args.kind == "sdk":
        async with SdkSession.open(Path(args.binary), args.url, home) as sdk:
            yield sdk
    else:
        async with SageSession.open(client, f"peer{n}") as sage:
            yield sage


async def _main(args: argparse.Namespace) -> None:
    async with contextlib.AsyncExitStack() as stack:
        client = None
        if args.kind == "sage":
            from bus import BusClient

            client = await stack.enter_async_context(
                BusClient.connect(args.socket, role="cli", name="peer")
            )
        if args.idle:
            async with _session(args, client, 0) as session:
                await session.turn("hi")
                print(json.dumps({"rss_kib": rss_kib(os.getpid())}), flush=True)
                await anyio.to_thread.run_sync(sys.stdin.read)
            return
        done = 0

        async def one(n: int) -> None:
            nonlocal done
            async with _session(args, client, n) as session:
                for _ in range(args.turns):
                    await session.turn("hi")
                    done += 1

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for n in range(args.sessions):
                tg.start_soon(one, n)
        print(json.dumps({"wall": time.perf_counter() - t0, "turns": done}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="peer_driver")
    parser.add_argument("kind", choices=("bare", "sdk", "sage"))
    parser.add_argument("--binary", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--home", required=True)
    parser.add_argument("--socket", default="")
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--idle", action="store_true")
    anyio.run(_main, parser.parse_args())


if __name__ == "__main__":
    main()
