"""The subjects of sessions anywhere: nothing a caller sends reaches a NATS subject unchecked."""

from __future__ import annotations

import pytest

from sage.contract.sessions import Verb, event_of, request_topic
from sage.errors import BadRoute, RequestError, SessionConflict
from sage.fleet.routes import (
    Forwarded,
    SessionEntry,
    approval_answer,
    decode_entry,
    decode_forwarded,
    event_pattern,
    event_subject,
    parse_event_subject,
    parse_request_subject,
    registry_key,
    request_subject,
    resolve,
)

BAD = ["*", ">", ".", "a.b", "a.*", "a.>", "", "a b", "x" * 65, "a\n"]


def test_request_subjects_are_per_node_and_name_the_origin() -> None:
    """The target's prefix, then the sending node (what the server proves), verb, id."""
    assert request_subject("a", "b", "send", "s1") == "sage.fleet.a.request.b.send.s1"
    assert request_subject("a", "b", "spawn") == "sage.fleet.a.request.b.spawn"
    assert request_subject("a", "c", "sessions") == "sage.fleet.a.request.c.sessions"
    assert parse_request_subject("a", "sage.fleet.a.request.b.stop.s-1") == ("b", "stop", "s-1")
    assert parse_request_subject("a", "sage.fleet.a.request.c.spawn") == ("c", "spawn", None)


@pytest.mark.parametrize("bad", BAD)
def test_wildcards_dots_and_junk_never_make_a_subject(bad: str) -> None:
    with pytest.raises(BadRoute):
        request_subject("a", "b", "send", bad)
    with pytest.raises(BadRoute):
        request_subject(bad, "b", "spawn")
    with pytest.raises(BadRoute):
        request_subject("a", bad, "spawn")
    with pytest.raises(BadRoute):
        event_subject("a", bad, "text")
    with pytest.raises(BadRoute):
        event_pattern(bad, "s1")
    with pytest.raises(RequestError):  # the runner's topic: the contract checks it
        request_topic(Verb.SEND, bad)


@pytest.mark.parametrize(
    "subject",
    [
        "sage.fleet.b.request.c.send.s1",  # another node's prefix
        "sage.fleet.a.request.b.install",  # not a routed verb
        "sage.fleet.a.request.b.send",  # a session verb without a session
        "sage.fleet.a.request.b.spawn.s1",
        "sage.fleet.a.request.b.send.s1.x",
        "sage.fleet.a.request.send.s1",  # no origin (the old subject)
        "sage.fleet.a.request.spawn",
        "sage.fleet.a.request.*.spawn",  # an origin that is not a name
        "sage.fleet.a.event.s1.text",
    ],
)
def test_a_node_takes_requests_on_its_own_prefix_only(subject: str) -> None:
    with pytest.raises(BadRoute):
        parse_request_subject("a", subject)


def test_a_forwarded_request_is_checked() -> None:
    good = Forwarded(principal="alice").encode()
    assert decode_forwarded(good).principal == "alice"
    # an origin in the payload is no one's word: the subject's is the one taken
    assert decode_forwarded(b'{"origin": "c", "principal": "bob"}') == Forwarded(principal="bob")
    assert b"origin" not in good
    for bad in (
        b"nope",
        b'{"principal": "*"}',
        b'{"principal": "a.b"}',
    ):
        with pytest.raises(BadRoute):
            decode_forwarded(bad)


def test_events_and_entries() -> None:
    assert event_of("sage.v1.event.s1.text") == ("s1", "text")
    assert event_of("sage.v1.event.session_rejected") is None
    assert parse_event_subject("sage.fleet.a.event.s1.done") == ("a", "s1", "done")
    with pytest.raises(BadRoute):
        parse_event_subject("sage.fleet.a.request.s1.done")
    assert decode_entry("s1", b'{"node": "a", "principal_id": "alice"}') is not None
    assert decode_entry("s1", b'{"node": "a.>", "principal_id": "alice"}') is None
    assert decode_entry("s1", b"garbage") is None


def _error(code: str) -> dict[str, object]:
    return {"ok": False, "error": code, "message": code}


def test_the_holder_of_an_approval_answers_whoever_answered_first() -> None:
    """A node that refused the caller's principal, or holds no such approval, answering
    before the holder does not hide the holder's answer (success or its own error)."""
    allowed = {"ok": True, "decision": "allow"}
    refused = _error("principal_not_authenticated")
    down = _error("fleet_unavailable")
    unknown = _error("unknown_approval")
    assert approval_answer([refused, unknown, allowed]) is allowed
    not_yours = _error("not_authorized")
    assert approval_answer([refused, down, not_yours]) is not_yours
    assert approval_answer([unknown, refused, down]) is down  # it may be on the lost one
    assert approval_answer([unknown, refused]) is refused  # why the caller got nothing
    assert approval_answer([unknown, unknown]) is None
    assert approval_answer([]) is None


def test_registry_keys_are_under_the_claiming_nodes_name() -> None:
    """``<node>.<sid>``: the server lets a node write only keys under its own name."""
    assert registry_key("a", "s1") == "a.s1"
    for bad in BAD:
        with pytest.raises(BadRoute):
            registry_key(bad, "s1")
        with pytest.raises(BadRoute):
            registry_key("a", bad)


def claim(node: str, at: float = 1.0) -> SessionEntry:
    return SessionEntry(node=node, principal_id="alice", at=at)


def test_a_session_claimed_by_a_live_and_a_lost_node_follows_the_live_one() -> None:
    """An adopter's claim beside the lost node's own (kept until that node comes back
    and deletes it): the live one, however old, never the lost one, however new."""
    claims = {"a": claim("a", at=9.0), "c": claim("c", at=1.0)}
    found = resolve("s1", claims, {"b", "c"})
    assert found is not None
    assert found.node == "c"
    only = resolve("s1", {"a": claim("a")}, set())
    assert only is not None
    assert only.node == "a"  # one claim: followed (its node's loss shows when asked)
    assert resolve("s1", {}, {"a"}) is None


def test_two_live_claimants_are_a_conflict_naming_both() -> None:
    with pytest.raises(SessionConflict, match="a, b") as raised:
        resolve("s1", {"b": claim("b"), "a": claim("a")}, {"a", "b"})
    assert raised.value.code == "session_conflict"


def test_with_no_live_claimant_the_latest_claim_is_followed() -> None:
    found = resolve("s1", {"a": claim("a", at=2.0), "b": claim("b", at=5.0)}, set())
    assert found is not None
    assert found.node == "b"
