"""astrid doctor and its probes: a real bwrap sandbox, fake claude binaries, real permissions."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import sage.claude.binary as claude_binary
from sage.claude.binary import FLOOR, NEWEST_TESTED
from sage.cli import main
from sage.security.bwrap import probe_bwrap, sandbox_argv
from tests.support.daemon import ASTRID, Daemon, short_dir
from tests.support.refusing_api import refusing_api

SECRET = "sk-ant-do-not-print-me"
_PRINCIPAL = '\n[[principals]]\nname = "alice"\nuids = [4242]\n'


def _fake_claude(folder: Path, version: str) -> Path:
    path = folder / "fake-claude"
    path.write_text(f"#!/bin/sh\necho '{version} (Claude Code)'\n")
    path.chmod(0o755)
    return path


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    with refusing_api() as url:
        yield url


_API_URL = ""


@pytest.fixture(autouse=True)
def _local_api(api_url: str) -> None:
    """Every config this module writes points its sessions at the local API above."""
    global _API_URL
    _API_URL = api_url


def _setup(
    root: Path, *, version: str = "2.1.328", state_mode: int | None = 0o700, extra: str = ""
) -> Path:
    """A config in ``root`` with a fake claude printing ``version`` and a state folder."""
    binary = _fake_claude(root, version)
    if state_mode is not None:
        (root / "state").mkdir()
        (root / "state").chmod(state_mode)
    config = root / "supervisor.toml"
    config.write_text(
        f'[supervisor]\nstate_dir = "state"\n\n[claude]\nbinary = "{binary}"\n'
        f'env = {{ ANTHROPIC_API_KEY = "{SECRET}", ANTHROPIC_BASE_URL = "{_API_URL}" }}\n'
        f"{extra}"
    )
    return config


def _doctor(capsys: pytest.CaptureFixture[str], config: Path) -> tuple[int, dict[str, Any]]:
    code = main(["doctor", "--config", str(config), "--json"])
    report = json.loads(capsys.readouterr().out)
    return code, report


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["checks"]}


# -- bwrap --------------------------------------------------------------------


@pytest.mark.anyio
async def test_bwrap_runs_a_sandbox_here() -> None:
    """bubblewrap is installed here (and in CI) and really runs the minimal sandbox."""
    probe = await probe_bwrap()
    assert probe.ok, probe.reason
    assert probe.path.endswith("/bwrap")
    assert probe.version[0].isdigit()
    assert probe.reason == ""


@pytest.mark.anyio
async def test_bwrap_missing_from_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no bwrap on PATH the probe is not ok and says so."""
    monkeypatch.setenv("PATH", str(tmp_path))
    probe = await probe_bwrap()
    assert not probe.ok
    assert probe.path == ""
    assert "bwrap not found on PATH" in probe.reason


@pytest.mark.anyio
async def test_bwrap_whose_sandbox_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bwrap that answers --version but cannot sandbox is not ok, with its exit and stderr."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo "bubblewrap 0.9.1"; exit 0; }\n'
        'echo "bwrap: No permissions to create new namespace" >&2; exit 1\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    probe = await probe_bwrap()
    assert not probe.ok
    assert probe.path == str(fake)
    assert probe.version == "0.9.1"
    assert probe.reason == (
        "a minimal sandbox exited with code 1: bwrap: No permissions to create new namespace"
    )


@pytest.mark.anyio
async def test_bwrap_that_hangs_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bwrap that never finishes is reported as a timeout, not waited for."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\nexec sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    probe = await probe_bwrap(timeout=0.5)
    assert not probe.ok
    assert probe.reason == "bwrap did not finish within 0.5 s"


def test_sandbox_follows_the_root_layout(tmp_path: Path) -> None:
    """Top-level symlinks (merged /usr) are recreated; real top-level folders are bound."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").symlink_to("usr/lib")
    argv = sandbox_argv("bwrap", tmp_path)
    joined = " ".join(argv)
    assert "--ro-bind /bin /bin" in joined
    assert "--symlink usr/lib /lib" in joined
    assert "/lib64" not in joined
    assert argv[-2:] == ["--", "/bin/true"]


# -- astrid doctor --------------------------------------------------------------


def test_world_writable_state_folder_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0777 state folder is a fail naming the fix, and the exit status is 1."""
    config = _setup(tmp_path, state_mode=0o777)
    code, report = _doctor(capsys, config)
    assert code == 1
    assert report["ok"] is False
    state = _rows(report)["state"]
    assert state["status"] == "fail"
    assert "0777" in state["detail"]
    assert "group or others can write to it" in state["detail"]
    assert f"chmod 700 {tmp_path / 'state'}" in state["detail"]


