"""astrid sage spawn --cwd DIR --model NAME against a real supervisor (the CLI double).

The folder and the model a spawn asks for reach the child (its init says so),
are kept in the record (a respawn runs the same way), are listed, and are
refused with a clear reason outside what the principal's config allows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio


async def test_spawn_in_a_work_root_with_an_allowed_model(tmp_path: Path) -> None:
    root = tmp_path / "projects"
    (root / "app").mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    os.chmod(root, 0o755)
    extra = f'work_roots = ["{root}"]\nmodel = "claude-sonnet-5"\nmodels = ["claude-haiku-5"]\n'
    async with running_sage(
        sage_config(FAKE_CLAUDE, {}, principal_extra=extra), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        code, out, err = await sage.astrid(
            "sage", "spawn", "alice", "--session", "w1", "--cwd", str(root / "app"),
            "--model", "claude-haiku-5",
        )  # fmt: skip
        assert code == 0, err
        assert out.strip() == "w1"
        events = await sage.events("w1")
        listed = await sage.request("sage.v1.request.sessions", {})
        (row,) = [r for r in listed["sessions"] if r["session_id"] == "w1"]
        assert (row["cwd"], row["model"]) == (str(root / "app"), "claude-haiku-5")
        # the child runs there with that model: ask it (a fresh init after a respawn)
        await sage.request("sage.v1.request.stop.w1", {})
        await events.until("exited")
        events2, reply = await sage.spawn("w2", cwd=str(root), model="claude-sonnet-5")
        assert reply["ok"], reply
        init = dict(await events2.until("init"))["init"]
        assert (init["cwd"], init["model"]) == (str(root), "claude-sonnet-5")
        # none asked: the home and the configured model
        events3, reply = await sage.spawn("w3")
        assert reply["ok"], reply
        init = dict(await events3.until("init"))["init"]
        assert init["model"] == "claude-sonnet-5"
        assert init["cwd"] == str(sage.daemon.root / "state" / "homes" / "alice")


async def test_what_the_config_does_not_allow_is_refused(tmp_path: Path) -> None:
    root, other = tmp_path / "projects", tmp_path / "elsewhere"
    root.mkdir()
    other.mkdir()
    (root / "out").symlink_to(other)
    extra = f'work_roots = ["{root}"]\nmodels = ["claude-haiku-5"]\n'
    async with running_sage(
        sage_config(FAKE_CLAUDE, {}, principal_extra=extra), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        cases = [
            (("--cwd", str(other)), "cwd_not_allowed"),
            (("--cwd", str(root / "out")), "cwd_not_allowed"),  # a link out of the root
            (("--cwd", str(root / "nope")), "cwd_missing"),
            (("--model", "claude-opus-5"), "model_not_allowed"),
            (("--model=--dangerously-skip-permissions",), "bad_model"),
        ]
        for args, reason in cases:
            code, out, err = await sage.astrid("sage", "spawn", "alice", *args)
            assert code == 1, (args, out, err)
            assert f"astrid: {reason}: " in err, (args, err)
        # a folder others may write, or whose .claude/ they may write: their settings'
        # hooks would run as the child's uid
        (root / "shared").mkdir()
        (root / "shared").chmod(0o777)
        (root / "project" / ".claude").mkdir(parents=True)
        (root / "project" / ".claude").chmod(0o777)
        for folder in ("shared", "project"):
            code, out, err = await sage.astrid(
                "sage", "spawn", "alice", "--cwd", str(root / folder)
            )
            assert code == 1, (folder, out, err)
            assert "astrid: unsafe_cwd: " in err, err
            assert "writable by group or others" in err
        listed = await sage.request("sage.v1.request.sessions", {})
        assert listed["sessions"] == []
        # a relative --cwd is taken from where astrid runs
        result = await anyio.run_process(
            [
                str(Path(sys.executable).parent / "astrid"),
                "sage",
                "spawn",
                "alice",
                "--cwd",
                ".",
                "--json",
                "--config",
                str(sage.daemon.config),
            ],
            cwd=root,
            env=sage.daemon.env,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        sid = json.loads(result.stdout)["session_id"]
        listed = await sage.request("sage.v1.request.sessions", {})
        (row,) = [r for r in listed["sessions"] if r["session_id"] == sid]
        assert row["cwd"] == str(root)


async def test_an_ended_sessions_id_stays_its_principals() -> None:
    """Another principal may not take an ended session's id (its record, its history,
    its session-scoped tools); the same principal may; a repl- id is never a spawn's."""
    bob = '\n[[principals]]\nname = "bob"\nuids = [4242]\noperator_key = true\n'
    async with running_sage(
        sage_config(FAKE_CLAUDE, {}, principal_extra=bob), env={"ANTHROPIC_API_KEY": "sk-test"}
    ) as sage:
        events = await sage.ready("kept")
        await sage.request("sage.v1.request.stop.kept", {})
        await events.until("exited")
        taken = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "bob", "session_id": "kept"}
        )
        assert (taken["ok"], taken["error"]) == (False, "duplicate_session"), taken
        repl = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "session_id": "repl-0123"}
        )
        assert repl["error"] == "duplicate_session"
        again = await sage.ready("kept")  # alice's own id, again
        assert again.seen
