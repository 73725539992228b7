"""The processes a person or Claude Code starts: ``astrid-emit`` and the ``astrid`` CLI.

One supervisor (runner and hooks capsules, the CLI test double as ``claude``,
so a turn costs the double's few milliseconds and the figures are the
processes' own) and one session ``c1`` of ``alice``.  Rounds alternate the
contenders, ``ROUNDS`` of each; medians in the table, p90 on the console.
Every process is the installed console script of this virtualenv, as a hook
or a person runs it.

- ``python -c pass``: the interpreter's own start (with ``site``), the floor.
- ``astrid-emit PreToolUse``: a REPL hook, start to exit, stdin a PreToolUse
  input, its token minted by ``sage.v1.request.repl.open``: hello, publish,
  pong, and the hooks capsule republishes it (checked once).  Goal <= 20 ms.
  Its peak RSS too (GNU ``time``), against the interpreter's.
- ``astrid --help`` and ``astrid status`` (a real status request): goal well
  under 100 ms.
- ``astrid sage send c1 hi`` against the same turn through the bus client
  (``sage.v1.request.send.c1`` to its ``done`` event): what send adds to the
  turn, less the start of ``astrid status``: goal <= 30 ms.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec

from tests.bench.report import Report, percentile
from tests.support import FAKE_CLAUDE
from tests.support.daemon import short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config

ROUNDS = 25
BIN = Path(sys.executable).parent
HOOK_INPUT = json.dumps(
    {
        "session_id": "b1f2",
        "hook_event_name": "PreToolUse",
        "tool_name": "mcp__sage__greet",
        "tool_input": {"name": "Ada"},
        "tool_use_id": "toolu_1",
    }
).encode()


GNU_TIME = Path("/usr/bin/time")


def _peak_rss_kib(argv: list[str], env: dict[str, str], stdin: bytes) -> int | None:
    """The peak RSS of ``argv`` in KiB, by GNU time (a child spawned from this process
    would report this process's own peak: vfork shares its memory until exec)."""
    if not GNU_TIME.is_file():
        return None
    done = subprocess.run(
        [str(GNU_TIME), "-f", "%M", *argv], env=env, input=stdin, capture_output=True, check=True
    )
    return int(done.stderr.decode().strip().splitlines()[-1])


class _Child:
    """A child started with posix_spawn and reaped with wait4."""

    @staticmethod
    def run(argv: list[str], env: dict[str, str], stdin: bytes = b"") -> float:
        r, w = os.pipe()
        t0 = time.perf_counter()
        pid = os.posix_spawn(
            argv[0],
            argv,
            env,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, r, 0),
                (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
                (os.POSIX_SPAWN_OPEN, 2, "/dev/null", os.O_WRONLY, 0),
            ],
        )
        os.close(r)
        os.write(w, stdin)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        elapsed = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"{argv} exited with status {status}")
        return elapsed


async def _turn(sage: Sage, sid: str) -> float:
    """Seconds from the send request to the turn's done event, through the bus client."""
    events = await sage.events(sid)
    try:
        t0 = time.perf_counter()
        reply = await sage.send(sid, "hi")
        if not reply.get("ok"):
            raise RuntimeError(f"send failed: {reply}")
        await events.until("done", within=30)
        return time.perf_counter() - t0
    finally:
        await events.subscription.close()


