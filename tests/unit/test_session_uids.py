"""Whom claude children run as: config checks, the uid table, the launch, the home helpers.

Real files and real uids (the tests run as root); what a uid can do is tried
with ``setpriv`` as that uid, never inferred from mode bits alone.
"""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
from pathlib import Path

import pytest

from capsules.runner.command import build_launch, flags_hash
from sage.claude.homes import can_run, own_home, unreachable, unsafe_home, write_in_home
from sage.config import Config, PrincipalConfig, decode_config
from sage.errors import ConfigError
from sage.security.runas import RunAs, SessionUids, access_group, emit_launcher, setpriv_prefix

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="uid changes need root")
UUID = "0b6c6f44-3a2b-4c0e-9d7e-8f1a2b3c4d5e"
NOBODY = pwd.getpwnam("nobody").pw_uid


def _config(tmp_path: Path, text: str = "") -> Config:
    return decode_config(f'[supervisor]\nstate_dir = "state"\n{text}', base_dir=str(tmp_path))


def _as(uid: int, *argv: str, groups: tuple[int, ...] = ()) -> subprocess.CompletedProcess[bytes]:
    prefix = ["setpriv", "--reuid", str(uid), "--regid", str(uid)]
    prefix += ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    # through a shell: a direct exec by setpriv still walks paths with root's rights
    return subprocess.run(
        [*prefix, "--", "/bin/sh", "-c", '"$@"', "sh", *argv], capture_output=True
    )


# -- config -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[[principals]]\nname = "a"\nrun_as = "no-such-user-xyz"\n', "no user named"),
        ('[[principals]]\nname = "a"\nrun_as = "root"\n', "is root"),
        ('[[principals]]\nname = "a"\nrun_as = 0\n', "run_as"),
        (
            '[[principals]]\nname = "a"\nrun_as = 5000\n[[principals]]\nname = "b"\nrun_as = 5000\n',
            "also principal 'a'",
        ),
        ('[supervisor]\nadmins = [5000]\n[[principals]]\nname = "a"\nrun_as = 5000\n', "admin"),
        (
            '[[principals]]\nname = "a"\nrun_as = 5000\n[[principals]]\nname = "b"\nuids = [5000]\n',
            "acts for principal 'b'",
        ),
        ('[[principals]]\nname = "a"\nrun_as = 91005\n', r"range of \[sessions\] uid_base"),
        ('[[principals]]\nname = "a"\nrun_as = 90005\n', r"range of \[forge\] sandbox_uid_base"),
        ("[sessions]\nuid_base = 90500\n", "overlaps"),
        ("[sessions]\nuid_base = 65000\n", "65534"),
    ],
)
def test_bad_run_as_and_ranges_are_refused(tmp_path: Path, text: str, message: str) -> None:
    body = text
    if body.startswith("[supervisor]"):  # merge with the state_dir line
        body = body.replace("[supervisor]\n", "")
        with pytest.raises(ConfigError, match=message):
            decode_config(f'[supervisor]\nstate_dir = "s"\n{body}', base_dir=str(tmp_path))
        return
    with pytest.raises(ConfigError, match=message):
        _config(tmp_path, body)


def test_run_as_by_name_or_uid(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        '[[principals]]\nname = "a"\nrun_as = "nobody"\n[[principals]]\nname = "b"\nrun_as = 4321\n',
    )
    a, b = config.principals
    assert a.run_as_uid == NOBODY
    assert b.run_as_uid == 4321


# -- the uid table and the socket's view of it ----------------------------------------


