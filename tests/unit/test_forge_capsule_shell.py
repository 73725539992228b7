"""The forge capsule's bus shell: topics, principals, admin gate, never an exception out."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import msgspec
import pytest

from bus import Envelope
from capsules.forge.capsule import ForgeCapsule
from sage.capsule.context import CapsuleContext
from sage.config import Config, PrincipalConfig, SupervisorConfig

pytestmark = pytest.mark.anyio


class _Log:
    def error(self, *args: Any, **kw: Any) -> None:
        pass


class FakeCtx:
    def __init__(self, tmp: Path) -> None:
        self.config = Config(
            supervisor=SupervisorConfig(state_dir=str(tmp / "state")),
            principals=[PrincipalConfig(name="alice")],
        )
        self.log = _Log()
        self.published: list[tuple[str, Any]] = []

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> None:
        self.published.append((topic, payload))


def _env(topic: str, payload: Any, principal: str | None = None) -> Envelope:
    return Envelope(
        id=1, topic=topic, payload=msgspec.json.encode(payload), source="t", principal=principal
    )


@pytest.fixture
def shell(tmp_path: Path) -> tuple[ForgeCapsule, FakeCtx]:
    ctx = FakeCtx(tmp_path)
    return ForgeCapsule(cast(CapsuleContext, ctx)), ctx


async def test_forge_and_list_through_the_shell(shell: tuple[ForgeCapsule, FakeCtx]) -> None:
    capsule, ctx = shell
    args = {
        "name": "t1",
        "description": "d",
        "input_schema": {"type": "object"},
        "impl": "print(1)",
        "runtime": "python",
    }
    out = await capsule.handle(
        _env(
            "forge.v1.request.call",
            {"session_id": "s1", "tool_name": "forge_tool", "arguments": args},
            "alice",
        )
    )
    assert out["isError"] is False
    assert ("sage.v1.tools.changed", {"session_id": "s1", "names": ["t1"], "server": "forge"}) in (
        ctx.published
    )
    assert any(t == "forge.v1.audit.created" for t, _ in ctx.published)
    listed = await capsule.handle(_env("forge.v1.request.list", {"session_id": "s1"}, "alice"))
    assert [t["name"] for t in listed["tools"]][-1] == "t1"
    # the payload cannot claim a principal: alice's project tools are not bob's
    out = await capsule.handle(
        _env(
            "forge.v1.request.call",
            {"session_id": "s1", "tool_name": "forge_list", "arguments": {}},
            "alice",
        )
    )
    assert out["structuredContent"]["data"]["tools"][0]["name"] == "t1"


async def test_admin_requests_need_no_principal(shell: tuple[ForgeCapsule, FakeCtx]) -> None:
    capsule, _ = shell
    denied = await capsule.handle(_env("forge.v1.request.admin.list", {}, "alice"))
    assert denied["error"] == "acl_denied"
    allowed = await capsule.handle(_env("forge.v1.request.admin.list", {}))
    assert allowed == {"ok": True, "tools": []}
    missing = await capsule.handle(_env("forge.v1.request.admin.show", {"name": "nope"}))
    assert missing["error"] == "unknown_tool"


async def test_bad_requests_are_error_results(shell: tuple[ForgeCapsule, FakeCtx]) -> None:
    capsule, _ = shell
    out = await capsule.handle(_env("forge.v1.request.call", [1, 2], "alice"))
    assert out["isError"] is True
    out = await capsule.handle(
        _env("forge.v1.request.call", {"session_id": "s1", "tool_name": 3}, "alice")
    )
    assert out["structuredContent"]["error"] == "bad_request"
    out = await capsule.handle(
        _env("forge.v1.request.call", {"session_id": "s1", "tool_name": "x", "arguments": 5})
    )
    assert out["structuredContent"]["error"] == "bad_arguments"
