"""TopicTrie: agreement with the reference matcher, insert/remove/prune, cache."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from bus.topics import pattern_matches
from bus.trie import TopicTrie

_TOKENS = st.sampled_from(["a", "b", "c"])
_TOPICS = st.lists(_TOKENS, min_size=1, max_size=4).map(".".join)


@st.composite
def _patterns(draw: st.DrawFn) -> str:
    tokens = draw(st.lists(st.sampled_from(["a", "b", "c", "*"]), min_size=1, max_size=4))
    if draw(st.booleans()):
        tokens[-1] = ">"
    return ".".join(tokens)


class _Value:
    """A distinct object per pattern (the trie keys values by identity)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern

    def __repr__(self) -> str:
        return f"_Value({self.pattern!r})"


def _root_is_empty(trie: TopicTrie[_Value]) -> bool:
    return trie._root.empty()


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(_patterns(), max_size=12), topics=st.lists(_TOPICS, min_size=1))
def test_match_agrees_with_reference_matcher(patterns: list[str], topics: list[str]) -> None:
    """TopicTrie.match returns exactly the values whose pattern_matches the topic."""
    trie: TopicTrie[_Value] = TopicTrie()
    values = [_Value(p) for p in patterns]
    for value in values:
        trie.insert(value.pattern, value)
    for topic in topics:
        expected = Counter(id(v) for v in values if pattern_matches(v.pattern, topic))
        assert Counter(id(v) for v in trie.match(topic)) == expected
        # second lookup comes from the cache and must agree too
        assert Counter(id(v) for v in trie.match(topic)) == expected


@settings(max_examples=200, deadline=None)
@given(
    patterns=st.lists(_patterns(), min_size=1, max_size=10),
    data=st.data(),
)
def test_removals_keep_agreement_and_prune_to_empty(
    patterns: list[str], data: st.DataObject
) -> None:
    """After random removals match still agrees; removing everything leaves an empty root."""
    trie: TopicTrie[_Value] = TopicTrie()
    values = [_Value(p) for p in patterns]
    for value in values:
        trie.insert(value.pattern, value)
    order = data.draw(st.permutations(values))
    topics = data.draw(st.lists(_TOPICS, min_size=1, max_size=5))
    live = list(values)
    for value in order:
        for topic in topics:
            trie.match(topic)  # warm the cache so removal must invalidate it
        assert trie.remove(value.pattern, value) is True
        live.remove(value)
        assert len(trie) == len(live)
        for topic in topics:
            expected = Counter(id(v) for v in live if pattern_matches(v.pattern, topic))
            assert Counter(id(v) for v in trie.match(topic)) == expected
    assert _root_is_empty(trie)


def test_insert_then_remove_prunes_every_node() -> None:
    """Removing the only pattern under a deep path leaves no empty nodes behind."""
    trie: TopicTrie[_Value] = TopicTrie()
    deep, star, rest = _Value("a.b.c"), _Value("a.*.c"), _Value("a.b.>")
    for v in (deep, star, rest):
        trie.insert(v.pattern, v)
    assert trie.remove("a.b.c", deep)
    assert "c" not in trie._root.children["a"].children["b"].children
    assert trie.remove("a.*.c", star)
    assert trie._root.children["a"].star is None
    assert trie.remove("a.b.>", rest)
    assert _root_is_empty(trie)
    assert len(trie) == 0


def test_remove_of_unknown_pattern_or_value_is_false() -> None:
    """remove() reports False and changes nothing for a pattern/value not inserted."""
    trie: TopicTrie[_Value] = TopicTrie()
    v, other = _Value("a.b"), _Value("a.b")
    trie.insert("a.b", v)
    assert trie.remove("a.b", other) is False
    assert trie.remove("a.c", v) is False
    assert trie.remove("x.y.z", v) is False
    assert trie.remove("a.>", v) is False
    assert trie.remove("a.*", v) is False
    assert len(trie) == 1
    assert trie.match("a.b") == (v,)


def test_value_under_two_patterns_is_returned_once_per_pattern() -> None:
    """One value inserted under two matching patterns is returned twice."""
    trie: TopicTrie[_Value] = TopicTrie()
    v = _Value("both")
    trie.insert("a.*", v)
    trie.insert("a.>", v)
    assert trie.match("a.b") == (v, v)
    assert trie.remove("a.*", v)
    assert trie.match("a.b") == (v,)


def test_insert_invalidates_cached_match() -> None:
    """A cached (even empty) result is dropped when a new matching pattern is inserted."""
    trie: TopicTrie[_Value] = TopicTrie()
    assert trie.match("a.b") == ()
    assert "a.b" in trie.cache
    v = _Value(">")
    trie.insert(">", v)
    assert "a.b" not in trie.cache
    assert trie.match("a.b") == (v,)


def test_remove_invalidates_cached_match() -> None:
    """A cached result is dropped when a matching pattern is removed."""
    trie: TopicTrie[_Value] = TopicTrie()
    v = _Value("a.*")
    trie.insert("a.*", v)
    assert trie.match("a.b") == (v,)
    trie.remove("a.*", v)
    assert trie.match("a.b") == ()


def test_cache_is_bounded() -> None:
    """The match cache never holds more than cache_size topics."""
    trie: TopicTrie[_Value] = TopicTrie(cache_size=8)
    trie.insert(">", _Value(">"))
    for i in range(100):
        trie.match(f"t.{i}")
        assert len(trie.cache) <= 8
    assert trie.match("t.5") != ()


def test_cache_view_is_the_live_cache() -> None:
    """trie.cache stays the same dict object across clears (the Bus hot path relies on it)."""
    trie: TopicTrie[_Value] = TopicTrie(cache_size=2)
    view = trie.cache
    v = _Value("a")
    trie.insert("a", v)
    for t in ("a", "b", "c", "a"):
        trie.match(t)
    trie.remove("a", v)
    trie.match("a")
    assert trie.cache is view
    assert view["a"] == ()