@ROOT_ONLY
def test_session_uids_are_given_once_and_map_back_to_emit_only(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        '[[principals]]\nname = "alice"\n[[principals]]\nname = "bob"\n'
        '[[principals]]\nname = "carol"\nrun_as = 4321\n',
    )
    config.state_dir.mkdir(mode=0o700)
    uids = SessionUids(config)
    uids.allocate()
    alice, bob, carol = config.principals
    ra, rb, rc = uids.run_as(alice), uids.run_as(bob), uids.run_as(carol)
    assert ra is not None
    assert rb is not None
    assert rc is not None
    assert (ra.uid, rb.uid) == (91001, 91002)
    assert (ra.gid, ra.groups) == (91001, (91000,))  # the access group, nothing else
    assert (rc.uid, rc.gid) == (4321, 4321)  # no such user: its own number as group
    # a second table on the same folder (the runner's, the installer's) agrees
    again = SessionUids(config)
    assert again.run_as(bob) == rb
    assert stat.S_IMODE((config.state_dir / "session_uids.json").stat().st_mode) == 0o600
    assert uids.principal_of(91001) == "alice"
    assert uids.principal_of(4321) == "carol"
    for nobody_of_ours in (0, 91000, 91003, NOBODY):
        assert uids.principal_of(nobody_of_ours) is None
    assert access_group(config) == 91000
    # a principal added on reload and given its uid by another table (the runner's)
    grown = _config(
        tmp_path,
        '[[principals]]\nname = "alice"\n[[principals]]\nname = "bob"\n'
        '[[principals]]\nname = "carol"\nrun_as = 4321\n[[principals]]\nname = "dave"\n',
    )
    watcher = SessionUids(grown)  # the supervisor's, whose own allocation did not run
    runner = SessionUids(grown)
    dave = runner.run_as(grown.principals[3])
    assert dave is not None
    assert dave.uid == 91003
    assert watcher.principal_of(91003) == "dave"


@ROOT_ONLY
def test_a_sessions_gid_the_host_uses_is_refused(tmp_path: Path) -> None:
    import grp

    taken = sorted(g.gr_gid for g in grp.getgrall() if 1000 <= g.gr_gid < 65000)
    assert taken, "the test needs a host group with a gid from 1000"
    config = _config(tmp_path, f"[sessions]\nuid_base = {taken[0]}\n")
    with pytest.raises(ConfigError, match="is the host's group"):
        access_group(config)


# -- the launch -----------------------------------------------------------------------


@ROOT_ONLY
def test_a_launch_as_the_principals_uid(tmp_path: Path) -> None:
    tmp_path.chmod(0o711)
    config = _config(tmp_path)
    config.state_dir.mkdir(mode=0o700)
    principal = PrincipalConfig(name="alice")
    run_as = RunAs(91001, 91001, (91000,))
    launch = build_launch(
        config,
        principal,
        session_id="s1",
        claude_session=UUID,
        binary=Path("/opt/claude"),
        token="tok-secret",
        api_key="sk-secret",
        identity="be kind",
        run_as=run_as,
    )
    assert launch.uid == 91001
    assert launch.argv[0] == "/opt/claude"
    assert launch.flags_hash == flags_hash(launch.argv)  # what /proc/<pid>/cmdline shows
    assert launch.command == [*setpriv_prefix(run_as), *launch.argv]
    prefix = list(launch.prefix)
    assert prefix[prefix.index("--reuid") + 1] == "91001"
    assert prefix[prefix.index("--groups") + 1] == "91000"
    assert "--no-new-privs" in prefix
    assert prefix[prefix.index("--pdeathsig") + 1] == "KILL"
    assert "sk-secret" not in " ".join(launch.command)
    home = config.state_dir / "homes" / "alice"
    st = home.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (91001, 91001, 0o700)
    assert stat.S_IMODE((config.state_dir / "homes").stat().st_mode) == 0o711
    # the identity file: the child's to read, in folders it may pass but not list
    identity = launch.identity_file
    assert identity.stat().st_uid == 91001
    assert stat.S_IMODE(identity.stat().st_mode) == 0o400
    config.state_dir.chmod(0o711)  # what the access group gives (tested end to end)
    assert _as(91001, "cat", str(identity)).stdout == b"be kind"
    assert _as(91002, "cat", str(identity)).returncode != 0
    assert _as(91001, "ls", str(identity.parent)).returncode != 0
    assert _as(91001, "touch", str(home / "x")).returncode == 0


def test_no_run_as_no_prefix(tmp_path: Path) -> None:
    config = _config(tmp_path)
    launch = build_launch(
        config,
        PrincipalConfig(name="alice"),
        session_id="s1",
        claude_session=UUID,
        binary=Path("/opt/claude"),
        token="t",
        api_key=None,
        identity=None,
    )
    assert launch.prefix == ()
    assert launch.uid is None
    assert launch.command == launch.argv
    assert launch.identity_file.stat().st_uid == os.getuid()


