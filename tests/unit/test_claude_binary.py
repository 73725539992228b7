"""The claude binary: which one is chosen, and reading its version from small fake executables."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import sage.claude.binary as claude_binary
from sage.claude.binary import (
    FLOOR,
    INSTALLED_BINARY,
    NEWEST_TESTED,
    PINNED,
    Support,
    parse_claude_version,
    read_claude_version,
    resolve_claude_binary,
    support,
    version_key,
)
from sage.config import Config, decode_config
from sage.errors import ConfigError, ProcessError

REAL_BINARY = (
    Path(__file__).resolve().parents[2]
    / ".tools/node_modules/@anthropic-ai/claude-code-linux-x64/claude"
)


def _script(folder: Path, body: str, name: str = "claude") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def _config(binary: str = "", base_dir: str = "") -> Config:
    text = f"[claude]\nbinary = {binary!r}\n".replace("'", '"')
    return decode_config(text, base_dir=base_dir)


# -- resolve ------------------------------------------------------------------


def test_config_binary_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """claude.binary is used even when the .tools/ binary and PATH have one too."""
    fake = _script(tmp_path / "mine", "echo 1.0.0")
    _script(tmp_path / "onpath", "echo 2.0.0")
    monkeypatch.setenv("PATH", str(tmp_path / "onpath"))
    assert resolve_claude_binary(_config(str(fake))) == fake


def test_relative_config_binary_resolves_against_the_config_folder(tmp_path: Path) -> None:
    """A relative claude.binary is relative to the config file's folder, not the cwd."""
    fake = _script(tmp_path / "bin", "echo 1.0.0")
    assert resolve_claude_binary(_config("bin/claude", base_dir=str(tmp_path))) == fake


def test_config_binary_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A claude.binary starting with ~ is under $HOME."""
    fake = _script(tmp_path / "bin", "echo 1.0.0")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_claude_binary(_config("~/bin/claude")) == fake


def test_missing_config_binary_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """A claude.binary that does not exist is one ConfigError naming the field and path."""
    missing = tmp_path / "nope" / "claude"
    with pytest.raises(ConfigError, match=r"claude\.binary: .*nope/claude is not an executable"):
        resolve_claude_binary(_config(str(missing)))


def test_non_executable_config_binary_is_refused(tmp_path: Path) -> None:
    """A claude.binary without the execute bit is refused, not run."""
    fake = _script(tmp_path, "echo 1.0.0")
    fake.chmod(0o644)
    with pytest.raises(ConfigError, match="not an executable"):
        resolve_claude_binary(_config(str(fake)))


def test_default_is_the_make_setup_binary() -> None:
    """With claude.binary empty, the binary make setup installed in .tools/ is used."""
    assert INSTALLED_BINARY == REAL_BINARY
    assert REAL_BINARY.is_file(), f"{REAL_BINARY} is missing: run `make setup`"
    assert resolve_claude_binary(Config()) == REAL_BINARY


def test_path_is_the_last_resort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without claude.binary and the .tools/ binary, `claude` on PATH is used."""
    monkeypatch.setattr(claude_binary, "INSTALLED_BINARY", tmp_path / "absent" / "claude")
    fake = _script(tmp_path / "onpath", "echo 1.0.0")
    monkeypatch.setenv("PATH", str(tmp_path / "onpath"))
    assert resolve_claude_binary(Config()) == fake


