"""The fleet listing's rows of nodes that do not answer, from the registry copy or from the
bucket (sage.fleet.registry_copy.RegistryCopy.entries, sage.fleet.routes.registry_rows):
the same rows for the same keys, nothing from a copy that cannot be trusted, and only what
the caller may see.  Sans-IO: the bucket's read is what sage/fleet/member.py does with the
values it gets (each key in subject order, decoded by decode_keyed)."""

from __future__ import annotations

import random

from sage.fleet.registry_copy import RegistryCopy
from sage.fleet.routes import SessionEntry, decode_keyed, registry_rows

ADMIN = None


def value(node: str, principal: str = "alice", at: float = 1.0) -> bytes:
    return SessionEntry(node=node, principal_id=principal, at=at).encode()


def bucket() -> dict[str, bytes]:
    """Keys as the bucket holds them: three nodes, two principals, a session claimed by
    two nodes, and values no listing may use."""
    keys = {f"lost1.s{i:03d}": value("lost1", "alice" if i % 2 else "bob", i) for i in range(40)}
    keys |= {f"gone.t{i:02d}": value("gone", "bob", 100.0 + i) for i in range(10)}
    keys |= {f"busy.s{i:03d}": value("busy", "alice", 200.0 + i) for i in range(5)}
    keys["gone.s001"] = value("gone", "alice", 300.0)  # s001 claimed by lost1 and gone
    keys["gone.liar"] = value("lost1")  # a value naming another node than its key
    keys["gone.junk"] = b"\x00not json"
    return keys


def bucket_read(keys: dict[str, bytes]) -> list[tuple[str, SessionEntry]]:
    """What the listing's bucket path gets: every key in subject order, decoded."""
    found = [decode_keyed(key, keys[key]) for key in sorted(keys)]
    return [keyed for keyed in found if keyed is not None]


def synced_copy(keys: dict[str, bytes]) -> RegistryCopy:
    """A copy the watch fed with ``keys`` in another order, and a put since deleted: the
    revisions 1 to :func:`last_of` ``keys``."""
    copy = RegistryCopy()
    shuffled = list(keys.items())
    random.Random(7).shuffle(shuffled)
    for revision, (key, data) in enumerate(shuffled, start=1):
        copy.apply(key, data, revision)
    copy.apply("gone.ended", value("gone"), len(keys) + 1)
    copy.apply("gone.ended", None, len(keys) + 2)
    copy.caught_up()
    return copy


def last_of(keys: dict[str, bytes]) -> int:
    """The bucket stream's last sequence once :func:`synced_copy`'s updates are in."""
    return len(keys) + 2


SHOWN = {"lost1": "lost", "gone": "stopped", "busy": "refused"}


def test_the_copy_gives_the_rows_the_bucket_gives() -> None:
    keys = bucket()
    copied = synced_copy(keys).entries(last_of(keys))
    assert copied is not None
    assert sorted(copied, key=lambda e: (e[0], e[1].node)) == sorted(
        bucket_read(keys), key=lambda e: (e[0], e[1].node)
    )
    listed = {"t03"}
    for principal in (ADMIN, "alice", "bob", "carol"):
        from_copy = registry_rows(copied, SHOWN, listed, principal)
        assert from_copy == registry_rows(bucket_read(keys), SHOWN, listed, principal)
    rows = registry_rows(copied, SHOWN, listed, ADMIN)
    assert len(rows) == 40 + 10 - 1 + 1 + 5  # t03 listed by a node that answered
    assert [row["node"] for row in rows] == ["busy"] * 5 + ["gone"] * 10 + ["lost1"] * 40
    assert {row["node"]: row["state"] for row in rows} == SHOWN
    s001 = [row for row in rows if row["session_id"] == "s001"]
    assert [(row["node"], row["started_at"]) for row in s001] == [
        ("busy", 201.0),
        ("gone", 300.0),
        ("lost1", 1.0),
    ]
    assert rows[0] == {
        "session_id": "s000",
        "principal_id": "alice",
        "pid": None,
        "state": "refused",
        "node": "busy",
        "started_at": 200.0,
    }


