"""The approval desk, with no process: a tool call decided by a rule, by nobody, by a person,
by the older response topic, or by the clock; and the hook relay."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import Bus, Envelope, Identity
from capsules.hooks.validate import event_name as capsule_event_name
from capsules.runner.approval_desk import AUDIT_BURST, ApprovalDesk
from capsules.runner.approvals import Verdict
from capsules.runner.claude_process import SessionError
from capsules.runner.command import Launch
from capsules.runner.session_life import HOOKS
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import load_manifest
from sage.claude.hooks import IN_BAND_HOOKS, KNOWN_HOOKS, PAYLOAD_LIMIT, mint_token
from sage.claude.protocol import CanUseToolRequest, HookCallbackRequest
from sage.config import Config, LimitsConfig, PrincipalConfig

pytestmark = pytest.mark.anyio

RUNNER = Path(__file__).resolve().parents[2] / "capsules" / "runner"
ADMIN = Identity("cli:admin")
ASK = CanUseToolRequest(tool_name="mcp__sage__greet", input={"name": "Ada"}, tool_use_id="tu1")
CLAUDE_SESSION = "8121bd04-f55c-4cf1-b9ef-f73e73c33b8c"
TOKEN = mint_token()


@dataclass
class Turns:
    finished: int = 2


@dataclass
class Proc:
    """What the desk reads of the asking session."""

    session_id: str = "s1"
    principal_id: str = "alice"
    turn: Turns = field(default_factory=Turns)
    launch: Launch = field(
        default_factory=lambda: Launch(
            argv=[],
            env={"ASTRID_HOOK_TOKEN": TOKEN},
            cwd=Path("/"),
            identity_file=Path("/nonexistent"),
            claude_session=CLAUDE_SESSION,
            flags_hash="",
            identity_fallback=False,
        )
    )


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

    async def ask_and_answer(self, answer: Any, proc: Proc | None = None) -> tuple[Verdict, Any]:
        """Ask with an approver listening; ``answer(cid)`` decides; (the outcome, its result)."""
        outcome: list[Verdict] = []
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
    assert await rig.desk.can_use_tool(Proc(), ASK) == Verdict(True, "")
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
    assert await rig.desk.can_use_tool(Proc(), ASK) == Verdict(False, "no approver is listening")
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

    (allowed, why, updated), reply = await rig.ask_and_answer(approve)
    assert (allowed, why, updated) == (True, "", None)
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
    assert outcome == Verdict(False, "denied by approver")
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
    assert (outcome, refused) == (Verdict(True, ""), code)
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
    assert outcome == Verdict(True, "fine")
    (malformed,) = rig.audited("approval_malformed")
    assert malformed["approval_id"] == rig.approval()["approval_id"]


async def test_nobody_answering_in_time_is_a_denial() -> None:
    rig = Rig(timeout=0.05)

    async def wait(cid: str) -> None:
        pass

    outcome, _ = await rig.ask_and_answer(wait)
    assert outcome == Verdict(False, "no approver answered")
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


def _hook(event: str, callback: str | None = None, **fields: Any) -> HookCallbackRequest:
    """A hook_callback as the CLI sends it for ``event`` in session CLAUDE_SESSION."""
    hook_input = {"session_id": CLAUDE_SESSION, "hook_event_name": event, **fields}
    return HookCallbackRequest(
        callback_id=callback or f"hook_{event}", input=hook_input, tool_use_id="tu1"
    )


async def test_hook_callbacks_are_relayed_under_their_sage_names() -> None:
    """In-band hooks go out on hook.v1.event.<mapped> with the session's own ids."""
    rig = Rig()
    for request in (
        _hook("PreToolUse", tool_name="Read"),
        HookCallbackRequest(callback_id="hook_SessionStart", input={}),
    ):
        assert await rig.desk.hook_callback(Proc(), request) == {"continue": True}
    assert [topic for topic, _ in rig.published] == [
        "hook.v1.event.before_tool_call",
        "hook.v1.event.session_start",
    ]
    payload = rig.published[0][1]
    assert payload == {
        "hook": "PreToolUse",
        "payload": {
            "session_id": CLAUDE_SESSION,
            "hook_event_name": "PreToolUse",
            "tool_name": "Read",
        },
        "correlation_id": "tu1",
        "principal_id": "alice",
        "session_id": "s1",
        "decision_source": "in_band",
    }
    assert rig.audits == []


def test_every_hook_sage_knows_is_registered_in_band_under_the_capsules_name() -> None:
    """initialize registers every known event but the unhooked ones; each maps to the
    topic the hooks capsule uses for the same event from astrid-emit."""
    assert set(HOOKS) == set(IN_BAND_HOOKS)
    assert {"PreToolUse", "PostToolUse", "SessionEnd", "PermissionRequest"} <= set(HOOKS)
    assert not {"MessageDisplay", "UserPromptExpansion"} & set(HOOKS)
    assert set(HOOKS) <= KNOWN_HOOKS
    for event, matchers in HOOKS.items():
        assert [m.hook_callback_ids for m in matchers] == [[f"hook_{event}"]]


async def test_each_in_band_hook_lands_where_its_command_hook_would() -> None:
    """SessionEnd is claude_session_end on both paths (not Stop's session_end)."""
    rig = Rig()
    for event in IN_BAND_HOOKS:
        await rig.desk.hook_callback(Proc(), _hook(event))
    hook_topics = [t for t, _ in rig.published if t.startswith("hook.v1.event.")]
    assert hook_topics == [f"hook.v1.event.{capsule_event_name(e)}" for e in IN_BAND_HOOKS]
    assert "hook.v1.event.claude_session_end" in hook_topics


