"""The tool bridge's pure parts: catalogue caps, names, conflicts; policy rules and pointers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from capsules.tools.catalogue import (
    MAX_DESCRIPTION,
    MAX_SCHEMA,
    MAX_TOOLS,
    Catalogue,
    SchemaCache,
    valid_name,
)
from capsules.tools.policy import (
    DEFAULT_POLICY,
    PolicyError,
    PolicyFile,
    decide,
    found,
    parse_pointer,
    parse_policy,
    resolve_pointer,
)

OBJECT: dict[str, Any] = {"type": "object"}


def _tool(name: Any, description: Any = "", schema: Any = None, **extra: Any) -> dict[str, Any]:
    return {"name": name, "description": description, "inputSchema": schema or OBJECT, **extra}


def _greet(**properties: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"type": "string"}, **properties},
        "required": ["name"],
    }


# -- names ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["greet", "a", "A-b_9", "x" * 64])
def test_good_names(name: str) -> None:
    """Letters, digits, '_' and '-', 1 to 64 of them, are tool names."""
    assert valid_name(name)


@pytest.mark.parametrize("name", ["", "x" * 65, "a.b", "a b", "é", "a\n", "a/b", 7, None])
def test_bad_names(name: Any) -> None:
    """Anything else is not (including a trailing newline and non-strings)."""
    assert not valid_name(name)


# -- descriptors ----------------------------------------------------------------


def test_offer_keeps_good_tools_and_lists_them_prefixed() -> None:
    """A good descriptor is kept and listed as mcp__sage__<name> with its schema."""
    catalogue = Catalogue()
    change = catalogue.offer("greeter", {"tools": [_tool("greet", "Greet.", _greet())]})
    assert change.changed == ["greet"]
    assert change.rejected == []
    assert catalogue.mcp_tools() == [
        {"name": "mcp__sage__greet", "description": "Greet.", "inputSchema": _greet()}
    ]
    tool = catalogue.get("greet")
    assert tool is not None
    assert tool.capsule == "greeter"


@pytest.mark.parametrize(
    ("entry", "tool", "reason"),
    [
        ("greet", None, "must be a JSON object"),
        (_tool("a.b"), "a.b", "must match"),
        (_tool(12), None, "must match"),
        (_tool("t", description=5), "t", "description must be a string"),
        (_tool("t", description="é" * (MAX_DESCRIPTION // 2 + 1)), "t", "over the cap"),
        ({"name": "t"}, "t", "inputSchema must be a JSON object"),
        (_tool("t", schema=["type", "object"]), "t", "inputSchema must be a JSON object"),
        (_tool("t", schema={"type": "string"}), "t", '"type": "object"'),
        (_tool("t", schema={"properties": {}}), "t", '"type": "object"'),
        (_tool("t", schema={"type": "object", "minProperties": "x"}), "t", "does not compile"),
        (
            _tool("t", schema={"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}),
            "t",
            "remote $ref",
        ),
        (
            _tool("t", schema={"type": "object", "properties": {"a": {"$ref": "/etc/passwd"}}}),
            "t",
            "remote $ref",
        ),
    ],
)
def test_bad_descriptor_is_rejected_and_the_rest_kept(
    entry: Any, tool: str | None, reason: str
) -> None:
    """An offending tool is dropped with a reason; the capsule's other tools stay."""
    catalogue = Catalogue()
    change = catalogue.offer("c", {"tools": [entry, _tool("good")]})
    assert change.changed == ["good"]
    assert [(r.capsule, r.tool) for r in change.rejected] == [("c", tool)]
    assert reason in change.rejected[0].reason
    assert [t.name for t in catalogue.tools()] == ["good"]


def test_description_cap_is_in_bytes_and_inclusive() -> None:
    """A description of exactly 4 KiB is kept; one byte more is not."""
    catalogue = Catalogue()
    change = catalogue.offer(
        "c",
        {
            "tools": [
                _tool("ok", "x" * MAX_DESCRIPTION),
                _tool("long", "x" * (MAX_DESCRIPTION + 1)),
            ]
        },
    )
    assert change.changed == ["ok"]
    assert [r.tool for r in change.rejected] == ["long"]