def test_only_the_callers_sessions_and_only_of_nodes_that_did_not_answer() -> None:
    keys = bucket()
    copied = synced_copy(keys).entries(last_of(keys))
    assert copied is not None
    alice = registry_rows(copied, {"lost1": "lost"}, set(), "alice")
    assert len(alice) == 20
    assert {(row["principal_id"], row["node"], row["state"]) for row in alice} == {
        ("alice", "lost1", "lost")
    }
    bob = registry_rows(copied, {"gone": "stopped"}, {"t00"}, "bob")
    assert [row["session_id"] for row in bob] == [f"t{i:02d}" for i in range(1, 10)]
    assert registry_rows(copied, SHOWN, set(), "carol") == []
    assert registry_rows(copied, {}, set(), ADMIN) == []


def test_an_entry_whose_session_moved_on_is_not_shown() -> None:
    """A lost node's entry whose claim names its adopter is left out, only that one."""
    keys = bucket()
    copied = synced_copy(keys).entries(last_of(keys))
    assert copied is not None
    every = registry_rows(copied, {"lost1": "lost"}, set(), ADMIN)
    first = every[0]["session_id"]
    rest = registry_rows(copied, {"lost1": "lost"}, set(), ADMIN, {(first, "lost1")})
    assert [row["session_id"] for row in rest] == [row["session_id"] for row in every[1:]]
    assert registry_rows(copied, {"lost1": "lost"}, set(), ADMIN, {(first, "other")}) == every


def test_a_copy_not_caught_up_behind_or_found_stale_gives_nothing() -> None:
    """The listing then reads the bucket: a copy that may miss claims must not hide rows,
    nor show ones gone."""
    keys = bucket()
    copy = RegistryCopy()
    for revision, (key, data) in enumerate(keys.items(), start=1):
        copy.apply(key, data, revision)
    assert copy.entries(len(keys)) is None  # the watch has not delivered every current value
    copy.caught_up()
    s000 = ("s000", SessionEntry(node="lost1", principal_id="bob", at=0.0))
    assert s000 in (copy.entries(len(keys)) or [])
    assert copy.entries(0) is not None  # (an older last sequence: read before the copy)
    # the bucket had an update since, which the watch has not delivered (yet)
    assert copy.entries(len(keys) + 1) is None
    copy.apply("lost1.s000", None, len(keys) + 1)
    after = copy.entries(len(keys) + 1)
    assert after is not None
    assert s000 not in after
    copy.found_stale()
    assert copy.entries(0) is None
    copy.caught_up()  # the old watch's end of the current values, come late
    assert copy.entries(0) is None
    copy.restart()  # the new watch
    assert copy.revision == 0
    copy.apply("lost1.s001", keys["lost1.s001"], 7)
    assert copy.entries(7) is None
    copy.caught_up()
    assert copy.entries(8) is None
    assert copy.entries(7) == [("s001", SessionEntry(node="lost1", principal_id="alice", at=1.0))]


def test_the_sweeps_claims_carry_the_revisions_the_bucket_gives() -> None:
    """A takeover's sweep reads ``(sid, entry, revision)`` (sage/fleet/failover.py): each
    key's revision is the stream sequence of its latest put, as a read of the key says."""
    copy = RegistryCopy()
    copy.apply("lost1.s1", value("lost1"), 1)
    copy.apply("lost1.s2", value("lost1"), 2)
    copy.apply("live.s1", value("live", at=5.0), 3)
    copy.apply("lost1.s2", value("lost1", at=9.0), 4)  # written again
    copy.apply("live.s1", None, 5)  # deleted
    copy.apply("lost1.s3", b"junk", 6)  # unusable: no claim, as the bucket's read
    copy.caught_up()
    assert copy.keyed_entries(6) == [
        ("s1", SessionEntry(node="lost1", principal_id="alice", at=1.0), 1),
        ("s2", SessionEntry(node="lost1", principal_id="alice", at=9.0), 4),
    ]
    assert copy.keyed_entries(7) is None
    copy.restart()
    copy.caught_up()
    assert copy.keyed_entries(0) == []
