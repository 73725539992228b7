"""The tool bridge on a real bus, with capsules played by plain subscriptions.

The bridge runs in-process under its manifest's ACL (as the supervisor runs
it); a "capsule" here is an identity ``capsule:<name>`` that answers
``tool.v1.request.describe`` and serves ``tool.v1.execute.<tool>`` by hand,
so each test decides exactly when and what it answers.  Waits are bounded by
deadlines and driven by bus envelopes, never by sleeps.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from structlog.testing import capture_logs

from bus import Acl, Bus, BusError, Envelope, Identity, Subscription
from capsules.tools.bridge import ToolBridge
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import load_manifest
from sage.config import Config, SupervisorConfig
from sage.daemon.capsule_host import capsule_folder

pytestmark = pytest.mark.anyio

RUNNER = Identity(source="capsule:runner")
WATCHER = Identity(source="test")
WITHIN = 5.0  # seconds any awaited envelope may take; a hang fails, it never blocks

GREET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}},
    "required": ["name"],
    "additionalProperties": False,
}


def _tool(name: str, description: str = "", schema: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "description": description, "inputSchema": schema or {"type": "object"}}


GREET = _tool("greet", "Greet a person by name.", GREET_SCHEMA)


async def _next(sub: Subscription, within: float = WITHIN) -> Envelope:
    with anyio.fail_after(within):
        return await sub.get()


class FakeCapsule:
    """A tool capsule played by hand: answers describe requests, serves chosen tools."""

    def __init__(self, bus: Bus, name: str, tools: list[dict[str, Any]]) -> None:
        self.bus = bus
        self.name = name
        self.tools = tools
        self.identity = Identity(source=f"capsule:{name}")
        self.requests = bus.subscribe("tool.v1.request.describe", self.identity)
        self.asked = 0
        self._asked = anyio.Event()

    def describe(self, tools: list[dict[str, Any]] | None = None) -> None:
        if tools is not None:
            self.tools = tools
        self.bus.publish(
            self.identity, f"tool.v1.response.describe.{self.name}", {"tools": self.tools}
        )

    async def answer_describes(self) -> None:
        async for _ in self.requests:
            self.asked += 1
            self.describe()
            self._asked.set()
            self._asked = anyio.Event()

    async def until_asked(self, times: int) -> None:
        """Wait (bounded) until the bridge has asked this capsule ``times`` times."""
        with anyio.fail_after(WITHIN):
            while self.asked < times:
                await self._asked.wait()

    def crash(self) -> None:
        """Stop answering describe requests, as a dead capsule would."""
        self.requests.close()

    def serve(self, tool: str) -> Subscription:
        return self.bus.subscribe(f"tool.v1.execute.{tool}", self.identity)

    def answer(self, tool: str, payload: dict[str, Any]) -> None:
        self.bus.publish(self.identity, f"tool.v1.execute.{tool}.result", payload)

    def reply(self, tool: str, call_id: str, text: str, is_error: bool = False) -> None:
        content = [{"type": "text", "text": text}]
        self.answer(tool, {"call_id": call_id, "content": content, "is_error": is_error})


@dataclass
class Harness:
    bus: Bus
    bridge: ToolBridge
    state_dir: Path
    lists: Subscription
    changes: Subscription
    audits: Subscription
    capsules: dict[str, FakeCapsule] = field(default_factory=dict)

    def start_call(
        self,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        principal: str | None = "alice",
        cid: str | None = None,
    ) -> tuple[str, Subscription]:
        cid = cid or uuid.uuid4().hex
        results = self.bus.subscribe(f"sage.v1.tool.result.{cid}", WATCHER)
        self.bus.publish(
            RUNNER,
            f"sage.v1.tool.call.{cid}",
            {
                "session_id": "s1",
                "principal_id": principal,
                "tool_name": tool,
                "arguments": arguments if arguments is not None else {},
                "tool_use_id": "toolu_1",
            },
        )
        return cid, results

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any] | None = None,
        *,
        principal: str | None = "alice",
        within: float = WITHIN,
    ) -> dict[str, Any]:
        _, results = self.start_call(tool, arguments, principal=principal)
        with results:
            result: dict[str, Any] = (await _next(results, within)).data()
        return result

    async def catalogue(self, names: set[str]) -> list[dict[str, Any]]:
        """Lists until one names exactly ``names`` (bare); that list's tools."""
        while True:
            tools: list[dict[str, Any]] = (await _next(self.lists)).data()["tools"]
            if {t["name"].removeprefix("mcp__sage__") for t in tools} == names:
                return tools

    async def audit(self, event: str, **where: Any) -> Envelope:
        """The next ``sage.v1.audit.<event>`` whose payload has the given values."""
        while True:
            envelope = await _next(self.audits)
            data = envelope.data()
            if envelope.topic == f"sage.v1.audit.{event}" and all(
                data.get(k) == v for k, v in where.items()
            ):
                return envelope

    def capsule_changed(self, capsule: str, state: str) -> None:
        self.bus.publish(
            Identity(source="supervisor"),
            "sage.v1.capsules.changed",
            {"capsule": capsule, "state": state},
        )


