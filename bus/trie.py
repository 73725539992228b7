"""A token trie that maps a concrete topic to the subscribers whose patterns match.

Cost of a lookup grows with the depth of the topic, not with the number of
subscriptions.  A bounded match cache remembers the result for hot topics;
any change to the trie clears it, since one insert can change many results.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from bus.topics import split_pattern, split_topic

__all__ = ("TopicTrie",)

T = TypeVar("T")


class _Node(Generic[T]):
    __slots__ = ("children", "here", "rest", "star")

    def __init__(self) -> None:
        self.children: dict[str, _Node[T]] = {}
        self.star: _Node[T] | None = None
        self.here: dict[int, T] = {}
        self.rest: dict[int, T] = {}  # values whose pattern ends with '>' at this level

    def empty(self) -> bool:
        return not (self.children or self.star or self.here or self.rest)


class TopicTrie(Generic[T]):
    """Patterns -> values, matched against concrete topics.

    Values are kept by identity, so one value may be inserted under several
    patterns and is returned once per pattern that matches.
    """

    def __init__(self, cache_size: int = 4096) -> None:
        self._root: _Node[T] = _Node()
        self._cache: dict[str, tuple[T, ...]] = {}
        self.cache = self._cache
        """Read-only view for hot paths: topic -> matching values (may miss)."""
        self._cache_size = cache_size
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def insert(self, pattern: str, value: T) -> None:
        node = self._root
        tokens = split_pattern(pattern)
        for token in tokens[:-1]:
            node = self._child(node, token)
        last = tokens[-1]
        slot = node.rest if last == ">" else self._child(node, last).here
        if id(value) not in slot:
            self._count += 1
        slot[id(value)] = value
        self._cache.clear()

    def remove(self, pattern: str, value: T) -> bool:
        tokens = split_pattern(pattern)
        path: list[tuple[_Node[T], str]] = []
        node: _Node[T] | None = self._root
        for token in tokens[:-1]:
            assert node is not None
            path.append((node, token))
            node = node.star if token == "*" else node.children.get(token)
            if node is None:
                return False
        assert node is not None
        last = tokens[-1]
        if last == ">":
            removed = node.rest.pop(id(value), None) is not None
        else:
            path.append((node, last))
            leaf = node.star if last == "*" else node.children.get(last)
            removed = leaf is not None and leaf.here.pop(id(value), None) is not None
            node = leaf
        if not removed:
            return False
        self._count -= 1
        self._cache.clear()
        # prune empty nodes bottom-up
        while path and node is not None and node.empty():
            parent, token = path.pop()
            if token == "*":
                parent.star = None
            else:
                parent.children.pop(token, None)
            node = parent
        return True

    def match(self, topic: str) -> tuple[T, ...]:
        """Every value whose pattern matches ``topic`` (a concrete topic)."""
        hit = self._cache.get(topic)
        if hit is not None:
            return hit
        tokens = split_topic(topic)
        out: list[T] = []
        self._walk(self._root, tokens, 0, out)
        result = tuple(out)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[topic] = result
        return result

    @staticmethod
    def _child(node: _Node[T], token: str) -> _Node[T]:
        if token == "*":
            if node.star is None:
                node.star = _Node()
            return node.star
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
        return child

    def _walk(self, node: _Node[T], tokens: tuple[str, ...], i: int, out: list[T]) -> None:
        if i == len(tokens):
            out.extend(node.here.values())
            return
        if node.rest:
            out.extend(node.rest.values())
        child = node.children.get(tokens[i])
        if child is not None:
            self._walk(child, tokens, i + 1, out)
        if node.star is not None:
            self._walk(node.star, tokens, i + 1, out)