def test_schema_cap_counts_encoded_bytes() -> None:
    """An inputSchema over 16 KiB encoded is rejected; one just under is kept."""

    def schema_of(size: int) -> dict[str, Any]:
        base = {"type": "object", "description": ""}
        overhead = len(b'{"description":"","type":"object"}')
        return {**base, "description": "d" * (size - overhead)}

    catalogue = Catalogue()
    change = catalogue.offer(
        "c",
        {
            "tools": [
                _tool("ok", schema=schema_of(MAX_SCHEMA)),
                _tool("big", schema=schema_of(MAX_SCHEMA + 1)),
            ]
        },
    )
    assert change.changed == ["ok"]
    assert [r.tool for r in change.rejected] == ["big"]
    assert "over the cap of 16384" in change.rejected[0].reason


def test_tool_count_cap() -> None:
    """A capsule's first 256 entries are considered; the rest are dropped in one rejection."""
    catalogue = Catalogue()
    change = catalogue.offer("c", {"tools": [_tool(f"t{i}") for i in range(MAX_TOOLS + 10)]})
    assert len(change.changed) == MAX_TOOLS
    assert len(catalogue.tools()) == MAX_TOOLS
    assert catalogue.get(f"t{MAX_TOOLS - 1}") is not None
    assert catalogue.get(f"t{MAX_TOOLS}") is None
    [rejection] = change.rejected
    assert rejection.tool is None
    assert "266 tools" in rejection.reason


def test_a_bad_response_changes_nothing() -> None:
    """A response that is not {"tools": [...]} is one rejection and keeps the old tools."""
    catalogue = Catalogue()
    catalogue.offer("c", {"tools": [_tool("keep")]})
    responses: list[Any] = [None, [], {"tools": {}}, {"nope": 1}]
    for response in responses:
        change = catalogue.offer("c", response)
        assert change.changed == []
        assert [r.tool for r in change.rejected] == [None]
    assert [t.name for t in catalogue.tools()] == ["keep"]


def test_same_name_twice_in_one_capsule() -> None:
    """A capsule that offers a name twice keeps the first."""
    catalogue = Catalogue()
    change = catalogue.offer("c", {"tools": [_tool("t", "first"), _tool("t", "second")]})
    assert [r.tool for r in change.rejected] == ["t"]
    tool = catalogue.get("t")
    assert tool is not None
    assert tool.description == "first"


def test_rejection_truncates_a_long_bad_name() -> None:
    """An oversized bad name is shortened in the rejection (it lands in the audit log)."""
    change = Catalogue().offer("c", {"tools": [_tool("x" * 5000)]})
    [rejection] = change.rejected
    assert rejection.tool is not None
    assert len(rejection.tool) < 200
    assert rejection.audit() == {"capsule": "c", "tool": rejection.tool, "reason": rejection.reason}


# -- conflicts and changes ------------------------------------------------------------


def test_name_conflict_first_keeps_it() -> None:
    """Two capsules offering one name: the first keeps it, the second's is rejected."""
    catalogue = Catalogue()
    catalogue.offer("a", {"tools": [_tool("t", "from a")]})
    change = catalogue.offer("b", {"tools": [_tool("t", "from b"), _tool("u")]})
    assert change.changed == ["u"]
    assert [(r.capsule, r.tool) for r in change.rejected] == [("b", "t")]
    assert "taken by capsule a" in change.rejected[0].reason
    tool = catalogue.get("t")
    assert tool is not None
    assert tool.capsule == "a"
    # the first re-describing does not lose the name, whatever the order of offers
    assert catalogue.offer("a", {"tools": [_tool("t", "from a")]}).changed == []


def test_name_let_go_passes_to_the_next_offer() -> None:
    """When the owner stops offering a name, the capsule that also offered it takes over."""
    catalogue = Catalogue()
    catalogue.offer("a", {"tools": [_tool("t", "from a")]})
    catalogue.offer("b", {"tools": [_tool("t", "from b")]})
    change = catalogue.remove("a")
    assert change.changed == ["t"]
    tool = catalogue.get("t")
    assert tool is not None
    assert tool.capsule == "b"


