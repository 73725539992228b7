"""sage/claude/homes.py: what a principal's home may be, how files are written in it,
who can reach and run what, and where the operator's API key comes from.

(More of the same, as real uids: tests/unit/test_session_uids.py; the runner's
use of them: tests/unit/test_runner_command.py.)"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from sage.claude.homes import (
    API_KEY_CREDENTIAL,
    can_run,
    own_home,
    read_api_key,
    unreachable,
    unsafe_home,
    write_in_home,
)
from sage.config import Config, decode_config
from sage.errors import ConfigError
from sage.files import write_replace

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as other uids")
OTHER = 91001  # a uid that is neither the test's nor root
#: tests/conftest.py makes the folders above tmp_path passable by other uids only as root.
PASSABLE = pytest.mark.skipif(os.geteuid() != 0, reason="tmp_path is passable by others as root")


@pytest.fixture
def umask0() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _config(tmp_path: Path, text: str = "") -> Config:
    return decode_config(f'[supervisor]\nstate_dir = "state"\n{text}', base_dir=str(tmp_path))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# -- the API key ------------------------------------------------------------------------


def test_the_key_file_comes_first_then_credentials_then_the_environment(tmp_path: Path) -> None:
    (tmp_path / "key").write_text("sk-file\n")
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / API_KEY_CREDENTIAL).write_text("sk-cred\n")
    env = {"CREDENTIALS_DIRECTORY": str(creds), "ANTHROPIC_API_KEY": "sk-env"}
    # a relative key file is the config file's folder's
    with_file = _config(tmp_path, '[claude]\napi_key_file = "key"\n')
    assert read_api_key(with_file, env) == "sk-file"
    assert read_api_key(_config(tmp_path), env) == "sk-cred"
    assert read_api_key(_config(tmp_path), {"ANTHROPIC_API_KEY": "sk-env"}) == "sk-env"


def test_an_empty_or_missing_key_file_falls_through(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("  \n")
    env = {"ANTHROPIC_API_KEY": "sk-env"}
    assert read_api_key(_config(tmp_path, '[claude]\napi_key_file = "empty"\n'), env) == "sk-env"
    assert read_api_key(_config(tmp_path, '[claude]\napi_key_file = "absent"\n'), env) == "sk-env"
    assert read_api_key(_config(tmp_path), {"ANTHROPIC_API_KEY": "   "}) is None


def test_an_unreadable_key_file_is_a_config_error_not_a_fallback(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    config = _config(tmp_path, '[claude]\napi_key_file = "folder"\n')
    with pytest.raises(ConfigError, match="cannot read the API key file"):
        read_api_key(config, {"ANTHROPIC_API_KEY": "sk-env"})


# -- which homes may be used ------------------------------------------------------------


def test_a_private_home_or_one_still_to_make_is_safe(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert unsafe_home(home) is None
    home.mkdir(mode=0o700)
    (home / ".claude").mkdir(mode=0o755)  # readable is fine; writable is not
    assert unsafe_home(home) is None


@pytest.mark.parametrize("where", ["home", "home/.claude"])
@pytest.mark.parametrize("mode", [0o770, 0o707, 0o720, 0o702])
def test_a_home_others_can_write_is_unsafe(tmp_path: Path, where: str, mode: int) -> None:
    (tmp_path / "home" / ".claude").mkdir(parents=True, mode=0o700)
    (tmp_path / where).chmod(mode)
    assert f"{tmp_path / where} is writable by group or others" in (
        unsafe_home(tmp_path / "home") or ""
    )


def test_a_linked_home_or_claude_folder_is_unsafe(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "home").symlink_to(real)
    assert "is a symbolic link" in (unsafe_home(tmp_path / "home") or "")
    home = tmp_path / "home2"
    home.mkdir(mode=0o700)
    (home / ".claude").symlink_to(real)
    assert f"{home / '.claude'} is a symbolic link" in (unsafe_home(home) or "")


@ROOT_ONLY
def test_a_home_is_the_supervisors_or_the_principals_children_s(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    os.chown(home, OTHER, OTHER)
    assert unsafe_home(home, OTHER) is None
    assert "not the supervisor's uid 0" in (unsafe_home(home) or "")
    assert f"not the principal's children's uid {OTHER + 1}" in (unsafe_home(home, OTHER + 1) or "")


# -- making and handing over homes ------------------------------------------------------


@ROOT_ONLY
def test_own_home_makes_a_missing_home_the_childs_behind_a_passable_folder(
    tmp_path: Path, umask0: None
) -> None:
    homes = tmp_path / "homes"
    homes.mkdir(mode=0o700)
    own_home(homes / "alice", OTHER, OTHER, homes_dir=homes)
    assert _mode(homes) == 0o711  # passable by the child, never listable
    home = homes / "alice"
    assert (home.stat().st_uid, home.stat().st_gid, _mode(home)) == (OTHER, OTHER, 0o700)


def test_own_home_tightens_a_home_to_0700(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    own_home(home, os.getuid(), os.getgid())
    assert _mode(home) == 0o700


# -- writing --------------------------------------------------------------------------


def test_write_replace_is_0600_in_0700_whatever_the_umask(tmp_path: Path, umask0: None) -> None:
    path = tmp_path / "a" / "b" / "file"
    write_replace(path, b"one")
    assert (path.read_bytes(), _mode(path)) == (b"one", 0o600)
    assert _mode(path.parent) == 0o700


def test_write_replace_replaces_a_link_never_writes_through_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "file"
    path.symlink_to(victim)
    write_replace(path, b"new")
    assert victim.read_text() == "keep"
    assert not path.is_symlink()
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "victim"]  # no temp left


@ROOT_ONLY
def test_write_in_home_makes_missing_folders_the_childs(tmp_path: Path, umask0: None) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    write_in_home(home, Path(".claude") / "deep" / "settings.json", b"{}", OTHER, OTHER)
    for folder in (home / ".claude", home / ".claude" / "deep"):
        assert (folder.stat().st_uid, _mode(folder)) == (OTHER, 0o700), folder
    written = home / ".claude" / "deep" / "settings.json"
    assert (written.read_bytes(), written.stat().st_uid, _mode(written)) == (b"{}", OTHER, 0o600)
    assert [p.name for p in written.parent.iterdir()] == ["settings.json"]


def test_write_in_home_refuses_a_linked_home(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "home").symlink_to(real)
    with pytest.raises(OSError, match=r"symbolic links|Not a directory"):
        write_in_home(tmp_path / "home", Path("f"), b"x", os.getuid(), os.getgid())
    assert list(real.iterdir()) == []


# -- reaching and running -----------------------------------------------------------------


@PASSABLE
def test_the_execute_bit_that_applies_is_the_owners_the_groups_or_others(
    tmp_path: Path,
) -> None:
    tmp_path.chmod(0o711)
    tool = tmp_path / "tool"
    tool.write_text("#!/bin/sh\n")
    me, gid = os.getuid(), os.getgid()
    tool.chmod(0o700)
    assert can_run(tool, me, set())
    assert not can_run(tool, OTHER, {OTHER})
    tool.chmod(0o710)
    assert can_run(tool, OTHER, {gid})
    assert not can_run(tool, OTHER, {OTHER})
    tool.chmod(0o601)  # others may, the owner may not: the owner's bit is the one
    assert can_run(tool, OTHER, {OTHER})
    assert not can_run(tool, me, {gid})
    link = tmp_path / "link"
    link.symlink_to(tool)
    assert can_run(link, OTHER, {OTHER})  # judged on the target
    assert not can_run(tmp_path / "absent", me, {gid})


@PASSABLE
def test_a_folder_on_the_way_without_search_rights_is_named(tmp_path: Path) -> None:
    tmp_path.chmod(0o711)
    closed = tmp_path / "closed"
    (closed / "in").mkdir(parents=True)
    closed.chmod(0o750)
    problem = unreachable(closed / "in" / "home", OTHER, {OTHER})
    assert problem is not None
    assert f"uid {OTHER} cannot pass through {closed} (mode 750" in problem
    assert unreachable(closed / "in" / "home", OTHER, {closed.stat().st_gid}) is None
    tool = closed / "in" / "tool"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    assert not can_run(tool, OTHER, {OTHER})  # its own bits allow it; the way does not


# -- the folders above a working folder -----------------------------------------------


def test_ancestors_of_ours_are_fine_and_a_sticky_tmp_too(tmp_path: Path) -> None:
    from sage.claude.homes import unsafe_ancestors

    work = tmp_path / "projects" / "app"
    work.mkdir(parents=True)
    assert unsafe_ancestors(work) is None  # /tmp is 1777, but what is below it is ours


def test_an_ancestor_others_may_write_lets_them_swap_the_folder(tmp_path: Path) -> None:
    from sage.claude.homes import unsafe_ancestors

    shared = tmp_path / "shared"
    (shared / "app").mkdir(parents=True)
    shared.chmod(0o777)  # not sticky: anyone may rename app away and put theirs there
    problem = unsafe_ancestors(shared / "app")
    assert problem is not None
    assert "could swap" in problem
    shared.chmod(0o1777)  # sticky: only app's owner (us) may rename it
    assert unsafe_ancestors(shared / "app") is None


@ROOT_ONLY
def test_an_ancestor_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    from sage.claude.homes import unsafe_ancestors

    theirs = tmp_path / "theirs"
    (theirs / "app").mkdir(parents=True)
    os.chown(theirs, 4242, 4242)
    problem = unsafe_ancestors(theirs / "app")
    assert problem is not None
    assert "owned by uid 4242" in problem
    assert unsafe_ancestors(theirs / "app", owner=4242) is None  # the child's own


def test_a_linked_ancestor_is_refused(tmp_path: Path) -> None:
    from sage.claude.homes import unsafe_ancestors

    (tmp_path / "real" / "app").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    problem = unsafe_ancestors(tmp_path / "link" / "app")
    assert problem is not None
    assert "symbolic link" in problem