def test_group_readable_state_folder_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 0750 state folder without socket.group is readable beyond what it needs: fail."""
    config = _setup(tmp_path, state_mode=0o750)
    code, report = _doctor(capsys, config)
    assert code == 1
    assert "group or others can read it" in _rows(report)["state"]["detail"]


@pytest.mark.skipif(os.geteuid() != 0, reason="the access group is a root supervisor's")
def test_a_state_folder_of_the_childrens_access_group_is_ok_as_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0750 is what a root supervisor makes for its claude children's group (gid 91000)."""
    config = _setup(tmp_path, state_mode=0o750)
    os.chown(tmp_path / "state", -1, 91000)
    _, report = _doctor(capsys, config)
    assert _rows(report)["state"]["status"] == "ok", report
    os.chown(tmp_path / "state", -1, 91001)  # a group that is not the access group
    code, report = _doctor(capsys, config)
    assert code == 1
    assert "group or others can read it" in _rows(report)["state"]["detail"]


def test_good_host_has_no_fail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 0700 state folder and a tested claude: no fail, exit 0; keys and socket not there yet."""
    config = _setup(tmp_path)
    code, report = _doctor(capsys, config)
    assert code == 0
    assert report["ok"] is True
    rows = _rows(report)
    assert list(rows) == [
        "config", "claude", "api", "bwrap", "state", "homes", "keys", "socket"
    ]  # fmt: skip
    assert rows["api"]["status"] == "ok"
    assert rows["api"]["detail"] == (
        f"{_API_URL} answers (HTTP 401); sessions and astrid llm generate use it"
    )
    assert rows["config"]["status"] == "ok"
    assert rows["config"]["source"] == str(config)
    assert rows["claude"] == {
        "name": "claude",
        "status": "ok",
        "detail": f"{tmp_path / 'fake-claude'} 2.1.328 (supported: {FLOOR} to {NEWEST_TESTED})",
        "path": str(tmp_path / "fake-claude"),
        "version": "2.1.328",
        "support": "supported",
    }
    assert rows["homes"]["status"] == "ok"
    assert rows["homes"]["checked"] == 0
    assert rows["bwrap"]["status"] == "ok"
    assert rows["state"]["status"] == "ok"
    assert rows["state"]["mode"] == "0700"
    assert rows["keys"]["status"] == "warn"
    assert rows["socket"]["status"] == "warn"
    assert "not running" in rows["socket"]["detail"]


@pytest.mark.parametrize(
    ("version", "status", "code", "words"),
    [
        ("2.1.200", "fail", 1, "older than the floor"),
        ("2.0.77", "fail", 1, "older than the floor"),
        ("2.1.300", "ok", 0, "supported"),
        ("2.1.333", "warn", 0, "newer than any release sage was tested with"),
    ],
)
def test_the_claude_check_follows_the_supported_range(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    version: str,
    status: str,
    code: int,
    words: str,
) -> None:
    """Below the floor: fail (exit 1); inside: ok; above the newest tested: warn."""
    config = _setup(tmp_path, version=version)
    exit_code, report = _doctor(capsys, config)
    claude = _rows(report)["claude"]
    assert (claude["status"], exit_code) == (status, code)
    assert words in claude["detail"]
    assert f"{FLOOR} to {NEWEST_TESTED}" in claude["detail"]
    if status == "fail":
        assert "sessions will not start" in claude["detail"]


def test_a_known_bad_release_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(claude_binary.KNOWN_BAD, "2.1.310", "loses hook callbacks")
    config = _setup(tmp_path, version="2.1.310")
    code, report = _doctor(capsys, config)
    claude = _rows(report)["claude"]
    assert (claude["status"], claude["support"], code) == ("fail", "known_bad", 1)
    assert "loses hook callbacks" in claude["detail"]


def test_a_configured_version_marks_nothing_tested(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[claude] version` once silenced the check for any release; now it is ignored."""
    config = _setup(tmp_path, version="2.1.100")
    config.write_text(config.read_text().replace("[claude]\n", '[claude]\nversion = "2.1.100"\n'))
    code, report = _doctor(capsys, config)
    claude = _rows(report)["claude"]
    assert (claude["status"], code) == ("fail", 1)
    assert "claude.version in the config is ignored" in claude["detail"]


