"""The ``astrid`` commands: which module registers each, and its line in ``astrid --help``.

Imported by :mod:`sage.cli` before any command module, so that ``astrid --help``
lists every command, and ``astrid status`` parses its own, without importing the
other commands' modules (and what they import).  Each module names its
command's line with :func:`summary`; a test checks that the modules register
exactly these commands.
"""

from __future__ import annotations

__all__ = ("COMMANDS", "module_of", "summary")

COMMANDS: dict[str, tuple[str, str]] = {
    "supervisor": ("supervisor_cmd", "run the sage supervisor"),
    "config": ("config_cmd", "check or show configuration"),
    "status": ("status", "show the running supervisor's state"),
    "doctor": ("doctor", "check that this host can run the supervisor"),
    "sage": ("sage_cmd", "Claude sessions: spawn, send, watch, interrupt, stop, list"),
    "capsule": ("capsule_cmd", "capsules: list, install, restart and remove them (admins)"),
    "tools": ("capsule_cmd", "the tool catalogue Claude sessions are offered"),
    "bus": ("bus_cmd", "publish, subscribe and send requests on the bus"),
    "audit": ("audit", "verify, follow or export the key of the audit log"),
    "forge": ("forge_cmd", "forged tools: list, show, run, promote, rm, runs, secrets"),
    "llm": ("llm_cmd", "one completion from the Messages API provider (llm capsule)"),
    "mcp": ("mcp_cmd", "MCP servers for Claude Code sessions sage does not run itself"),
    "fleet": ("fleet_cmd", "the fleet this supervisor is a node of (NATS)"),
}
"""Command -> (module of ``sage.cli`` that registers it, its ``--help`` line), in the
order ``astrid --help`` lists them."""


def module_of(command: str) -> str:
    """The module of ``sage.cli`` that registers ``command``."""
    return COMMANDS[command][0]


def summary(command: str) -> str:
    """``command``'s line in ``astrid --help``."""
    return COMMANDS[command][1]
