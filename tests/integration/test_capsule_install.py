"""astrid capsule install: a checked folder becomes a running worker capsule whose tool is called."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.daemon import ASTRID, Daemon, short_dir

MANIFEST = """[package]
name = "{name}"
version = "1.2.0"
entry = "{entry}"

[publish]
patterns = [{publish}]

[subscribe]
patterns = ["tool.v1.request.describe", "tool.v1.execute.hello"]
"""
GOOD_PUBLISH = '"tool.v1.response.describe.{name}", "tool.v1.execute.hello.result"'
CODE = '''
import msgspec
from sage.sdk import tool


class HelloArgs(msgspec.Struct):
    who: str


@tool("hello")
async def hello(args: HelloArgs) -> str:
    """Say hello."""
    return f"hello {args.who}, from a worker"
'''


def _capsule(root: Path, folder: str = "my_capsule", *, name: str = "mine", **kw: str) -> Path:
    path = root / folder
    path.mkdir(parents=True)
    entry = kw.get("entry", folder)
    publish = kw.get("publish", GOOD_PUBLISH.format(name=name))
    (path / "Capsule.toml").write_text(MANIFEST.format(name=name, entry=entry, publish=publish))
    (path / "__init__.py").write_text(kw.get("code", CODE))
    return path


def _wait_for_tool(d: Daemon, name: str) -> list[dict[str, str]]:
    for _ in range(200):
        result = d.astrid("tools", "list", "--json")
        tools: list[dict[str, str]] = json.loads(result.stdout) if result.returncode == 0 else []
        if any(t["name"] == name for t in tools):
            return tools
        time.sleep(0.05)
    raise AssertionError(f"{name} never appeared; log:\n{d.log()[-3000:]}")


def test_install_starts_a_worker_whose_tool_answers(tmp_path: Path) -> None:
    d = Daemon(short_dir(), 'capsules = ["tools"]\n').start()
    try:
        folder = _capsule(tmp_path)
        result = d.astrid("capsule", "install", str(folder))
        assert result.returncode == 0, result.stderr
        assert "installed mine" in result.stdout
        assert "started mine" in result.stdout
        tools = _wait_for_tool(d, "mcp__sage__hello")
        assert {"name": "mcp__sage__hello", "capsule": "mine"}.items() <= next(
            t for t in tools if t["name"] == "mcp__sage__hello"
        ).items()
        rows = json.loads(d.astrid("capsule", "list", "--json").stdout)
        mine = next(r for r in rows if r["name"] == "mine")
        assert mine["state"] == "running"
        assert mine["version"] == "1.2.0"
        assert mine["pid"]  # a worker process, not imported into the supervisor
        # a tool call through the bridge reaches the worker and its answer comes back
        listener = subprocess.Popen(
            [*ASTRID, "bus", "sub", "sage.v1.tool.result.>", "-n", "1", "--config", str(d.config)],
            stdout=subprocess.PIPE,
            text=True,
        )
        time.sleep(0.5)  # let the subscription reach the supervisor
        call = {
            "session_id": "s",
            "principal_id": None,
            "tool_name": "hello",
            "arguments": {"who": "Ada"},
            "tool_use_id": None,
        }
        assert d.astrid("bus", "pub", "sage.v1.tool.call.c1", json.dumps(call)).returncode == 0
        out, _ = listener.communicate(timeout=20)
        envelope = json.loads(out)
        assert envelope["topic"] == "sage.v1.tool.result.c1"
        assert "hello Ada, from a worker" in json.dumps(envelope["payload"])
        again = d.astrid("capsule", "install", str(folder))
        assert again.returncode == 1
        assert "--force" in again.stderr
        forced = d.astrid("capsule", "install", str(folder), "--force")
        assert forced.returncode == 0, forced.stderr
        assert "runs already; restart the supervisor" in forced.stdout
    finally:
        d.stop()
    # installed capsules start with the supervisor
    again_d = Daemon(d.root, 'capsules = ["tools"]\n')
    again_d.config = d.config
    again_d.start()
    try:
        _wait_for_tool(again_d, "mcp__sage__hello")
    finally:
        again_d.stop()


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        (
            {"publish": '"tool.v1.execute.hello.result"'},
            "[publish] patterns must include 'tool.v1.response.describe.mine'",
        ),
        (
            {"code": "import nonexistent_module_x\n"},
            "cannot load 'my_capsule': ModuleNotFoundError",
        ),
        ({"entry": "my_capsule.missing"}, "cannot load 'my_capsule.missing': ModuleNotFoundError"),
        ({"name": "greeter"}, "taken by a built-in capsule"),
        ({"name": "../x"}, "package.name"),
        ({"code": "x = 1\n"}, "has no @tool or @subscribe functions"),
    ],
)
def test_bad_capsules_are_refused_with_the_reason(
    tmp_path: Path, kw: dict[str, str], expected: str
) -> None:
    name = kw.pop("name", "mine")
    folder = _capsule(tmp_path, name=name, **kw)
    d = Daemon(short_dir())  # not started: the check needs no supervisor
    result = d.astrid("capsule", "install", str(folder))
    assert result.returncode == 1
    assert expected in result.stderr, result.stderr
    assert not (d.root / "state" / "capsules").exists()


def test_a_folder_whose_name_is_not_a_module_installs_under_its_package(tmp_path: Path) -> None:
    """The issue's ./my-capsule: the folder is installed as the entry's package."""
    d = Daemon(short_dir())
    folder = _capsule(tmp_path, "my-capsule", entry="my_capsule")
    result = d.astrid("capsule", "install", str(folder))
    assert result.returncode == 0, result.stderr
    assert (d.root / "state" / "capsules" / "my_capsule" / "__init__.py").is_file()


def test_install_without_a_running_supervisor(tmp_path: Path) -> None:
    d = Daemon(short_dir())
    result = d.astrid("capsule", "install", str(_capsule(tmp_path)), "--check")
    assert result.returncode == 0, result.stderr
    assert "mine: good (1 tools)" in result.stdout
    result = d.astrid("capsule", "install", str(_capsule(tmp_path / "b")))
    assert result.returncode == 0, result.stderr
    assert "it starts with the supervisor" in result.stdout
    assert (d.root / "state" / "capsules" / "my_capsule" / "Capsule.toml").is_file()
