"""Tools anywhere without a network: the fleet-wide catalogue and the bucket's values."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import msgspec
import pytest

from bus import Bus, Identity
from capsules.tools.fleet import MAX_REMOTE_TOOLS, FleetCatalogue
from sage.fleet.member import FleetMember
from sage.fleet.nodes import NodeRecord
from sage.fleet.tools import (
    MAX_CATALOGUE,
    FleetTools,
    fit,
    own_catalogue,
    read_catalogue,
    valid_node,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}}


def tool(name: str, capsule: str = "greeter", description: str = "d") -> dict[str, Any]:
    return {"name": name, "description": description, "inputSchema": SCHEMA, "capsule": capsule}


def test_a_local_tool_wins_its_name_and_the_clash_is_shown() -> None:
    """A remote node offering a local tool's name does not take it; the clash names both."""
    catalogue = FleetCatalogue()
    catalogue.offer("greeter", {"tools": [tool("greet")]})
    change = catalogue.set_remote("a", {"b": [tool("greet", "evil"), tool("shout")]})
    assert change.changed == ["shout"]
    greet = catalogue.get("greet")
    assert greet is not None
    assert (greet.node, greet.capsule) == ("", "greeter")
    shout = catalogue.get("shout")
    assert shout is not None
    assert shout.node == "b"
    assert catalogue.clashes() == [
        {"name": "greet", "capsule": "evil", "node": "b", "owner": "greeter", "owner_node": "a"}
    ]


def test_a_clash_between_remote_nodes_goes_to_the_first_by_name() -> None:
    """Whatever the order they come in, node b's tool wins over node c's (and is shown)."""
    for nodes in (
        {"c": [tool("t", "x")], "b": [tool("t", "y")]},
        {"b": [tool("t", "y")], "c": [tool("t", "x")]},
    ):
        catalogue = FleetCatalogue()
        catalogue.set_remote("a", nodes)
        owner = catalogue.get("t")
        assert owner is not None
        assert (owner.node, owner.capsule) == ("b", "y")
        (clash,) = catalogue.clashes()
        assert (clash["node"], clash["owner_node"]) == ("c", "b")


def test_remote_tools_pass_the_local_checks_and_caps() -> None:
    """A wildcard in a tool or node name, an oversized description, this node's own name,
    or more than MAX_REMOTE_TOOLS tools: dropped with a rejection; the rest kept."""
    catalogue = FleetCatalogue()
    change = catalogue.set_remote(
        "a",
        {
            "b": [tool("gr*et"), tool("ok>"), tool("big", description="x" * 5000), tool("fine")],
            "c.>": [tool("x")],
            "a": [tool("mine")],
            "d": [tool(f"t{i}") for i in range(MAX_REMOTE_TOOLS + 5)],
        },
    )
    names = {t.name for t in catalogue.tools()}
    assert "fine" in names
    assert not names & {"gr*et", "ok>", "big", "x", "mine"}
    assert len([t for t in catalogue.tools() if t.node == "d"]) == MAX_REMOTE_TOOLS
    reasons = " | ".join(r.reason for r in change.rejected)
    assert "over the cap of 1024" in reasons
    assert "not another node's name" in reasons
    assert "description is 5000 bytes" in reasons


def test_a_node_gone_from_the_fleet_takes_its_tools_away() -> None:
    """The next fleet catalogue without node b drops b's tools (a changed name)."""
    catalogue = FleetCatalogue()
    catalogue.set_remote("a", {"b": [tool("greet")]})
    change = catalogue.set_remote("a", {})
    assert change.changed == ["greet"]
    assert catalogue.get("greet") is None


def test_the_bucket_value_is_bounded_and_holds_only_this_nodes_tools() -> None:
    """Remote tools of the listing are left out; past MAX_CATALOGUE bytes, tools are."""
    listing = [
        {**tool(f"mcp__sage__t{i}", description="y" * 4000), "node": "a"} for i in range(400)
    ]
    listing.append({**tool("mcp__sage__remote"), "node": "b"})
    value = own_catalogue("a", listing)
    assert len(value) <= MAX_CATALOGUE
    tools = read_catalogue("a", value)
    assert tools is not None
    assert 100 < len(tools) < 400
    assert tools[0]["name"] == "t0"
    assert all(t["name"] != "remote" for t in tools)


