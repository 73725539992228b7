"""Config: the embedded defaults, supervisor.toml, and one clear line per bad field."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from sage.config import Config, decode_config, load_config
from sage.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_repository_file_equals_embedded_defaults() -> None:
    """supervisor.toml spells out exactly the defaults in sage/config.py."""
    from_file = load_config(ROOT / "supervisor.toml")
    assert msgspec.structs.replace(from_file, base_dir="") == Config()


def test_no_file_gives_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --config or ASTRID_CONFIG the embedded defaults apply."""
    monkeypatch.delenv("ASTRID_CONFIG", raising=False)
    assert load_config() == Config()


def test_astrid_config_env_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ASTRID_CONFIG names the file when --config is absent."""
    file = tmp_path / "s.toml"
    file.write_text("[bus]\nqueue_size = 7\n")
    monkeypatch.setenv("ASTRID_CONFIG", str(file))
    assert load_config().bus.queue_size == 7


def test_relative_paths_resolve_against_the_file(tmp_path: Path) -> None:
    """state_dir and socket in a file are relative to the file's folder."""
    file = tmp_path / "conf" / "s.toml"
    file.parent.mkdir()
    file.write_text('[supervisor]\nstate_dir = "st"\n')
    config = load_config(file)
    assert config.state_dir == tmp_path / "conf" / "st"
    assert config.socket_path == tmp_path / "conf" / "st" / "run" / "astrid.sock"


def test_defaults_resolve_against_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded defaults put state in ./.state of the current folder."""
    monkeypatch.chdir(tmp_path)
    assert Config().state_dir == tmp_path / ".state"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[bus]\nmax_payload = "big"\n', "bus.max_payload: Expected `int`, got `str`"),
        ("[bus]\nmax_payload = -1\n", "bus.max_payload: Expected `int` >= 1"),
        ("[bus]\nqueue_size = 0\n", "bus.queue_size"),
        ("[buss]\nx = 1\n", "unknown field `buss`"),
        ("[bus]\nwhat = 1\n", "unknown field `what`"),
        ('[[principals]]\nname = "../etc"\n', "principals[0].name"),
        ('[[principals]]\nname = "alice\\n"\n', "principals[0].name"),
        ('[socket]\ngroup = "no-such-group-here"\n', "no group named"),
        ('[supervisor]\nstate_dir = "/' + "x" * 120 + '"\n', "longer than 107 bytes"),
        ('[[principals]]\nname = "a"\nuids = [-1]\n', "principals[0].uids[0]"),
        ('[[principals]]\nname = "a"\n[[principals]]\nname = "a"\n', "declared twice"),
        ('[bus]\nuser_publish = ["a..b"]\n', "empty token"),
        ('[supervisor]\nlog_level = "loud"\n', "supervisor.log_level"),
        ("[bus\n", "not valid TOML"),
        ('base_dir = "/x"\n', "base_dir"),
    ],
)
def test_bad_field_is_named_in_one_line(text: str, expected: str) -> None:
    """A bad value fails with one line that names the file, the field and the problem."""
    with pytest.raises(ConfigError) as info:
        decode_config(text, source="f.toml")
    message = str(info.value)
    assert message.startswith("f.toml: ")
    assert expected in message
    assert "\n" not in message


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    """A missing file is a ConfigError naming it, not a traceback."""
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "nope.toml")


def test_config_is_frozen() -> None:
    """The decoded config cannot be changed after validation."""
    config = Config()
    with pytest.raises(AttributeError):
        config.bus = config.bus  # type: ignore[misc]


def test_principals_for_uid_and_admins(tmp_path: Path) -> None:
    """A uid acts for the principals listing it; admins and our own uid act for all."""
    other = os.getuid() + 1000
    config = decode_config(
        f"[supervisor]\nadmins = [{other + 1}]\n"
        f'[[principals]]\nname = "alice"\nuids = [{other}]\n'
        '[[principals]]\nname = "bob"\nuids = []\n'
    )
    assert config.principals_for_uid(other) == {"alice"}
    assert config.principals_for_uid(other + 2) == frozenset()
    assert config.principals_for_uid(other + 1) == {"alice", "bob"}
    assert config.principals_for_uid(os.getuid()) == {"alice", "bob"}