def test_an_installed_home_naming_hooks_the_binary_does_not_know_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A home installed for a newer CLI, run by one that does not know its hook events."""
    config = _setup(tmp_path, version="2.1.200", extra=_PRINCIPAL)
    settings = tmp_path / "state" / "homes" / "alice" / ".claude" / "settings.local.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"hooks": {"PreToolUse": [], "DirectoryAdded": []}}))
    code, report = _doctor(capsys, config)
    homes = _rows(report)["homes"]
    assert (homes["status"], code) == ("fail", 1)
    assert "alice: hook events claude 2.1.200 does not know: DirectoryAdded" in homes["detail"]
    assert "astrid sage install alice --force" in homes["detail"]
    # the same home with a binary that knows the event is fine
    _fake_claude(tmp_path, "2.1.328")
    _, report = _doctor(capsys, config)
    assert _rows(report)["homes"]["status"] == "ok"
    assert _rows(report)["homes"]["checked"] == 1


def test_an_api_that_does_not_answer_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A closed port: a warning that names the URL and where to set it, exit 0."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    config = _setup(tmp_path)
    config.write_text(config.read_text().replace(_API_URL, f"http://127.0.0.1:{port}"))
    code, report = _doctor(capsys, config)
    api = _rows(report)["api"]
    assert (api["status"], code) == ("warn", 0)
    assert f"http://127.0.0.1:{port} does not answer" in api["detail"]
    assert "ANTHROPIC_BASE_URL in [claude] env" in api["detail"]
    config.write_text(config.read_text().replace(f"http://127.0.0.1:{port}", "ftp://x"))
    code, report = _doctor(capsys, config)
    assert (_rows(report)["api"]["status"], code) == ("fail", 1)


def test_missing_claude_binary_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A claude.binary that does not exist is a fail naming it."""
    config = _setup(tmp_path)
    (tmp_path / "fake-claude").unlink()
    code, report = _doctor(capsys, config)
    assert code == 1
    claude = _rows(report)["claude"]
    assert claude["status"] == "fail"
    assert "claude.binary:" in claude["detail"]
    assert "fake-claude" in claude["detail"]


def test_missing_state_folder_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A state folder that does not exist yet is only a warn: the first start creates it."""
    config = _setup(tmp_path, state_mode=None)
    code, report = _doctor(capsys, config)
    assert code == 0
    assert _rows(report)["state"]["status"] == "warn"
    assert "does not exist yet" in _rows(report)["state"]["detail"]


def test_readable_audit_key_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A private key others can read is a fail; the public key may be 0644."""
    config = _setup(tmp_path)
    keys = tmp_path / "state" / "keys"
    keys.mkdir(mode=0o700)
    (keys / "audit_ed25519.pem").write_text("x")
    (keys / "audit_ed25519.pem").chmod(0o640)
    (keys / "audit_ed25519.pub").write_text("x")
    (keys / "audit_ed25519.pub").chmod(0o644)
    code, report = _doctor(capsys, config)
    assert code == 1
    detail = _rows(report)["keys"]["detail"]
    assert "audit_ed25519.pem has mode 0640" in detail
    assert "chmod 600" in detail
    assert "audit_ed25519.pub" not in detail
    (keys / "audit_ed25519.pem").chmod(0o600)
    code, report = _doctor(capsys, config)
    assert code == 0
    assert _rows(report)["keys"]["status"] == "ok"