async def test_a_notification_also_goes_to_sage_notification() -> None:
    """As the hooks capsule does for astrid-emit's Notification."""
    rig = Rig()
    await rig.desk.hook_callback(Proc(), _hook("Notification", message="waiting"))
    assert [t for t, _ in rig.published] == [
        "hook.v1.event.notification",
        "sage.v1.notification",
    ]


@pytest.mark.parametrize(
    ("request_", "reason", "hook"),
    [
        (_hook("PreToolUse", callback="hook_0"), "unknown_hook", "PreToolUse"),
        (_hook("Bogus"), "unknown_hook", "Bogus"),
        (_hook("MessageDisplay"), "unknown_hook", "MessageDisplay"),
        (_hook("Stop", callback="hook_PreToolUse"), "unknown_hook", "Stop"),
        (
            HookCallbackRequest(
                callback_id="hook_Stop",
                input={"session_id": "0" * 8 + CLAUDE_SESSION[8:], "hook_event_name": "Stop"},
            ),
            "session_mismatch",
            "Stop",
        ),
    ],
)
async def test_an_in_band_hook_that_contradicts_its_channel_is_audited_not_published(
    request_: HookCallbackRequest, reason: str, hook: str
) -> None:
    """A callback never registered, another hook's input, another Claude session's:
    a spoof report from claude:<sid>; the CLI still hears continue."""
    rig = Rig()
    assert await rig.desk.hook_callback(Proc(), request_) == {"continue": True}
    assert rig.published == []
    (report,) = rig.audited("hook_spoof_attempt")
    assert report["reason"] == reason
    assert report["hook"] == hook
    assert report["source"] == "claude:s1"
    assert report["claimed_principal"] == "alice"
    assert report["suppressed_before"] == 0


async def test_in_band_spoof_reports_are_rate_limited_per_session() -> None:
    """A child that floods bad callbacks gets AUDIT_BURST reports a minute; another
    session's first is reported at once."""
    rig = Rig()
    for _ in range(AUDIT_BURST + 5):
        await rig.desk.hook_callback(Proc(), _hook("PreToolUse", callback="hook_x"))
    assert len(rig.audited("hook_spoof_attempt")) == AUDIT_BURST
    await rig.desk.hook_callback(Proc(session_id="s2"), _hook("Stop", callback="hook_x"))
    assert rig.audited("hook_spoof_attempt")[-1]["source"] == "claude:s2"


async def test_an_in_band_hook_input_never_carries_the_token_nor_too_much() -> None:
    """The child's hook token echoed by a tool response is redacted; an input over
    the payload limit is left out (truncated), as for a command hook."""
    rig = Rig()
    await rig.desk.hook_callback(
        Proc(), _hook("PostToolUse", tool_response=f"env: ASTRID_HOOK_TOKEN={TOKEN}")
    )
    await rig.desk.hook_callback(Proc(), _hook("PostToolUse", tool_response="x" * PAYLOAD_LIMIT))
    (_, echoed), (_, large) = rig.published
    assert TOKEN not in msgspec.json.encode(echoed).decode()
    assert echoed["payload"]["tool_response"] == "env: ASTRID_HOOK_TOKEN=<redacted>"
    assert large["payload"] is None
    assert large["truncated"] is True


async def test_an_approver_may_change_the_input_and_the_change_is_audited() -> None:
    """``updated_input`` with an approval runs the call with it; event and audit say so."""

    async def approve(cid: str) -> dict[str, Any]:
        answer = {"allowed": True, "updated_input": {"name": "Bo"}}
        return await rig.desk.approve(_approve(cid, answer, "alice"))

    rig = Rig()
    outcome, reply = await rig.ask_and_answer(approve)
    assert outcome == Verdict(True, "", {"name": "Bo"})
    assert reply["input_updated"] is True
    assert rig.approval()["input_updated"] is True
    (audit,) = rig.audited("tool_call")
    assert audit["input_updated"] is True
    assert audit["updated_input_sha256"] == hashlib.sha256(b'{"name":"Bo"}').hexdigest()
    assert "Bo" not in msgspec.json.encode(audit).decode()  # the input itself is not kept


async def test_a_denial_cannot_carry_an_input_and_leaves_the_call_pending() -> None:
    """``updated_input`` with ``allowed: false`` is refused; the approval is still open."""

    async def deny_with_input(cid: str) -> str:
        with pytest.raises(SessionError) as refused:
            await rig.desk.approve(
                _approve(cid, {"allowed": False, "updated_input": {"name": "Bo"}}, "alice")
            )
        await rig.desk.approve(_approve(cid, {"allowed": False}, "alice"))
        return refused.value.code

    rig = Rig()
    outcome, code = await rig.ask_and_answer(deny_with_input)
    assert code == "bad_request"
    assert outcome == Verdict(False, "denied by approver")


async def test_another_principal_cannot_change_the_input() -> None:
    """Only the session's principal (or an admin) may answer, with an input or not."""

    async def intrude(cid: str) -> None:
        answer = {"allowed": True, "updated_input": {"name": "Mallory"}}
        with pytest.raises(SessionError) as refused:
            await rig.desk.approve(_approve(cid, answer, "bob"))
        assert refused.value.code == "unknown_approval"
        await rig.desk.approve(_approve(cid, {"allowed": True}, None))  # an admin

    rig = Rig()
    outcome, _ = await rig.ask_and_answer(intrude)
    assert outcome == Verdict(True, "")
