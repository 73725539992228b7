"""The contract between the runner and the fleet (sage/contract/sessions.py), without
processes: its topics are the runner's (its manifest subscribes them, the doc names
them), and what the runner answers is exactly what the fleet decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from bus import Envelope
from bus.acl import pattern_covers
from capsules.runner.runner import Runner
from capsules.runner.sessions import RecordState, Session, SessionRecord, SessionState
from sage.capsule.manifest import load_manifest
from sage.config import PrincipalConfig
from sage.contract.sessions import (
    CLAIMS_TOPIC,
    EVENTS,
    FLEET_APPROVALS_TOPIC,
    FLEET_KEYED,
    FLEET_SESSIONS_TOPIC,
    FLEET_SPAWN_TOPIC,
    FLEET_STATUS_TOPIC,
    KEYED_VERBS,
    AdoptRequest,
    ClaimsReply,
    ClaimsRequest,
    ConversationReply,
    SessionRow,
    SlotsReply,
    TurnEnd,
    Verb,
    YieldReply,
    YieldRequest,
    event_of,
    event_topic,
    fleet_topic,
    request_pattern,
    request_topic,
    turn_end,
)
from sage.errors import RequestError
from tests.support.runner_context import RunnerContext

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ROOT / "docs" / "topics.md"


def fields(struct: type[msgspec.Struct]) -> set[str]:
    return {f.encode_name for f in msgspec.structs.fields(struct)}


def test_request_topics_name_the_verb_and_the_checked_key() -> None:
    """A keyed verb's topic ends in its session (or approval) id; no key that is no name
    ever reaches a topic."""
    assert request_topic(Verb.SPAWN) == "sage.v1.request.spawn"
    assert request_topic(Verb.YIELD, "s1") == "sage.v1.request.yield.s1"
    assert request_topic(Verb.SETTINGS_SET) == "sage.v1.request.settings.set"
    assert request_pattern(Verb.SEND) == "sage.v1.request.send.*"
    assert request_pattern(Verb.ADOPT) == "sage.v1.request.adopt"
    for bad in ("*", ">", "a.b", "", "x" * 65):
        with pytest.raises(RequestError) as refused:
            request_topic(Verb.SEND, bad)
        assert refused.value.code == "invalid_session_id"
    with pytest.raises(RequestError) as approval:
        request_topic(Verb.APPROVE, "c.1")
    assert approval.value.code == "bad_request"
    with pytest.raises(ValueError, match="not_a_verb"):
        request_topic("not_a_verb")


def test_events_round_trip() -> None:
    topic = event_topic("s1", "exited")
    assert event_of(topic) == ("s1", "exited")
    assert event_of("sage.v1.event.session_rejected") is None
    assert event_of("sage.v1.event.s1.text.more") is None
    assert pattern_covers(EVENTS, topic)


def test_the_runners_manifest_serves_every_verb_and_the_doc_names_every_topic() -> None:
    """Each verb's pattern is what the runner's Capsule.toml subscribes; each request
    and fleet topic is named in docs/topics.md (``<sid>`` for a key)."""
    manifest = load_manifest(ROOT / "capsules" / "runner")
    doc = TOPICS.read_text()
    for verb in Verb:
        pattern = request_pattern(verb)
        assert pattern in manifest.subscribe.patterns, pattern
        shown = pattern.replace(".*", ".<cid>" if verb is Verb.APPROVE else ".<sid>")
        assert f"`{shown}`" in doc, shown
    assert {v for v in Verb if request_pattern(v).endswith(".*")} == KEYED_VERBS
    for topic in (
        CLAIMS_TOPIC,
        FLEET_SPAWN_TOPIC,
        FLEET_SESSIONS_TOPIC,
        FLEET_APPROVALS_TOPIC,
        FLEET_STATUS_TOPIC,
    ):
        assert f"`{topic}`" in doc, topic
    assert pattern_covers(FLEET_KEYED, fleet_topic(Verb.SEND, "s1"))


def _asleep(runner: Runner, sid: str) -> Session:
    record = SessionRecord(
        session_id=sid,
        principal_id="alice",
        claude_session="0d7c6c2e-3a4f-4b8e-9c1d-2e3f4a5b6c7d",
        state=RecordState.HIBERNATED,
    )
    session = Session(record, PrincipalConfig(name="alice"), state=SessionState.HIBERNATED)
    runner.sessions.add(session)
    return session


def _admin(topic: str, payload: Any) -> Envelope:
    return Envelope(1, topic, msgspec.json.encode(payload), "fleet")


def _contract_of(reply: dict[str, Any], struct: type[msgspec.Struct]) -> msgspec.Struct:
    """``reply`` as ``struct``: its fields, ``ok`` beside them, nothing else."""
    assert reply["ok"] is True
    assert set(reply) - {"ok"} == fields(struct), (reply, struct)
    return msgspec.convert(reply, struct)


@pytest.mark.anyio
async def test_what_the_runner_answers_is_what_the_fleet_decodes(tmp_path: Path) -> None:
    """Slots, conversation and yield replies have exactly the contract's fields."""
    ctx = RunnerContext(tmp_path)
    runner = Runner(ctx)  # type: ignore[arg-type]
    _asleep(runner, "s1")
    _asleep(runner, "s2")
    slots = await runner.fleet.slots(_admin(request_topic(Verb.SLOTS), {}))
    assert _contract_of(slots, SlotsReply) == SlotsReply(
        live=0, max_live=None, idle=0, hibernated=2, waiting=0, states={"hibernated": 2}
    )
    conversation = await runner.fleet.conversation(
        _admin(request_topic(Verb.CONVERSATION, "s1"), {})
    )
    assert isinstance(_contract_of(conversation, ConversationReply), ConversationReply)
    body = YieldRequest(node="b")
    answer = await runner.fleet.yield_request(_admin(request_topic(Verb.YIELD, "s2"), body))
    assert _contract_of(answer, YieldReply) == YieldReply(session_id="s2", node="b")