def test_a_supervisor_that_is_not_root_runs_children_as_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    config = _config(tmp_path, '[[principals]]\nname = "alice"\n')
    uids = SessionUids(config)
    uids.allocate()
    assert uids.run_as(config.principals[0]) is None
    assert uids.principal_of(91001) is None
    assert access_group(config) is None
    assert not (config.state_dir / "session_uids.json").exists()


# -- homes ------------------------------------------------------------------------------


@ROOT_ONLY
def test_own_home_hands_a_supervisor_home_over_without_following_links(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".claude" / "projects").mkdir(parents=True)
    (home / ".claude" / "projects" / "t.jsonl").write_text("x")
    outside = tmp_path / "outside"
    outside.write_text("root's")
    (home / "link").symlink_to(outside)
    assert unsafe_home(home, 91001) is None  # the supervisor's: to be handed over
    own_home(home, 91001, 91001)
    for path in (home, home / ".claude", home / ".claude" / "projects" / "t.jsonl"):
        assert path.lstat().st_uid == 91001, path
    assert (home / "link").lstat().st_uid == 91001
    assert outside.stat().st_uid == 0  # the link's target was not touched
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert unsafe_home(home, 91001) is None
    assert "owned by uid 91001" in (unsafe_home(home, 91002) or "")
    os.chown(home, 91002, 91002)  # another principal's: never taken over
    own_home(home, 91001, 91001)
    assert home.stat().st_uid == 91002


@ROOT_ONLY
def test_write_in_home_never_follows_a_link_the_child_planted(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    target = tmp_path / "etc"
    target.mkdir()
    (home / ".claude").symlink_to(target)
    with pytest.raises(OSError, match="not a folder of the home"):
        write_in_home(home, Path(".claude") / "settings.local.json", b"{}", 91001, 91001)
    assert list(target.iterdir()) == []
    (home / ".claude").unlink()
    (home / ".claude").mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (home / ".claude" / "settings.local.json").symlink_to(victim)
    write_in_home(home, Path(".claude") / "settings.local.json", b"{}", 91001, 91001)
    assert victim.read_text() == "keep"  # the link was replaced, not written through
    written = home / ".claude" / "settings.local.json"
    assert not written.is_symlink()
    st = written.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (91001, 0o600)
    (home / ".astrid" / "forge").mkdir(parents=True)  # the forge's, made as root
    write_in_home(home, Path(".astrid") / "run", b"#!/bin/sh\n", 91001, 91001, mode=0o700)
    assert (home / ".astrid").stat().st_uid == 91001  # the child must pass through it
    assert (home / ".astrid" / "forge").stat().st_uid == 0  # nothing below it is taken
    assert stat.S_IMODE((home / ".astrid" / "run").stat().st_mode) == 0o700


@ROOT_ONLY
def test_reachability_is_judged_as_the_uid(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "in").mkdir(parents=True)
    closed.chmod(0o700)
    tmp_path.chmod(0o711)
    problem = unreachable(closed / "in" / "home", 91001, {91001})
    assert problem is not None
    assert f"cannot pass through {closed}" in problem
    assert _as(91001, "ls", str(closed / "in")).returncode != 0
    closed.chmod(0o710)
    os.chown(closed, 0, 91000)
    assert unreachable(closed / "in" / "home", 91001, {91001, 91000}) is None
    assert _as(91001, "ls", str(closed / "in"), groups=(91000,)).returncode == 0
    assert can_run(Path("/bin/sh"), 91001, {91001})
    assert not can_run(closed / "in", 91001, {91001})


@ROOT_ONLY
def test_the_emit_launcher_runs_as_a_uid_that_cannot_reach_sages_python(
    tmp_path: Path,
) -> None:
    import sys

    run_as = RunAs(91001, 91001, (91000,))
    launcher = emit_launcher(run_as)
    if can_run(Path(sys.executable), 91001, {91001, 91000}):
        assert launcher is None  # sage's own Python serves
        return
    assert launcher is not None
    tmp_path.chmod(0o711)
    script = tmp_path / "astrid-emit"
    script.write_bytes(launcher)
    script.chmod(0o755)
    ran = _as(91001, str(script), "--help", groups=(91000,))
    assert ran.returncode == 0, ran.stderr
    assert b"astrid-emit" in ran.stdout + ran.stderr
