"""How the runner starts claude: argv, environment, flags hash, key, identity file, homes."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from capsules.runner.command import (
    MCP_CONFIG,
    Launch,
    build_launch,
    flags_hash,
    hash_token,
    mint_token,
    read_api_key,
    unsafe_home,
)
from sage.config import Config, PrincipalConfig, decode_config
from sage.errors import ConfigError

UUID = "0b6c6f44-3a2b-4c0e-9d7e-8f1a2b3c4d5e"


def _config(tmp_path: Path, text: str = "") -> Config:
    return decode_config(f'[supervisor]\nstate_dir = "state"\n{text}', base_dir=str(tmp_path))


def _launch(config: Config, principal: PrincipalConfig, **kw: object) -> Launch:
    args: dict[str, object] = {
        "session_id": "s1",
        "claude_session": UUID,
        "binary": Path("/opt/claude"),
        "token": "tok-secret",
        "api_key": "sk-secret",
        "identity": None,
    }
    args.update(kw)
    return build_launch(config, principal, **args)  # type: ignore[arg-type]


def test_flags_hash_is_sha256_over_nul_terminated_args() -> None:
    argv = ["claude", "-p", "", "--tools"]
    expected = hashlib.sha256(b"claude\0-p\0\0--tools\0").hexdigest()
    assert flags_hash(argv) == f"sha256:{expected}"
    # the NUL keeps ["ab", "c"] and ["a", "bc"] apart
    assert flags_hash(["ab", "c"]) != flags_hash(["a", "bc"])


def test_headless_command_line(tmp_path: Path) -> None:
    config = _config(tmp_path)
    principal = PrincipalConfig(name="alice", model="claude-x", max_turns=3)
    launch = _launch(config, principal)
    argv = launch.argv
    assert argv[:2] == ["/opt/claude", "-p"]
    assert argv[argv.index("--tools") + 1] == ""
    assert argv[argv.index("--mcp-config") + 1] == MCP_CONFIG
    assert "--strict-mcp-config" in argv
    assert argv[argv.index("--permission-prompt-tool") + 1] == "stdio"
    # never the CLI's default, which was "auto" (its own classifier) in 2.1.296-2.1.301
    assert argv[argv.index("--permission-mode") + 1] == "default"
    assert launch.permission_mode == "default"
    assert argv[argv.index("--model") + 1] == "claude-x"
    assert argv[argv.index("--max-turns") + 1] == "3"
    assert argv[-1] == f"--session-id={UUID}"  # one token: never read as a flag
    assert launch.flags_hash == flags_hash(argv)
    assert "sk-secret" not in " ".join(argv)
    assert "tok-secret" not in " ".join(argv)
    resumed = _launch(config, principal, resume=True)
    assert resumed.argv[-1] == f"--resume={UUID}"
    bare = _launch(config, PrincipalConfig(name="bob"))
    assert "--model" not in bare.argv
    assert "--max-turns" not in bare.argv


def test_clean_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SECRET_OF_THE_DAEMON", "x")
    monkeypatch.setenv("LANG", "de_DE.UTF-8")
    config = _config(tmp_path, '[claude]\nenv = { ANTHROPIC_BASE_URL = "http://127.0.0.1:9" }\n')
    launch = _launch(config, PrincipalConfig(name="alice"))
    env = launch.env
    home = tmp_path / "state" / "homes" / "alice"
    assert env["HOME"] == str(home)
    assert launch.cwd == home
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert env["ASTRID_PRINCIPAL_ID"] == "alice"
    assert env["ASTRID_SESSION_ID"] == "s1"
    assert env["ASTRID_HOOK_TOKEN"] == "tok-secret"
    assert env["ANTHROPIC_API_KEY"] == "sk-secret"
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"
    assert env["LANG"] == "de_DE.UTF-8"
    assert "SECRET_OF_THE_DAEMON" not in env
    assert set(env) <= {
        "HOME",
        "PATH",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "ASTRID_PRINCIPAL_ID",
        "ASTRID_SESSION_ID",
        "ASTRID_HOOK_TOKEN",
        "ASTRID_SOCKET",
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_BASE_URL",
    }
    sub = _launch(config, PrincipalConfig(name="carol", auth_mode="subscription"))
    assert "ANTHROPIC_API_KEY" not in sub.env


def test_identity_file_is_private_and_falls_back(tmp_path: Path) -> None:
    config = _config(tmp_path)
    launch = _launch(config, PrincipalConfig(name="alice"), identity="You are Alice.")
    path = launch.identity_file
    assert path.read_text() == "You are Alice."
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert launch.identity_fallback is False
    argv = launch.argv
    assert argv[argv.index("--append-system-prompt-file") + 1] == str(path)
    # read afresh on every request, so a resumed conversation takes a changed identity
    assert argv[argv.index("--system-prompt-snapshot") + 1] == "off"
    fallback = _launch(config, PrincipalConfig(name="alice"), identity=None)
    assert fallback.identity_fallback is True
    assert "alice" in fallback.identity_file.read_text()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_api_key_sources(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    config = _config(tmp_path, f'[claude]\napi_key_file = "{key_file}"\n')
    assert read_api_key(config, {"ANTHROPIC_API_KEY": "sk-env"}) == "sk-from-file"
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "anthropic-api-key").write_text("sk-cred")
    plain = _config(tmp_path)
    assert read_api_key(plain, {"CREDENTIALS_DIRECTORY": str(creds)}) == "sk-cred"
    assert read_api_key(plain, {"ANTHROPIC_API_KEY": " sk-env "}) == "sk-env"
    assert read_api_key(plain, {}) is None
    (tmp_path / "dir_key").mkdir()
    broken = _config(tmp_path, f'[claude]\napi_key_file = "{tmp_path / "dir_key"}"\n')
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        read_api_key(broken, {})


def test_unsafe_homes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert unsafe_home(home) is None  # made 0700 later
    home.mkdir(mode=0o700)
    assert unsafe_home(home) is None
    home.chmod(0o777)
    assert "writable by group or others" in (unsafe_home(home) or "")
    home.chmod(0o700)
    (home / ".claude").mkdir(mode=0o700)
    (home / ".claude").chmod(0o770)
    assert ".claude" in (unsafe_home(home) or "")
    link = tmp_path / "link"
    link.symlink_to(home)
    assert "symbolic link" in (unsafe_home(link) or "")
    if os.getuid() == 0:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 1234, 1234)
        assert "owned by uid 1234" in (unsafe_home(other) or "")


def test_tokens() -> None:
    a, b = mint_token(), mint_token()
    assert a != b
    assert len(a) >= 40
    assert hash_token(a) == hashlib.sha256(a.encode()).hexdigest()


def test_pre_allowed_tools_skip_the_approval_prompt(tmp_path: Path) -> None:
    config = _config(tmp_path)
    principal = PrincipalConfig(name="alice", allowed_tools=["mcp__sage__greet", "mcp__sage__wave"])
    argv = _launch(config, principal).argv
    assert argv[argv.index("--allowedTools") + 1] == "mcp__sage__greet,mcp__sage__wave"
    with pytest.raises(ValueError, match="not a tool name"):
        PrincipalConfig(name="alice", allowed_tools=["--dangerously-skip-permissions x"])
