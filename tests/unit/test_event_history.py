"""The runner's event rings for watch --replay: bounded per session and in number."""

from __future__ import annotations

from capsules.runner.history import EventHistory


def test_the_last_events_oldest_first_with_their_ids() -> None:
    history = EventHistory(ring=3)
    for i in range(1, 6):
        history.record("s1", i, "text", float(i), {"delta": str(i)})
    assert history.last("s1", 10) == [
        {"id": i, "event": "text", "ts": float(i), "data": {"delta": str(i)}} for i in (3, 4, 5)
    ]
    assert [e["id"] for e in history.last("s1", 2)] == [4, 5]
    assert history.last("s1", 0) == []
    assert history.last("nope", 5) == []


def test_only_the_most_recent_ended_sessions_keep_their_rings() -> None:
    history = EventHistory(ring=4, ended_kept=2)
    for sid in ("a", "b", "c"):
        history.record(sid, 1, "spawned", 0.0, {})
    history.record("live", 1, "spawned", 0.0, {})
    for sid in ("a", "b", "c"):
        history.ended(sid)
    assert history.last("a", 5) == []  # the oldest ended ring went
    assert len(history.last("b", 5)) == len(history.last("c", 5)) == 1
    assert len(history.last("live", 5)) == 1  # live rings are never dropped
    assert len(history) == 3
    history.record("b", 2, "spawned", 0.0, {})  # the id spawned again: live once more
    history.ended("x")  # never recorded: nothing to keep
    assert len(history) == 3


def test_what_programs_follow_live_is_not_kept_for_a_replay() -> None:
    """assistant events are not kept; tool results and final texts lose their content."""
    history = EventHistory()
    history.record("s", 1, "assistant", 0.0, {"content": [{"type": "text", "text": "x"}]})
    history.record("s", 2, "tool_result", 0.0, {"tool_use_id": "t", "content": "big"})
    history.record("s", 3, "done", 0.0, {"turn": 1, "result": "all of it"})
    assert [(e["event"], e["data"]) for e in history.last("s", 10)] == [
        ("tool_result", {"tool_use_id": "t"}),
        ("done", {"turn": 1}),
    ]