def test_nothing_found_says_what_was_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No binary anywhere: one ConfigError naming the .tools/ path, PATH and make setup."""
    absent = tmp_path / "absent" / "claude"
    monkeypatch.setattr(claude_binary, "INSTALLED_BINARY", absent)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError) as info:
        resolve_claude_binary(Config())
    message = str(info.value)
    assert str(absent) in message
    assert "PATH" in message
    assert "make setup" in message
    assert "\n" not in message


# -- version ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("output", "version"),
    [
        ("2.1.328 (Claude Code)\n", "2.1.328"),
        ("claude 10.0.1-beta.2\n", "10.0.1-beta.2"),
        ("\n  2.1.328\n", "2.1.328"),
    ],
)
def test_parse_version(output: str, version: str) -> None:
    """The first x.y.z token (with any suffix) is the version."""
    assert parse_claude_version(output) == version


def test_parse_version_without_a_number() -> None:
    """Output with no x.y.z is a ProcessError quoting it."""
    with pytest.raises(ProcessError, match=r"no version number.*hello 2\.1"):
        parse_claude_version("hello 2.1\n")


@pytest.mark.anyio
async def test_reads_the_version_a_script_prints(tmp_path: Path) -> None:
    """A script printing `2.1.328 (Claude Code)` reports 2.1.328."""
    fake = _script(tmp_path, "echo '2.1.328 (Claude Code)'")
    assert await read_claude_version(fake) == "2.1.328"


@pytest.mark.anyio
async def test_runs_in_a_clean_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--version runs with telemetry off, a throw-away HOME and none of our environment."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-must-not-leak")
    fake = _script(
        tmp_path,
        f'''[ -z "$ANTHROPIC_API_KEY" ] || {{ echo leaked >&2; exit 1; }}
[ "$DISABLE_TELEMETRY" = 1 ] || {{ echo telemetry >&2; exit 1; }}
[ "$CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC" = 1 ] || {{ echo traffic >&2; exit 1; }}
[ -d "$HOME" ] && [ "$HOME" != "{Path.home()}" ] || {{ echo home >&2; exit 1; }}
echo 2.1.328''',
    )
    assert await read_claude_version(fake) == "2.1.328"


@pytest.mark.anyio
async def test_garbage_output_is_a_process_error(tmp_path: Path) -> None:
    """A binary printing no version number is a ProcessError naming it."""
    fake = _script(tmp_path, "echo 'hello world'")
    with pytest.raises(ProcessError, match=re.escape(f"{fake} --version: no version number")):
        await read_claude_version(fake)


@pytest.mark.anyio
async def test_non_zero_exit_is_a_process_error_with_stderr(tmp_path: Path) -> None:
    """A binary exiting 1 is a ProcessError with the exit code and the end of its stderr."""
    fake = _script(tmp_path, "echo 2.1.328; echo 'boom: no licence' >&2; exit 1")
    with pytest.raises(ProcessError, match="exited with code 1: boom: no licence"):
        await read_claude_version(fake)


@pytest.mark.anyio
async def test_long_stderr_is_cut_to_its_tail(tmp_path: Path) -> None:
    """Only the last few hundred characters of a chatty stderr are kept, on one line."""
    fake = _script(
        tmp_path, "i=0; while [ $i -lt 200 ]; do echo line $i >&2; i=$((i+1)); done; exit 3"
    )
    with pytest.raises(ProcessError) as info:
        await read_claude_version(fake)
    message = str(info.value)
    assert "line 199" in message
    assert "line 0 " not in message
    assert "\n" not in message
    assert len(message) < 400


@pytest.mark.anyio
async def test_a_hanging_binary_times_out(tmp_path: Path) -> None:
    """A binary that does not finish within the timeout is a ProcessError, and is killed."""
    fake = _script(tmp_path, "exec sleep 30")
    with pytest.raises(ProcessError, match=r"did not finish within 0\.5 s"):
        await read_claude_version(fake, timeout=0.5)


@pytest.mark.anyio
async def test_a_file_that_cannot_run_is_a_process_error(tmp_path: Path) -> None:
    """A path that is not an executable program is a ProcessError, not an OSError."""
    with pytest.raises(ProcessError, match="cannot run"):
        await read_claude_version(tmp_path / "absent")


@pytest.mark.anyio
async def test_the_installed_binary_is_the_pinned_version() -> None:
    """The claude make setup installed reports the pin (fails, not skips, when missing)."""
    assert REAL_BINARY.is_file(), f"{REAL_BINARY} is missing: run `make setup`"
    assert await read_claude_version(REAL_BINARY) == PINNED


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("2.1.274", Support.TOO_OLD),
        ("2.0.77", Support.TOO_OLD),
        ("2.1.0", Support.TOO_OLD),
        (FLOOR, Support.SUPPORTED),
        ("2.1.300", Support.SUPPORTED),
        (PINNED, Support.SUPPORTED),
        (NEWEST_TESTED, Support.SUPPORTED),
        ("2.1.333", Support.UNTESTED),
        ("3.0.0", Support.UNTESTED),
        ("2.1.328-beta.1", Support.SUPPORTED),
    ],
)
def test_the_supported_range(version: str, expected: Support) -> None:
    verdict = support(version)
    assert verdict.support is expected
    assert verdict.version == version
    assert f"{FLOOR} to {NEWEST_TESTED}" in verdict.message
    assert verdict.support.allowed is (expected in (Support.SUPPORTED, Support.UNTESTED))


def test_a_known_bad_release_is_refused_whatever_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(claude_binary.KNOWN_BAD, "2.1.310", "drops hook callbacks")
    verdict = support("2.1.310")
    assert verdict.support is Support.KNOWN_BAD
    assert not verdict.support.allowed
    assert "drops hook callbacks" in verdict.message


def test_the_range_is_ordered_and_holds_the_pin() -> None:
    assert version_key(FLOOR) <= version_key(PINNED) <= version_key(NEWEST_TESTED)
    assert version_key("2.1.10") > version_key("2.1.9")  # numeric, not text
    with pytest.raises(ValueError, match="not a Claude Code version"):
        version_key("latest")


def test_the_config_no_longer_marks_a_version_tested() -> None:
    """A copied `[claude] version = X` used to silence the check; it is ignored now."""
    config = decode_config('[claude]\nversion = "9.9.9"\n')
    assert config.claude.version == "9.9.9"  # still loads
    assert support("9.9.9").support is Support.UNTESTED
    assert support("2.0.1").support is Support.TOO_OLD


def test_the_makefile_installs_the_releases_this_module_names() -> None:
    """The Makefile reads the pin, the range and the witness from this module."""
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "claude-versions"],
        cwd=INSTALLED_BINARY.parents[4],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert dict(zip(out[::2], out[1::2], strict=True)) == {
        "pin": PINNED,
        "floor": FLOOR,
        "newest": NEWEST_TESTED,
        "witness": claude_binary.AUTO_DEFAULT_WITNESS,
    }
