"""Hook envelope validation (capsules/hooks/validate.py): every reason, the map, the caps."""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgspec
import pytest

from capsules.hooks.validate import (
    FIELD_LIMIT,
    KNOWN_HOOKS,
    PAYLOAD_LIMIT,
    REASONS,
    HookEnvelope,
    HookRejected,
    event_name,
    parse,
    republished,
    spoof_report,
    verify,
)
from capsules.runner.command import mint_token

TOKEN = mint_token()
RECORD = {"sha256": hashlib.sha256(TOKEN.encode()).hexdigest(), "principal_id": "alice"}


def _envelope(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "hook": "PreToolUse",
        "payload": {"hook_event_name": "PreToolUse", "tool_name": "mcp__sage__greet"},
        "correlation_id": None,
        "principal_id": "alice",
        "session_id": "s1",
        "token": TOKEN,
    }
    base.update(fields)
    return base


def _raw(**fields: Any) -> bytes:
    return msgspec.json.encode(_envelope(**fields))


def _reason(topic: str, raw: bytes, record: Any = RECORD, verified: str | None = None) -> str:
    with pytest.raises(HookRejected) as caught:
        verify(parse(topic, raw), record, verified)
    return caught.value.code


TOPIC = "sage.v1.hook.PreToolUse"


def test_a_valid_envelope_passes() -> None:
    """The claimed principal comes back when token, session and hook all check out."""
    claim = parse(TOPIC, _raw())
    assert verify(claim, RECORD, None) == "alice"
    assert verify(claim, RECORD, "alice") == "alice"


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1, 2]",
        b'"a string"',
        _raw(token=5),
        _raw(principal_id=["alice"]),
        _raw(session_id=None),
        _raw(hook={"x": 1}),
        _raw(correlation_id=7),
        b"[" * 100_000,
    ],
)
def test_malformed_envelopes(raw: bytes) -> None:
    """Bad JSON or a field of the wrong type is ``malformed``."""
    assert _reason(TOPIC, raw) == "malformed"


def test_malformed_still_reports_its_string_claims() -> None:
    """What a malformed envelope claimed as strings is kept for the report; not the token."""
    with pytest.raises(HookRejected) as caught:
        parse(TOPIC, _raw(correlation_id=7))
    report = spoof_report(caught.value, "emit:1")
    assert report == {
        "claimed_principal": "alice",
        "claimed_session": "s1",
        "hook": "PreToolUse",
        "reason": "malformed",
        "source": "emit:1",
    }


@pytest.mark.parametrize("sid", ["", "../etc", "a b", "x" * 65, "a.b", "s\n"])
def test_bad_session_ids(sid: str) -> None:
    """A session id outside ``[A-Za-z0-9_-]{1,64}`` is refused before any lookup."""
    assert _reason(TOPIC, _raw(session_id=sid)) == "bad_session_id"


def test_missing_session_id_is_a_bad_session_id() -> None:
    data = _envelope()
    del data["session_id"]
    assert _reason(TOPIC, msgspec.json.encode(data)) == "bad_session_id"


@pytest.mark.parametrize(
    ("topic", "fields"),
    [
        ("sage.v1.hook.Bogus", {"hook": "Bogus", "payload": {}}),
        ("sage.v1.hook.pre_tool_use", {"hook": "pre_tool_use", "payload": {}}),
        ("sage.v1.hook.PostToolUse", {}),  # the topic says one hook, the envelope another
        (TOPIC, {"hook": "PostToolUse"}),
        ("sage.v1.hook.PreToolUse.extra", {}),
        (TOPIC, {"payload": {"hook_event_name": "Stop"}}),  # the hook input disagrees
        (TOPIC, {"hook": ""}),
    ],
)
def test_unknown_or_inconsistent_hooks(topic: str, fields: dict[str, Any]) -> None:
    """A hook that is not a Claude Code event, or disagrees with its topic, is ``unknown_hook``."""
    assert _reason(topic, _raw(**fields)) == "unknown_hook"


def test_a_payload_without_hook_event_name_is_fine() -> None:
    """Only a hook_event_name that is there must agree."""
    claim = parse(TOPIC, _raw(payload="not an object"))
    assert verify(claim, RECORD, None) == "alice"