@asynccontextmanager
async def bridge_running(
    tmp_path: Path,
    tools: dict[str, list[dict[str, Any]]],
    *,
    deadline: float = 30.0,
    before: Callable[[Path], None] = lambda _: None,
) -> AsyncIterator[Harness]:
    """The bridge under its manifest's ACL, plus one fake capsule per ``tools`` entry."""
    bus = Bus()
    manifest = load_manifest(capsule_folder("tools"))
    identity = Identity(
        source=f"capsule:{manifest.name}",
        acl=Acl(manifest.publish.patterns, manifest.subscribe.patterns),
    )
    config = Config(supervisor=SupervisorConfig(state_dir=str(tmp_path)))
    before(tmp_path)
    ready = anyio.Event()
    ctx = CapsuleContext(bus, identity, manifest, config_of=lambda: config, ready=ready)
    harness = Harness(
        bus,
        ToolBridge(ctx, execute_deadline=deadline),
        tmp_path,
        lists=bus.subscribe("sage.v1.tools.list", WATCHER),
        changes=bus.subscribe("sage.v1.tools.changed", WATCHER),
        audits=bus.subscribe("sage.v1.audit.>", WATCHER),
    )
    async with anyio.create_task_group() as tg:
        for name, offered in tools.items():
            capsule = harness.capsules[name] = FakeCapsule(bus, name, offered)
            tg.start_soon(capsule.answer_describes)
        tg.start_soon(harness.bridge.run)
        with anyio.fail_after(WITHIN):
            await ready.wait()
        yield harness
        tg.cancel_scope.cancel()
    ctx.close()


def _text(result: dict[str, Any]) -> str:
    return " ".join(c.get("text", "") for c in result["content"])


# -- the catalogue ---------------------------------------------------------------------


async def test_describe_fan_in_builds_the_list(tmp_path: Path) -> None:
    """At start the bridge asks every capsule and lists their tools prefixed, with schemas."""
    offered = {"greeter": [GREET], "calc": [_tool("add", "Add.")]}
    async with bridge_running(tmp_path, offered) as h:
        tools = await h.catalogue({"greet", "add"})
        assert tools == [
            {"name": "mcp__sage__add", "description": "Add.", "inputSchema": {"type": "object"}},
            {
                "name": "mcp__sage__greet",
                "description": "Greet a person by name.",
                "inputSchema": GREET_SCHEMA,
            },
        ]
        names: set[str] = set()
        while names != {"mcp__sage__greet", "mcp__sage__add"}:
            names |= set((await _next(h.changes)).data()["names"])
        assert h.capsules["greeter"].asked == 1


async def test_refresh_republishes_and_asks_again(tmp_path: Path) -> None:
    """sage.v1.tools.describe republishes the list at once and asks the capsules again."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        await _next(h.changes)
        h.bus.publish(RUNNER, "sage.v1.tools.describe", {})
        await h.catalogue({"greet"})  # at once, though nothing changed
        # the capsule's unchanged answer is no change: the next list is the new tool's
        h.capsules["greeter"].describe([GREET, _tool("wave")])
        await h.catalogue({"greet", "wave"})
        assert (await _next(h.changes)).data() == {"names": ["mcp__sage__wave"]}
        assert h.capsules["greeter"].asked == 2


async def test_unsolicited_describe_replaces_a_capsules_tools(tmp_path: Path) -> None:
    """A capsule's new answer replaces its tools; the changed names are announced."""
    async with bridge_running(tmp_path, {"greeter": [GREET, _tool("wave")]}) as h:
        await h.catalogue({"greet", "wave"})
        await _next(h.changes)
        h.capsules["greeter"].describe([_tool("greet", "Changed.", GREET_SCHEMA), _tool("new")])
        await h.catalogue({"greet", "new"})
        changed = (await _next(h.changes)).data()
        assert changed == {"names": ["mcp__sage__greet", "mcp__sage__new", "mcp__sage__wave"]}
        h.capsules["greeter"].describe([])  # a clean stop says so
        await h.catalogue(set())