@pytest.fixture
def root() -> Iterator[Path]:
    """A short temp folder (socket paths are limited to 107 bytes), removed afterwards."""
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_stale_socket_warns(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A socket file nobody listens on: socket ok, supervisor warn (stale), exit 0."""
    config = _setup(root)
    run = root / "state" / "run"
    run.mkdir(mode=0o700)
    path = run / "astrid.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.fspath(path))
    sock.close()
    path.chmod(0o600)
    code, report = _doctor(capsys, config)
    rows = _rows(report)
    assert code == 0
    assert rows["socket"]["status"] == "ok"
    assert rows["supervisor"]["status"] == "warn"
    assert "refused the connection" in rows["supervisor"]["detail"]


def test_regular_file_at_socket_path_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A regular file where the socket goes is a fail: the supervisor will not replace it."""
    config = _setup(tmp_path)
    (tmp_path / "state" / "run").mkdir(mode=0o700)
    (tmp_path / "state" / "run" / "astrid.sock").write_text("")
    code, report = _doctor(capsys, config)
    assert code == 1
    assert "is not a socket" in _rows(report)["socket"]["detail"]


def test_bad_config_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A config that does not load is a fail naming the field; bwrap is still checked."""
    config = tmp_path / "supervisor.toml"
    config.write_text("[bus]\nqueue_size = 0\n")
    code, report = _doctor(capsys, config)
    assert code == 1
    rows = _rows(report)
    assert list(rows) == ["config", "bwrap"]
    assert rows["config"]["status"] == "fail"
    assert "bus.queue_size" in rows["config"]["detail"]


def test_human_output_is_an_aligned_table_without_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One aligned row per check; [claude] env values appear in neither output."""
    config = _setup(tmp_path)
    assert main(["doctor", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1] == (
        f"ok    claude   {tmp_path / 'fake-claude'} 2.1.328 (supported: {FLOOR} to {NEWEST_TESTED})"
    )
    assert lines[0].startswith("ok    config   ")
    assert [line[:15] for line in lines[2:5]] == [
        "ok    api      ",
        "ok    bwrap    ",
        "ok    state    ",
    ]
    assert SECRET not in out
    main(["doctor", "--config", str(config), "--json"])
    assert SECRET not in capsys.readouterr().out


def test_help_explains_each_check(capsys: pytest.CaptureFixture[str]) -> None:
    """astrid doctor --help names every check and the exit status."""
    with pytest.raises(SystemExit):
        main(["doctor", "--help"])
    out = capsys.readouterr().out
    for name in (
        "config", "claude", "api", "bwrap", "state", "homes", "keys", "socket", "supervisor"
    ):  # fmt: skip
        assert f"\n  {name} " in out
    assert "exit status" in out


@pytest.fixture
def daemon(root: Path, api_url: str) -> Iterator[Daemon]:
    extra = f'capsules = ["echo"]\n[claude]\nenv = {{ ANTHROPIC_BASE_URL = "{api_url}" }}\n'
    d = Daemon(root, extra=extra).start()
    yield d
    d.stop()


def test_running_supervisor_is_all_ok(daemon: Daemon) -> None:
    """Against a live supervisor every check is ok and it reports the supervisor's pid."""
    assert daemon.proc is not None
    result = daemon.astrid("doctor", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    rows = _rows(report)
    assert {name: row["status"] for name, row in rows.items()} == {
        "config": "ok",
        "claude": "ok",
        "api": "ok",
        "bwrap": "ok",
        "state": "ok",
        "homes": "ok",
        "keys": "ok",
        "socket": "ok",
        "supervisor": "ok",
    }
    assert rows["supervisor"]["pid"] == daemon.proc.pid
    # as root the socket is the claude children's access group's (sage/security/runas.py)
    assert rows["socket"]["mode"] == ("0660" if os.geteuid() == 0 else "0600")
    assert "audit_ed25519.pem 0600" in rows["keys"]["detail"]


def test_astrid_doctor_as_a_command(tmp_path: Path) -> None:
    """`astrid doctor` as a process prints JSON and exits 1 on a fail."""
    config = _setup(tmp_path, state_mode=0o777)
    result = subprocess.run(
        [*ASTRID, "doctor", "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["ok"] is False
    assert result.stderr == ""


def test_doctor_says_forge_refuses_tools_without_bwrap(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No bwrap on PATH: the bwrap row fails and says forge fails closed."""
    config = _setup(tmp_path)
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    code, report = _doctor(capsys, config)
    assert code == 1
    row = _rows(report)["bwrap"]
    assert row["status"] == "fail"
    assert "bwrap not found on PATH" in row["detail"]
    assert "forge refuses to run any tool" in row["detail"]
    assert "fail closed" in row["detail"]


def test_doctor_warns_when_llm_generate_would_use_another_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """[llm] base_url pointing elsewhere than the sessions' gateway is named, not silent."""
    config = _setup(tmp_path, extra='\n[llm]\nbase_url = "https://elsewhere.invalid"\n')
    _, report = _doctor(capsys, config)
    api = _rows(report)["api"]
    assert api["status"] == "warn"
    assert "sends astrid llm generate to https://elsewhere.invalid" in api["detail"]
