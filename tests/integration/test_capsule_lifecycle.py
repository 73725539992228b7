"""A capsule's life while the supervisor serves: replaced live, restarted, removed, clashes shown.

Against a real supervisor with installed worker capsules and the real `astrid`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.integration.test_capsule_install import CODE, _capsule, _wait_for_tool
from tests.support.daemon import Daemon, short_dir


def _row(d: Daemon, name: str) -> dict[str, Any] | None:
    result = d.astrid("capsule", "list", "--json")
    assert result.returncode == 0, result.stderr
    rows: list[dict[str, Any]] = json.loads(result.stdout)
    return next((r for r in rows if r["name"] == name), None)


def _running_pid(d: Daemon, name: str, other_than: int | None = None) -> int:
    for _ in range(200):
        row = _row(d, name)
        if row and row["state"] == "running" and row.get("pid") and row["pid"] != other_than:
            pid: int = row["pid"]
            return pid
        time.sleep(0.05)
    raise AssertionError(f"{name} never ran (other than pid {other_than}); log:\n{d.log()[-3000:]}")


def _tool(d: Daemon, name: str) -> dict[str, str] | None:
    tools: list[dict[str, str]] = json.loads(d.astrid("tools", "list", "--json").stdout)
    return next((t for t in tools if t["name"] == name), None)


def _audited(d: Daemon, kind: str) -> list[dict[str, Any]]:
    result = d.astrid("audit", "tail", "-n", "200", "--json")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    return [r["payload"]["payload"] for r in rows if r["kind"] == f"sage.v1.audit.{kind}"]


def test_install_force_replaces_a_running_capsule_live(tmp_path: Path) -> None:
    d = Daemon(short_dir(), 'capsules = ["tools"]\n').start()
    try:
        folder = _capsule(tmp_path)
        assert d.astrid("capsule", "install", str(folder)).returncode == 0
        _wait_for_tool(d, "mcp__sage__hello")
        first = _running_pid(d, "mine")
        (folder / "__init__.py").write_text(CODE.replace('"""Say hello."""', '"""Say hi, v2."""'))
        forced = d.astrid("capsule", "install", str(folder), "--force")
        assert forced.returncode == 0, forced.stderr
        assert "restarted mine" in forced.stdout
        second = _running_pid(d, "mine", other_than=first)
        assert second != first
        for _ in range(200):  # the catalogue now carries the new code's tool
            tool = _tool(d, "mcp__sage__hello")
            if tool and "v2" in tool.get("description", ""):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the new version's tool never showed: {tool}")
        loaded = _audited(d, "capsule_loaded")
        assert [r["replaced"] for r in loaded] == [False, True], json.dumps(loaded)
    finally:
        d.stop()


def test_restart_and_remove(tmp_path: Path) -> None:
    d = Daemon(short_dir(), 'capsules = ["tools", "echo"]\n').start()
    try:
        assert d.astrid("capsule", "install", str(_capsule(tmp_path))).returncode == 0
        _wait_for_tool(d, "mcp__sage__hello")
        first = _running_pid(d, "mine")
        restarted = d.astrid("capsule", "restart", "mine")
        assert restarted.returncode == 0, restarted.stderr
        assert restarted.stdout.strip() == "restarted mine"
        _running_pid(d, "mine", other_than=first)
        _wait_for_tool(d, "mcp__sage__hello")
        # a built-in capsule restarts too, and answers again
        assert d.astrid("capsule", "restart", "echo").returncode == 0
        for _ in range(100):
            echo = d.astrid("bus", "request", "demo.v1.echo", '{"x": 1}')
            if echo.returncode == 0:
                break
            time.sleep(0.05)
        assert '"echo"' in echo.stdout, echo.stderr
        # what cannot be done says why, exit 1
        unknown = d.astrid("capsule", "restart", "nope")
        assert unknown.returncode == 1
        assert "unknown_capsule: no capsule 'nope'" in unknown.stderr
        builtin = d.astrid("capsule", "rm", "echo")
        assert builtin.returncode == 1
        assert "built in" in builtin.stderr
        assert _row(d, "echo") is not None
        # rm stops it, deletes its copy, and its tools leave the catalogue
        removed = d.astrid("capsule", "rm", "mine")
        assert removed.returncode == 0, removed.stderr
        assert removed.stdout.strip() == "removed mine"
        assert _row(d, "mine") is None
        assert not (d.root / "state" / "capsules" / "my_capsule").exists()
        for _ in range(100):
            if _tool(d, "mcp__sage__hello") is None:
                break
            time.sleep(0.05)
        assert _tool(d, "mcp__sage__hello") is None
        restarts = [r["capsule"] for r in _audited(d, "capsule_restarted")]
        assert restarts == ["mine", "echo"]
        assert [r["capsule"] for r in _audited(d, "capsule_removed")] == ["mine"]
    finally:
        d.stop()


def test_a_tool_name_clash_shows_in_both_listings(tmp_path: Path) -> None:
    d = Daemon(short_dir(), 'capsules = ["tools"]\n').start()
    try:
        assert d.astrid("capsule", "install", str(_capsule(tmp_path / "a"))).returncode == 0
        _wait_for_tool(d, "mcp__sage__hello")
        other = _capsule(tmp_path / "b", "other_capsule", name="other")
        assert d.astrid("capsule", "install", str(other)).returncode == 0
        _running_pid(d, "other")
        line = "clash: tool 'hello' of capsule other is not offered: capsule mine has that name"
        for _ in range(200):
            listed = d.astrid("tools", "list")
            if line in listed.stdout:
                break
            time.sleep(0.05)
        assert line in listed.stdout, listed.stdout
        assert line in d.astrid("capsule", "list").stdout
        row = _row(d, "other")
        assert row is not None
        assert row["tool_clashes"] == [{"name": "hello", "capsule": "other", "owner": "mine"}]
        mine = _row(d, "mine")
        assert mine is not None
        assert mine["tool_clashes"] == []
    finally:
        d.stop()
