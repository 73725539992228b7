"""The pure half of the sandbox: bind checks, environment and bwrap options."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from sage.errors import SandboxError
from sage.forge.mounts import Bind, ResolvedBind, check_binds, open_binds
from sage.forge.sandbox import Limits, build_args, label_of, sandbox_env, seccomp_program
from sage.forge.sitecustomize import denied, denied_address


def _refused(binds: list[Bind], forbidden: tuple[Path, ...] = (), **kw: object) -> str:
    with pytest.raises(SandboxError) as caught:
        check_binds(binds, forbidden, **kw)  # type: ignore[arg-type]
    assert caught.value.code == "mount_refused"
    return str(caught.value)


def test_resolves_and_sorts_parents_first(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "a")
    out = check_binds([Bind(tmp_path / "link" / "b", "rw"), Bind(tmp_path / "a", "ro")])
    assert [b.path for b in out] == [tmp_path / "a", tmp_path / "a" / "b"]
    assert out[1].mode == "rw"
    assert out[1].is_dir


def test_ro_wins_over_rw_for_the_same_path(tmp_path: Path) -> None:
    out = check_binds([Bind(tmp_path, "rw"), Bind(tmp_path, "ro")])
    assert len(out) == 1
    assert out[0].mode == "ro"


def test_forbidden_inside_equal_and_above(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "inner").mkdir(parents=True)
    for path in (state, state / "inner", tmp_path, Path("/")):
        assert "never mounted" in _refused([Bind(path, "ro")], (state,))


def test_system_paths_are_forbidden() -> None:
    for path in ("/etc/shadow", "/etc", "/proc/self", "/sys", "/dev/null", "/root"):
        if os.path.exists(path):
            _refused([Bind(Path(path), "ro")])


def test_symlink_into_forbidden_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x").symlink_to("/etc")
    assert "resolves to /etc" in _refused([Bind(tmp_path / "x", "ro")])


def test_relative_missing_and_special_files_are_refused(tmp_path: Path) -> None:
    _refused([Bind(Path("relative"), "ro")])
    _refused([Bind(tmp_path / "missing", "ro")])
    os.mkfifo(tmp_path / "fifo")
    assert "neither" in _refused([Bind(tmp_path / "fifo", "ro")])
    _refused([Bind(tmp_path, "xx")])  # type: ignore[arg-type]


def test_access_is_checked_for_the_sandbox_uid() -> None:
    import shutil
    import tempfile

    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        _access_checks(tmp_path)
    finally:
        shutil.rmtree(tmp_path)


def _access_checks(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    (closed / "open").mkdir(parents=True)
    closed.chmod(0o700)
    (closed / "open").chmod(0o755)
    uid = 65534 if os.getuid() != 65534 else 65533
    assert "cannot enter" in _refused([Bind(closed / "open", "ro")], uid=uid, gids=[uid])
    folder = tmp_path / "ro-only"
    folder.mkdir(mode=0o755)
    tmp_path.chmod(0o755)
    closed.chmod(0o755)
    check_binds([Bind(folder, "ro")], uid=uid, gids=[uid])
    assert "read and write" in _refused([Bind(folder, "rw")], uid=uid, gids=[uid])


def test_open_binds_refuses_a_swapped_path(tmp_path: Path) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    checked = check_binds([Bind(folder, "ro")])
    folder.rename(tmp_path / "moved")
    folder.symlink_to("/etc")
    with pytest.raises(SandboxError, match="swapped"):
        open_binds(checked)
    folder.unlink()
    folder.mkdir()  # same name, another inode
    with pytest.raises(SandboxError, match="replaced"):
        open_binds(checked)


def test_env_is_clean_and_validated() -> None:
    env = sandbox_env({"API_KEY": "v"}, shim=True)
    assert env["PATH"]
    assert env["HOME"] == "/tmp"
    assert env["LANG"] == "C.UTF-8"
    assert env["PYTHONPATH"] == "/forge/site"
    assert env["API_KEY"] == "v"
    with pytest.raises(SandboxError):
        sandbox_env({"A=B": "v"}, shim=False)
    with pytest.raises(SandboxError):
        sandbox_env({"A": "v\0"}, shim=False)


def test_build_args(tmp_path: Path) -> None:
    bind = ResolvedBind(tmp_path, "rw", 1, 2, True, tmp_path)
    args = build_args(
        env={"PATH": "/usr/bin"}, binds=[(bind, 7)], impl_fd=5, status_fd=6, network=False
    )
    joined = " ".join(args)
    assert args[0] == "--unshare-all"
    assert "--share-net" not in args
    for flag in ("--die-with-parent", "--new-session", "--clearenv", "--disable-userns"):
        assert flag in args
    assert "--cap-drop ALL" in joined
    assert f"--bind-fd 7 {tmp_path}" in joined
    assert "--ro-bind-data 5 /forge/tool.py" in joined
    assert "/etc/resolv.conf" not in joined
    assert args.index("--clearenv") < args.index("--setenv")
    # every writable tmpfs has a size cap; /dev (bwrap's, uncapped) and / are read-only
    assert f"--size {64 << 20} --tmpfs /tmp" in joined
    assert f"--size {8 << 20} --tmpfs /dev/shm" in joined
    assert args.count("--tmpfs") == 2
    assert args[args.index("--dev") + 1] == "/dev"
    assert "--remount-ro /dev --remount-ro /" in joined
    assert args.index("--tmpfs") > args.index("--dev")
    for size in (0, -1):
        with pytest.raises(SandboxError):
            build_args(env={}, binds=[], impl_fd=5, status_fd=6, network=False, shm_bytes=size)
        with pytest.raises(SandboxError):
            build_args(env={}, binds=[], impl_fd=5, status_fd=6, network=False, tmp_bytes=size)
    assert "--seccomp" not in args
    filtered = build_args(env={}, binds=[], impl_fd=5, status_fd=6, network=False, seccomp_fd=9)
    assert filtered[filtered.index("--seccomp") + 1] == "9"
    net = build_args(env={}, binds=[], impl_fd=5, status_fd=6, network=True, shim_fd=8)
    assert "--share-net" in net
    assert "8" in net
    assert "/forge/site/sitecustomize.py" in net


def test_labels_and_limits() -> None:
    assert label_of(False, True) == "bwrap"
    assert label_of(True, False) == "bwrap+net-noloop"
    assert label_of(True, True) == "bwrap+net"
    from sage.config import ForgeConfig

    limits = Limits.from_config(ForgeConfig())
    assert limits.output_cap == 4 * 1024 * 1024
    assert limits.sandbox_uid == 90000  # the first of the range, never nobody


@pytest.mark.parametrize(
    ("host", "loop", "bad"),
    [
        ("127.0.0.1", False, True),
        ("127.9.9.9", False, True),
        ("::1", False, True),
        ("::ffff:127.0.0.1", False, True),
        ("0.0.0.0", False, True),
        ("169.254.169.254", True, True),
        ("fd00:ec2::254", True, True),
        ("127.0.0.1", True, False),
        ("93.184.216.34", False, False),
        ("2606:4700::1111", False, False),
    ],
)
def test_shim_policy(host: str, loop: bool, bad: bool) -> None:
    assert denied_address(host, loop) is bad


def test_shim_resolves_names_and_abstract_unix() -> None:
    import socket

    assert denied(("localhost", 80), socket.AF_INET)
    assert denied(("", 80), socket.AF_INET)
    assert denied(b"\0abstract", socket.AF_UNIX)
    assert not denied("/tmp/sock", socket.AF_UNIX)


def test_seccomp_program() -> None:
    """arch check, load nr, (x32), one test per denied call, allow, EPERM; 8 bytes each."""
    x86 = seccomp_program("x86_64")
    arm = seccomp_program("aarch64")
    assert x86 is not None
    assert arm is not None
    assert len(x86) == 10 * 8
    assert len(arm) == 9 * 8
    ins = [struct.unpack("=HBBI", x86[i : i + 8]) for i in range(0, len(x86), 8)]
    assert ins[1] == (0x15, 1, 0, 0xC000003E)  # AUDIT_ARCH_X86_64, else the next: kill
    assert ins[2] == (0x06, 0, 0, 0x80000000)
    assert ins[-2] == (0x06, 0, 0, 0x7FFF0000)
    assert ins[-1] == (0x06, 0, 0, 0x00050000 | errno.EPERM)
    for index, (code, jt, _, k) in enumerate(ins[4:8], start=4):
        assert code in (0x15, 0x35), (index, k)
        assert index + 1 + jt == len(ins) - 1, (index, k)  # to the EPERM
    assert {k for _, _, _, k in ins[5:8]} == {319, 29, 68}
    assert seccomp_program("sparc64") is None
