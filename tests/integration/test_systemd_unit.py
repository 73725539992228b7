"""The shipped systemd unit (docs/sage.service): tight, and per-principal uids stay on.

``systemd-analyze security --offline=true`` rates the unit file itself
(nothing needs to run under systemd), and a real supervisor is run under
the unit's capability bounding set, ``NoNewPrivileges`` and umask (by
``setpriv``, as systemd would set them up): a principal's ``claude`` child
still runs as its own uid, a forged tool still runs in its sandbox, and an
installed capsule's worker still starts under a uid of its own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import anyio
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import running_sage, sage_config

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "docs" / "sage.service"
MAX_EXPOSURE = 5.0


def _settings() -> dict[str, str]:
    """The unit's [Service] settings (the last of each name)."""
    found: dict[str, str] = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found[key.strip()] = value.strip()
    return found


def test_the_unit_keeps_exposure_at_most_five(tmp_path: Path) -> None:
    """systemd-analyze's exposure of the shipped unit is at most 5.0 (0 safest, 10 worst)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is missing: make setup installs it (systemd)"
    unit = tmp_path / "sage.service"
    shutil.copy(UNIT, unit)
    result = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    found = re.search(r"Overall exposure level for sage\.service: (\d+\.\d)", result.stdout)
    assert found, result.stdout + result.stderr
    assert float(found.group(1)) <= MAX_EXPOSURE, result.stdout


def test_the_unit_runs_the_supervisor_as_root_with_bounded_capabilities() -> None:
    """No User= (children get their principals' uids), and a capability set that is not all."""
    unit = _settings()
    assert "User" not in unit
    assert unit["NoNewPrivileges"] == "yes"
    caps = unit["CapabilityBoundingSet"].split()
    assert "CAP_SETUID" in caps
    assert "CAP_SYS_MODULE" not in caps
    assert "CAP_SYS_PTRACE" not in caps
    assert unit["AmbientCapabilities"] == ""


def _status(pid: int) -> str:
    return Path(f"/proc/{pid}/status").read_text()


def _bounded() -> list[str]:
    """``setpriv`` with the unit's bounding set and no-new-privs: the supervisor's lot."""
    unit = _settings()
    caps = ",".join(
        "+" + c.lower().removeprefix("cap_") for c in unit["CapabilityBoundingSet"].split()
    )
    prefix = ["setpriv", f"--bounding-set=-all,{caps}", "--inh-caps=-all"]
    if unit.get("NoNewPrivileges") == "yes":
        prefix.append("--no-new-privs")
    return prefix


@pytest.mark.anyio
@pytest.mark.skipif(os.geteuid() != 0, reason="the unit runs the supervisor as root")
async def test_under_the_units_capabilities_children_still_get_their_own_uids(
    tmp_path: Path,
) -> None:
    """Bounded as the unit bounds it: alice's home is installed and her child runs as a
    uid of sage's range, a forged tool runs in its sandbox, and an installed capsule's
    worker starts under a uid of its own."""
    from tests.integration.test_capsule_install import _capsule, _uids, _worker_pids
    from tests.integration.test_forge_capsule import FIB_ARGS

    config = sage_config(
        FAKE_CLAUDE,
        {"ANTHROPIC_API_KEY": "sk-double"},
        capsules='["runner", "hooks", "installer", "tools", "forge"]',
    )
    async with running_sage(config, prefix=_bounded()) as sage:
        assert sage.daemon.proc is not None
        status = _status(sage.daemon.proc.pid)
        assert "NoNewPrivs:\t1" in status
        bounding = int(re.search(r"CapBnd:\t([0-9a-f]+)", status).group(1), 16)  # type: ignore[union-attr]
        assert bounding != 0
        assert bin(bounding).count("1") == len(_settings()["CapabilityBoundingSet"].split())
        installed = await sage.request("sage.v1.request.install", {"principal_id": "alice"})
        assert installed["ok"], installed
        events = await sage.events("u1")
        reply = await sage.request(
            "sage.v1.request.spawn", {"principal_id": "alice", "session_id": "u1"}
        )
        assert reply["ok"], reply
        await events.until("init")
        uid = int(_status(reply["pid"]).split("Uid:\t")[1].split()[0])
        assert 91000 < uid < 92000
        call = {"session_id": "s1", "tool_name": "forge_tool", "arguments": FIB_ARGS}
        assert (await sage.request("forge.v1.request.call", call))["isError"] is False
        fib = {"session_id": "s1", "tool_name": "fib", "arguments": {"n": 10}}
        assert '"value":55' in json.dumps(
            await sage.request("forge.v1.request.call", fib), separators=(",", ":")
        )
        added = await sage.astrid("capsule", "install", str(_capsule(tmp_path)))
        assert added[0] == 0, added
        with anyio.fail_after(20):
            while True:
                _, out, _ = await sage.astrid("capsule", "list", "--json")
                row = next(r for r in json.loads(out) if r["name"] == "mine")
                assert row["state"] != "failed", row["last_error"]
                if row["state"] == "running" and row.get("pid"):
                    break
                await anyio.sleep(0.1)
        (worker,) = _worker_pids(sage.daemon, "mine")
        assert _uids(worker) == [92000] * 4