async def test_oversized_and_bad_descriptors_are_rejected_and_audited(tmp_path: Path) -> None:
    """Each offending tool is dropped and audited; the capsule's good tools stay."""
    offered = [
        _tool("huge", "x" * 5000),
        _tool("bad.name"),
        _tool("wide", schema={"type": "object", "description": "d" * 17000}),
        _tool("string", schema={"type": "string"}),
        GREET,
    ]
    async with bridge_running(tmp_path, {"greeter": offered}) as h:
        await h.catalogue({"greet"})
        rejected = {}
        for _ in range(4):
            envelope = await h.audit("tool_rejected")
            data = envelope.data()
            assert set(data) == {"capsule", "tool", "reason"}
            assert data["capsule"] == "greeter"
            rejected[data["tool"]] = data["reason"]
        assert set(rejected) == {"huge", "bad.name", "wide", "string"}
        assert "over the cap of 4096" in rejected["huge"]
        assert "over the cap of 16384" in rejected["wide"]
        # offered again in the next describe round: not audited again
        h.capsules["greeter"].describe()
        FakeCapsule(h.bus, "zz", [_tool("bad.again")]).describe()
        assert (await h.audit("tool_rejected")).data()["capsule"] == "zz"


async def test_name_conflict_first_keeps_it(tmp_path: Path) -> None:
    """Two capsules offer one name: the first keeps it, the second's offer is audited."""
    async with bridge_running(tmp_path, {"a": [GREET]}) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["a"].serve("greet")
        other = FakeCapsule(h.bus, "b", [_tool("greet", "Impostor."), _tool("own")])
        other_serving = other.serve("greet")
        other.describe()
        rejection = (await h.audit("tool_rejected", capsule="b")).data()
        assert rejection["tool"] == "greet"
        assert "taken by capsule a" in rejection["reason"]
        tools = await h.catalogue({"greet", "own"})
        assert tools[0]["description"] == "Greet a person by name."
        cid, results = h.start_call("greet", {"name": "Ada"})
        await _next(serving)
        # the bus routes by topic, so b sees the call too; only a's answer counts
        await _next(other_serving)
        other.reply("greet", cid, "from b")
        h.capsules["a"].reply("greet", cid, "from a")
        assert _text((await _next(results)).data()) == "from a"


async def test_failed_capsule_loses_its_tools_and_pending_calls(tmp_path: Path) -> None:
    """A capsule reported failed: its pending call is answered isError at once, tools go."""
    async with bridge_running(tmp_path, {"greeter": [GREET], "calc": [_tool("add")]}) as h:
        await h.catalogue({"greet", "add"})
        serving = h.capsules["greeter"].serve("greet")
        started = time.monotonic()
        _, results = h.start_call("greet", {"name": "Ada"})
        await _next(serving)  # the capsule has the call and never answers it
        h.capsules["greeter"].crash()
        h.capsule_changed("greeter", "failed")
        result = (await _next(results)).data()
        assert time.monotonic() - started < 5  # not the 30 s deadline
        assert result["isError"] is True
        assert "capsule greeter stopped" in _text(result)
        await h.catalogue({"add"})
        # the capsule's gone: its tool is unknown now
        again = await h.call("greet", {"name": "Ada"})
        assert again["isError"] is True
        assert "unknown tool" in _text(again)


