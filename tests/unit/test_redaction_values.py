"""Redaction of secret values (raw, base64, hex, split by whitespace) from tool output."""

from __future__ import annotations

import base64
import json

from hypothesis import assume, given
from hypothesis import strategies as st

from sage.redaction import MIN_SECRET_LENGTH, REDACTED, redact_json, redact_text, secret_forms

SECRET = "sk-live-0123456789abcdef"


def test_forms_cover_raw_base64_and_hex() -> None:
    forms = secret_forms(SECRET)
    raw = SECRET.encode()
    assert SECRET in forms
    assert base64.b64encode(raw).decode() in forms
    assert base64.urlsafe_b64encode(raw).decode().rstrip("=") in forms
    assert raw.hex() in forms
    assert raw.hex().upper() in forms


def test_short_secrets_are_redacted_raw_only() -> None:
    assert secret_forms("abc") == ["abc"]
    assert secret_forms("") == []
    assert len(secret_forms("x" * MIN_SECRET_LENGTH)) > 1


def test_text_split_across_lines_is_redacted() -> None:
    b64 = base64.b64encode(SECRET.encode()).decode()
    text = f"a {SECRET[:5]}\n{SECRET[5:]} b {b64[:10]}\r\n {b64[10:]} c {SECRET.encode().hex()}"
    out = redact_text(text, [SECRET])
    assert out.count(REDACTED) == 3
    assert "0123456789" not in out
    assert out.startswith("a ")
    assert out.endswith(REDACTED)


def test_json_leaves_keys_and_pieces() -> None:
    value = {
        "ok": True,
        "data": {"env": {"K": SECRET}, SECRET: 1, "list": [1, f"x{SECRET[:4]}\n{SECRET[4:]}y"]},
        "pieces": [SECRET[:9], SECRET[9:]],
        "fine": "nothing here",
    }
    out = redact_json(value, [SECRET])
    dumped = json.dumps(out)
    assert SECRET not in dumped
    assert SECRET[:9] not in dumped
    assert out["ok"] is True
    assert out["fine"] == "nothing here"
    assert out["data"]["env"]["K"] == REDACTED
    assert out["data"]["list"][0] == 1


def test_depth_cap_redacts_what_it_cannot_check() -> None:
    deep: object = SECRET
    for _ in range(40):
        deep = [deep]
    assert SECRET not in json.dumps(redact_json(deep, [SECRET], depth=32))


def test_no_secrets_is_identity() -> None:
    value = {"a": ["b"]}
    assert redact_json(value, []) == value
    assert redact_text("text", [""]) == "text"


@given(
    secret=st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=8, max_size=40
    ),
    cuts=st.lists(st.integers(min_value=1, max_value=39), max_size=4),
    ws=st.sampled_from(["\n", "\r\n", " ", "\t", "\n  "]),
    prefix=st.text(max_size=10),
)
def test_any_whitespace_split_is_found(secret: str, cuts: list[int], ws: str, prefix: str) -> None:
    assume(secret not in REDACTED)  # "<redacte" is in every redacted text
    for form in (secret, base64.b64encode(secret.encode()).decode(), secret.encode().hex()):
        pieces, last = [], 0
        for cut in sorted({c for c in cuts if c < len(form)}):
            pieces.append(form[last:cut])
            last = cut
        pieces.append(form[last:])
        out = redact_text(prefix + ws.join(pieces) + "!", [secret])
        assert form not in "".join(out.split())
        assert REDACTED in out


def test_several_secret_keys_stay_distinct() -> None:
    other = "another-secret-value"
    out = redact_json({SECRET: 1, other: 2}, [SECRET, other])
    assert sorted(out.values()) == [1, 2]
    assert all(k.startswith(REDACTED) for k in out)
