"""astrid config check / show: what the start would fail on, nearest keys, readable TOML."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from sage.cli import main
from sage.config import Config, FleetConfig, PrincipalConfig, decode_config, load_config

ROOT = Path(__file__).resolve().parents[2]


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "supervisor.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "hint"),
    [
        ('[claude]\nbinnary = "x"\n', "claude: Object contains unknown field `binnary`"
         " (did you mean `binary`?)"),
        ("[forge]\nspare_sandbox = 1\n", "(did you mean `spare_sandboxes`?)"),
        ('log_levle = "info"\n', "(did you mean `log_level` under [supervisor]?)"),
        ('[[principals]]\nname = "a"\nallowed_tool = []\n', "(did you mean `allowed_tools`?)"),
    ],
)  # fmt: skip
def test_a_misspelt_key_gets_the_nearest_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, hint: str
) -> None:
    assert main(["config", "check", _file(tmp_path, text)]) == 1
    assert hint in capsys.readouterr().err


def test_unknown_capsules_fail_the_check_as_they_would_fail_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = '[supervisor]\ncapsules = ["runner", "greter", "./nowhere/cap"]\n'
    assert main(["config", "check", _file(tmp_path, text)]) == 1
    err = capsys.readouterr().err
    assert "no built-in capsule 'greter' (did you mean 'greeter'?)" in err
    assert "./nowhere/cap: no Capsule.toml in that folder" in err
    assert main(["config", "check", "--json", _file(tmp_path, text)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert len(report["errors"]) == 2


def test_a_fleet_without_credentials_fails_the_check_and_insecure_no_auth_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the start would: no credentials is an error, the insecure flag a warning."""
    fleet = '[fleet]\nurl = "nats://127.0.0.1:4222"\nnode = "a"\n'
    assert main(["config", "check", "--json", _file(tmp_path, fleet)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    (error,) = report["errors"]
    assert error.startswith("fleet: no credentials:"), error
    insecure = fleet + "insecure_no_auth = true\n"
    assert main(["config", "check", "--json", _file(tmp_path, insecure)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["errors"] == []
    assert [w for w in report["warnings"] if w.startswith("fleet.insecure_no_auth:")]


def test_allowed_tools_naming_no_tool_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        '[[principals]]\nname = "alice"\nuids = [1000]\n'
        'allowed_tools = ["mcp__sage__greet", "mcp__sage__gret", "mcp__sage__*",'
        ' "mcp__forge__fib", "Read"]\n'
    )
    assert main(["config", "check", _file(tmp_path, text)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("warning:") == 1
    assert "'mcp__sage__gret' names no tool" in captured.err
    assert "(did you mean 'mcp__sage__greet'?)" in captured.err
    assert "1 principal," in captured.out
    assert "1 warning)" in captured.out


def test_show_prints_toml_that_reads_back_as_the_same_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        '[claude]\nenv = { ANTHROPIC_BASE_URL = "http://x" }\n'
        '[[principals]]\nname = "alice"\nuids = [1000]\nmodel = "m"\n'
    )
    path = _file(tmp_path, text)
    assert main(["config", "show", "--config", path]) == 0
    out = capsys.readouterr().out
    assert "[supervisor]\n" in out
    assert '\n[[principals]]\nname = "alice"\n' in out
    assert "http://x" not in out  # env values may be keys: hidden
    shown = decode_config(out.replace('"<hidden>"', '"http://x"'))
    assert shown == msgspec.structs.replace(load_config(path), base_dir="")
    assert main(["--json", "config", "show", "--config", path]) == 0
    assert json.loads(capsys.readouterr().out)["principals"][0]["model"] == "m"


#: Keys kept only to refuse them with a message (their value must stay unset).
REFUSED = {("forge", "sandbox_uid")}


def test_supervisor_toml_names_every_key() -> None:
    """The repository's supervisor.toml is the reference: every key appears in it."""
    text = (ROOT / "supervisor.toml").read_text()
    missing = []
    for section in msgspec.structs.fields(Config):
        if section.encode_name in ("base_dir", "principals", "fleet"):
            continue
        for field in msgspec.structs.fields(type(getattr(Config(), section.name))):
            if (section.encode_name, field.encode_name) in REFUSED:
                continue
            if f"\n{field.encode_name} =" not in text:
                missing.append(f"[{section.encode_name}] {field.encode_name}")
    for field in msgspec.structs.fields(PrincipalConfig):
        if f"\n# {field.encode_name} =" not in text:
            missing.append(f"[[principals]] {field.encode_name}")
    for field in msgspec.structs.fields(FleetConfig):  # optional: shown commented out
        if f"\n# {field.encode_name} =" not in text:
            missing.append(f"[fleet] {field.encode_name}")
    assert missing == []


def test_max_live_at_or_below_the_per_principal_cap_is_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One principal's cap reaching max_live is said, not accepted silently."""
    two = '[[principals]]\nname = "alice"\n[[principals]]\nname = "bob"\n'
    text = "[sessions]\nmax_live = 3\n[limits]\nmax_sessions_per_principal = 4\n" + two
    assert main(["config", "check", _file(tmp_path, text)]) == 0
    err = capsys.readouterr().err
    assert "warning: sessions.max_live = 3 is at or below" in err
    assert "one principal could hold every live slot" in err
    fine = "[sessions]\nmax_live = 8\n" + two
    assert main(["config", "check", _file(tmp_path, fine)]) == 0
    assert "max_live" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "values"),
    [
        ('[supervisor]\nlog_level = "verbose"\n', "one of: debug, info, warning, error"),
        ('[[principals]]\nname = "a"\ninteraction_mode = "cli"\n', "one of: headless, repl"),
        ('[[principals]]\nname = "a"\nauth_mode = "key"\n', "one of: api_key, subscription"),
        ('[limits]\nself_allow_rules = "all"\n', "one of: exact, prefix, any"),
        ('[fleet]\nnode = "a"\nplacement = "x"\n', "one of: local, least_loaded"),
    ],
)
def test_a_value_outside_a_keys_set_lists_the_valid_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, values: str
) -> None:
    """An enum error names the values the key takes, not only the one it refused."""
    assert main(["config", "check", _file(tmp_path, text)]) == 1
    err = capsys.readouterr().err
    assert "Invalid enum value" in err
    assert values in err


def test_a_missing_socket_names_the_config_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No supervisor at the config's socket: the error names the config, the likely cause."""
    config = _file(tmp_path, f'[supervisor]\nstate_dir = "{tmp_path}/state"\n')
    assert main(["status", "--config", config]) == 1
    err = capsys.readouterr().err
    assert (
        f"no supervisor socket at {tmp_path}/state/run/astrid.sock (from --config {config})" in err
    )
    assert "no supervisor runs with that config" in err


def test_a_relative_astrid_config_that_is_not_here_says_how_to_export_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`export ASTRID_CONFIG=my.toml`, then `cd`: the error says to export it absolute."""
    monkeypatch.setenv("ASTRID_CONFIG", "my.toml")
    monkeypatch.chdir(tmp_path)
    assert main(["status"]) == 1
    err = capsys.readouterr().err
    assert "ASTRID_CONFIG=my.toml is relative" in err
    assert "export ASTRID_CONFIG=$PWD/my.toml" in err