@pytest.mark.parametrize("state", ["stopped", "backoff"])
async def test_stopped_or_backoff_capsule_loses_its_tools(tmp_path: Path, state: str) -> None:
    """Stopped and backoff take a capsule's tools away as failed does; others re-describe."""
    async with bridge_running(tmp_path, {"greeter": [GREET], "calc": [_tool("add")]}) as h:
        await h.catalogue({"greet", "add"})
        h.capsules["greeter"].crash()
        h.capsule_changed("greeter", state)
        await h.catalogue({"add"})
        # the change also asked every capsule to describe again
        await h.capsules["calc"].until_asked(2)
        # back (restarted): the running event asks again, and its tools return
        back = FakeCapsule(h.bus, "greeter", [GREET])
        async with anyio.create_task_group() as tg:
            tg.start_soon(back.answer_describes)
            h.capsule_changed("greeter", "running")
            await h.catalogue({"greet", "add"})
            back.crash()


async def test_describe_for_another_capsule_is_refused(tmp_path: Path) -> None:
    """A capsule cannot describe tools under another capsule's name."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        intruder = Identity(source="capsule:intruder")
        h.bus.publish(intruder, "tool.v1.response.describe.greeter", {"tools": []})
        rejection = (await h.audit("tool_rejected")).data()
        assert rejection["capsule"] == "greeter"
        assert "capsule:intruder" in rejection["reason"]
        result = await h.call("greet", {"name": "Ada"}, within=2.0)
        assert "not serving" in _text(result)  # still listed: known, just not served here


# -- calls ------------------------------------------------------------------------------


async def test_a_call_reaches_the_capsule_and_its_answer_comes_back(tmp_path: Path) -> None:
    """Execute request as the contract says, on behalf of the principal; the answer relayed."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["greeter"].serve("greet")
        cid, results = h.start_call("mcp__sage__greet", {"name": "Ada"})
        request = await _next(serving)
        assert request.principal == "alice"
        assert request.data() == {
            "type": "tool_execute_request",
            "call_id": cid,
            "tool_name": "greet",
            "arguments": {"name": "Ada"},
            "session_id": request.data()["session_id"],
            "principal_id": "alice",
        }
        assert request.data()["session_id"]  # who asked, for a ToolCall parameter
        h.capsules["greeter"].reply("greet", cid, "Hello, Ada!")
        assert (await _next(results)).data() == {
            "content": [{"type": "text", "text": "Hello, Ada!"}],
            "isError": False,
        }
        audit = await h.audit("tool_call")
        assert audit.principal == "alice"
        assert audit.data() == {
            "principal_id": "alice",
            "session_id": "s1",
            "call_id": cid,
            "tool_use_id": "toolu_1",  # joins it with the runner's approval audit
            "tool_name": "greet",
            "allowed": True,
            "decision_source": "default",
        }


async def test_a_capsules_error_answer_is_an_error_result(tmp_path: Path) -> None:
    """is_error from the capsule becomes isError; a malformed answer is an isError too."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["greeter"].serve("greet")
        cid, results = h.start_call("greet", {"name": "Ada"})
        await _next(serving)
        h.capsules["greeter"].reply("greet", cid, "no such person", is_error=True)
        assert (await _next(results)).data()["isError"] is True
        cid, results = h.start_call("greet", {"name": "Ada"})
        await _next(serving)
        h.capsules["greeter"].answer("greet", {"call_id": cid, "content": "not a list"})
        bad = (await _next(results)).data()
        assert bad["isError"] is True
        assert "bad result" in _text(bad)


async def test_unknown_tool(tmp_path: Path) -> None:
    """A tool nobody offers is an isError result, audited as unknown_tool."""
    async with bridge_running(tmp_path, {}) as h:
        result = await h.call("nope", {})
        assert result["isError"] is True
        assert "unknown tool 'nope'" in _text(result)
        audit = (await h.audit("tool_call")).data()
        assert (audit["allowed"], audit["decision_source"]) == (False, "unknown_tool")


async def test_schema_violation_never_reaches_the_capsule(tmp_path: Path) -> None:
    """Arguments that break the inputSchema are refused before the capsule sees them."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["greeter"].serve("greet")
        for arguments in ({"name": 5}, {}, {"name": "Ada", "extra": 1}):
            result = await h.call("greet", arguments)
            assert result["isError"] is True
            assert "invalid arguments for tool 'greet'" in _text(result)
            audit = (await h.audit("tool_call")).data()
            assert (audit["allowed"], audit["decision_source"]) == (False, "schema")
        assert len(serving) == 0  # delivery is synchronous: anything sent would be queued


