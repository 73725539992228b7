"""The approval desk, with no process: a tool call decided by a rule, by nobody, by a person,
by the older response topic, or by the clock; and the hook relay."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import Bus, Envelope, Identity
from capsules.runner.approval_desk import ApprovalDesk
from capsules.runner.claude_process import SessionError
from sage.claude.protocol import CanUseToolRequest, HookCallbackRequest
from sage.config import Config, LimitsConfig, PrincipalConfig
from sage.daemon.capsule_host import CapsuleContext, load_manifest

pytestmark = pytest.mark.anyio

RUNNER = Path(__file__).resolve().parents[2] / "capsules" / "runner"
ADMIN = Identity("cli:admin")
ASK = CanUseToolRequest(tool_name="mcp__sage__greet", input={"name": "Ada"}, tool_use_id="tu1")


@dataclass
class Turns:
    finished: int = 2


@dataclass
class Proc:
    """What the desk reads of the asking session."""

    session_id: str = "s1"
    principal_id: str = "alice"
    turn: Turns = field(default_factory=Turns)


class Rules:
    """The principals' allow rules, in memory."""

    def __init__(self) -> None:
        self.rules: dict[str, list[str]] = {}

    def allow_rules(self, principal: str) -> list[str]:
        return list(self.rules.get(principal, []))

    async def change_rules(
        self, name: str, *, add: list[str], remove: list[str], requester: str | None
    ) -> list[str]:
        kept = [r for r in self.rules.get(name, []) if r not in remove]
        self.rules[name] = kept + [r for r in add if r not in kept]
        return self.rules[name]


class Rig:
    def __init__(self, timeout: float = 60.0) -> None:
        config = Config(
            principals=[PrincipalConfig(name="alice")],
            limits=LimitsConfig(approval_timeout=timeout),
        )
        self.bus = Bus()
        self.ctx = CapsuleContext(
            self.bus, Identity("capsule:runner"), load_manifest(RUNNER), config_of=lambda: config
        )
        self.rules = Rules()
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.events: list[tuple[str, str, dict[str, Any]]] = []
        self.audits: list[tuple[str, dict[str, Any]]] = []
        self.desk = ApprovalDesk(
            self.ctx,
            rules=self.rules,
            publish=self.publish,
            event=lambda sid, name, payload, principal=None: self.events.append(
                (sid, name, payload)
            ),
            audit=lambda kind, payload: self.audits.append((kind, payload)),
        )

    def publish(
        self, topic: str, payload: dict[str, Any], principal: str | None = None
    ) -> Envelope | None:
        self.published.append((topic, payload))
        return self.ctx.publish(topic, payload, on_behalf_of=principal)

    def audited(self, kind: str) -> list[dict[str, Any]]:
        return [payload for k, payload in self.audits if k == kind]

    def approval(self) -> dict[str, Any]:
        (event,) = [payload for _, name, payload in self.events if name == "approval"]
        return event

    async def ask_and_answer(
        self, answer: Any, proc: Proc | None = None
    ) -> tuple[tuple[bool, str], Any]:
        """Ask with an approver listening; ``answer(cid)`` decides; (the outcome, its result)."""
        outcome: list[tuple[bool, str]] = []
        with self.bus.subscribe("approval.v1.request.*", ADMIN) as asks:

            async def ask() -> None:
                outcome.append(await self.desk.can_use_tool(proc or Proc(), ASK))

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                request = await asks.get()
                result = await answer(request.data()["approval_id"])
        return outcome[0], result


def _approve(cid: str, payload: dict[str, Any], principal: str | None = None) -> Envelope:
    topic = f"sage.v1.request.approve.{cid}"
    return Envelope(
        id=1, topic=topic, payload=msgspec.json.encode(payload), source="t", principal=principal
    )


async def test_an_allow_rule_decides_without_asking_anyone() -> None:
    rig = Rig()
    rig.rules.rules["alice"] = ["mcp__sage__*"]
    assert await rig.desk.can_use_tool(Proc(), ASK) == (True, "")
    assert rig.published == []  # nobody was asked
    event = rig.approval()
    assert (event["allowed"], event["source"], event["rule"], event["turn"]) == (
        True,
        "allow_rule",
        "mcp__sage__*",
        3,
    )
    (audit,) = rig.audited("tool_call")
    assert (audit["decision_source"], audit["rule"], audit["tool_use_id"]) == (
        "allow_rule",
        "mcp__sage__*",
        "tu1",
    )


async def test_with_nobody_to_ask_the_call_is_denied() -> None:
    rig = Rig()
    assert await rig.desk.can_use_tool(Proc(), ASK) == (False, "no approver is listening")
    assert rig.approval()["source"] == "no_approver"
    (audit,) = rig.audited("tool_call")
    assert (audit["allowed"], audit["decision_source"]) == (False, "no_approver")
    assert "rule" not in audit


