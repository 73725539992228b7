"""sage/redaction.py: which key names count as secret, and what ``redact`` hides."""

from __future__ import annotations

import pytest

from sage.redaction import REDACTED, is_secret_key, redact

SECRET = (
    "token",
    "hook_token",
    "ASTRID_HOOK_TOKEN",
    "ANTHROPIC_API_KEY",
    "api-key",
    "apiKey",
    "apikey",
    "x.api.key",
    "privateKey",
    "private_key",
    "PRIVATEKEY",
    "accessToken",
    "auth_token",
    "authToken",
    "client_secret",
    "Password",
    "db_passwd",
    "Authorization",
    "credential",
    "aws_credentials",
    "my secret",
)
NOT_SECRET = (
    "input_tokens",  # a count, not a token: the word is "tokens"
    "output_tokens",
    "tokenizer",
    "key",
    "api",
    "keyboard",
    "api_version",
    "public_key",
    "key_api",  # the pair is ordered: api then key
    "private",
    "secretary",
    "passwords_hint_count",
    "name",
    "",
)


@pytest.mark.parametrize("key", SECRET)
def test_names_that_are_secret(key: str) -> None:
    assert is_secret_key(key)


@pytest.mark.parametrize("key", NOT_SECRET)
def test_names_that_are_not(key: str) -> None:
    assert not is_secret_key(key)


def test_redact_hides_the_values_of_secret_keys_at_any_depth() -> None:
    value = {
        "session_id": "s1",
        "env": {"ANTHROPIC_API_KEY": "sk-1", "PATH": "/usr/bin"},
        "hooks": [{"hook_token": "t" * 43, "tool": "Bash"}, "plain", 3],
        "usage": {"input_tokens": 12, "output_tokens": 5},
        "password": {"nested": "all of it goes"},
    }
    assert redact(value) == {
        "session_id": "s1",
        "env": {"ANTHROPIC_API_KEY": REDACTED, "PATH": "/usr/bin"},
        "hooks": [{"hook_token": REDACTED, "tool": "Bash"}, "plain", 3],
        "usage": {"input_tokens": 12, "output_tokens": 5},
        "password": REDACTED,
    }


def test_redact_copies_and_leaves_the_original_alone() -> None:
    value = {"token": "abc", "inner": {"secret": "xyz"}, "items": [{"token": "t"}]}
    out = redact(value)
    assert value == {"token": "abc", "inner": {"secret": "xyz"}, "items": [{"token": "t"}]}
    assert out is not value
    assert out["inner"] is not value["inner"]
    assert out["items"] is not value["items"]


def test_redact_looks_at_key_names_only() -> None:
    """A secret-looking value under an innocent key is kept: the rule is by name;
    a non-string key is never a secret name; scalars come back as they are."""
    assert redact({"note": "my token is abc"}) == {"note": "my token is abc"}
    assert redact({1: "one", None: "none"}) == {1: "one", None: "none"}
    assert redact(["token", 1, None, 2.5, True]) == ["token", 1, None, 2.5, True]
    assert redact("token") == "token"


def test_a_hidden_value_reads_redacted() -> None:
    """What logs and the audit show in place of a secret."""
    assert REDACTED == "<redacted>"