@pytest.mark.parametrize("fields", [{"token": ""}, {}])
def test_missing_token(fields: dict[str, Any]) -> None:
    """An empty or absent token is ``missing_token``."""
    data = _envelope(**fields)
    if not fields:
        del data["token"]
    assert _reason(TOPIC, msgspec.json.encode(data)) == "missing_token"


@pytest.mark.parametrize("record", [None, {}, [1], {"sha256": 5, "principal_id": "alice"}])
def test_no_record_is_an_unknown_or_ended_session(record: Any) -> None:
    """No record (never spawned, or scrubbed at the end: a replay) or a broken one."""
    assert _reason(TOPIC, _raw(), record) == "unknown_or_ended_session"


def test_a_wrong_token() -> None:
    assert _reason(TOPIC, _raw(token=mint_token())) == "bad_token"
    assert _reason(TOPIC, _raw(token=TOKEN + "x")) == "bad_token"
    # the stored value is a hash: presenting the hash itself is no token
    assert _reason(TOPIC, _raw(token=RECORD["sha256"])) == "bad_token"


def test_a_claimed_principal_the_token_does_not_belong_to() -> None:
    assert _reason(TOPIC, _raw(principal_id="bob")) == "principal_mismatch"
    assert _reason(TOPIC, _raw(principal_id="")) == "principal_mismatch"


def test_the_verified_publisher_principal_must_agree() -> None:
    """A connection the bus verified as bob cannot present alice's token."""
    assert _reason(TOPIC, _raw(), verified="bob") == "principal_mismatch"


def test_every_reason_is_reached() -> None:
    """REASONS lists exactly what the checks can answer."""
    seen = {
        _reason(TOPIC, b"{"),
        _reason(TOPIC, _raw(session_id="")),
        _reason("sage.v1.hook.X", _raw(hook="X")),
        _reason(TOPIC, _raw(token="")),
        _reason(TOPIC, _raw(), None),
        _reason(TOPIC, _raw(token="x" * 43)),
        _reason(TOPIC, _raw(principal_id="bob")),
    }
    assert seen == set(REASONS)


def test_tokens_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digest comparison goes through hmac.compare_digest, with the stored hex."""
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)  # validate looks it up per call
    assert verify(parse(TOPIC, _raw()), RECORD, None) == "alice"
    assert calls == [(RECORD["sha256"].encode(), RECORD["sha256"].encode())]
    calls.clear()
    with pytest.raises(HookRejected):
        verify(parse(TOPIC, _raw(token="wrong-token")), RECORD, None)
    assert len(calls) == 1


def test_the_map() -> None:
    """The TOPICS.md map, snake_case for the rest, and no two hooks on one topic."""
    assert event_name("PreToolUse") == "before_tool_call"
    assert event_name("PostToolUse") == "after_tool_call"
    assert event_name("UserPromptSubmit") == "message_received"
    assert event_name("Stop") == "session_end"
    assert event_name("SubagentStop") == "subagent_stop"
    assert event_name("Notification") == "notification"
    assert event_name("PreCompact") == "pre_compact"
    assert event_name("SessionStart") == "session_start"
    assert event_name("PostToolUseFailure") == "post_tool_use_failure"
    assert event_name("SessionEnd") == "claude_session_end"  # session_end is Stop's
    names = [event_name(hook) for hook in KNOWN_HOOKS]
    assert len(set(names)) == len(names)
    assert all(name.replace("_", "").isalnum() and name.islower() for name in names)
    for hook in ("PreToolUse", "PostToolUse", "UserPromptSubmit", "Stop", "SubagentStop"):
        assert hook in KNOWN_HOOKS
    for hook in ("Notification", "PreCompact", "SessionStart", "SessionEnd"):
        assert hook in KNOWN_HOOKS


def test_the_republished_payload() -> None:
    """The canonical shape: no token, the record's principal, decision_source token."""
    claim = parse(TOPIC, _raw(payload={"hook_event_name": "PreToolUse", "tool_use_id": "tu_1"}))
    out = republished(claim, "alice")
    assert out == {
        "hook": "PreToolUse",
        "payload": {"hook_event_name": "PreToolUse", "tool_use_id": "tu_1"},
        "correlation_id": "tu_1",
        "principal_id": "alice",
        "session_id": "s1",
        "decision_source": "token",
    }
    assert TOKEN not in msgspec.json.encode(out).decode()
    given = republished(parse(TOPIC, _raw(correlation_id="c1")), "alice")
    assert given["correlation_id"] == "c1"