async def test_an_approver_decides_and_always_adds_the_rule_first() -> None:
    rig = Rig()

    async def approve(cid: str) -> dict[str, Any]:
        listing = await rig.desk.listing(
            Envelope(id=2, topic="sage.v1.request.approvals", payload=b"", source="t")
        )
        assert [row["approval_id"] for row in listing["approvals"]] == [cid]
        return await rig.desk.approve(_approve(cid, {"allowed": True, "always": True}, "alice"))

    (allowed, why), reply = await rig.ask_and_answer(approve)
    assert (allowed, why) == (True, "")
    assert reply["rule_added"] == "mcp__sage__greet"
    assert (reply["allowed"], reply["session_id"], reply["tool_name"]) == (
        True,
        "s1",
        "mcp__sage__greet",
    )
    assert rig.rules.rules == {"alice": ["mcp__sage__greet"]}
    (asked,) = [p for sid, name, p in rig.events if name == "approval_request"]
    assert (asked["approval_id"], asked["turn"]) == (reply["approval_id"], 3)
    assert rig.approval()["source"] == "approver"
    (audit,) = rig.audited("tool_call")
    assert audit["decision_source"] == "approval"
    assert len(rig.desk.approvals) == 0  # closed once decided


async def test_a_denial_says_why() -> None:
    rig = Rig()

    async def deny(cid: str) -> dict[str, Any]:
        return await rig.desk.approve(_approve(cid, {"allowed": False}))

    outcome, reply = await rig.ask_and_answer(deny)
    assert outcome == (False, "denied by approver")
    assert reply["allowed"] is False
    assert "rule_added" not in reply


@pytest.mark.parametrize(
    ("payload", "principal", "code"),
    [
        ({"allowed": False, "always": True}, None, "bad_request"),
        ({"allowed": True, "always": True, "rule": "Bash(rm -rf)"}, None, "bad_request"),
        ({"allowed": True}, "bob", "unknown_approval"),  # another principal's
    ],
)
async def test_a_wrong_decision_is_refused_and_the_call_still_waits(
    payload: dict[str, Any], principal: str | None, code: str
) -> None:
    rig = Rig()

    async def wrong_then_right(cid: str) -> str:
        with pytest.raises(SessionError) as info:
            await rig.desk.approve(_approve(cid, payload, principal))
        await rig.desk.approve(_approve(cid, {"allowed": True}, "alice"))
        return info.value.code

    outcome, refused = await rig.ask_and_answer(wrong_then_right)
    assert (outcome, refused) == ((True, ""), code)
    assert rig.rules.rules == {}


async def test_an_unknown_approval_is_refused() -> None:
    with pytest.raises(SessionError) as info:
        await Rig().desk.approve(_approve("nope", {"allowed": True}))
    assert info.value.code == "unknown_approval"


async def test_the_older_response_topic_decides_and_a_typo_is_audited() -> None:
    rig = Rig()

    async def respond(cid: str) -> None:
        topic = f"approval.v1.response.{cid}"
        rig.bus.publish(ADMIN, topic, {"allowd": True})  # a typo: no decision
        await anyio.wait_all_tasks_blocked()
        rig.bus.publish(ADMIN, topic, {"allowed": True, "reason": "fine"})

    outcome, _ = await rig.ask_and_answer(respond)
    assert outcome == (True, "fine")
    (malformed,) = rig.audited("approval_malformed")
    assert malformed["approval_id"] == rig.approval()["approval_id"]


async def test_nobody_answering_in_time_is_a_denial() -> None:
    rig = Rig(timeout=0.05)

    async def wait(cid: str) -> None:
        pass

    outcome, _ = await rig.ask_and_answer(wait)
    assert outcome == (False, "no approver answered")
    (audit,) = rig.audited("tool_call")
    assert audit["decision_source"] == "approval_timeout"


async def test_the_session_s_own_approver_is_enough_to_ask() -> None:
    rig = Rig()
    alice = Identity("cli:alice", principal="alice")
    with rig.bus.subscribe("sage.v1.approver.s1", alice):
        rig.rules.rules["bob"] = ["mcp__sage__*"]  # not alice's
        async with anyio.create_task_group() as tg:
            tg.start_soon(rig.desk.can_use_tool, Proc(), ASK)
            await anyio.wait_all_tasks_blocked()
            (row,) = rig.desk.approvals.listing("alice")
            await rig.desk.approve(_approve(row["approval_id"], {"allowed": True}, "alice"))
    assert rig.approval()["source"] == "approver"


async def test_hook_callbacks_are_relayed_under_their_sage_names() -> None:
    rig = Rig()
    for callback, hook_input in (
        ("hook_PreToolUse", {"hook_event_name": "PreToolUse", "tool_name": "Read"}),
        ("hook_SessionStart", {}),
    ):
        request = HookCallbackRequest(callback_id=callback, input=hook_input, tool_use_id="tu1")
        assert await rig.desk.hook_callback(Proc(), request) == {"continue": True}
    assert [topic for topic, _ in rig.published] == [
        "hook.v1.event.before_tool_call",
        "hook.v1.event.session_start",
    ]
    payload = rig.published[0][1]
    assert payload == {
        "hook": "PreToolUse",
        "payload": {"hook_event_name": "PreToolUse", "tool_name": "Read"},
        "correlation_id": "tu1",
        "principal_id": "alice",
        "session_id": "s1",
        "decision_source": "in_band",
    }
