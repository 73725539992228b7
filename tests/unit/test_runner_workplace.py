"""What a spawn may ask for: a working folder inside the allowed roots, an allowed model."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from capsules.runner.errors import SessionError
from capsules.runner.workplace import chosen_model, work_folder
from sage.config import PrincipalConfig


def _principal(**fields: object) -> PrincipalConfig:
    return PrincipalConfig(name="alice", **fields)  # type: ignore[arg-type]


def _refused(code: str, func: object, *args: object) -> str:
    with pytest.raises(SessionError) as info:
        func(*args)  # type: ignore[operator]
    assert info.value.code == code
    return str(info.value)


def test_no_folder_asked_is_the_home(tmp_path: Path) -> None:
    assert work_folder(_principal(), tmp_path, None) == ""


def test_the_home_and_the_work_roots_with_their_subfolders(tmp_path: Path) -> None:
    home, root = tmp_path / "home", tmp_path / "projects"
    (home / "notes").mkdir(parents=True)
    (root / "app" / "src").mkdir(parents=True)
    alice = _principal(work_roots=[str(root)])
    assert work_folder(alice, home, str(home)) == str(home)
    assert work_folder(alice, home, str(home / "notes")) == str(home / "notes")
    assert work_folder(alice, home, str(root)) == str(root)
    assert work_folder(alice, home, str(root / "app" / "src")) == str(root / "app" / "src")
    # the resolved path is what the session gets: no dot-dot, no link
    assert work_folder(alice, home, f"{root}/app/../app") == str(root / "app")


def test_outside_the_roots_is_refused_and_says_where_it_may(tmp_path: Path) -> None:
    home, root, other = tmp_path / "home", tmp_path / "projects", tmp_path / "projects-old"
    for folder in (home, root, other):
        folder.mkdir()
    alice = _principal(work_roots=[str(root)])
    text = _refused("cwd_not_allowed", work_folder, alice, home, str(other))  # prefix only
    assert str(root) in text
    assert "work_roots" in text
    _refused("cwd_not_allowed", work_folder, alice, home, "/")
    _refused("cwd_not_allowed", work_folder, alice, home, f"{root}/../projects-old")
    _refused("cwd_not_allowed", work_folder, _principal(), home, str(root))  # no roots: home


def test_a_link_out_of_a_root_is_refused(tmp_path: Path) -> None:
    home, root, secret = tmp_path / "home", tmp_path / "projects", tmp_path / "secret"
    for folder in (home, root, secret):
        folder.mkdir()
    os.symlink(secret, root / "escape")
    _refused(
        "cwd_not_allowed", work_folder, _principal(work_roots=[str(root)]), home, f"{root}/escape"
    )


def test_bad_or_missing_folders(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "file").write_text("x")
    alice = _principal()
    for bad in ("relative/dir", "", "/tmp/a\0b"):
        _refused("bad_cwd", work_folder, alice, home, bad)
    _refused("cwd_missing", work_folder, alice, home, str(home / "nope"))
    _refused("cwd_missing", work_folder, alice, home, str(home / "file"))


def test_models_the_config_allows() -> None:
    alice = _principal(model="claude-sonnet-5", models=["claude-haiku-5", "claude-opus-5-5[1m]"])
    assert chosen_model(alice, None) == ""
    assert chosen_model(alice, "claude-sonnet-5") == "claude-sonnet-5"
    assert chosen_model(alice, "claude-opus-5-5[1m]") == "claude-opus-5-5[1m]"
    text = _refused("model_not_allowed", chosen_model, alice, "claude-opus-5")
    assert "claude-haiku-5" in text
    assert "none but the CLI's default" in _refused(
        "model_not_allowed", chosen_model, _principal(), "claude-haiku-5"
    )
    for bad in ("--dangerously-skip-permissions", "../x", "a b", "x" * 101, ""):
        _refused("bad_model", chosen_model, alice, bad)


@pytest.mark.parametrize(("field", "value"), [("work_roots", ["relative"]), ("models", ["--flag"])])
def test_the_config_refuses_bad_roots_and_models(field: str, value: list[str]) -> None:
    with pytest.raises(ValueError, match=field):
        _principal(**{field: value})


@pytest.mark.parametrize(
    ("kinds", "error"),
    [
        ([{"cwd": "relative/dir"}], "is not an absolute path"),
        ([{"model": "--dangerous"}], "is not a model name"),
        ([{"cwd": "/srv"}] * 9, "spare_kinds"),
        ([{"folder": "/srv"}], "folder"),
    ],
)
def test_spare_kinds_are_checked_when_the_config_is_read(
    kinds: list[dict[str, str]], error: str
) -> None:
    with pytest.raises(msgspec.ValidationError, match=error):
        msgspec.convert({"name": "alice", "spare_kinds": kinds}, PrincipalConfig)
