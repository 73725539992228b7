"""Which registry entry a lost node's session is adopted from (sage.fleet.failover.lost_entries)."""

from __future__ import annotations

from sage.fleet.failover import lost_entries
from sage.fleet.routes import SessionEntry


def claim(node: str, at: float) -> SessionEntry:
    return SessionEntry(node=node, principal_id="alice", at=at, resume=True)


def test_a_session_a_live_node_claims_is_not_adopted_again() -> None:
    """The lost node's claim stays beside its adopter's: while the adopter is live, the
    session is its, and no sweep takes it from the stale claim."""
    entries = [("s1", claim("a", 1.0), 3), ("s1", claim("c", 2.0), 7), ("s2", claim("a", 1.0), 4)]
    found = lost_entries(entries, {"b", "c"})
    assert sorted(found) == ["s2"]
    assert found["s2"] == (claim("a", 1.0), 4)


def test_of_several_lost_claims_the_latest_is_adopted_from() -> None:
    """The session moved from a to c, and both are lost now: c's (the later) is taken."""
    entries = [("s1", claim("c", 5.0), 9), ("s1", claim("a", 1.0), 3)]
    assert lost_entries(entries, {"b"}) == {"s1": (claim("c", 5.0), 9)}
    assert lost_entries(list(reversed(entries)), {"b"}) == {"s1": (claim("c", 5.0), 9)}


def test_another_principals_live_session_of_the_same_id_does_not_hide_a_lost_one() -> None:
    """Ids are each node's: bob's live ``review`` on c is not alice's lost ``review`` of a,
    which is still adopted (found by the fleet's first try: it stayed lost)."""
    bobs = SessionEntry(node="c", principal_id="bob", at=2.0, resume=True)
    entries = [("review", claim("a", 1.0), 3), ("review", bobs, 5)]
    assert lost_entries(entries, {"b", "c"}) == {"review": (claim("a", 1.0), 3)}