def test_a_catalogue_under_another_nodes_key_or_too_big_is_not_read() -> None:
    """The value must name its key's node and fit the bound."""
    value = msgspec.json.encode({"node": "b", "tools": []})
    assert read_catalogue("c", value) is None
    assert read_catalogue("b", value) == []
    assert read_catalogue("b", b"{" + b" " * (MAX_CATALOGUE + 2048) + b"}") is None
    assert read_catalogue("b", b"not json") is None


@pytest.mark.parametrize("name", ["b.x", "*", ">", "b>", "", "a b", "x" * 65])
def test_node_names_that_are_not_one_subject_token_are_refused(name: str) -> None:
    """No subject is ever built from a name with a dot or a wildcard."""
    assert not valid_node(name)


@pytest.mark.anyio
@pytest.mark.parametrize("node", ["*", "b.>", "a"])
async def test_a_forward_to_a_bad_node_or_itself_is_an_error_result(node: str) -> None:
    """A wildcard node, or this node, is answered isError before any NATS subject."""
    member = _member("a")
    fleet = FleetTools(member, Bus(), Identity("supervisor"), lambda: 5.0)
    request = {"node": node, "deadline": 1.0, "call": {"tool_name": "greet"}}
    result = await fleet.forward(msgspec.json.encode(request))
    assert result["isError"] is True
    assert "cannot forward to node" in result["content"][0]["text"]


@pytest.mark.anyio
async def test_a_forward_while_nats_is_down_is_an_error_result_at_once() -> None:
    """Not connected: isError naming the node and the cause, without waiting."""
    member = _member("a", connected=False)
    fleet = FleetTools(member, Bus(), Identity("supervisor"), lambda: 5.0)
    request = {"node": "b", "deadline": 30.0, "call": {"tool_name": "greet"}}
    result = await fleet.forward(msgspec.json.encode(request))
    assert result["isError"] is True
    assert result["content"][0]["text"] == "node b cannot be reached: NATS is not connected"


def test_the_catalogues_given_to_the_bridge_fit_a_bus_payload() -> None:
    """Nodes are taken by name while they fit; the others are left out."""
    big = [tool(f"t{i}", description="z" * 4000) for i in range(100)]  # ~420 KB a node
    remote = {"d": big, "b": big, "c": big}
    kept = fit(remote, 1024 * 1024)
    assert list(kept) == ["b", "c"]
    assert len(msgspec.json.encode({"node": "a", "nodes": kept})) < 1024 * 1024
    assert fit(remote, 10 * 1024 * 1024) == dict(sorted(remote.items()))


def test_on_a_single_host_a_clash_row_is_as_before() -> None:
    """No fleet: the local clash rows keep {name, capsule, owner}."""
    catalogue = FleetCatalogue()
    catalogue.offer("mine", {"tools": [tool("hello")]})
    catalogue.offer("other", {"tools": [tool("hello")]})
    assert catalogue.clashes() == [{"name": "hello", "capsule": "other", "owner": "mine"}]


def _member(
    node: str, *, connected: bool = True, declared: dict[str, tuple[str, ...]] | None = None
) -> FleetMember:
    """A member whose node bucket holds a record for each of ``declared`` (node -> the
    principals it declares; default: node a declares alice)."""
    records = {"a": ("alice",)} if declared is None else declared

    async def record_of(name: str) -> NodeRecord | None:
        if name not in records:
            return None
        return NodeRecord(
            node=name,
            host="h",
            pid=1,
            started_at=0.0,
            heartbeat_at=0.0,
            heartbeat=1.0,
            principals=list(records[name]),
        )

    config = SimpleNamespace(peers={}, heartbeat=1.0)
    return cast(
        FleetMember,
        SimpleNamespace(node=node, connected=connected, config=config, record_of=record_of),
    )


class _Msg:
    """A NATS message whose server takes at most ``limit`` bytes (its max_payload)."""

    def __init__(self, data: bytes, limit: int, subject: str = "sage.fleet.b.tool.call.a") -> None:
        self.data = data
        self.subject = subject
        self.reply = "_INBOX.a.1"
        self.limit = limit
        self.sent: list[bytes] = []

    async def respond(self, data: bytes) -> None:
        if len(data) > self.limit:  # what nats-py's publish raises past max_payload
            from nats.errors import MaxPayloadError

            raise MaxPayloadError
        self.sent.append(data)


