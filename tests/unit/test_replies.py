"""The one reply shape: built by capsules, parsed by clients."""

from __future__ import annotations

import pytest

from sage import replies
from sage.errors import ConfigError, ProtocolError, SageError


def test_ok_and_error_shapes() -> None:
    assert replies.ok(session_id="s") == {"ok": True, "session_id": "s"}
    assert replies.error("bad_request", "no") == {
        "ok": False,
        "error": "bad_request",
        "message": "no",
    }
    assert replies.from_error(ConfigError("x is wrong")) == {
        "ok": False,
        "error": "config_invalid",
        "message": "x is wrong",
    }
    assert replies.from_error(SageError("taken", code="name_taken"))["error"] == "name_taken"


def test_parse_returns_success_fields() -> None:
    assert replies.parse(b'{"ok": true, "n": 1}') == {"ok": True, "n": 1}
    assert replies.parse({"ok": True}) == {"ok": True}


def test_parse_raises_the_reply_code() -> None:
    with pytest.raises(replies.ReplyError) as info:
        replies.parse(b'{"ok": false, "error": "unknown_session", "message": "no s"}')
    assert info.value.code == "unknown_session"
    assert str(info.value) == "unknown_session: no s"
    assert info.value.reply["error"] == "unknown_session"
    with pytest.raises(replies.ReplyError) as bare:
        replies.parse(b'{"ok": false}')
    assert bare.value.code == "error"


@pytest.mark.parametrize(
    "payload", [b"not json", b"[]", b'{"ok": "yes"}', b"{}", b'{"error": {"kind": "x"}}']
)
def test_parse_refuses_what_is_not_a_reply(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        replies.parse(payload)
