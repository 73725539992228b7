"""`make fleet-trial` (python -m tests.support.fleet_trial): the cluster it starts and the
node configs it writes make a working fleet, as docs/fleet.md's walk says."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.daemon import ASTRID, short_dir
from tests.support.fleet_trial import READY
from tests.support.nats_cluster import wait_for

ROOT = Path(__file__).resolve().parents[2]


def test_the_trial_fleet_starts_and_its_nodes_see_each_other() -> None:
    where = short_dir()
    trial = subprocess.Popen(
        [sys.executable, "-m", "tests.support.fleet_trial", "--dir", str(where)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        assert trial.stdout is not None
        lines = []
        for line in trial.stdout:
            lines.append(line.rstrip("\n"))
            if line.strip() == READY:
                break
        assert lines[-1:] == [READY], (lines, trial.stderr.read() if trial.stderr else "")
        configs = [where / node / "supervisor.toml" for node in ("a", "b")]
        for node, config in zip(("a", "b"), configs, strict=True):
            assert f"node {node}: " in "\n".join(lines)
            assert config.stat().st_mode & 0o077 == 0
            with (where / f"{node}.log").open("wb") as log:
                nodes.append(
                    subprocess.Popen(
                        [*ASTRID, "supervisor", "run", "--config", str(config)],
                        stdout=subprocess.DEVNULL,
                        stderr=log,
                    )
                )

        def live() -> list[str]:
            status = subprocess.run(
                [*ASTRID, "fleet", "status", "--json", "--config", str(configs[0])],
                capture_output=True,
                text=True,
                check=False,
            )
            if status.returncode != 0:
                return []
            return sorted(
                n["node"] for n in json.loads(status.stdout)["nodes"] if n["state"] == "live"
            )

        wait_for(lambda: live() == ["a", "b"], 60.0, "a and b live in a's fleet status")
    finally:
        for proc in nodes:
            proc.terminate()
            proc.wait(20)
        trial.send_signal(signal.SIGINT)
        _, err = trial.communicate(timeout=30)
    assert trial.returncode == 0, err
    assert "servers stopped" in err
