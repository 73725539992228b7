"""ACLs: pattern_covers and Acl publish/subscribe decisions."""

from __future__ import annotations

import pytest

from bus.acl import Acl, Identity, pattern_covers
from bus.errors import TopicError


@pytest.mark.parametrize(
    ("allowed", "requested", "expected"),
    [
        ("a.b", "a.b", True),
        ("a.b", "a.c", False),
        ("a.*", "a.b", True),
        ("a.*", "a.*", True),
        ("a.*", "a.>", False),
        ("a.*", "a.b.c", False),
        ("a.b", "a.*", False),
        ("a.>", "a.b", True),
        ("a.>", "a.*", True),
        ("a.>", "a.>", True),
        ("a.>", "a.b.>", True),
        ("a.>", "a.*.c", True),
        ("a.>", "a", False),
        ("a.b.>", "a.>", False),
        (">", ">", True),
        (">", "x.y.z", True),
        ("*", ">", False),
        ("*.b", "a.b", True),
        ("*.b", "*.c", False),
        ("a", "a.b", False),
    ],
)
def test_pattern_covers(allowed: str, requested: str, expected: bool) -> None:
    """pattern_covers is true only when every topic `requested` matches is allowed."""
    assert pattern_covers(allowed, requested) is expected


def test_publish_allowed_by_any_pattern() -> None:
    """A topic may be published when one publish pattern matches it."""
    acl = Acl(publish=["tool.*.call", "log.>"])
    assert acl.may_publish("tool.web.call")
    assert acl.may_publish("log.a.b")
    assert not acl.may_publish("tool.web.result")
    assert not acl.may_publish("log")
    # a second call answers from the cache with the same decision
    assert not acl.may_publish("tool.web.result")
    assert acl.may_publish("tool.web.call")


def test_publish_to_wildcard_raises_even_if_pattern_covers_it() -> None:
    """may_publish refuses a wildcard topic with TopicError, not a silent yes."""
    acl = Acl(publish=[">"])
    with pytest.raises(TopicError):
        acl.may_publish("a.*")


def test_subscribe_needs_cover_not_overlap() -> None:
    """A subscription pattern is allowed only if fully covered by an allowed pattern."""
    acl = Acl(subscribe=["session.*.events"])
    assert acl.may_subscribe("session.s1.events")
    assert acl.may_subscribe("session.*.events")
    assert not acl.may_subscribe("session.>")
    assert not acl.may_subscribe(">")


def test_publish_and_subscribe_lists_are_separate() -> None:
    """Being allowed to publish a topic does not allow subscribing to it, and vice versa."""
    acl = Acl(publish=["a"], subscribe=["b"])
    assert acl.may_publish("a")
    assert not acl.may_subscribe("a")
    assert acl.may_subscribe("b")
    assert not acl.may_publish("b")


def test_acl_validates_its_patterns() -> None:
    """A malformed pattern in an ACL is refused when the ACL is built."""
    with pytest.raises(TopicError):
        Acl(publish=["a..b"])
    with pytest.raises(TopicError):
        Acl(subscribe=[">.a"])


def test_empty_acl_allows_nothing() -> None:
    """An Acl with no patterns refuses every publish and subscribe."""
    acl = Acl()
    assert not acl.may_publish("a")
    assert not acl.may_subscribe("a")


def test_identity_defaults_are_unrestricted() -> None:
    """An Identity without an acl has acl None (unrestricted) and no principal."""
    ident = Identity("supervisor")
    assert ident.acl is None
    assert ident.principal is None