async def test_policy_deny_and_reload(tmp_path: Path) -> None:
    """A policy rule denies with its reason; a bad new file keeps the last good policy."""
    path = tmp_path / "tools-policy.json"

    def write(text: str, mtime: int) -> None:
        path.write_text(text)
        os.utime(path, ns=(mtime * 10**9, mtime * 10**9))

    policy = """{"rules": [{"tools": "greet", "match": {"/name": "Eve*"},
                            "action": "deny", "reason": "no Eves here"}]}"""
    async with bridge_running(
        tmp_path, {"greeter": [GREET]}, before=lambda _: write(policy, 1)
    ) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["greeter"].serve("greet")
        denied = await h.call("greet", {"name": "Evelyn"}, principal="bob")
        assert denied == {"content": [{"type": "text", "text": "no Eves here"}], "isError": True}
        audit = await h.audit("tool_call")
        assert audit.principal == "bob"
        assert (audit.data()["allowed"], audit.data()["decision_source"]) == (False, "policy:0")
        assert len(serving) == 0

        write("{broken", 2)
        denied = await h.call("greet", {"name": "Eve"})
        assert denied["isError"] is True
        failed = (await h.audit("policy_reload_failed")).data()
        assert failed["path"] == str(path)
        assert failed["error"]

        write(
            '{"default": "deny", "rules": [{"tools": "*", "principals": ["alice"], '
            '"action": "allow"}]}',
            3,
        )
        cid, results = h.start_call("greet", {"name": "Eve"})
        await _next(serving)
        h.capsules["greeter"].reply("greet", cid, "hi")
        assert (await _next(results)).data()["isError"] is False
        refused = await h.call("greet", {"name": "Ada"}, principal="bob")
        assert "default" in _text(refused)


async def test_timeout_is_an_error_result(tmp_path: Path) -> None:
    """A capsule that never answers: isError after the (short) deadline, and no later."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}, deadline=0.2) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["greeter"].serve("greet")
        started = time.monotonic()
        cid, results = h.start_call("greet", {"name": "Ada"})
        result = (await _next(results)).data()
        elapsed = time.monotonic() - started
        assert 0.2 <= elapsed < WITHIN
        assert result["isError"] is True
        assert "did not answer within 0.2 s" in _text(result)
        await _next(serving)
        # an answer after the deadline is ignored: nothing more on the result topic
        with capture_logs() as logs:
            h.capsules["greeter"].reply("greet", cid, "too late")
            await h.call("nope")  # a round trip through the bridge
        assert len(results) == 0
        assert any(e["event"] == "tools.result_ignored" for e in logs)


async def test_wrong_call_id_is_ignored(tmp_path: Path) -> None:
    """An answer with another call id is ignored and logged; the right one is relayed."""
    with capture_logs() as logs:
        async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
            await h.catalogue({"greet"})
            serving = h.capsules["greeter"].serve("greet")
            cid, results = h.start_call("greet", {"name": "Ada"})
            await _next(serving)
            h.capsules["greeter"].reply("greet", "not-the-call", "wrong")
            h.capsules["greeter"].reply("greet", cid, "right")
            assert _text((await _next(results)).data()) == "right"
    ignored = [e for e in logs if e["event"] == "tools.result_ignored"]
    assert [e["call_id"] for e in ignored] == ["not-the-call"]


async def test_second_answer_is_ignored(tmp_path: Path) -> None:
    """A capsule that answers twice: the first answer counts, the second is dropped."""
    with capture_logs() as logs:
        async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
            await h.catalogue({"greet"})
            serving = h.capsules["greeter"].serve("greet")
            cid, results = h.start_call("greet", {"name": "Ada"})
            await _next(serving)
            h.capsules["greeter"].reply("greet", cid, "first")
            h.capsules["greeter"].reply("greet", cid, "second")
            assert _text((await _next(results)).data()) == "first"
            # a second call's answer comes after the duplicate on the same queue
            cid2, results2 = h.start_call("greet", {"name": "Bo"})
            await _next(serving)
            h.capsules["greeter"].reply("greet", cid2, "next")
            assert _text((await _next(results2)).data()) == "next"
            assert len(results) == 0
    assert [e["call_id"] for e in logs if e["event"] == "tools.result_ignored"] == [cid]


async def test_answers_from_the_wrong_place_are_ignored(tmp_path: Path) -> None:
    """An answer on another tool's topic, or from another capsule, does not finish a call."""
    async with bridge_running(tmp_path, {"greeter": [GREET, _tool("wave")]}) as h:
        await h.catalogue({"greet", "wave"})
        serving = h.capsules["greeter"].serve("greet")
        cid, results = h.start_call("greet", {"name": "Ada"})
        await _next(serving)
        h.capsules["greeter"].reply("wave", cid, "wrong topic")
        FakeCapsule(h.bus, "intruder", []).reply("greet", cid, "forged")
        h.capsules["greeter"].reply("greet", cid, "genuine")
        assert _text((await _next(results)).data()) == "genuine"