async def _bench(report: Report) -> None:
    config = sage_config(FAKE_CLAUDE, {"FAKE_CLAUDE_MODE": ""}, capsules='["runner", "hooks"]')
    root = short_dir()
    async with running_sage(config, root=root, env={"ANTHROPIC_API_KEY": "sk-bench"}) as sage:
        await sage.ready("c1")
        opened = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert opened["ok"], opened
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(root)}
        hook_env = {
            **base,
            "ASTRID_SOCKET": str(sage.daemon.socket),
            "ASTRID_PRINCIPAL_ID": "alice",
            "ASTRID_SESSION_ID": opened["session_id"],
            "ASTRID_HOOK_TOKEN": opened["token"],
        }
        cli_env = {**base, "ASTRID_CONFIG": str(sage.daemon.config)}
        # the emitter's hook arrives, token-checked: what is timed is a real delivery
        hooks = await sage.client.subscribe("hook.v1.event.before_tool_call")
        await anyio.to_thread.run_sync(
            _Child.run, [str(BIN / "astrid-emit"), "PreToolUse"], hook_env, HOOK_INPUT
        )
        with anyio.fail_after(10):
            event = msgspec.json.decode((await hooks.get()).payload)
        assert event["decision_source"] == "token", event
        await hooks.close()

        contenders = {
            "python": ([sys.executable, "-c", "pass"], base, b""),
            "emit": ([str(BIN / "astrid-emit"), "PreToolUse"], hook_env, HOOK_INPUT),
            "help": ([str(BIN / "astrid"), "--help"], cli_env, b""),
            "status": ([str(BIN / "astrid"), "status"], cli_env, b""),
            "send": ([str(BIN / "astrid"), "sage", "send", "c1", "hi"], cli_env, b""),
        }
        seconds: dict[str, list[float]] = {name: [] for name in [*contenders, "turn"]}
        rss = {
            name: await anyio.to_thread.run_sync(_peak_rss_kib, *contenders[name])
            for name in ("python", "emit")
        }
        for _ in range(2):  # warm-up: page cache, pyc files
            for argv, env, stdin in contenders.values():
                await anyio.to_thread.run_sync(_Child.run, argv, env, stdin)
        for i in range(ROUNDS):
            for name, (argv, env, stdin) in contenders.items():
                seconds[name].append(await anyio.to_thread.run_sync(_Child.run, argv, env, stdin))
            seconds["turn"].append(await _turn(sage, "c1"))
            if i % 5 == 4:
                print(
                    f"  cli: round {i + 1}/{ROUNDS}: "
                    + ", ".join(f"{n} {v[-1] * 1e3:.1f} ms" for n, v in seconds.items()),
                    flush=True,
                )
    med = {name: statistics.median(v) * 1e3 for name, v in seconds.items()}
    p90 = {name: percentile(v, 0.9) * 1e3 for name, v in seconds.items()}
    print(
        "  cli: p90 " + ", ".join(f"{n} {v:.1f} ms" for n, v in p90.items()),
        flush=True,
    )
    added = med["send"] - med["turn"] - med["status"]
    print(
        f"  cli: send {med['send']:.1f} ms = turn {med['turn']:.1f} ms + start of status"
        f" {med['status']:.1f} ms + {added:.1f} ms",
        flush=True,
    )
    report.add(
        "cli",
        f"astrid-emit hook, start to exit (p50 of {ROUNDS})",
        med["emit"],
        "ms",
        reference=med["python"],
        reference_name="python -c pass",
        goal="<= 20 ms",
        higher_is_better=False,
    )
    if rss["emit"] is not None and rss["python"] is not None:
        report.add(
            "cli",
            "astrid-emit peak RSS",
            rss["emit"] / 1024,
            "MiB",
            reference=rss["python"] / 1024,
            reference_name="python -c pass",
            higher_is_better=False,
        )
    else:
        print(f"  cli: no {GNU_TIME}: the emitter's peak RSS is not measured", flush=True)
    for name in ("help", "status"):
        report.add(
            "cli",
            f"astrid {'--help' if name == 'help' else name}, start to exit (p50)",
            med[name],
            "ms",
            reference=med["python"],
            reference_name="python -c pass",
            goal="well under 100 ms",
            higher_is_better=False,
        )
    report.add(
        "cli",
        "astrid sage send: added to the turn past status's start",
        added,
        "ms",
        goal="<= 30 ms",
        higher_is_better=False,
    )


def run(report: Report) -> None:
    anyio.run(_bench, report)


if __name__ == "__main__":
    r = Report()
    run(r)
    print(r.render())