@pytest.mark.anyio
async def test_an_answer_too_big_for_nats_is_an_error_result_instead() -> None:
    """The serving node's bridge answers 600 KB; NATS takes 512 KB: the caller gets isError."""
    import anyio

    bus = Bus()
    supervisor = Identity("supervisor")
    bridge = Identity("capsule:tools")
    member = _member("b")
    fleet = FleetTools(member, bus, supervisor, lambda: 5.0)
    calls = bus.subscribe("sage.v1.tool.remote", bridge)
    call = {"from_node": "a", "call": {"tool_name": "greet", "principal_id": "alice"}}
    msg = _Msg(msgspec.json.encode({"call": call["call"]}), 512 * 1024)
    big = {"content": [{"type": "text", "text": "x" * 600_000}], "isError": False}
    async with anyio.create_task_group() as tg:
        tg.start_soon(fleet._serve_call, cast(Any, msg))
        request = await calls.get()
        assert request.data() == call
        assert request.reply_to is not None
        bus.reply(bridge, request.reply_to, big)
    (sent,) = msg.sent
    result = msgspec.json.decode(sent)
    assert result["isError"] is True
    assert "answer not sent" in result["content"][0]["text"]


def test_tools_list_names_the_nodes_of_a_clash(capsys: pytest.CaptureFixture[str]) -> None:
    """A clash between nodes says both nodes; a single host's line is as before."""
    from sage.cli.capsule_cmd import _print_clashes

    _print_clashes(
        [
            {"name": "t", "capsule": "x", "node": "c", "owner": "y", "owner_node": "b"},
            {"name": "u", "capsule": "p", "owner": "q"},
        ]
    )
    assert capsys.readouterr().out.splitlines() == [
        "clash: tool 't' of capsule x on node c is not offered: capsule y on node b has that name",
        "clash: tool 'u' of capsule p is not offered: capsule q has that name",
    ]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("subject", "principal", "why"),
    [
        ("sage.fleet.b.tool.call.a", "mallory", "does not authenticate principal 'mallory'"),
        ("sage.fleet.b.tool.call.a", None, "admin"),
        ("sage.fleet.b.tool.call.c", "alice", "no heartbeat record"),
    ],
)
async def test_a_tool_call_for_a_principal_its_node_did_not_vouch_for_is_refused(
    subject: str, principal: str | None, why: str
) -> None:
    """The origin is the subject's (a payload's from_node is ignored); a principal that
    node's record does not declare, an admin, or a node with no record: isError
    principal_not_authenticated, the bridge never asked, one audit row without the
    arguments."""
    import anyio

    bus = Bus()
    fleet = FleetTools(_member("b"), bus, Identity("supervisor"), lambda: 5.0)
    calls = bus.subscribe("sage.v1.tool.remote", Identity("capsule:tools"))
    audit = bus.subscribe("sage.v1.audit.>", Identity("audit"))
    call = {"tool_name": "greet", "arguments": {"secret": "x"}, "principal_id": principal}
    msg = _Msg(msgspec.json.encode({"from_node": "a", "call": call}), 1 << 20, subject)
    await fleet._serve_call(cast(Any, msg))
    (sent,) = msg.sent
    result = msgspec.json.decode(sent)
    assert result["isError"] is True
    text = result["content"][0]["text"]
    assert text.startswith("principal_not_authenticated: "), text
    assert why in text
    with anyio.fail_after(1):
        row = await audit.get()
    assert row.topic == "sage.v1.audit.fleet_principal_rejected"
    origin = subject.rsplit(".", 1)[1]
    assert row.data() == {
        "origin": origin,
        "principal_id": principal,
        "verb": "tool.call",
        "tool_name": "greet",
        "session_id": None,
        "subject": subject,
        "reason": text.removeprefix("principal_not_authenticated: "),
    }
    assert len(calls) == 0  # the bridge was never asked


@pytest.mark.anyio
async def test_a_tool_call_its_node_vouches_for_reaches_the_bridge_with_that_origin() -> None:
    """From a for alice (a's record declares her): the bridge gets from_node a, whatever
    the payload said."""
    import anyio

    bus = Bus()
    fleet = FleetTools(_member("b"), bus, Identity("supervisor"), lambda: 5.0)
    bridge = Identity("capsule:tools")
    calls = bus.subscribe("sage.v1.tool.remote", bridge)
    call = {"tool_name": "greet", "principal_id": "alice"}
    msg = _Msg(msgspec.json.encode({"from_node": "c", "call": call}), 1 << 20)
    async with anyio.create_task_group() as tg:
        tg.start_soon(fleet._serve_call, cast(Any, msg))
        request = await calls.get()
        assert request.data() == {"from_node": "a", "call": call}
        assert request.reply_to is not None
        bus.reply(bridge, request.reply_to, {"content": [], "isError": False})
    assert msgspec.json.decode(msg.sent[0]) == {"content": [], "isError": False}