def test_the_fleets_requests_encode_as_the_runner_decodes() -> None:
    """An adoption and a claims question, as the fleet builds them, are what the runner's
    decoder takes (unknown fields refused there)."""
    adopt = AdoptRequest(
        session_id="s1",
        principal_id="alice",
        claude_session="0d7c6c2e-3a4f-4b8e-9c1d-2e3f4a5b6c7d",
        from_node="a",
        asleep=True,
    )
    wire = msgspec.json.encode(adopt)
    assert msgspec.json.decode(wire, type=AdoptRequest) == adopt
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(wire[:-1] + b',"extra":1}', type=AdoptRequest)
    claims = msgspec.json.decode(b'{"session_ids": ["s1", "s2"]}', type=ClaimsRequest)
    assert claims.session_ids == ["s1", "s2"]
    assert msgspec.convert({"ok": True, "elsewhere": {"s1": "b"}}, ClaimsReply).elsewhere == {
        "s1": "b"
    }


def test_a_listing_row_keeps_what_every_row_says() -> None:
    """A runner's row (more fields) and a registry row both read as a SessionRow."""
    live = {"session_id": "s1", "principal_id": "alice", "pid": 7, "state": "ready", "turns": 2}
    row = msgspec.convert(live, SessionRow)
    assert (row.session_id, row.pid, row.state, row.node) == ("s1", 7, "ready", None)
    ended = msgspec.convert({"session_id": "s2", "state": RecordState.ENDED}, SessionRow)
    assert ended.state == "ended"


@pytest.mark.parametrize(
    ("fields", "end"),
    [
        ({"is_error": False, "subtype": "success"}, TurnEnd.COMPLETED),
        # what 2.1.328 says of an API failure: subtype success, is_error, the status
        ({"is_error": True, "subtype": "success", "api_error_status": 529}, TurnEnd.OVERLOADED),
        ({"is_error": True, "subtype": "success", "api_error_status": 403}, TurnEnd.AUTH_FAILED),
        ({"is_error": True, "subtype": "success", "api_error_status": 401}, TurnEnd.AUTH_FAILED),
        ({"is_error": True, "subtype": "success", "api_error_status": 429}, TurnEnd.RATE_LIMITED),
        (
            {"is_error": True, "subtype": "success", "api_error_status": 413},
            TurnEnd.PAYLOAD_TOO_LARGE,
        ),
        ({"is_error": True, "subtype": "success", "api_error_status": 400}, TurnEnd.API_REFUSED),
        ({"is_error": True, "subtype": "success", "api_error_status": 500}, TurnEnd.API_ERROR),
        (
            {"is_error": True, "subtype": "success", "terminal_reason": "api_error"},
            TurnEnd.API_ERROR,
        ),
        (
            {
                "is_error": True,
                "subtype": "error_during_execution",
                "terminal_reason": "aborted_streaming",
            },
            TurnEnd.INTERRUPTED,
        ),
        ({"is_error": True, "subtype": "error_max_turns"}, TurnEnd.MAX_TURNS),
        ({"is_error": True, "subtype": "error_during_execution"}, TurnEnd.EXECUTION_ERROR),
        ({"is_error": True, "subtype": "brand_new"}, TurnEnd.FAILED),
    ],
)
def test_how_a_turn_ended_is_read_from_its_result(fields: dict[str, Any], end: TurnEnd) -> None:
    """A failed turn is named for what failed, never for the subtype 'success' it carries."""
    assert turn_end(**fields) is end
