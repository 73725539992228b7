"""sage.fleet.registry_copy: the registry as a watch keeps it, without NATS (the sans-IO core)."""

from __future__ import annotations

from sage.fleet.registry_copy import RegistryCopy
from sage.fleet.routes import SessionEntry


def entry(node: str) -> bytes:
    return SessionEntry(node=node, principal_id="alice", at=1.0).encode()


def test_it_answers_nothing_until_the_watch_caught_up() -> None:
    """Before the bucket's current values are all in, a miss could be a session not yet
    seen: the copy says nothing, and the router asks the bucket."""
    copy = RegistryCopy()
    copy.apply("a.s1", entry("a"))
    assert copy.owner("s1") is None
    assert not copy.synced
    copy.caught_up()
    owner = copy.owner("s1")
    assert owner is not None
    assert owner.node == "a"


def test_puts_replace_and_deletes_remove() -> None:
    copy = RegistryCopy()
    copy.caught_up()
    copy.apply("a.s1", entry("a"))
    copy.apply("a.s1", entry("a"))
    owner = copy.owner("s1")
    assert owner is not None
    assert owner.node == "a"
    copy.apply("a.s1", None)
    assert copy.owner("s1") is None
    assert len(copy) == 0
    assert copy.updates == 3


def test_an_unusable_value_counts_as_none() -> None:
    """Garbage, or a node name that may not be routed, must never name an owner (the
    entry it replaces is gone too)."""
    copy = RegistryCopy()
    copy.caught_up()
    copy.apply("a.s1", entry("a"))
    copy.apply("a.s1", b"\x00not json")
    assert copy.owner("s1") is None
    copy.apply("a.s2", SessionEntry(node="a.>", principal_id="alice").encode())
    assert copy.owner("s2") is None


def test_a_value_naming_another_node_than_its_key_is_ignored() -> None:
    """The key is what the server proves (a node writes only its own): node b's key
    naming a is a lie, and names no owner."""
    copy = RegistryCopy()
    copy.caught_up()
    copy.apply("b.s1", entry("a"))
    assert copy.owner("s1") is None
    copy.apply("s1", entry("a"))  # no node in the key: no claim at all
    copy.apply("a.s1.x", entry("a"))
    assert copy.owner("s1") is None
    assert len(copy) == 0


def test_a_session_claimed_by_two_nodes_is_left_to_the_bucket() -> None:
    """Which claim wins needs the node table (sage.fleet.routes.resolve): the copy names
    no owner while two nodes claim it, and the other again once one claim is gone."""
    copy = RegistryCopy()
    copy.caught_up()
    copy.apply("a.s1", entry("a"))
    copy.apply("b.s1", entry("b"))
    assert copy.owner("s1") is None
    assert len(copy) == 1
    copy.apply("a.s1", None)
    owner = copy.owner("s1")
    assert owner is not None
    assert owner.node == "b"


def test_a_restarted_watch_forgets_everything_until_it_caught_up_again() -> None:
    """A watch that failed may have missed updates: nothing it knew is trusted."""
    copy = RegistryCopy()
    copy.caught_up()
    copy.apply("a.s1", entry("a"))
    copy.restart()
    assert not copy.synced
    assert copy.owner("s1") is None
    copy.caught_up()
    assert copy.owner("s1") is None
