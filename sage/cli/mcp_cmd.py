"""``astrid mcp serve``: the stdio MCP server a principal's ``.mcp.json`` starts."""

from __future__ import annotations

import argparse
from typing import Any

from sage.cli._commands import summary
from sage.cli._common import add_common
from sage.cli._connect import config_of
from sage.errors import SageError

__all__ = ("register",)


def register(sub: Any) -> None:
    group = sub.add_parser(
        "mcp",
        help=summary("mcp"),
        description="MCP servers for Claude Code: `serve` proxies a principal's tools.",
    )
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)
    serve = commands.add_parser(
        "serve",
        help="a stdio MCP server offering PRINCIPAL's tools from the supervisor",
        description=(
            "Speak MCP (JSON-RPC, one message per line) on stdin/stdout and answer tools/list"
            " and tools/call from the supervisor's tool bridge, acting for PRINCIPAL, with the"
            " same checks, policy and audit as a headless session. Claude Code starts it from"
            " a principal's .mcp.json. The socket is $ASTRID_SOCKET, else the config's."
        ),
        epilog='example .mcp.json: {"mcpServers": {"sage": {"type": "stdio",'
        ' "command": "astrid", "args": ["mcp", "serve", "--principal", "alice"]},'
        ' "forge": {"type": "stdio", "command": "astrid",'
        ' "args": ["mcp", "serve", "--server", "forge", "--principal", "alice"]}}}',
    )
    serve.add_argument("--principal", required=True, help="the principal whose tools to offer")
    serve.add_argument(
        "--server",
        choices=("sage", "forge"),
        default="sage",
        help="sage: the capsules' tools (default); forge: the forge's meta-tools and the"
        " principal's forged tools, with list changes forwarded",
    )
    add_common(serve, json_output=False)
    serve.set_defaults(handler=_serve)


async def _serve(args: argparse.Namespace) -> int:
    import re

    from sage.config import NAME_PATTERN
    from sage.mcp.serve import serve

    if not re.match(NAME_PATTERN, args.principal):
        raise SageError(f"principal {args.principal!r} is not [A-Za-z0-9_-]{{1,64}}")
    await serve(config_of(args), args.principal, server=args.server)
    return 0
