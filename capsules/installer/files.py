"""What the installer writes into a principal's home: pure functions of the settings.

``.claude/settings.local.json`` is in Claude Code's own settings format, the
project-local file the CLI reads from its working folder (the home) without
any flag:

- ``permissions.deny``: every built-in tool in ``headless`` mode (the
  session's tools are the supervisor's, ``mcp__sage__*`` and
  ``mcp__forge__*``), nothing in ``repl`` mode;
- ``hooks``, in ``repl`` mode only: every hook event the hooks capsule knows,
  in the nested ``{matcher?, hooks: [{type: "command", command, timeout}]}``
  form, each running ``astrid-emit <Event>``, which sends it to the
  supervisor to be checked against the session's token (``matcher`` only for
  the tool events, which take one).  A REPL session has no control channel,
  so that is the only way its hooks reach sage.  A ``headless`` session gets
  the same events in-band (the runner registers them at ``initialize``), so
  its settings have no command hooks: none of its hooks starts a process;
- ``apiKeyHelper: "/bin/false"`` in ``api_key`` mode only, so the CLI
  cannot fall back to credentials of its own; ``subscription`` mode leaves
  it out so the CLI's own login works.

``CLAUDE.md`` says who the principal is and how its tools and hooks work;
``.astrid/install.json`` is the marker: artifact version, the settings it
was written for, the CLI version and the SHA-256 of each file.
"""

from __future__ import annotations

import hashlib
import shlex
from typing import Any, Final

import msgspec

from sage.claude.homes import HOME_ARTIFACTS
from sage.claude.hooks import IN_BAND_HOOKS, hooks_known_by

__all__ = (
    "ARTIFACT_VERSION",
    "BUILT_IN_TOOLS",
    "HOOK_EVENTS",
    "claude_md",
    "digest",
    "marker",
    "mcp_json",
    "settings_local",
)

ARTIFACT_VERSION: Final = HOME_ARTIFACTS
"""Bumped (in sage/claude/homes.py) whenever a file's format changes: the runner
installs a home of an older version again before its next session."""
BUILT_IN_TOOLS: Final = (
    "Bash", "BashOutput", "CronCreate", "CronDelete", "CronList", "Edit", "EnterWorktree",
    "ExitPlanMode", "ExitWorktree", "Glob", "Grep", "KillShell", "LS", "ListAgents",
    "Monitor", "MultiEdit", "NotebookEdit", "Read", "ReportFindings", "ScheduleWakeup",
    "SendMessage", "Skill", "SlashCommand", "Task", "TaskStop", "TodoWrite", "ToolSearch",
    "WebFetch", "WebSearch", "Workflow", "Write",
)  # fmt: skip
"""Claude Code's own tools (2.1.328's init ``tools`` plus those of earlier releases)."""
HOOK_EVENTS: Final = IN_BAND_HOOKS
"""The events a REPL principal's command hooks report: those a headless session
registers in-band (``sage.claude.hooks.UNHOOKED`` left out on both paths)."""
TOOL_EVENTS: Final = frozenset(
    {"PreToolUse", "PostToolUse", "PostToolUseFailure", "PermissionRequest", "PermissionDenied"}
)
HOOK_TIMEOUT: Final = 5
"""Seconds Claude gives each hook command (astrid-emit gives up after 2)."""


def _json(value: Any) -> bytes:
    return msgspec.json.format(msgspec.json.encode(value), indent=2) + b"\n"


def settings_local(config: dict[str, Any], emit: str, claude_version: str) -> bytes:
    """``.claude/settings.local.json`` for ``config`` (interaction_mode, auth_mode, ...):
    in ``repl`` mode command hooks for the events ``claude_version`` knows (a release
    that meets one it does not know may drop the whole file, deny rules and
    ``apiKeyHelper`` with it); in ``headless`` mode none (they come in-band)."""
    headless = config.get("interaction_mode", "headless") == "headless"
    known = frozenset() if headless else hooks_known_by(claude_version)
    hooks: dict[str, list[dict[str, Any]]] = {}
    for event in (e for e in HOOK_EVENTS if e in known):
        entry: dict[str, Any] = {
            "hooks": [
                {
                    "type": "command",
                    "command": f"{shlex.quote(emit)} {event}",
                    "timeout": HOOK_TIMEOUT,
                }
            ]
        }
        if event in TOOL_EVENTS:
            entry = {"matcher": "*", **entry}
        hooks[event] = [entry]
    settings: dict[str, Any] = {
        "permissions": {"allow": [], "deny": list(BUILT_IN_TOOLS) if headless else []},
        "hooks": hooks,
    }
    if not headless:  # .mcp.json's servers are sage's own: not a question at the terminal
        settings["enabledMcpjsonServers"] = ["sage", "forge"]
    if config.get("auth_mode", "api_key") == "api_key":
        settings["apiKeyHelper"] = "/bin/false"
    return _json(settings)


def mcp_json(principal: str, astrid: str, socket: str) -> bytes:
    """``.mcp.json``: the ``sage`` and ``forge`` MCP servers for sessions sage does not
    run (REPL): ``astrid mcp serve`` proxies the principal's tools from the supervisor.
    Headless sessions ignore it (the runner passes ``--strict-mcp-config``)."""

    def server(*which: str) -> dict[str, Any]:
        return {
            "type": "stdio",
            "command": astrid,
            "args": ["mcp", "serve", *which, "--principal", principal],
            "env": {"ASTRID_SOCKET": socket},
        }

    return _json({"mcpServers": {"sage": server(), "forge": server("--server", "forge")}})


def claude_md(principal: str, config: dict[str, Any]) -> bytes:
    mode = config.get("interaction_mode", "headless")
    tools = (
        "Your tools are the supervisor's: `mcp__sage__*` (capsule tools) and"
        " `mcp__forge__*` (tools forged at runtime). Claude Code's built-in tools are"
        " denied for this principal."
        if mode == "headless"
        else "Claude Code's built-in tools are allowed for this principal."
    )
    hooks = (
        "The supervisor receives every hook over its control channel with the session"
        if mode == "headless"
        else "Every hook fires `astrid-emit`, which reports it to the supervisor"
    )
    return (
        f"# {principal}\n\n"
        f"This folder is the home of principal `{principal}`, run by the sage supervisor"
        f" ({mode} mode).\n\n"
        f"{tools}\n\n"
        f"{hooks}; each tool call is checked against a policy and written to a"
        " tamper-evident audit log.\n"
    ).encode()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def marker(
    principal: str, config: dict[str, Any], claude_version: str, files: dict[str, bytes]
) -> dict[str, Any]:
    """The install marker's content, without the time (the shell adds ``installed_at``)."""
    return {
        "artifact_version": ARTIFACT_VERSION,
        "principal_id": principal,
        "config": config,
        "claude_version": claude_version,
        "files": {name: digest(data) for name, data in sorted(files.items())},
    }
