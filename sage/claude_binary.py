"""The ``claude`` binary: which one sage runs, and which version it is.

This module owns the choice of the Claude Code executable and the reading
of its version, for ``astrid doctor`` and the session runner.  The order is
``[claude] binary`` when set (relative to the config file's folder, ``~``
expanded), else the binary ``make setup`` installs into the repository's
``.tools/``, else ``claude`` on PATH; nothing usable is one
:class:`~sage.errors.ConfigError` line.  :func:`read_claude_version` runs
``claude --version`` in a small clean environment (a throw-away HOME, no
telemetry, none of ``[claude] env``) under a deadline, and
:func:`parse_claude_version` is its pure core.  A version is "tested" when
it is the configured ``claude.version`` or one of :data:`TESTED_VERSIONS`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Final

import anyio

import sage
from sage.config import Config
from sage.errors import ConfigError, ProcessError

__all__ = (
    "INSTALLED_BINARY",
    "TESTED_VERSIONS",
    "is_tested",
    "parse_claude_version",
    "read_claude_version",
    "resolve_claude_binary",
)

TESTED_VERSIONS: Final[frozenset[str]] = frozenset({"2.1.328"})
"""Claude Code versions this release of sage was tested against."""

INSTALLED_BINARY: Final[Path] = (
    Path(sage.__file__).resolve().parents[1]
    / ".tools"
    / "node_modules"
    / "@anthropic-ai"
    / "claude-code-linux-x64"
    / "claude"
)
"""Where ``make setup`` installs the pinned native binary."""

_VERSION = re.compile(r"\d+\.\d+\.\d+\S*")
_TAIL = 200


def _runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def resolve_claude_binary(config: Config) -> Path:
    """The ``claude`` executable to run: ``[claude] binary``, the ``.tools/`` one, or PATH."""
    if config.claude.binary:
        path = Path(config.claude.binary).expanduser()
        if not path.is_absolute():
            path = Path(config.base_dir or os.getcwd()) / path
        if not _runnable(path):
            raise ConfigError(
                f"claude.binary: {path} is not an executable file"
                " (leave claude.binary empty to use the one `make setup` installs)"
            )
        return path
    if _runnable(INSTALLED_BINARY):
        return INSTALLED_BINARY
    found = shutil.which("claude")
    if found:
        return Path(found).absolute()
    raise ConfigError(
        f"no claude binary: claude.binary is empty, {INSTALLED_BINARY} does not exist"
        " and there is no `claude` on PATH; `make setup` installs it"
    )


def parse_claude_version(output: str) -> str:
    """The version in ``claude --version`` output (``2.1.328 (Claude Code)`` -> ``2.1.328``)."""
    match = _VERSION.search(output)
    if match is None:
        raise ProcessError(f"no version number in `claude --version` output: {_tail(output)!r}")
    return match.group(0)


async def read_claude_version(path: Path, *, timeout: float = 15.0) -> str:  # noqa: ASYNC109 - a hung claude is an error
    """Run ``<path> --version`` in a clean environment and return the version it prints."""
    async with anyio.TemporaryDirectory(prefix="sage-claude-home-") as home:
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": home,
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        try:
            with anyio.fail_after(timeout):
                result = await anyio.run_process(
                    [os.fspath(path), "--version"],
                    stdin=subprocess.DEVNULL,
                    env=env,
                    cwd=home,
                    check=False,
                )
        except TimeoutError:
            raise ProcessError(f"{path} --version did not finish within {timeout:g} s") from None
        except OSError as exc:
            raise ProcessError(f"{path}: cannot run: {exc.strerror or exc}") from exc
    stdout = result.stdout.decode(errors="replace")
    if result.returncode != 0:
        stderr = result.stderr.decode(errors="replace")
        said = _tail(stderr) or _tail(stdout) or "no output"
        raise ProcessError(f"{path} --version {_exit_text(result.returncode)}: {said}")
    try:
        return parse_claude_version(stdout)
    except ProcessError as exc:
        raise ProcessError(f"{path} --version: {exc}") from None


def is_tested(version: str, config: Config) -> bool:
    """Whether sage was tested with this Claude Code version (config's or built in)."""
    return version == config.claude.version or version in TESTED_VERSIONS


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _tail(text: str) -> str:
    """The end of a process's output, on one line, at most a couple of hundred characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _TAIL else "..." + flat[-_TAIL:]
