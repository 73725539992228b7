"""``astrid supervisor run``: the daemon in the foreground."""

from __future__ import annotations

import argparse
from typing import Any

from sage.cli._commands import summary
from sage.cli._common import add_common
from sage.cli._connect import config_of


def register(sub: Any) -> None:
    group = sub.add_parser("supervisor", help=summary("supervisor"))
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    run = commands.add_parser(
        "run",
        help="run the supervisor in the foreground (JSON logs on stderr)",
        description=(
            "Start the state store, audit log, bus, socket server and capsules, then serve "
            "until SIGTERM or SIGINT. SIGHUP reloads the config file. Under systemd "
            "(Type=notify) readiness and the watchdog are reported through NOTIFY_SOCKET."
        ),
    )
    add_common(run, json_output=False)
    run.set_defaults(handler=_run)


async def _run(args: argparse.Namespace) -> int:
    from sage.daemon.supervisor import Supervisor
    from sage.logs import configure_logging

    config = config_of(args)
    configure_logging(config.supervisor.log_level)
    await Supervisor(config, args.config).run()
    return 0
