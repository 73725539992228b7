"""Which manifest patterns reach beyond a capsule's own tools, and the grants that admit them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sage.capsule.privileges import check_granted, grant, grants, privileges, revoke
from sage.errors import ConfigError

OWN_PUBLISH = ["tool.v1.response.describe.mine", "tool.v1.execute.hello.result"]
OWN_SUBSCRIBE = ["tool.v1.request.describe", "tool.v1.execute.hello"]


def test_a_tool_capsules_own_patterns_and_its_own_namespace_are_not_privileged() -> None:
    """The SDK's required patterns and a namespace of the capsule's own need no grant."""
    assert privileges("mine", [*OWN_PUBLISH, "myapp.v1.>"], [*OWN_SUBSCRIBE, "demo.v1.echo"]) == []


@pytest.mark.parametrize(
    ("kind", "pattern", "reaches"),
    [
        ("publish", "sage.v1.request.>", "sessions' events"),
        ("subscribe", "sage.v1.event.>", "every principal's"),
        ("subscribe", "approval.v1.request.*", "approval prompts"),
        ("subscribe", "hook.v1.event.>", "hook events"),
        ("publish", "llm.v1.request.generate.sage", "completion provider"),
        ("publish", "demo.v1.audit.x", "the audit log"),
        ("subscribe", "tool.v1.execute.>", "other capsules' tool calls"),
        ("subscribe", "tool.v1.execute.*", "other capsules' tool calls"),
        ("publish", "tool.v1.response.describe.greeter", "other capsules' tool calls"),
        ("subscribe", ">", "sage's requests"),
        ("subscribe", "*.v1.audit.>", "the audit log"),
        ("subscribe", "*.v1.event.x", "sage's requests"),
    ],
)
def test_patterns_reaching_sages_namespaces_are_privileged(
    kind: str, pattern: str, reaches: str
) -> None:
    """Other principals' sessions, events, approvals, hooks, audit, llm.v1, `>`: privileged."""
    publish = [*OWN_PUBLISH, pattern] if kind == "publish" else OWN_PUBLISH
    subscribe = [*OWN_SUBSCRIBE, pattern] if kind == "subscribe" else OWN_SUBSCRIBE
    found = privileges("mine", publish, subscribe)
    assert [(p.kind, p.pattern) for p in found] == [(kind, pattern)]
    assert reaches in found[0].reaches


def test_an_installed_capsule_runs_only_with_every_privileged_pattern_granted(
    tmp_path: Path,
) -> None:
    """No grant, or a grant that misses a pattern added later: refused, the pattern named."""
    publish = [*OWN_PUBLISH, "sage.v1.request.>"]
    with pytest.raises(ConfigError, match=r"\[publish\] 'sage.v1.request.>'"):
        check_granted(tmp_path, "mine", publish, OWN_SUBSCRIBE)
    given = grant(tmp_path, "mine", privileges("mine", publish, OWN_SUBSCRIBE))
    assert given is not None
    assert given.publish == ["sage.v1.request.>"]
    assert check_granted(tmp_path, "mine", publish, OWN_SUBSCRIBE) == given
    assert (tmp_path / "capsule_grants.json").stat().st_mode & 0o077 == 0
    with pytest.raises(ConfigError, match=r"\[subscribe\] 'sage.v1.event.>'"):
        check_granted(tmp_path, "mine", publish, [*OWN_SUBSCRIBE, "sage.v1.event.>"])
    assert check_granted(tmp_path, "mine", OWN_PUBLISH, OWN_SUBSCRIBE) is None
    revoke(tmp_path, "mine")
    assert grants(tmp_path) == {}
