"""The fleet's pure parts: its config, the node table's verdicts, the node permissions."""

from __future__ import annotations

import json
from typing import ClassVar

import msgspec
import pytest
from structlog.testing import capture_logs

from sage.cli import main
from sage.config import Config, FleetConfig, decode_config
from sage.errors import ConfigError
from sage.fleet.nodes import NodeRecord, NodeState, NodeTable, decode_record
from sage.fleet.permissions import BUCKET, node_permissions, server_block

GOOD = '[fleet]\nurl = "nats://127.0.0.1:4222"\nnode = "a"\n'


def record(node: str, at: float, **fields: object) -> bytes:
    base = {
        "node": node,
        "host": "h",
        "pid": 10,
        "started_at": 1.0,
        "heartbeat_at": at,
        "heartbeat": 2.0,
    }
    return json.dumps({**base, **fields}).encode()


# -- config -------------------------------------------------------------------


def test_no_fleet_section_means_a_single_host() -> None:
    """Without [fleet] the config has none: nothing of the fleet runs."""
    assert Config().fleet is None
    assert decode_config("").fleet is None


def test_a_minimal_fleet_section_takes_the_defaults() -> None:
    """url and node are enough; heartbeat 2 s, lost after 6 s, the user is the node."""
    fleet = decode_config(GOOD).fleet
    assert fleet is not None
    assert (fleet.urls, fleet.node, fleet.user_name) == (["nats://127.0.0.1:4222"], "a", "a")
    assert (fleet.heartbeat, fleet.lost_after, fleet.replicas) == (2.0, 6.0, 1)
    several = decode_config('[fleet]\nurl = ["nats://x:1", "tls://y:2"]\nnode = "b"\n').fleet
    assert several is not None
    assert several.urls == ["nats://x:1", "tls://y:2"]


def test_fleet_paths_resolve_against_the_config_file() -> None:
    """password_file and the TLS files are relative to the config's folder."""
    config = decode_config(GOOD + 'password_file = "a.pw"\n', base_dir="/etc/sage")
    assert config.fleet is not None
    assert str(config.path_of(config.fleet.password_file)) == "/etc/sage/a.pw"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[fleet]\nnode = "a"\n', "fleet: Object missing required field `url`"),
        ('[fleet]\nurl = "nats://x"\n', "fleet: Object missing required field `node`"),
        ('[fleet]\nurl = "nats://x"\nnode = "a b"\n', "fleet.node: Expected `str` matching"),
        ('[fleet]\nurl = "http://x"\nnode = "a"\n', "is not a nats://HOST[:PORT] URL"),
        ('[fleet]\nurl = []\nnode = "a"\n', "name at least one NATS server"),
        (
            '[fleet]\nurl = "nats://u:secret@x:4222"\nnode = "a"\n',
            "a user or password in the URL; secrets go in a file",
        ),
        ('[fleet]\nurl = "nats://x/path"\nnode = "a"\n', "only nats://HOST[:PORT]"),
        (GOOD + 'cert = "c.pem"\n', "fleet.cert and fleet.key: give both or neither"),
        (GOOD + "heartbeat = 5.0\nlost_after = 5.0\n", "is not longer than fleet.heartbeat"),
        (GOOD + "heartbeat = 0\n", "fleet.heartbeat: Expected `float` > 0.0"),
        (GOOD + "replicas = 7\n", "fleet.replicas: Expected `int` <= 5"),
        (GOOD + 'password = "x"\n', "fleet: Object contains unknown field `password`"),
        (GOOD + 'user = "a b"\n', "is not a NATS user name"),
        (
            GOOD + 'nkey_seed = "a.nk"\npassword_file = "a.pw"\n',
            "fleet: password_file and nkey_seed: give one of password_file, nkey_seed, creds",
        ),
        (GOOD + 'nkey_seed = "a.nk"\nuser = "a"\n', "fleet.nkey_seed: an NKey names the node"),
        (
            GOOD + 'creds = "a.creds"\npassword_file = "a.pw"\n',
            "fleet: password_file and creds: give one of password_file, nkey_seed, creds",
        ),
        (
            GOOD + 'creds = "a.creds"\nnkey_seed = "a.nk"\n',
            "fleet: nkey_seed and creds: give one of password_file, nkey_seed, creds",
        ),
        (GOOD + 'creds = "a.creds"\nuser = "a"\n', "fleet.creds: the user JWT names the node's"),
    ],
)
def test_a_bad_fleet_section_is_one_clear_line(text: str, expected: str) -> None:
    """Each bad [fleet] key is refused with a line naming it; a secret is never echoed."""
    with pytest.raises(ConfigError) as info:
        decode_config(text, source="f.toml")
    message = str(info.value)
    assert message.startswith("f.toml: ")
    assert expected in message, message
    assert "secret" not in message.replace("secrets go", "")
    assert "\n" not in message


