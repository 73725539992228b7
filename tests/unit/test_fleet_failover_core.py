"""Failover's sans-IO parts: who adopts a lost node's sessions, the replicas owed, and the
checks on every id and path a transcript brings (sage/fleet/adoption.py, transcripts.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sage.fleet.adoption import (
    ADOPTING,
    HIBERNATED,
    Owed,
    Pending,
    adoptable,
    adopters,
    adopting_entry,
    rank,
)
from sage.fleet.nodes import NodeLoad, NodeState, NodeView
from sage.fleet.routes import SessionEntry
from sage.fleet.transcripts import (
    CHUNK_BYTES,
    TranscriptMeta,
    TranscriptRefused,
    check_meta,
    escape_cwd,
    read_transcript,
    restore_transcript,
    transcript_rel,
)

CS = "0d7c6c2e-3a4f-4b8e-9c1d-2e3f4a5b6c7d"


def view(node: str, state: NodeState) -> NodeView:
    return NodeView(
        node=node, state=state, host="h", pid=1, started_at=0.0, heartbeat_at=0.0, age_s=0.0
    )


def entry(node: str, principal: str = "alice", resume: bool = True) -> SessionEntry:
    return SessionEntry(node=node, principal_id=principal, resume=resume)


VIEWS = [
    view("a", NodeState.LOST),
    view("b", NodeState.LIVE),
    view("c", NodeState.LIVE),
    view("d", NodeState.STOPPED),
]


def test_a_lost_nodes_resumable_sessions_are_adoptable_with_their_revision() -> None:
    entries = {
        "s1": (entry("a"), 7),
        "s2": (entry("a", resume=False), 8),  # its node does not resume sessions
        "s3": (entry("d"), 9),  # stopped, not lost: it resumes them itself
        "s4": (entry("c"), 10),  # live
        "s5": (entry("a", "bob"), 11),  # a principal b does not run
        "s6": (entry("zz"), 12),  # a node without a record
        "../s7": (entry("a"), 13),  # a key no spawn makes
        "s8.x": (entry("a"), 14),
    }
    got = adoptable(entries, VIEWS, "b", lambda name: name == "alice")
    assert got == [("s1", entry("a"), 7)]


def test_a_node_not_live_itself_adopts_nothing() -> None:
    entries = {"s1": (entry("a"), 7)}
    views = [view("a", NodeState.LOST), view("b", NodeState.LOST)]
    assert adoptable(entries, views, "b", lambda _: True) == []
    assert adoptable(entries, VIEWS, "a", lambda _: True) == []  # never its own


def test_the_claim_names_the_adopter_and_keeps_the_principal() -> None:
    mine = adopting_entry(entry("a"), "b", 5.0)
    assert (mine.node, mine.principal_id, mine.state, mine.at, mine.resume) == (
        "b",
        "alice",
        ADOPTING,
        5.0,
        True,
    )


def loaded(node: str, live: int, max_live: int | None = 4, idle: int = 0, **kw: object) -> NodeView:
    return NodeView(
        node=node,
        state=kw.get("state", NodeState.LIVE),  # type: ignore[arg-type]
        host="h",
        pid=1,
        started_at=0.0,
        heartbeat_at=0.0,
        age_s=0.0,
        load=NodeLoad(live=live, max_live=max_live, idle=idle),
        principals=kw.get("principals", ["alice", "bob"]),  # type: ignore[arg-type]
    )


def lost_sessions(n: int, state: str = "running") -> list[tuple[str, SessionEntry, int]]:
    return [
        (f"s{i:03}", SessionEntry(node="a", principal_id="alice", state=state, resume=True), i)
        for i in range(n)
    ]


def test_adopters_are_the_least_loaded_first_and_each_session_counts() -> None:
    """b has 1 of 4 slots in use, c 3 of 4 (1 idle): b first until it is as loaded as c;
    a full node is never an adopter; the lost node and a node without the principal
    neither."""
    views = [
        loaded("a", 0, state=NodeState.LOST),
        loaded("b", 1),
        loaded("c", 3, idle=1),
        loaded("d", 4),  # full, none idle
        loaded("e", 0, principals=["bob"]),
    ]
    plan = adopters(lost_sessions(5), views)
    firsts = [order[0] for order in plan.values() if order]
    # b takes two (1 -> 3 of 4), then b and c are even (the hash decides), then full
    assert firsts[:2] == ["b", "b"]
    assert sorted(firsts) == ["b", "b", "b", "c", "c"]
    assert all(
        "d" not in order and "e" not in order and "a" not in order for order in plan.values()
    )
    assert plan["s000"] == ["b", "c"]
    assert rank("s000", "b", plan) == 0
    assert rank("s000", "c", plan) == 1
    assert rank("s000", "d", plan) is None
    assert rank("nope", "b", plan) is None


def test_every_node_plans_alike_and_ties_spread() -> None:
    """Nodes equally loaded (sessions asleep add no load): the order is the hash's, the
    same on every node whatever order it read the heartbeats in, and the sessions spread."""
    views = [loaded(n, 0, max_live=None) for n in ("b", "c")]
    found = lost_sessions(400, HIBERNATED)
    plan = adopters(found, views)
    assert plan == adopters(list(reversed(found)), list(reversed(views)))
    firsts = [order[0] for order in plan.values()]
    assert 150 < firsts.count("b") < 250


def test_a_hibernated_session_takes_no_slot_so_a_full_node_may_adopt_it() -> None:
    views = [loaded("b", 4), loaded("c", 4, idle=1)]  # b full; c may hibernate one
    asleep = lost_sessions(3, HIBERNATED)
    plan = adopters(asleep, views)
    assert all(sorted(order) == ["b", "c"] for order in plan.values())
    awake = adopters(lost_sessions(2), views)
    assert awake == {"s000": ["c"], "s001": []}  # c's idle one made room once


def test_a_burst_of_turns_is_one_replica_and_an_end_wins() -> None:
    pending = Pending(limit=3)
    for _ in range(5):
        pending.owe("s1", Owed.PUT)
    pending.owe("s2", Owed.PUT)
    assert len(pending) == 2
    pending.owe("s2", Owed.DELETE)
    pending.owe("s2", Owed.PUT)  # a late turn after the end
    assert pending.next() == ("s1", Owed.PUT)
    assert pending.next() == ("s2", Owed.DELETE)
    assert pending.next() is None


def test_the_debts_are_bounded_oldest_upload_first() -> None:
    pending = Pending(limit=2)
    pending.owe("s1", Owed.PUT)
    pending.owe("s2", Owed.DELETE)
    pending.owe("s3", Owed.PUT)
    assert pending.dropped == 1
    assert [pending.next(), pending.next(), pending.next()] == [
        ("s2", Owed.DELETE),
        ("s3", Owed.PUT),
        None,
    ]


# -- paths and metadata -------------------------------------------------------------


def test_the_transcript_path_is_the_clis() -> None:
    assert escape_cwd("/srv/homes/al_ice.x") == "-srv-homes-al-ice-x"
    assert transcript_rel("/srv/h", CS) == Path(".claude", "projects", "-srv-h", f"{CS}.jsonl")


@pytest.mark.parametrize("claude_session", ["../../etc/passwd", "x", CS + "/..", ""])
def test_a_claude_session_that_is_not_a_uuid_is_refused(claude_session: str) -> None:
    with pytest.raises(TranscriptRefused):
        transcript_rel("/srv/h", claude_session)


def meta(**fields: object) -> str:
    base: dict[str, object] = {
        "session_id": "s1",
        "principal_id": "alice",
        "claude_session": CS,
        "cwd": "",
        "model": "",
        "node": "a",
        "turns": 2,
        "size": 10,
        "chunks": 1,
        "sha256": "0" * 64,
    }
    return TranscriptMeta(**{**base, **fields}).encode()  # type: ignore[arg-type]


def test_a_good_description_is_taken() -> None:
    got = check_meta(
        "s1", "alice", meta(cwd="/srv/work", model="claude-x", cost_usd=1.5, started_at=1e9)
    )
    assert (got.claude_session, got.cwd, got.turns) == (CS, "/srv/work", 2)
    assert (got.cost_usd, got.started_at) == (1.5, 1e9)  # the adopter carries them on


@pytest.mark.parametrize(
    ("sid", "principal", "text"),
    [
        ("s2", "alice", meta()),  # about another session
        ("s1", "bob", meta()),  # another principal's
        ("s1", "alice", meta(claude_session="../../x")),
        ("s1", "alice", meta(cwd="relative/path")),
        ("s1", "alice", meta(cwd="/srv/../etc")),
        ("s1", "alice", meta(model="x; rm -rf /")),
        ("s1", "alice", meta(node="a.b")),
        ("s1", "alice", meta(turns=-1)),
        ("s1", "alice", meta(cost_usd=-1.0)),
        ("s1", "alice", meta(cost_usd=float("nan"))),
        ("s1", "alice", meta(started_at=4e10)),  # in the future
        ("s1", "alice", meta(chunks=5)),  # more chunks than its size fills
        ("s1", "alice", meta(size=CHUNK_BYTES + 1)),  # fewer
        ("s1", "alice", meta(sha256="not a digest")),
        ("s1", "alice", "not json"),
        ("s1", "alice", None),
    ],
)
def test_a_description_from_the_bucket_is_checked(sid: str, principal: str, text: str) -> None:
    with pytest.raises(TranscriptRefused):
        check_meta(sid, principal, text)


# -- reading and writing in a home that is not ours to trust ------------------------


def home_with(tmp_path: Path, data: bytes = b'{"turn": 1}\n') -> tuple[Path, Path]:
    home = tmp_path / "home"
    rel = transcript_rel("/srv/h", CS)
    (home / rel.parent).mkdir(parents=True)
    (home / rel).write_bytes(data)
    return home, rel


def test_a_regular_transcript_of_the_owner_is_read(tmp_path: Path) -> None:
    home, rel = home_with(tmp_path)
    assert read_transcript(home, rel, os.getuid(), 100) == b'{"turn": 1}\n'
    with pytest.raises(FileNotFoundError):
        read_transcript(home, transcript_rel("/srv/other", CS), os.getuid(), 100)


def test_a_link_a_fifo_a_huge_file_or_another_owner_is_refused(tmp_path: Path) -> None:
    home, rel = home_with(tmp_path)
    outside = tmp_path / "secret"
    outside.write_bytes(b"the operator's secret")
    target = home / rel
    with pytest.raises(TranscriptRefused, match="over the 5"):
        read_transcript(home, rel, os.getuid(), 5)
    with pytest.raises(TranscriptRefused, match="owned by uid"):
        read_transcript(home, rel, os.getuid() + 1, 100)
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(TranscriptRefused, match="not opened"):
        read_transcript(home, rel, os.getuid(), 100)
    target.unlink()
    os.mkfifo(target)
    with pytest.raises(TranscriptRefused, match="not a regular file"):
        read_transcript(home, rel, os.getuid(), 100)  # never blocks on the FIFO
    # a link for a folder of the path
    projects = home / ".claude" / "projects"
    (tmp_path / "elsewhere" / rel.parent.name).mkdir(parents=True)
    (tmp_path / "elsewhere" / rel.parent.name / rel.name).write_bytes(b"x")
    os.rename(projects, tmp_path / "old")
    projects.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TranscriptRefused, match="not opened"):
        read_transcript(home, rel, os.getuid(), 100)


def test_a_restore_makes_the_folders_and_a_private_file(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    rel = transcript_rel("/srv/h", CS)
    restore_transcript(home, rel, b"turns\n", os.getuid(), os.getgid())
    st = (home / rel).stat()
    assert (home / rel).read_bytes() == b"turns\n"
    assert (st.st_mode & 0o777, st.st_uid) == (0o600, os.getuid())


def test_a_restore_never_writes_through_a_link(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".claude").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (home / ".claude" / "projects").symlink_to(outside)
    rel = transcript_rel("/srv/h", CS)
    with pytest.raises(TranscriptRefused, match="not written"):
        restore_transcript(home, rel, b"turns\n", os.getuid(), os.getgid())
    assert list(outside.iterdir()) == []
    with pytest.raises(TranscriptRefused, match="not a transcript path"):
        restore_transcript(home, Path("../x/y/z"), b"", os.getuid(), os.getgid())
