"""policy.json: defaults written, strict decoding, mtime reload, last good kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sage.forge.policy import DEFAULT_POLICY, PolicyFile


def test_defaults_written_and_reload(tmp_path: Path) -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    path = tmp_path / "forge" / "policy.json"
    policy_file = PolicyFile(path, lambda e, p: events.append((e, p)))
    policy = policy_file.current()
    assert json.loads(path.read_text()) == DEFAULT_POLICY
    assert policy.forbidden("rm_rf") == "rm_*"
    assert policy.forbidden("fib") is None
    assert events == []
    assert policy_file.current() is policy  # unchanged file: same snapshot
    data = dict(DEFAULT_POLICY, persona_namespaces={"alice": "code"}, output_cap=10)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
    fresh = policy_file.current()
    assert fresh is not policy
    assert fresh.namespace_ok("alice", "code_x")
    assert not fresh.namespace_ok("alice", "codex")
    assert fresh.namespace_ok("bob", "anything")
    assert fresh.output_cap_for(1 << 20) == 4096  # clamped down, floor 4096
    assert [e for e, _ in events] == ["policy_reloaded"]
    path.write_text('{"breakers": {"per_tool_rpm": "many"}}')
    assert policy_file.current() is fresh
    assert events[-1][0] == "policy_reload_failed"


def test_secret_allow_list_fails_closed(tmp_path: Path) -> None:
    policy = PolicyFile(tmp_path / "p.json", lambda e, p: None).current()
    assert policy.secrets_denied("alice", ["K"]) == ["K"]
    assert policy.secrets_denied(None, ["K"]) == ["K"]
    assert policy.network_for("alice") == (False, False)