def test_fleet_config_is_frozen() -> None:
    fleet = FleetConfig(url="nats://x", node="a")
    with pytest.raises(AttributeError):
        fleet.node = "b"  # type: ignore[misc]


# -- the node table -------------------------------------------------------------


def test_a_node_is_live_until_lost_after_then_lost() -> None:
    """Given the clock: live at lost_after exactly, lost just past it."""
    table = NodeTable(lost_after=6.0)
    table.observe("a", record("a", at=100.0))
    assert [v.state for v in table.verdicts(now=106.0)] == [NodeState.LIVE]
    assert [v.state for v in table.verdicts(now=106.01)] == [NodeState.LOST]
    assert table.verdicts(now=103.5)[0].age_s == 3.5


def test_a_new_heartbeat_brings_a_lost_node_back() -> None:
    table = NodeTable(lost_after=6.0)
    table.observe("a", record("a", at=100.0))
    assert table.verdicts(now=200.0)[0].state is NodeState.LOST
    table.observe("a", record("a", at=199.0))
    assert table.verdicts(now=200.0)[0].state is NodeState.LIVE


def test_a_stopped_node_is_stopped_not_lost() -> None:
    table = NodeTable(lost_after=6.0)
    table.observe("a", record("a", at=100.0, stopped=True))
    assert table.verdicts(now=1000.0)[0].state is NodeState.STOPPED


def test_verdicts_are_sorted_and_forget_removes() -> None:
    table = NodeTable(lost_after=1.0)
    for node in ("c", "a", "b"):
        table.observe(node, record(node, at=10.0))
    assert [v.node for v in table.verdicts(now=10.0)] == ["a", "b", "c"]
    table.forget("b")
    assert [v.node for v in table.verdicts(now=10.0)] == ["a", "c"]


@pytest.mark.parametrize(
    ("key", "data", "why"),
    [
        ("x", b"\x00garbage", "malformed"),
        ("x", b"[]", "Expected `object`"),
        ("x", record("x", at=1.0, pid="ten"), "Expected `int`"),
        ("x", json.dumps({"node": "x"}).encode(), "missing required field"),
        ("x", record("y", at=1.0), "it names node 'y'"),
        ("x", record("x", at=1.0, heartbeat=0), "must be positive"),
        ("x.y", record("x.y", at=1.0), "not a node name"),
    ],
)
def test_an_unusable_record_is_left_out_and_said_why(key: str, data: bytes, why: str) -> None:
    """A malformed record, or one filed under another node's key, is ignored; the good
    ones are still judged."""
    table = NodeTable(lost_after=6.0)
    table.observe("a", record("a", at=100.0))
    assert table.observe(key, data) is None
    assert [v.node for v in table.verdicts(now=101.0)] == ["a"]
    assert why in table.ignored[key]


def test_a_record_made_good_again_is_no_longer_ignored() -> None:
    table = NodeTable(lost_after=6.0)
    table.observe("a", b"nope")
    table.observe("a", record("a", at=1.0))
    assert table.ignored == {}
    assert [v.node for v in table.verdicts(now=2.0)] == ["a"]


def test_a_record_round_trips() -> None:
    mine = NodeRecord(node="a", host="h", pid=1, started_at=1.0, heartbeat_at=2.0, heartbeat=2.0)
    assert decode_record("a", mine.encode()) == mine
    assert msgspec.json.decode(mine.encode())["stopped"] is False