def test_clashes_list_each_offer_left_out_and_its_owner() -> None:
    """What `astrid tools list` and `capsule list` show: who wanted a name another owns."""
    catalogue = Catalogue()
    catalogue.offer("a", {"tools": [_tool("t"), _tool("v")]})
    catalogue.offer("b", {"tools": [_tool("t"), _tool("u")]})
    catalogue.offer("c", {"tools": [_tool("t"), _tool("v")]})
    assert catalogue.clashes() == [
        {"name": "t", "capsule": "b", "owner": "a"},
        {"name": "t", "capsule": "c", "owner": "a"},
        {"name": "v", "capsule": "c", "owner": "a"},
    ]
    catalogue.remove("a")
    assert catalogue.clashes() == [{"name": "t", "capsule": "c", "owner": "b"}]
    catalogue.remove("b")
    assert catalogue.clashes() == []


def test_a_later_claim_does_not_steal_a_name() -> None:
    """A capsule that offered first but added the name later does not take it."""
    catalogue = Catalogue()
    catalogue.offer("a", {"tools": []})
    catalogue.offer("b", {"tools": [_tool("t")]})
    change = catalogue.offer("a", {"tools": [_tool("t")]})
    assert change.changed == []
    assert [r.capsule for r in change.rejected] == ["a"]
    tool = catalogue.get("t")
    assert tool is not None
    assert tool.capsule == "b"


def test_changes_name_added_removed_and_altered_tools() -> None:
    """A new response reports the names that appeared, went or changed, nothing else."""
    catalogue = Catalogue()
    catalogue.offer("c", {"tools": [_tool("same"), _tool("gone"), _tool("alter", "v1")]})
    change = catalogue.offer("c", {"tools": [_tool("same"), _tool("alter", "v2"), _tool("new")]})
    assert change.changed == ["alter", "gone", "new"]
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert catalogue.offer("c", {"tools": [_tool("same", schema=schema)]}).changed == [
        "alter",
        "new",
        "same",
    ]
    assert catalogue.remove("c").changed == ["same"]
    assert catalogue.remove("c").changed == []
    assert catalogue.tools() == []


def test_schema_key_is_order_independent() -> None:
    """The same schema with its keys in another order is no change."""
    catalogue = Catalogue()
    catalogue.offer("c", {"tools": [_tool("t", schema={"type": "object", "required": []})]})
    change = catalogue.offer(
        "c", {"tools": [_tool("t", schema={"required": [], "type": "object"})]}
    )
    assert change.changed == []


def test_validators_are_cached_per_schema() -> None:
    """Equal schemas share one compiled validator; the cache is bounded."""
    cache = SchemaCache(limit=2)
    catalogue = Catalogue(cache)
    catalogue.offer("a", {"tools": [_tool("t", schema=_greet())]})
    catalogue.offer("b", {"tools": [_tool("u", schema=_greet())]})
    assert len(cache) == 1
    a, b = catalogue.get("t"), catalogue.get("u")
    assert a is not None
    assert b is not None
    assert a.validator is b.validator
    catalogue.offer(
        "c", {"tools": [_tool("v"), _tool("w", schema={"type": "object", "title": "x"})]}
    )
    assert len(cache) <= 2


def test_argument_check() -> None:
    """Arguments are checked against the schema, and the check never changes them."""
    catalogue = Catalogue()
    schema = _greet(times={"type": "integer", "minimum": 1, "default": 1})
    catalogue.offer("c", {"tools": [_tool("greet", schema=schema)]})
    tool = catalogue.get("greet")
    assert tool is not None
    arguments: dict[str, Any] = {"name": "Ada"}
    assert tool.check(arguments) is None
    assert arguments == {"name": "Ada"}  # no default filled in
    assert "must contain" in (tool.check({}) or "")
    assert "must be string" in (tool.check({"name": 3}) or "")
    assert tool.check({"name": "Ada", "times": 0}) is not None
    assert tool.check([]) is not None


# -- JSON pointers --------------------------------------------------------------


@pytest.mark.parametrize(
    ("pointer", "tokens"),
    [
        ("", ()),
        ("/", ("",)),
        ("/a/b", ("a", "b")),
        ("/a~1b", ("a/b",)),
        ("/m~0n", ("m~n",)),
        ("/~01", ("~1",)),
        ("/~10", ("/0",)),
        ("/ ", (" ",)),
        ("/c%d", ("c%d",)),
    ],
)
def test_pointer_parsing(pointer: str, tokens: tuple[str, ...]) -> None:
    """RFC 6901 tokens, with ~1 -> '/' decoded before ~0 -> '~'."""
    assert parse_pointer(pointer) == tokens


