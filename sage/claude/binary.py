"""The ``claude`` binary: which one sage runs, and which version it is.

This module owns the choice of the Claude Code executable and the reading
of its version, for ``astrid doctor`` and the session runner.  The order is
``[claude] binary`` when set (relative to the config file's folder, ``~``
expanded), else the binary ``make setup`` installs into the repository's
``.tools/``, else ``claude`` on PATH; nothing usable is one
:class:`~sage.errors.ConfigError` line.  :func:`read_claude_version` runs
``claude --version`` in a small clean environment (a throw-away HOME, no
telemetry, none of ``[claude] env``) under a deadline, and
:func:`parse_claude_version` is its pure core.

The version policy (:func:`support`) is built in, not configured: a release
is ``supported`` inside [:data:`FLOOR`, :data:`NEWEST_TESTED`] (the lowest and
the highest release the end-to-end suite passes on; CI runs it on both and
on :data:`PINNED`), ``untested`` above that (it may work: a warning),
``too_old`` below the floor and ``known_bad`` when listed in
:data:`KNOWN_BAD` (both refused: doctor fails, the runner will not spawn).
"""

from __future__ import annotations

import enum
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import anyio

import sage
from sage.config import Config
from sage.errors import ConfigError, ProcessError

__all__ = (
    "AUTO_DEFAULT_WITNESS",
    "FLOOR",
    "INSTALLED_BINARY",
    "KNOWN_BAD",
    "NEWEST_TESTED",
    "PINNED",
    "Support",
    "Verdict",
    "parse_claude_version",
    "read_claude_version",
    "resolve_claude_binary",
    "support",
    "version_key",
)

PINNED: Final = "2.1.328"
"""The release ``make setup`` installs and the whole test suite runs on."""
FLOOR: Final = "2.1.275"
"""The lowest release the end-to-end suite passes on (CI runs it there).  Below it:
<= ~2.1.250 ignores ``notifications/tools/list_changed`` from an sdk MCP server (a
tool added mid-session never reaches the model); 2.1.0 sends no
``system/api_retry`` and drops a whole ``settings.local.json`` naming a hook event
it does not know; 2.0.x lacks ``--tools`` and ``--append-system-prompt-file``."""
NEWEST_TESTED: Final = "2.1.332"
"""The highest release the end-to-end suite passes on (CI runs it there)."""
AUTO_DEFAULT_WITNESS: Final = "2.1.300"
"""A release (of 2.1.296 to 2.1.301) whose ``-p`` default permission mode is ``auto``;
``make setup`` installs it and the e2e suite shows sessions on it still ask sage."""
KNOWN_BAD: Final[dict[str, str]] = {}
"""Releases inside the range that must not run, with the reason.  2.1.296 to 2.1.301,
whose ``-p`` default permission mode is ``auto``, are not listed: sage passes
``--permission-mode default`` and checks the mode the CLI reports, and the suite
passes on 2.1.300 that way."""


class Support(enum.Enum):
    SUPPORTED = "supported"
    UNTESTED = "untested"  # newer than NEWEST_TESTED: allowed, with a warning
    TOO_OLD = "too_old"
    KNOWN_BAD = "known_bad"

    @property
    def allowed(self) -> bool:
        """Whether sessions may run on such a release."""
        return self in (Support.SUPPORTED, Support.UNTESTED)


@dataclass(frozen=True)
class Verdict:
    version: str
    support: Support
    message: str


def version_key(version: str) -> tuple[int, ...]:
    """``2.1.328`` -> ``(2, 1, 328)``; a suffix (``-beta``) is ignored."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a Claude Code version: {version!r}")
    return tuple(int(part) for part in match.groups())


def support(version: str) -> Verdict:
    """Where ``version`` stands against the built-in policy, with a one-line message."""
    span = f"supported: {FLOOR} to {NEWEST_TESTED}"
    bad = KNOWN_BAD.get(version)
    if bad is not None:
        return Verdict(version, Support.KNOWN_BAD, f"{version} is known bad ({bad}); {span}")
    key = version_key(version)
    if key < version_key(FLOOR):
        return Verdict(version, Support.TOO_OLD, f"{version} is older than the floor ({span})")
    if key > version_key(NEWEST_TESTED):
        return Verdict(
            version,
            Support.UNTESTED,
            f"{version} is newer than any release sage was tested with ({span});"
            " run the e2e suite on it (docs/operations.md, Claude Code versions)",
        )
    return Verdict(version, Support.SUPPORTED, f"{version} ({span})")


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


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def _tail(text: str) -> str:
    """The end of a process's output, on one line, at most a couple of hundred characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= _TAIL else "..." + flat[-_TAIL:]