# -- the shell's reading of the bucket, logging ignored records -------------------


@pytest.mark.anyio
async def test_status_reads_past_a_malformed_record_and_logs_it() -> None:
    """FleetMember.nodes: a garbage entry is logged (fleet.record_ignored) and left out;
    the status reply still lists the good nodes."""
    from sage.fleet.member import FleetMember, status_reply

    class Entry:
        def __init__(self, value: bytes) -> None:
            self.value = value

    class Bucket:
        entries: ClassVar[dict[str, bytes]] = {"a": record("a", at=1e12), "zz": b"{not json"}

        async def get(self, key: str) -> Entry:
            return Entry(self.entries[key])

    class State:
        subjects: ClassVar[dict[str, int]] = {f"$KV.{BUCKET}.a": 1, f"$KV.{BUCKET}.zz": 1}

    class Info:
        state = State()

    class Js:
        async def stream_info(self, name: str, subjects_filter: str) -> Info:
            assert subjects_filter == f"$KV.{BUCKET}.>"
            return Info()

    class Connection:
        is_connected = True

    member = FleetMember(
        nc=Connection(),  # type: ignore[arg-type]
        js=Js(),  # type: ignore[arg-type]
        kv=Bucket(),  # type: ignore[arg-type]
        config=FleetConfig(url="nats://x", node="a"),
        started_at=0.0,
    )
    with capture_logs() as logs:
        reply = await status_reply(member)
    assert reply["ok"] is True
    assert [n["node"] for n in reply["nodes"]] == ["a"]
    ignored = [e for e in logs if e["event"] == "fleet.record_ignored"]
    assert len(ignored) == 1
    assert ignored[0]["key"] == "zz"
    assert ignored[0]["log_level"] == "warning"


@pytest.mark.anyio
async def test_without_a_membership_the_reply_is_not_in_fleet() -> None:
    from sage.fleet.member import status_reply

    reply = await status_reply(None)
    assert (reply["ok"], reply["error"]) == (False, "not_in_fleet")


# -- permissions ------------------------------------------------------------------


def test_a_node_may_publish_its_own_key_only() -> None:
    """No wildcard reaches another node's heartbeat or catalogue key; replies come to its own
    inboxes; tool calls go to other nodes only, and come in on its own subject only."""
    perms = node_permissions("a")
    publish = perms["publish"]["allow"]
    assert f"$KV.{BUCKET}.a" in publish
    assert not any(p.startswith(f"$KV.{BUCKET}.") and p != f"$KV.{BUCKET}.a" for p in publish)
    nodes_api = [p for p in publish if "KV_sage_nodes" in p]
    assert len(nodes_api) == 4
    # the fleet audit's subjects: its own, and the verify requests (test_fleet_audit_check)
    assert [p for p in publish if p.startswith("sage.audit.")] == [
        "sage.audit.a.entry",
        "sage.audit.a.checkpoint",
        "sage.audit.a.key",
    ]
    assert "sage.fleet.*.audit.verify" in publish
    assert perms["subscribe"]["allow"] == [
        "_INBOX.a.>",
        "sage.fleet.a.request.>",  # its own requests only
        "sage.fleet.*.event.>",
        "sage.fleet.a.audit.verify",
        "sage.fleet.a.tool.call.*",  # its own tool calls only
    ]
    # requests and tool calls carry its own name as the origin, never another's
    assert [p for p in publish if ".request." in p] == ["sage.fleet.*.request.a.>"]
    assert "sage.fleet.a.event.>" in publish  # its own sessions' events only
    assert not any(
        p.startswith("sage.fleet.") and ".event." in p and p != "sage.fleet.a.event.>"
        for p in publish
    )
    assert perms["allow_responses"] is True
    assert "$KV.sage_tools.a" in publish
    assert not any(p.startswith("$KV.sage_tools.") and p != "$KV.sage_tools.a" for p in publish)
    assert [p for p in publish if ".tool.call" in p] == ["sage.fleet.*.tool.call.a"]
    assert perms["publish"]["deny"] == ["sage.fleet.a.tool.call.*"]


