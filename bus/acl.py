"""Who may publish and subscribe to what.

An :class:`Acl` is two lists of patterns; a concrete topic is allowed when
one pattern matches it, and a subscription pattern is allowed when every
topic it could match is allowed (checked conservatively, token by token).
Decisions are cached per topic.  An :class:`Identity` is what the bus knows
of a publisher: its source name, principal and ACL (``None`` = unrestricted,
for the supervisor's own parts and admins).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from bus.topics import split_pattern, split_topic

__all__ = ("Acl", "Identity", "pattern_covers", "patterns_overlap")


def pattern_covers(allowed: str, requested: str) -> bool:
    """Whether every topic matched by ``requested`` is matched by ``allowed``."""
    a = split_pattern(allowed)
    r = split_pattern(requested)
    for i, token in enumerate(a):
        if token == ">":
            return len(r) > i
        if i >= len(r):
            return False
        if r[i] == ">":
            return False
        if token != "*" and token != r[i]:
            return False
    return len(a) == len(r)


def patterns_overlap(a: str, b: str) -> bool:
    """Whether some topic is matched by both patterns."""
    x, y = split_pattern(a), split_pattern(b)
    for i in range(max(len(x), len(y))):
        if i >= len(x) or i >= len(y):
            return False
        if x[i] == ">" or y[i] == ">":
            return True
        if x[i] != y[i] and "*" not in (x[i], y[i]):
            return False
    return True


class Acl:
    """Publish and subscribe allow-lists of patterns."""

    __slots__ = ("_pub_cache", "_sub_cache", "publish", "subscribe")

    def __init__(self, publish: Iterable[str] = (), subscribe: Iterable[str] = ()) -> None:
        self.publish = tuple(publish)
        self.subscribe = tuple(subscribe)
        for pattern in (*self.publish, *self.subscribe):
            split_pattern(pattern)
        self._pub_cache: dict[str, bool] = {}
        self._sub_cache: dict[str, bool] = {}

    def may_publish(self, topic: str) -> bool:
        hit = self._pub_cache.get(topic)
        if hit is None:
            split_topic(topic)
            hit = any(pattern_covers(p, topic) for p in self.publish)
            if len(self._pub_cache) > 4096:
                self._pub_cache.clear()
            self._pub_cache[topic] = hit
        return hit

    def may_subscribe(self, pattern: str) -> bool:
        hit = self._sub_cache.get(pattern)
        if hit is None:
            hit = any(pattern_covers(p, pattern) for p in self.subscribe)
            if len(self._sub_cache) > 4096:
                self._sub_cache.clear()
            self._sub_cache[pattern] = hit
        return hit

    def __repr__(self) -> str:
        return f"Acl(publish={list(self.publish)}, subscribe={list(self.subscribe)})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Acl):
            return NotImplemented
        return (self.publish, self.subscribe) == (other.publish, other.subscribe)

    def __hash__(self) -> int:
        return hash((self.publish, self.subscribe))


class Identity(msgspec.Struct, frozen=True):
    """A publisher or subscriber as the bus knows it (never self-asserted)."""

    source: str
    principal: str | None = None
    acl: Acl | None = None
    uid: int | None = None
    """The peer's uid for a socket connection the server authorized; ``None`` for
    what the process vouches for itself (its own parts, capsules, adopted workers)."""