@pytest.mark.parametrize("pointer", ["a", "a/b", "/~", "/~2", "/a~", "/~~01", "#/a"])
def test_bad_pointers(pointer: str) -> None:
    """A pointer not starting with '/' or with a bad escape is refused."""
    with pytest.raises(PolicyError):
        parse_pointer(pointer)


RFC_DOC: dict[str, Any] = {
    "foo": ["bar", "baz"],
    "": 0,
    "a/b": 1,
    "c%d": 2,
    "e^f": 3,
    "g|h": 4,
    "i\\j": 5,
    'k"l': 6,
    " ": 7,
    "m~n": 8,
}


@pytest.mark.parametrize(
    ("pointer", "value"),
    [
        ("", RFC_DOC),
        ("/foo", ["bar", "baz"]),
        ("/foo/0", "bar"),
        ("/", 0),
        ("/a~1b", 1),
        ("/c%d", 2),
        ("/e^f", 3),
        ("/g|h", 4),
        ("/i\\j", 5),
        ('/k"l', 6),
        ("/ ", 7),
        ("/m~0n", 8),
    ],
)
def test_pointer_resolution_rfc_examples(pointer: str, value: Any) -> None:
    """The examples of RFC 6901 section 5 resolve as the RFC says."""
    assert resolve_pointer(RFC_DOC, parse_pointer(pointer)) == value


@pytest.mark.parametrize("pointer", ["/nope", "/foo/2", "/foo/-", "/foo/01", "/foo/x", "/a~1b/c"])
def test_pointer_to_nothing(pointer: str) -> None:
    """Missing keys, indexes out of range, '-', leading zeros and scalars lead nowhere."""
    assert not found(resolve_pointer(RFC_DOC, parse_pointer(pointer)))


# -- policy ---------------------------------------------------------------------


def _policy(text: str) -> Any:
    return parse_policy(text.encode())


def test_no_policy_allows() -> None:
    """The documented default is allow."""
    decision = decide(DEFAULT_POLICY, "anything", None, {})
    assert decision.allowed
    assert decision.source == "default"
    assert _policy("{}") == DEFAULT_POLICY


def test_first_match_wins() -> None:
    """Rules are tried in order; the first match decides and is named by its index."""
    policy = _policy(
        """{"default": "deny", "rules": [
            {"tools": "greet", "principals": ["alice"], "action": "allow"},
            {"tools": "gr*", "action": "deny", "reason": "no greeting"},
            {"tools": "*", "action": "allow"}]}"""
    )
    assert decide(policy, "greet", "alice", {}).source == "policy:0"
    denied = decide(policy, "greet", "bob", {})
    assert (denied.allowed, denied.source, denied.reason) == (False, "policy:1", "no greeting")
    assert decide(policy, "grow", None, {}).source == "policy:1"
    assert decide(policy, "other", None, {}).source == "policy:2"
    assert decide(_policy('{"default": "deny"}'), "x", "alice", {}).allowed is False


def test_tools_glob_is_case_sensitive_and_ignores_the_prefix() -> None:
    """Globs are fnmatch, case-sensitive, over the bare name; mcp__sage__ in a glob is dropped."""
    policy = _policy(
        """{"rules": [{"tools": "mcp__sage__fs_*", "action": "deny"},
                       {"tools": "Shell", "action": "deny"}]}"""
    )
    assert not decide(policy, "fs_write", None, {}).allowed
    assert not decide(policy, "Shell", None, {}).allowed
    assert decide(policy, "shell", None, {}).allowed
    assert decide(policy, "xfs_write", None, {}).allowed


def test_a_rule_without_principal_match_skips_anonymous_calls() -> None:
    """A rule naming principals does not match a call that has none."""
    policy = _policy('{"rules": [{"tools": "*", "principals": ["alice"], "action": "deny"}]}')
    assert decide(policy, "t", None, {}).allowed
    assert not decide(policy, "t", "alice", {}).allowed


