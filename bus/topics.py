"""Topic grammar: validation of topics and subscription patterns.

Topics are dot-separated tokens of ``[A-Za-z0-9_-]+``, at most 16 tokens and
255 bytes.  A pattern may use ``*`` for exactly one token and ``>`` as its
last token for one or more (NATS semantics).  Publishing to a pattern is an
error.  :func:`pattern_matches` is the brute-force reference matcher the
trie is tested against.
"""

from __future__ import annotations

import re
from functools import lru_cache

from bus.errors import TopicError

__all__ = (
    "MAX_TOPIC_BYTES",
    "MAX_TOPIC_TOKENS",
    "pattern_matches",
    "split_pattern",
    "split_topic",
)

MAX_TOPIC_TOKENS = 16
MAX_TOPIC_BYTES = 255
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


def _split(text: str, *, wildcards: bool) -> tuple[str, ...]:
    if not isinstance(text, str):
        raise TopicError(f"topic must be a string, got {type(text).__name__}")
    if not text:
        raise TopicError("empty topic")
    if len(text.encode()) > MAX_TOPIC_BYTES:
        raise TopicError(f"topic longer than {MAX_TOPIC_BYTES} bytes")
    tokens = tuple(text.split("."))
    if len(tokens) > MAX_TOPIC_TOKENS:
        raise TopicError(f"topic {text!r} has more than {MAX_TOPIC_TOKENS} tokens")
    last = len(tokens) - 1
    for i, token in enumerate(tokens):
        if _TOKEN.fullmatch(token):
            continue
        if token in ("*", ">"):
            if not wildcards:
                raise TopicError(f"cannot publish to wildcard topic {text!r}")
            if token == ">" and i != last:
                raise TopicError(f"'>' must be the last token in {text!r}")
            continue
        if not token:
            raise TopicError(f"empty token in topic {text!r}")
        raise TopicError(f"bad token {token!r} in topic {text!r} (allowed: A-Z a-z 0-9 _ -)")
    return tokens


@lru_cache(maxsize=8192)
def split_topic(topic: str) -> tuple[str, ...]:
    """Tokens of a concrete topic; raise TopicError if it is malformed or a pattern."""
    return _split(topic, wildcards=False)


@lru_cache(maxsize=4096)
def split_pattern(pattern: str) -> tuple[str, ...]:
    """Tokens of a subscription pattern; raise TopicError if it is malformed."""
    return _split(pattern, wildcards=True)


def pattern_matches(pattern: str, topic: str) -> bool:
    """Whether ``pattern`` matches ``topic``, token by token (reference matcher)."""
    p = split_pattern(pattern)
    t = split_topic(topic)
    for i, token in enumerate(p):
        if token == ">":
            return len(t) > i
        if i >= len(t):
            return False
        if token != "*" and token != t[i]:
            return False
    return len(p) == len(t)
