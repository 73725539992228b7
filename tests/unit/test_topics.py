"""Topic grammar: tokens, limits, wildcards, and the reference matcher."""

from __future__ import annotations

import pytest

from bus.errors import TopicError
from bus.topics import (
    MAX_TOPIC_BYTES,
    MAX_TOPIC_TOKENS,
    pattern_matches,
    split_pattern,
    split_topic,
)


@pytest.mark.parametrize(
    ("topic", "tokens"),
    [
        ("a", ("a",)),
        ("session.started", ("session", "started")),
        ("A-z_0.9-x.__", ("A-z_0", "9-x", "__")),
        ("capsule.web-fetch.call_1", ("capsule", "web-fetch", "call_1")),
    ],
)
def test_valid_topics_split_into_tokens(topic: str, tokens: tuple[str, ...]) -> None:
    """A topic of [A-Za-z0-9_-]+ tokens splits on dots into those tokens."""
    assert split_topic(topic) == tokens


@pytest.mark.parametrize(
    "topic",
    [
        "",
        ".",
        "a.",
        ".a",
        "a..b",
        "a b",
        "a/b",
        "café",
        "a.b$",
        "a.*b",
        "a.>b",
        "a:b",
    ],
)
def test_malformed_topics_are_refused(topic: str) -> None:
    """Empty tokens, spaces, non-ASCII and punctuation other than _ and - are refused."""
    with pytest.raises(TopicError):
        split_topic(topic)
    with pytest.raises(TopicError):
        split_pattern(topic)


def test_non_string_topic_is_refused() -> None:
    """A topic that is not a str raises TopicError, not TypeError."""
    with pytest.raises(TopicError, match="string"):
        split_topic(42)


def test_sixteen_tokens_allowed_seventeen_refused() -> None:
    """At most 16 tokens: 16 pass, 17 raise."""
    ok = ".".join(["t"] * MAX_TOPIC_TOKENS)
    assert MAX_TOPIC_TOKENS == 16
    assert len(split_topic(ok)) == 16
    with pytest.raises(TopicError, match="16 tokens"):
        split_topic(ok + ".t")
    with pytest.raises(TopicError):
        split_pattern(ok + ".>")


def test_255_bytes_allowed_256_refused() -> None:
    """At most 255 bytes: a 255-byte topic passes, 256 bytes raise."""
    assert MAX_TOPIC_BYTES == 255
    ok = "a" * 100 + "." + "b" * 100 + "." + "c" * 53
    assert len(ok) == 255
    assert split_topic(ok)[2] == "c" * 53
    with pytest.raises(TopicError, match="255 bytes"):
        split_topic(ok + "c")


@pytest.mark.parametrize("pattern", ["*", ">", "a.*", "a.>", "*.b.>", "*.*", "a.*.c"])
def test_wildcard_patterns_are_valid_subscriptions(pattern: str) -> None:
    """'*' anywhere and '>' as the last token are valid in patterns."""
    assert split_pattern(pattern) == tuple(pattern.split("."))


@pytest.mark.parametrize("pattern", [">.a", "a.>.b", ">.>", "a.**", "a.>>"])
def test_gt_only_as_last_token(pattern: str) -> None:
    """'>' anywhere but the last token, or glued to other characters, is refused."""
    with pytest.raises(TopicError):
        split_pattern(pattern)


@pytest.mark.parametrize("topic", ["*", ">", "a.*", "a.>", "*.b"])
def test_publishing_to_a_wildcard_is_refused(topic: str) -> None:
    """split_topic (used for publishing) refuses any wildcard token."""
    with pytest.raises(TopicError, match="wildcard"):
        split_topic(topic)


@pytest.mark.parametrize(
    ("pattern", "topic", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.c", False),
        ("a.b", "a.b.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a", False),
        ("a.*", "a.b.c", False),
        ("*.b", "x.b", True),
        ("a.>", "a.b", True),
        ("a.>", "a.b.c.d", True),
        ("a.>", "a", False),
        (">", "a", True),
        (">", "a.b", True),
        ("*", "a", True),
        ("*", "a.b", False),
        ("a.*.>", "a.b", False),
        ("a.*.>", "a.b.c", True),
    ],
)
def test_reference_matcher_follows_nats_semantics(pattern: str, topic: str, expected: bool) -> None:
    """'*' is exactly one token, '>' one or more trailing tokens."""
    assert pattern_matches(pattern, topic) is expected