def test_a_token_echoed_in_the_hook_input_is_redacted() -> None:
    """A PostToolUse response that prints the child's environment does not leak the token."""
    payload = {
        "hook_event_name": "PostToolUse",
        "tool_response": {"stdout": f"ASTRID_HOOK_TOKEN={TOKEN}\nHOME=/x", "x": [TOKEN]},
    }
    raw = _raw(hook="PostToolUse", payload=payload)
    out = republished(parse("sage.v1.hook.PostToolUse", raw), "alice")
    text = msgspec.json.encode(out).decode()
    assert TOKEN not in text
    assert out["payload"]["tool_response"]["stdout"] == "ASTRID_HOOK_TOKEN=<redacted>\nHOME=/x"
    assert out["payload"]["tool_response"]["x"] == ["<redacted>"]


def test_a_large_hook_payload_is_dropped_not_cut() -> None:
    """Over 64 KiB of hook input: republished with payload null and truncated true."""
    big = {"hook_event_name": "PreToolUse", "blob": "x" * PAYLOAD_LIMIT}
    out = republished(parse(TOPIC, _raw(payload=big)), "alice")
    assert out["payload"] is None
    assert out["truncated"] is True
    fits = {"hook_event_name": "PreToolUse", "blob": "x" * (PAYLOAD_LIMIT - 100)}
    out = republished(parse(TOPIC, _raw(payload=fits)), "alice")
    assert out["payload"] == fits
    assert "truncated" not in out


def test_spoof_report_fields_are_truncated_and_never_hold_the_token() -> None:
    """Each claim is cut to 128 characters; a claim carrying the token is redacted."""
    long = "p" * 1000
    rejection = HookRejected("bad_token", long, "s" * 300, "H" * 200, token="short")
    report = spoof_report(rejection, "emit:" + "9" * 500)
    assert report["reason"] == "bad_token"
    for key in ("claimed_principal", "claimed_session", "hook", "source"):
        assert len(report[key]) == FIELD_LIMIT
    assert "token" not in report
    leaky = HookRejected("bad_session_id", "alice", f"../{TOKEN}", "PreToolUse", token=TOKEN)
    report = spoof_report(leaky, "emit:1")
    assert report["claimed_session"] == "<redacted>"
    assert TOKEN not in str(report)
    # a forged one-letter token redacts nothing
    short = spoof_report(HookRejected("bad_token", "alice", "s1", "Stop", token="a"), "emit:1")
    assert short["claimed_principal"] == "alice"


def test_rejections_never_say_the_token() -> None:
    """The exception's text is the reason alone (it may reach a log)."""
    with pytest.raises(HookRejected) as caught:
        verify(parse(TOPIC, _raw(principal_id="bob")), RECORD, None)
    assert str(caught.value) == "principal_mismatch"
    assert TOKEN not in repr(caught.value)


def test_the_envelope_type_matches_astrid_emit() -> None:
    """What sage/claude/emit.py builds decodes into HookEnvelope."""
    from sage.claude.emit import envelope, payload_json

    built = envelope("PreToolUse", payload_json(b'{"hook_event_name": "PreToolUse"}'))
    decoded = msgspec.json.decode(built, type=HookEnvelope)
    assert decoded.hook == "PreToolUse"
    assert decoded.payload == {"hook_event_name": "PreToolUse"}
    assert decoded.truncated is False
    # an input left out: republished as fired, without it
    decoded = msgspec.json.decode(envelope("PreToolUse", None), type=HookEnvelope)
    assert decoded.payload is None
    assert decoded.truncated is True
    out = republished(decoded, "alice")
    assert out["truncated"] is True
    assert out["payload"] is None