def test_argument_matchers() -> None:
    """Pointers into arguments: strings glob, other values compare as JSON, all must match."""
    policy = _policy(
        r"""{"rules": [
          {"tools": "fetch", "match": {"/url": "http://*"}, "action": "deny", "reason": "http"},
          {"tools": "fetch", "match": {"/opts/a~1b": true, "/n": 1}, "action": "deny",
           "reason": "escaped"},
          {"tools": "fetch", "match": {"/list/1": {"k": [1, "x"]}}, "action": "deny",
           "reason": "deep"},
          {"tools": "fetch", "match": {"": {"only": null}}, "action": "deny", "reason": "whole"}
        ]}"""
    )

    def reason(arguments: dict[str, Any]) -> str:
        return decide(policy, "fetch", None, arguments).reason

    assert reason({"url": "http://x"}) == "http"
    assert reason({"url": "https://x"}) == ""
    assert reason({"url": 5}) == ""  # a glob matches strings only
    assert reason({"opts": {"a/b": True}, "n": 1.0}) == "escaped"  # 1 equals 1.0
    assert reason({"opts": {"a/b": True}}) == ""  # every matcher must match
    assert reason({"opts": {"a/b": 1}, "n": 1}) == ""  # true is not 1
    assert reason({"list": [0, {"k": [1, "x"]}]}) == "deep"
    assert reason({"list": [0, {"k": [1, "x", 2]}]}) == ""
    assert reason({"only": None}) == "whole"


def test_deny_reason_defaults_to_the_rule() -> None:
    """A denying rule without a reason names itself."""
    policy = _policy('{"rules": [{"tools": "t", "action": "deny"}]}')
    assert decide(policy, "t", None, {}).reason == "denied by tool policy rule 0"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("not json", "malformed"),
        ('{"default": "maybe"}', "default"),
        ('{"rules": [{"tools": "t"}]}', "action"),
        ('{"rules": [{"tools": "t", "action": "allow", "wat": 1}]}', "wat"),
        ('{"rules": [{"tools": "t", "action": "allow", "match": {"a": 1}}]}', r"rules\[0\]\.match"),
        ('{"rules": [{"tools": "t", "action": "allow", "principals": "alice"}]}', "principals"),
        ('{"rules": "x"}', "rules"),
    ],
)
def test_bad_policy_file(text: str, expected: str) -> None:
    """A bad file is a PolicyError naming what is wrong."""
    with pytest.raises(PolicyError, match=expected):
        _policy(text)


# -- the policy file ------------------------------------------------------------


def _write(path: Path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))


def test_policy_file_reload(tmp_path: Path) -> None:
    """The file is re-read when it changes; a bad one keeps the last good; removal allows."""
    path = tmp_path / "tools-policy.json"
    policy = PolicyFile(path)
    assert policy.refresh() is None  # no file: the default, nothing to report
    assert policy.decide("t", None, {}).allowed
    _write(path, '{"default": "deny"}', 1_000_000_000)
    reload = policy.refresh()
    assert reload is not None
    assert reload.ok
    assert not policy.decide("t", None, {}).allowed
    assert policy.refresh() is None  # unchanged: not read again
    _write(path, "{oops", 2_000_000_000)
    reload = policy.refresh()
    assert reload is not None
    assert not reload.ok
    assert reload.audit()["path"] == str(path)
    assert "malformed" in reload.audit()["error"]
    assert policy.decide("t", None, {}).source == "default"  # still the last good: deny
    assert not policy.decide("t", None, {}).allowed
    _write(path, '{"rules": [{"tools": "t", "action": "allow"}]}', 3_000_000_000)
    assert policy.refresh() is not None
    assert policy.decide("t", None, {}).source == "policy:0"
    path.unlink()
    reload = policy.refresh()
    assert reload is not None
    assert reload.ok
    assert policy.decide("x", None, {}).source == "default"


def test_a_bad_file_at_start_fails_closed(tmp_path: Path) -> None:
    """With no good policy ever read from an existing file, calls are denied."""
    path = tmp_path / "tools-policy.json"
    _write(path, '{"default": "allow", "rules": [{}]}', 1_000_000_000)
    policy = PolicyFile(path)
    reload = policy.refresh()
    assert reload is not None
    assert not reload.ok
    decision = policy.decide("t", "alice", {})
    assert (decision.allowed, decision.source) == (False, "policy_invalid")
    assert "invalid" in decision.reason
    _write(path, '{"default": "allow"}', 2_000_000_000)
    policy.refresh()
    assert policy.decide("t", "alice", {}).allowed