async def test_a_capsule_not_serving_its_tool_fails_at_once(tmp_path: Path) -> None:
    """No subscriber on tool.v1.execute.<name>: isError now, not after the deadline."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        result = await h.call("greet", {"name": "Ada"}, within=2.0)
        assert result["isError"] is True
        assert "not serving" in _text(result)


async def test_a_bad_call_is_answered(tmp_path: Path) -> None:
    """A call payload that is not a tool call still gets an isError answer."""
    async with bridge_running(tmp_path, {}) as h:
        cid = uuid.uuid4().hex
        with h.bus.subscribe(f"sage.v1.tool.result.{cid}", WATCHER) as results:
            h.bus.publish(RUNNER, f"sage.v1.tool.call.{cid}", {"arguments": []})
            result = (await _next(results)).data()
        assert result["isError"] is True
        assert "bad tool call" in _text(result)


async def test_stopping_the_bridge_answers_pending_calls(tmp_path: Path) -> None:
    """A call in flight when the bridge stops is answered isError, not left hanging."""
    bus_results: list[dict[str, Any]] = []
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        await h.catalogue({"greet"})
        serving = h.capsules["greeter"].serve("greet")
        _, results = h.start_call("greet", {"name": "Ada"})
        await _next(serving)
    bus_results.extend(e.data() for e in results.drain())
    assert bus_results == [
        {"content": [{"type": "text", "text": "the tool bridge stopped"}], "isError": True}
    ]


# -- the fleet (capsules/tools/fleet.py; the supervisor's side is sage/fleet/tools.py) -------

SUPERVISOR = Identity(source="supervisor")
REMOTE_GREET = {**GREET, "capsule": "greeter"}


def _fleet(h: Harness, nodes: dict[str, Any], source: Identity = SUPERVISOR) -> None:
    h.bus.publish(source, "sage.v1.tools.fleet", {"node": "a", "nodes": nodes})


async def test_another_nodes_tools_join_the_catalogue_from_the_supervisor_only(
    tmp_path: Path,
) -> None:
    """sage.v1.tools.fleet from anyone but the supervisor is ignored; the supervisor's adds
    the node's tools, listed with their node; a local tool keeps its name."""
    async with bridge_running(tmp_path, {"calc": [_tool("add", "Add.")]}) as h:
        await h.catalogue({"add"})
        _fleet(h, {"b": [REMOTE_GREET, {**_tool("add"), "capsule": "x"}]})
        await h.catalogue({"add", "greet"})
        while "mcp__sage__greet" not in (await _next(h.changes)).data()["names"]:
            pass
        _fleet(h, {"evil": [{**_tool("evil"), "capsule": "x"}]}, RUNNER)
        wave = {**_tool("wave"), "capsule": "w"}
        _fleet(h, {"b": [REMOTE_GREET, {**_tool("add"), "capsule": "x"}, wave]})
        assert (await _next(h.changes)).data() == {"names": ["mcp__sage__wave"]}
        reply = await h.bus.request(WATCHER, "sage.v1.request.tools", {})
        listing = reply.data()
        nodes = {t["name"]: (t["node"], t["capsule"]) for t in listing["tools"]}
        assert nodes == {
            "mcp__sage__add": ("a", "calc"),
            "mcp__sage__greet": ("b", "greeter"),
            "mcp__sage__wave": ("b", "w"),
        }
        assert listing["clashes"] == [
            {"name": "add", "capsule": "x", "node": "b", "owner": "calc", "owner_node": "a"}
        ]


