"""How a session's ``claude`` process is started: argv, environment, files.

Everything here is decided before the process exists, so it is plain code
with no I/O except the two files a launch needs (the identity file, written
atomically, and the API key, read).  :func:`flags_hash` fingerprints the
argv for the ``spawn`` audit: SHA-256 over each element followed by a NUL.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sage.claude.homes import own_home, read_api_key, unsafe_home
from sage.claude.hooks import hash_token, mint_token
from sage.config import Config, PrincipalConfig
from sage.files import write_replace
from sage.security.runas import RunAs, setpriv_prefix

__all__ = (
    "MCP_CONFIG",
    "PERMISSION_MODE",
    "Launch",
    "build_launch",
    "flags_hash",
    "hash_token",
    "mint_token",
    "read_api_key",
    "unsafe_home",
)

MCP_CONFIG = (
    '{"mcpServers":{"sage":{"type":"sdk","name":"sage"},"forge":{"type":"sdk","name":"forge"}}}'
)
LOCALE_VARS = ("LANG", "LC_ALL", "LC_CTYPE")
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Every session asks for it: in ``default`` a tool that is not pre-allowed comes to
#: sage as ``can_use_tool``.  Never left to the CLI, whose default was ``auto`` (its
#: own classifier decides, sage sees nothing) in 2.1.296 to 2.1.301.
PERMISSION_MODE = "default"
DEFAULT_IDENTITY = (
    "You are {principal}, an agent run by the sage supervisor in session {session}. "
    "Use the tools offered to you; every tool call is checked and audited."
)


@dataclass(frozen=True)
class Launch:
    """One ``claude`` start: what to run, with what, where."""

    argv: list[str]
    env: dict[str, str]
    cwd: Path
    identity_file: Path
    claude_session: str
    flags_hash: str
    identity_fallback: bool
    permission_mode: str = PERMISSION_MODE
    prefix: tuple[str, ...] = ()
    """What runs before ``argv`` (``setpriv`` to the child's uid; supervisor root)."""
    uid: int | None = None
    """The uid the child runs as; None: the supervisor's."""
    identity_digest: str = ""
    """``sha256:`` and the SHA-256 of the identity text (a spare's staleness check)."""
    resume: bool = False
    """``--resume`` (the conversation goes on) rather than ``--session-id`` (it starts)."""

    @property
    def command(self) -> list[str]:
        """What is started: ``prefix`` then ``argv`` (``argv`` is what the child runs)."""
        return [*self.prefix, *self.argv]


def flags_hash(argv: Sequence[str]) -> str:
    digest = hashlib.sha256()
    for arg in argv:
        digest.update(os.fsencode(arg))
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()}"


def identity_path(config: Config, session_id: str) -> Path:
    """Where a session's identity file (``--append-system-prompt-file``) is written."""
    return config.state_dir / "sessions" / session_id / "identity.md"


def remove_session_files(config: Config, session_id: str) -> None:
    """Remove what :func:`build_launch` wrote for ``session_id`` (its identity file and
    folder); what is gone already, or cannot go, is left as it is."""
    identity = identity_path(config, session_id)
    with contextlib.suppress(OSError):
        identity.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        identity.parent.rmdir()


def build_launch(
    config: Config,
    principal: PrincipalConfig,
    *,
    session_id: str,
    claude_session: str,
    binary: Path,
    token: str,
    api_key: str | None,
    identity: str | None,
    resume: bool = False,
    run_as: RunAs | None = None,
    cwd: Path | None = None,
    model: str = "",
    files: bool = True,
) -> Launch:
    """Decide argv and environment, make the home, write the identity file
    (``files=False``: decide only, touch nothing; a spare's check).

    With ``run_as`` (a root supervisor) the child starts through ``setpriv`` as
    that uid, the home is handed to it, and the identity file is its own (0400)
    in folders it may pass through (0711) but not list."""
    home = config.home_of(principal)
    sessions = config.state_dir / "sessions"
    identity_file = identity_path(config, session_id)
    fallback = not identity
    text = identity or DEFAULT_IDENTITY.format(principal=principal.name, session=session_id)
    if not files:
        pass
    elif run_as is None:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_replace(identity_file, text.encode())
    else:
        own_home(
            home,
            run_as.uid,
            run_as.gid,
            homes_dir=config.homes_dir if home.parent == config.homes_dir else None,
        )
        write_replace(identity_file, text.encode())
        for folder in (sessions, identity_file.parent):
            os.chmod(folder, 0o711)
        os.chown(identity_file, run_as.uid, -1)
        os.chmod(identity_file, 0o400)
    argv = [
        str(binary),
        "-p",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "--include-partial-messages",
        "--mcp-config",
        MCP_CONFIG,
        "--strict-mcp-config",
        "--tools",
        "",
        "--permission-prompt-tool",
        "stdio",
        "--permission-mode",
        PERMISSION_MODE,
        "--append-system-prompt-file",
        str(identity_file),
        # render the system prompt from that file on every request: a resumed child
        # otherwise sends the snapshot its conversation recorded first, so a changed
        # identity would never reach a session that spoke (seen with 2.1.328)
        "--system-prompt-snapshot",
        "off",
    ]
    if principal.allowed_tools:
        argv += ["--allowedTools", ",".join(principal.allowed_tools)]
    if model or principal.model:
        argv += ["--model", model or principal.model]
    if principal.max_turns:
        argv += ["--max-turns", str(principal.max_turns)]
    # one token each, so an id can never be read as a flag
    argv.append(f"--resume={claude_session}" if resume else f"--session-id={claude_session}")
    env = {
        "HOME": str(home),
        "PATH": os.environ.get("PATH") or DEFAULT_PATH,
        "ASTRID_PRINCIPAL_ID": principal.name,
        "ASTRID_SESSION_ID": session_id,
        "ASTRID_HOOK_TOKEN": token,
        "ASTRID_SOCKET": str(config.socket_path),
    }
    for name in LOCALE_VARS:
        if os.environ.get(name):
            env[name] = os.environ[name]
    env.setdefault("LANG", "C.UTF-8")
    if principal.auth_mode == "api_key" and api_key:
        env["ANTHROPIC_API_KEY"] = api_key
    env.update(config.claude.env)
    return Launch(
        argv=argv,
        env=env,
        cwd=cwd or home,
        identity_file=identity_file,
        claude_session=claude_session,
        flags_hash=flags_hash(argv),
        identity_fallback=fallback,
        prefix=tuple(setpriv_prefix(run_as)) if run_as is not None else (),
        uid=None if run_as is None else run_as.uid,
        identity_digest="sha256:" + hashlib.sha256(text.encode()).hexdigest(),
        resume=resume,
    )