def test_the_transcripts_bucket_is_written_under_its_own_name_only() -> None:
    """Failover: its own copies, ``$KV.sage_transcripts.<node>.>``, and reads of any node's
    from the stream's leader; no purge, no consumer, no object store."""
    publish = node_permissions("a")["publish"]["allow"]
    assert [p for p in publish if p.startswith("$KV.sage_transcripts.")] == [
        "$KV.sage_transcripts.a.>"
    ]
    assert sorted(p for p in publish if "KV_sage_transcripts" in p) == sorted(
        [
            "$JS.API.STREAM.CREATE.KV_sage_transcripts",
            "$JS.API.STREAM.INFO.KV_sage_transcripts",
            "$JS.API.STREAM.MSG.GET.KV_sage_transcripts",
        ]
    )
    assert not any(p.startswith("$O.") or "OBJ_" in p for p in publish)
    assert not any(".PURGE." in p or ".MSG.DELETE." in p or ".UPDATE." in p for p in publish)
    assert not any(p.startswith("$JS.API.STREAM.DELETE.") for p in publish)


def test_a_node_writes_registry_keys_under_its_own_name_only() -> None:
    """Its entries and its claims are ``<node>.<sid>``: no wildcard reaches another
    node's; the streams are only read."""
    publish = node_permissions("a")["publish"]["allow"]
    assert [p for p in publish if p.startswith("$KV.sage_sessions.")] == ["$KV.sage_sessions.a.>"]
    assert [p for p in publish if p.startswith("$KV.sage_claims.")] == ["$KV.sage_claims.a.>"]
    assert sorted(p for p in publish if "KV_sage_claims" in p) == sorted(
        [
            "$JS.API.STREAM.CREATE.KV_sage_claims",
            "$JS.API.STREAM.INFO.KV_sage_claims",
            "$JS.API.STREAM.MSG.GET.KV_sage_claims",
            "$JS.API.DIRECT.GET.KV_sage_claims.>",
        ]
    )
    assert not any(".PURGE.KV_" in p or ".MSG.DELETE." in p for p in publish)


def test_peers_bound_where_a_node_may_forward() -> None:
    publish = node_permissions("a", ["b", "a"])["publish"]["allow"]
    assert [p for p in publish if ".request." in p] == ["sage.fleet.b.request.a.>"]
    assert [p for p in publish if ".tool.call" in p] == ["sage.fleet.b.tool.call.a"]


def test_the_server_block_carries_no_password(capsys: pytest.CaptureFixture[str]) -> None:
    """`astrid fleet permissions` prints a user entry whose password is a $VARIABLE."""
    assert main(["fleet", "permissions", "--node", "node-1", "--user", "n1"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == server_block("node-1", "n1")
    assert 'user: "n1"' in out
    assert "password: $SAGE_NODE_NODE_1" in out
    assert '"$KV.sage_nodes.node-1"' in out
    assert main(["fleet", "permissions", "--node", "a", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == node_permissions("a")


def test_permissions_refuse_a_bad_node_name(capsys: pytest.CaptureFixture[str]) -> None:
    """A name that is not a subject token (a wildcard) is refused, not printed."""
    assert main(["fleet", "permissions", "--node", ">"]) == 1
    assert "is not a node name" in capsys.readouterr().err


def test_an_nkey_entry_names_the_public_key_only(capsys: pytest.CaptureFixture[str]) -> None:
    """--nkey: the entry is `nkey: "U..."` with no user and no password line."""
    public = "U" + "A" * 55
    assert main(["fleet", "permissions", "--node", "k", "--nkey", public]) == 0
    out = capsys.readouterr().out
    assert f'  nkey: "{public}"' in out
    assert "user:" not in out
    assert "password" not in out
    assert main(["fleet", "permissions", "--node", "k", "--nkey", "SUAAAA"]) == 1
    assert "is not a user's public NKey" in capsys.readouterr().err