async def test_a_call_of_a_remote_tool_is_checked_forwarded_and_audited(tmp_path: Path) -> None:
    """Schema and policy here first; then sage.v1.tool.forward with the principal and session;
    the supervisor's answer is the result; tool_call (with node) and tool_forwarded audited."""
    async with bridge_running(tmp_path, {}) as h:
        _fleet(h, {"b": [REMOTE_GREET]})
        await h.catalogue({"greet"})
        bad = await h.call("greet", {"name": 5})
        assert bad["isError"] is True
        assert "invalid arguments" in _text(bad)
        forwards = h.bus.subscribe("sage.v1.tool.forward", SUPERVISOR)
        cid, results = h.start_call("greet", {"name": "Ada"})
        request = await _next(forwards)
        assert request.source == "capsule:tools"
        asked = request.data()
        assert asked["node"] == "b"
        assert asked["call"]["principal_id"] == "alice"
        assert asked["call"]["session_id"] == "s1"
        assert asked["call"]["arguments"] == {"name": "Ada"}
        assert request.reply_to is not None
        answer = {"content": [{"type": "text", "text": "Hello from b"}], "isError": False}
        h.bus.reply(SUPERVISOR, request.reply_to, answer)
        with results:
            assert (await _next(results)).data() == answer
        decided = (await h.audit("tool_call", call_id=cid)).data()
        assert (decided["node"], decided["allowed"]) == ("b", True)
        forwarded = (await h.audit("tool_forwarded", call_id=cid)).data()
        assert (forwarded["node"], forwarded["is_error"]) == ("b", False)


async def test_a_remote_tool_with_no_supervisor_to_forward_is_an_error_at_once(
    tmp_path: Path,
) -> None:
    """Nobody answers sage.v1.tool.forward: an isError result, not a wait for the deadline."""
    async with bridge_running(tmp_path, {}, deadline=30.0) as h:
        _fleet(h, {"b": [REMOTE_GREET]})
        await h.catalogue({"greet"})
        t0 = time.monotonic()
        result = await h.call("greet", {"name": "Ada"})
        assert result["isError"] is True
        assert "of node b could not be called" in _text(result)
        assert time.monotonic() - t0 < 5.0


async def test_a_forwarded_call_runs_here_for_the_named_principal_and_never_goes_on(
    tmp_path: Path,
) -> None:
    """sage.v1.tool.remote from the supervisor runs the local path (audited with from_node);
    from anyone else it is ignored; a remote tool named in it is an unknown tool here."""
    async with bridge_running(tmp_path, {"greeter": [GREET]}) as h:
        _fleet(h, {"c": [{**_tool("wave"), "capsule": "waver"}]})
        await h.catalogue({"greet", "wave"})
        serving = h.capsules["greeter"].serve("greet")
        call = {"tool_name": "greet", "arguments": {"name": "Ada"}, "principal_id": "bob"}
        call["session_id"] = "s9"
        with pytest.raises(BusError):
            await h.bus.request(
                RUNNER, "sage.v1.tool.remote", {"from_node": "b", "call": call}, deadline=0.5
            )
        async with anyio.create_task_group() as tg:

            async def answer() -> None:
                request = (await _next(serving)).data()
                assert request["principal_id"] == "bob"
                h.capsules["greeter"].reply("greet", request["call_id"], "Hello, Ada!")

            tg.start_soon(answer)
            reply = await h.bus.request(
                SUPERVISOR, "sage.v1.tool.remote", {"from_node": "b", "call": call}
            )
        assert reply.data() == {
            "content": [{"type": "text", "text": "Hello, Ada!"}],
            "isError": False,
        }
        executed = (await h.audit("tool_call", from_node="b")).data()
        assert (executed["principal_id"], executed["session_id"]) == ("bob", "s9")
        again = {**call, "tool_name": "wave"}
        reply = await h.bus.request(
            SUPERVISOR, "sage.v1.tool.remote", {"from_node": "b", "call": again}
        )
        assert "unknown tool 'wave'" in _text(reply.data())
