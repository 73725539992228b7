"""astrid sage repl: a terminal claude whose command hooks carry a freshly minted token.

The interactive CLI cannot be driven here, so ``[claude] binary`` is a small
script standing in for it: it fires ``astrid-emit PreToolUse`` as an
installed hook would, with the environment ``astrid sage repl`` gave it, and
records that environment.  The hooks capsule must republish the hook as
token-validated, and the token must be dead once the REPL ended.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from tests.support.daemon import ASTRID, short_dir
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

EMIT = Path(sys.executable).parent / "astrid-emit"


def _fake_claude(folder: Path) -> Path:
    script = folder / "claude-repl"
    script.write_text(
        "#!/bin/sh\n"
        'env > "$HOME/repl.env"\n'
        # the installed hook command: a launcher of the home's own when sage's Python is
        # out of the user's reach (sage/security/runas.py emit_launcher), else astrid-emit
        f'E="$HOME/.astrid/astrid-emit"; [ -x "$E" ] || E={EMIT}\n'
        f'echo \'{{"hook_event_name": "PreToolUse", "tool_name": "Bash"}}\''
        ' | "$E" PreToolUse\n'
    )
    script.chmod(0o755)
    return script


ROOT = os.geteuid() == 0
"""A root supervisor gives alice's home to her sessions' uid: her repl runs as her own user
(``run_as = "nobody"``, uid 65534, in the children's access group 91000), never as root."""


def _repl_config(script: Path) -> str:
    config = sage_config(
        script,
        {},
        capsules='["runner", "hooks", "installer"]',
        principal_extra='run_as = "nobody"\n' if ROOT else "",
    )
    return config.replace(f"uids = [{os.getuid()}]", "uids = [65534]") if ROOT else config


def _user(*argv: str) -> list[str]:
    """``argv`` as alice's own user (as root: nobody, in the socket's group)."""
    if not ROOT:
        return list(argv)
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--groups", "91000", "--", *argv]


async def _repl(sage: Sage, *args: str) -> tuple[int, str, str]:
    done = await anyio.run_process(
        _user(*ASTRID, "sage", "repl", "alice", "--config", str(sage.daemon.config), *args),
        env=sage.daemon.env,
        check=False,
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def _root() -> Path:
    root = short_dir()
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # alice's user reaches the stand-in claude and the state folder
    return root


async def test_repl_hooks_are_validated_and_the_token_dies_with_the_repl() -> None:
    root = _root()
    script = _fake_claude(root)
    config = _repl_config(script)
    async with running_sage(config, root=root, env={"ANTHROPIC_API_KEY": ""}) as sage:
        hooks = await sage.client.subscribe("hook.v1.event.before_tool_call")
        spoofs = await sage.client.subscribe("sage.v1.audit.hook_spoof_attempt")
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        code, out, err = await _repl(sage, "--dry-run")
        assert code == 0, err
        plan = json.loads(out)
        assert plan["env"]["ASTRID_HOOK_TOKEN"] == "<token>"
        assert plan["cwd"] == installed["home_path"]
        assert plan["argv"][1:3] == ["--permission-mode", "default"]  # never the CLI's default

        code, out, err = await _repl(sage, "--dry-run", "--", "--permission-mode", "plan")
        assert json.loads(out)["argv"][1:] == ["--permission-mode", "plan"], err
        code, out, err = await _repl(sage)
        assert code == 0, err
        with anyio.fail_after(10):
            event = msgspec.json.decode((await hooks.get()).payload)
        assert event["decision_source"] == "token"
        assert event["principal_id"] == "alice"
        assert event["session_id"].startswith("repl-")
        seen = dict(
            line.split("=", 1)
            for line in (Path(installed["home_path"]) / "repl.env").read_text().splitlines()
            if "=" in line
        )
        assert seen["HOME"] == installed["home_path"]
        assert seen["ASTRID_SESSION_ID"] == event["session_id"]
        # the dry run's token was scrubbed too; replaying the real one now fails
        done = await anyio.run_process(
            [str(EMIT), "PreToolUse"],
            input=b'{"hook_event_name": "PreToolUse"}',
            env={
                "PATH": os.environ.get("PATH", ""),
                "ASTRID_SOCKET": str(sage.daemon.socket),
                "ASTRID_PRINCIPAL_ID": "alice",
                "ASTRID_SESSION_ID": seen["ASTRID_SESSION_ID"],
                "ASTRID_HOOK_TOKEN": seen["ASTRID_HOOK_TOKEN"],
            },
            check=False,
        )
        assert done.returncode == 0
        with anyio.fail_after(10):
            report = msgspec.json.decode((await spoofs.get()).payload)
        assert report["reason"] == "unknown_or_ended_session"
        tokens = await sage.request("sage.v1.request.repl.close", {"session_id": "repl-nothing"})
        assert tokens["error"] == "unknown_session"
        other = await sage.request("sage.v1.request.repl.open", {"principal_id": "mallory"})
        assert other["error"] == "unknown_principal"


async def test_repl_tokens_are_capped_per_principal() -> None:
    """5,000 repl.open in a row minted 5,000 live tokens: now the 17th live one
    (``limits.max_repl_tokens_per_principal``, default 16) is refused with
    ``too_many_repl_sessions``, also through ``astrid sage repl``; a close frees a place."""
    root = _root()
    script = _fake_claude(root)
    config = _repl_config(script)
    async with running_sage(config, root=root, env={"ANTHROPIC_API_KEY": ""}) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        opened = []
        for _ in range(16):
            reply = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
            assert reply["ok"], reply
            opened.append(reply["session_id"])
        refused = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert refused["ok"] is False
        assert refused["error"] == "too_many_repl_sessions"
        assert "token" not in refused
        code, _, err = await _repl(sage)
        assert code == 1
        assert "too_many_repl_sessions" in err
        closed = await sage.request("sage.v1.request.repl.close", {"session_id": opened[0]})
        assert closed["ok"], closed
        code, _, err = await _repl(sage)
        assert code == 0, err  # it ran, and closed its own token when done
        again = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert again["ok"], again


async def test_a_repl_that_cannot_start_claude_releases_its_token() -> None:
    """``astrid sage repl`` mints a token before it looks for the claude binary:
    when that fails, the token is closed all the same (it used to leak)."""
    root = short_dir()
    root.mkdir(parents=True, exist_ok=True)
    config = sage_config(
        root / "no-such-claude", {}, capsules='["runner", "hooks"]', extra="[limits]\n"
    ).replace("[limits]\n", "[limits]\nmax_repl_tokens_per_principal = 2\n")
    async with running_sage(config, root=root, env={"ANTHROPIC_API_KEY": ""}) as sage:
        for _ in range(3):
            code, _, err = await sage.astrid("sage", "repl", "alice")
            assert code == 1
            assert "claude.binary" in err, err
        for _ in range(2):
            reply = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
            assert reply["ok"], reply


async def test_a_repl_in_a_home_that_is_not_the_callers_is_refused_with_the_fix() -> None:
    """As root under a root supervisor, alice's home is her sessions' uid's: a repl would
    run claude as root there, so it is refused, naming run_as and the reinstall."""
    if not ROOT:
        pytest.skip("only a root supervisor gives homes to other uids")
    root = _root()
    config = sage_config(_fake_claude(root), {}, capsules='["runner", "hooks", "installer"]')
    async with running_sage(config, root=root, env={"ANTHROPIC_API_KEY": ""}) as sage:
        installed = await sage.request(
            "sage.v1.request.install", {"principal_id": "alice", "interaction_mode": "repl"}
        )
        assert installed["ok"], installed
        code, _, err = await sage.astrid("sage", "repl", "alice")
        assert code == 1
        assert "repl_not_yours" in err
        assert 'run_as = "USER"' in err
        assert "astrid sage install alice --force" in err
        assert not (Path(installed["home_path"]) / "repl.env").exists()  # claude never ran
        again = await sage.request("sage.v1.request.repl.open", {"principal_id": "alice"})
        assert again["ok"], again  # and its token was closed
