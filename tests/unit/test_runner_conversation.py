"""The sans-IO conversation core of a runner session: no process, no event loop.

Recorded transcripts of the pinned CLI are fed through the protocol decoder
into a :class:`Conversation`, the way the session's stdout reader does, and the
turns, events and states it gives are checked line by line."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from capsules.runner.conversation import (
    CONTENT_SHOWN,
    INTERRUPTED_EXIT_WITHIN,
    PROCESS_TRANSITIONS,
    Conversation,
    EndReason,
    Fail,
    Output,
    ProcessState,
    Publish,
)
from sage.claude.protocol import Event, StreamDecoder
from sage.contract.sessions import TurnEnd
from sage.errors import IllegalTransition, SageError

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE = REPO_ROOT / "tests" / "fixtures" / "claude-code-2.1.328"
TOPICS = REPO_ROOT / "docs" / "topics.md"

ALL_STATES = list(ProcessState)


def state_of(conv: Conversation) -> ProcessState:
    """The state now (a call: mypy keeps no narrowing across the changes under test)."""
    return conv.state


def conversation(mode: str = "default") -> Conversation:
    return Conversation("alice", "s1", mode)


def decode(*lines: dict[str, Any] | bytes, max_line_bytes: int = 1 << 20) -> list[Event]:
    decoder = StreamDecoder(max_line_bytes)
    data = b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )
    return [*decoder.feed(data), *decoder.eof()]


def replay(conv: Conversation, name: str) -> list[Output]:
    """Feed a recorded transcript; the clock advances one second per line."""
    decoder = StreamDecoder(1 << 20)
    outputs: list[Output] = []
    events = [*decoder.feed((REFERENCE / name).read_bytes()), *decoder.eof()]
    for now, event in enumerate(events):
        outputs += conv.receive(event, float(now))
    return outputs


def recorded(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (REFERENCE / name).read_text().splitlines() if line]


def published(outputs: list[Output], name: str) -> list[dict[str, Any]]:
    return [o.payload for o in outputs if isinstance(o, Publish) and o.name == name]


def at(state: ProcessState) -> Conversation:
    conv = conversation()
    conv.state = state
    return conv


# -- the state table ------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new"),
    [(old, new) for old in ALL_STATES for new in sorted(PROCESS_TRANSITIONS[old], key=str)],
)
def test_every_legal_transition_is_taken(old: ProcessState, new: ProcessState) -> None:
    conv = at(old)
    conv._move(new)
    assert state_of(conv) is new


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (old, new)
        for old in ALL_STATES
        for new in ALL_STATES
        if new is not old and new not in PROCESS_TRANSITIONS[old]
    ],
)
def test_every_illegal_transition_is_refused(old: ProcessState, new: ProcessState) -> None:
    conv = at(old)
    with pytest.raises(IllegalTransition) as caught:
        conv._move(new)
    assert state_of(conv) is old
    assert isinstance(caught.value, SageError)
    assert caught.value.code == "illegal_transition"
    assert f"{old.value} -> {new.value}" in str(caught.value)


def test_exited_is_final_and_stopping_only_exits() -> None:
    assert PROCESS_TRANSITIONS[ProcessState.EXITED] == frozenset()
    assert PROCESS_TRANSITIONS[ProcessState.STOPPING] == {ProcessState.EXITED}


# -- turns and the state they move --------------------------------------------------


def test_a_turn_sent_while_starting_makes_the_process_busy_once_initialized() -> None:
    conv = conversation()
    assert conv.sent() == 1
    assert state_of(conv) is ProcessState.STARTING
    conv.initialized()
    assert state_of(conv) is ProcessState.BUSY


def test_an_idle_start_is_ready_and_a_send_makes_it_busy() -> None:
    conv = conversation()
    conv.initialized()
    assert state_of(conv) is ProcessState.READY
    assert conv.sent() == 1
    assert state_of(conv) is ProcessState.BUSY
    assert conv.sent() == 2  # a second turn queued behind the first


def test_the_process_is_ready_only_when_every_sent_turn_has_its_result() -> None:
    conv = conversation()
    conv.initialized()
    conv.sent()
    conv.sent()
    result = decode(recorded("print_text_only.jsonl")[-1])[0]
    conv.receive(result, 0.0)
    assert state_of(conv) is ProcessState.BUSY
    conv.receive(result, 0.0)
    assert state_of(conv) is ProcessState.READY
    assert (conv.turn.started, conv.turn.finished) == (2, 2)


def test_text_only_turn_from_a_recording() -> None:
    lines = recorded("print_text_only.jsonl")
    result = next(line for line in lines if line["type"] == "result")
    text = [
        block["text"]
        for line in lines
        if line["type"] == "assistant"
        for block in line["message"]["content"]
        if block["type"] == "text"
    ]
    conv = conversation()
    conv.initialized()
    conv.sent()
    outputs = replay(conv, "print_text_only.jsonl")
    # no partial messages: the assistant's text comes whole, in the turn it belongs to
    assert published(outputs, "text") == [{"delta": t, "turn": 1} for t in text]
    [done] = published(outputs, "done")
    assert done["turn"] == 1
    assert done["subtype"] == "success"
    assert done["is_error"] is False
    assert done["total_cost_usd"] == result["total_cost_usd"]
    assert done["num_turns"] == result["num_turns"]
    assert done["result"] == result["result"]
    assert done["duration_ms"] == result["duration_ms"]
    assert conv.turn.finished == 1
    assert conv.turn.cost_usd == result["total_cost_usd"]
    assert state_of(conv) is ProcessState.READY
    assert conv.init is not None
    assert not [o for o in outputs if isinstance(o, Fail)]


def test_streamed_turns_with_a_tool_call_from_a_recording() -> None:
    lines = recorded("tool_loop_partial.jsonl")
    results = [line for line in lines if line["type"] == "result"]
    deltas = [
        line["event"]["delta"]["text"]
        for line in lines
        if line["type"] == "stream_event"
        and line["event"].get("type") == "content_block_delta"
        and line["event"]["delta"].get("type") == "text_delta"
        and line["event"]["delta"].get("text")
    ]
    uses = [
        (i, block)
        for i, line in enumerate(lines)
        if line["type"] == "assistant"
        for block in line["message"]["content"]
        if block["type"] == "tool_use"
    ]
    answers = [
        (i, block)
        for i, line in enumerate(lines)
        if line["type"] == "user" and not isinstance(line["message"]["content"], str)
        for block in line["message"]["content"]
        if block["type"] == "tool_result"
    ]
    # the recording has what this test is about
    assert uses
    assert answers
    assert deltas
    conv = conversation()
    conv.initialized()
    for _ in results:
        conv.sent()
    outputs = replay(conv, "tool_loop_partial.jsonl")
    # streamed: the deltas, never the whole text a second time
    assert [p["delta"] for p in published(outputs, "text")] == deltas
    [(used_at, use)] = uses
    [(answered_at, answer)] = answers
    [tool_use] = published(outputs, "tool_use")
    assert tool_use == {
        "tool_use_id": use["id"],
        "name": use["name"],
        "input": use["input"],
        "parent_tool_use_id": None,
        "turn": 1,
    }
    [tool_result] = published(outputs, "tool_result")
    assert tool_result == {
        "tool_use_id": use["id"],
        "name": use["name"],
        "is_error": bool(answer.get("is_error")),
        "duration_ms": (answered_at - used_at) * 1000,  # the replay's clock: a line a second
        "content": answer["content"],
        "turn": 1,
    }
    assert [d["turn"] for d in published(outputs, "done")] == [1, 2]
    assert [d["result"] for d in published(outputs, "done")] == [r["result"] for r in results]
    assert conv.turn.finished == len(results)
    assert conv.turn.cost_usd == max(r["total_cost_usd"] for r in results)
    assert state_of(conv) is ProcessState.READY


def test_a_large_tool_input_is_shown_as_a_preview() -> None:
    big = {"text": "x" * 5000}
    [event] = decode(
        {
            "type": "assistant",
            "message": {
                "content": [{"type": "tool_use", "id": "t1", "name": "Write", "input": big}]
            },
            "parent_tool_use_id": None,
            "session_id": "c",
        }
    )
    [out, _assistant] = conversation().receive(event, 0.0)
    assert isinstance(out, Publish)
    assert out.name == "tool_use"
    assert "input" not in out.payload
    assert out.payload["input_bytes"] == len(json.dumps(big, separators=(",", ":")))
    assert len(out.payload["input_preview"]) == 4096


def test_a_result_without_its_call_echoed_forgets_the_call() -> None:
    conv = conversation()
    [use] = decode(
        {
            "type": "assistant",
            "message": {"content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            "parent_tool_use_id": None,
            "session_id": "c",
        }
    )
    conv.receive(use, 0.0)
    conv.receive(decode(recorded("print_text_only.jsonl")[-1])[0], 1.0)
    [echo] = decode(
        {
            "type": "user",
            "message": {"content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
            "session_id": "c",
        }
    )
    [late] = published(conv.receive(echo, 2.0), "tool_result")
    assert (late["name"], late["duration_ms"]) == ("", None)


# -- the end ------------------------------------------------------------------------


def documented_reasons() -> set[str]:
    """The ``exited`` reasons table of docs/topics.md."""
    text = TOPICS.read_text()
    table = text[text.index("| reason | cause |") :]
    rows = table[: table.index("\n\n")].splitlines()[2:]
    first = [row.split("|")[1] for row in rows]  # the reason column
    return {m for cell in first for m in re.findall(r"`([a-z_]+)", cell)}


def test_end_reasons_are_the_documented_strings() -> None:
    assert {r.value for r in EndReason} - {
        "respawn",
        "hibernate",
        "fenced",  # a fenced child's session hibernates: no exited event
        "supervisor_shutdown",
    } == documented_reasons()
    assert EndReason.RESUME_FAILED.value == "resume_failed"
    assert f"{EndReason.RESUME_FAILED}: boom" == "resume_failed: boom"
    assert str(EndReason.STOPPED) == "stopped"


def test_only_a_stop_a_respawn_or_a_hibernation_is_gentle() -> None:
    assert {r for r in EndReason if r.gentle} == {
        EndReason.STOPPED,
        EndReason.RESPAWN,
        EndReason.HIBERNATE,
    }
    assert {r for r in EndReason if r.planned} == {
        EndReason.RESPAWN,
        EndReason.HIBERNATE,
        EndReason.FENCED,
    }


def test_a_fence_overrides_a_planned_end_and_a_stop_overrides_a_fence() -> None:
    conv = conversation()
    reasons = []
    for reason in (EndReason.HIBERNATE, EndReason.FENCED, EndReason.STOPPED, EndReason.FENCED):
        conv.end(reason)
        reasons.append(conv.reason)
    assert reasons == [
        EndReason.HIBERNATE,
        EndReason.FENCED,
        EndReason.STOPPED,
        EndReason.STOPPED,
    ]


def test_the_first_reason_to_end_wins() -> None:
    conv = conversation()
    conv.end(EndReason.LINE_TOO_LONG)
    conv.end(EndReason.STOPPED)
    assert conv.reason is EndReason.LINE_TOO_LONG
    assert state_of(conv) is ProcessState.STOPPING
    assert conv.ending


def test_a_stop_overrides_a_respawn_but_not_the_reverse() -> None:
    conv = conversation()
    conv.end(EndReason.RESPAWN)
    conv.end(EndReason.STOPPED)
    assert conv.reason is EndReason.STOPPED
    conv.end(EndReason.RESPAWN)
    assert conv.reason is EndReason.STOPPED


@pytest.mark.parametrize(
    ("sent", "initialized", "busy"), [(0, True, False), (1, True, True), (1, False, True)]
)
def test_the_end_remembers_whether_a_turn_ran(sent: int, initialized: bool, busy: bool) -> None:
    conv = conversation()
    for _ in range(sent):
        conv.sent()
    if initialized:
        conv.initialized()
    conv.end(EndReason.STOPPED)
    assert conv.busy_at_end is busy


def test_after_the_end_a_result_leaves_the_process_stopping() -> None:
    conv = conversation()
    conv.initialized()
    conv.sent()
    conv.end(EndReason.STOPPED)
    conv.receive(decode(recorded("print_text_only.jsonl")[-1])[0], 0.0)
    assert state_of(conv) is ProcessState.STOPPING
    conv.exited()
    assert state_of(conv) is ProcessState.EXITED


@pytest.mark.parametrize(
    ("reason", "exit_code", "outcome"),
    [
        (None, 0, EndReason.EXITED),
        (None, 1, EndReason.CRASHED),
        (None, None, EndReason.CRASHED),  # killed by a signal
        (EndReason.STOPPED, 143, EndReason.STOPPED),
        (EndReason.AUTH_FAILED, 0, EndReason.AUTH_FAILED),
    ],
)
def test_the_outcome_of_a_child(
    reason: EndReason | None, exit_code: int | None, outcome: EndReason
) -> None:
    conv = conversation()
    if reason is not None:
        conv.end(reason)
    conv.exited()
    assert conv.outcome(exit_code) is outcome


def test_a_401_retry_ends_the_session_once_from_a_recording() -> None:
    conv = conversation()
    conv.initialized()
    conv.sent()
    outputs = replay(conv, "api_retry_401_truncated.jsonl")
    fails = [o for o in outputs if isinstance(o, Fail)]
    assert fails == [Fail(EndReason.AUTH_FAILED, {"status": 401}, {"status": 401})]
    assert published(outputs, "retry") == []  # retries after the end are not news
    assert conv.reason is EndReason.AUTH_FAILED
    assert state_of(conv) is ProcessState.STOPPING
    assert conv.busy_at_end


def test_an_ordinary_retry_is_published_with_its_turn() -> None:
    [event] = decode(
        {
            "type": "system",
            "subtype": "api_retry",
            "attempt": 2,
            "max_retries": 10,
            "retry_delay_ms": 500,
            "error_status": 529,
            "error": "overloaded",
            "session_id": "c",
        }
    )
    conv = conversation()
    assert conv.receive(event, 0.0) == [
        Publish(
            "retry",
            {
                "attempt": 2,
                "max_retries": 10,
                "status": 529,
                "error": "overloaded",
                "delay_ms": 500,
                "turn": 1,
            },
        )
    ]
    assert conv.reason is None


def test_a_turn_refused_with_403_ends_the_session_after_its_done() -> None:
    result = dict(recorded("print_text_only.jsonl")[-1], is_error=True, api_error_status=403)
    conv = conversation()
    conv.initialized()
    conv.sent()
    outputs = conv.receive(decode(result)[0], 0.0)
    assert [type(o) for o in outputs] == [Publish, Fail]
    assert outputs[1] == Fail(EndReason.AUTH_FAILED, {"status": 403}, {"status": 403})
    assert conv.reason is EndReason.AUTH_FAILED


def test_a_turn_after_an_authentication_failed_message_ends_the_session() -> None:
    assistant = {
        "type": "assistant",
        "message": {"content": [{"type": "text", "text": "Invalid API key"}]},
        "parent_tool_use_id": None,
        "error": "authentication_failed",
        "session_id": "c",
    }
    result = dict(recorded("print_text_only.jsonl")[-1], is_error=True)
    conv = conversation()
    conv.receive(decode(assistant)[0], 0.0)
    outputs = conv.receive(decode(result)[0], 1.0)
    assert outputs[-1] == Fail(EndReason.AUTH_FAILED, {"status": None}, {"status": None})


def test_a_cli_in_another_permission_mode_ends_the_session() -> None:
    init = dict(recorded("print_text_only.jsonl")[0], permissionMode="bypassPermissions")
    conv = conversation()
    details = {"expected": "default", "got": "bypassPermissions", "where": "system/init"}
    assert conv.receive(decode(init)[0], 0.0) == [
        Fail(EndReason.PERMISSION_MODE_MISMATCH, details, details)
    ]
    assert conv.reason is EndReason.PERMISSION_MODE_MISMATCH
    assert conv.init is not None


def test_the_initialize_answer_is_checked_too() -> None:
    conv = conversation()
    assert conv.check_mode("default", "initialize") is None
    assert conv.reason is None
    fail = conv.check_mode(None, "initialize")
    assert fail is not None
    assert fail.details == {"expected": "default", "got": None, "where": "initialize"}


def test_system_init_while_stopping_is_kept_but_not_checked() -> None:
    init = dict(recorded("print_text_only.jsonl")[0], permissionMode="plan")
    conv = conversation()
    conv.end(EndReason.STOPPED)
    assert conv.receive(decode(init)[0], 0.0) == []
    assert conv.init is not None
    assert conv.reason is EndReason.STOPPED


def test_a_line_too_long_ends_the_session() -> None:
    events = decode(b'{"type":"assistant","x":"' + b"y" * 200 + b'"}', max_line_bytes=64)
    conv = conversation()
    outputs = [o for e in events for o in conv.receive(e, 0.0)]
    [fail] = outputs
    assert isinstance(fail, Fail)
    assert fail.reason is EndReason.LINE_TOO_LONG
    assert fail.details == {}
    assert "seen" in fail.logged


def test_unknown_lines_are_counted_not_published() -> None:
    conv = conversation()
    outputs = [
        o for e in decode({"type": "martian"}, b"not json at all") for o in conv.receive(e, 0.0)
    ]
    assert outputs == []
    assert conv.unknown == 2


def test_permission_denied_and_informational_are_published() -> None:
    conv = conversation()
    [info] = decode({"type": "system", "subtype": "informational", "content": "hi"})
    assert conv.receive(info, 0.0) == [Publish("informational", {"content": "hi"})]


def test_a_tools_duration_leaves_out_the_approval_wait() -> None:
    """The call's clock restarts when its approval is answered: `[tool] NAME ok (N ms)`
    is the tool's time, not the person's time to say yes."""
    use = {"type": "tool_use", "id": "tu1", "name": "mcp__sage__greet", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "tu1", "content": "hi"}
    assistant = {
        "type": "assistant",
        "message": {"role": "assistant", "content": [use]},
        "parent_tool_use_id": None,
        "session_id": "u",
    }
    user = {
        "type": "user",
        "message": {"role": "user", "content": [result]},
        "parent_tool_use_id": None,
        "session_id": "u",
    }
    conv = conversation()
    conv.initialized()
    conv.sent()
    [used, answered] = decode(assistant, user)
    conv.receive(used, 10.0)
    conv.approval_answered("tu1", 15.0)  # five seconds of a person reading the prompt
    conv.approval_answered("unknown", 15.1)  # a call it never saw changes nothing
    [tool_result] = published(conv.receive(answered, 15.25), "tool_result")
    assert tool_result["duration_ms"] == 250


def test_assistant_events_carry_the_whole_message_from_a_recording() -> None:
    """Each assistant line is an ``assistant`` event: its message id, model, blocks, usage."""
    lines = [line for line in recorded("tool_loop_partial.jsonl") if line["type"] == "assistant"]
    assert lines  # the recording has what this test is about
    conv = conversation()
    conv.initialized()
    conv.sent()
    events = published(replay(conv, "tool_loop_partial.jsonl"), "assistant")
    assert [e["message_id"] for e in events] == [line["message"]["id"] for line in lines]
    assert [e["model"] for e in events] == [line["message"]["model"] for line in lines]
    blocks = [b for e in events for b in e["content"]]
    expected = [b for line in lines for b in line["message"]["content"]]
    assert [b["type"] for b in blocks] == [b["type"] for b in expected]
    for got, want in zip(blocks, expected, strict=True):
        if want["type"] == "tool_use":
            assert (got["id"], got["name"], got["input"]) == (
                want["id"],
                want["name"],
                want["input"],
            )
        else:
            assert got["text"] == want["text"]
    assert all(e["usage"]["output_tokens"] >= 0 for e in events)


def test_thinking_and_large_blocks_are_bounded() -> None:
    """A thinking block is carried; a text or tool input over the limit is cut and said so."""
    big = "x" * (CONTENT_SHOWN + 10)
    line = {
        "type": "assistant",
        "message": {
            "id": "msg_1",
            "model": "m",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": big},
                {"type": "tool_use", "id": "t1", "name": "Write", "input": {"x": big}},
            ],
        },
        "parent_tool_use_id": None,
    }
    conv = conversation()
    conv.initialized()
    conv.sent()
    [event] = published(conv.receive(decode(line)[0], 0.0), "assistant")
    thinking, text, use = event["content"]
    assert thinking == {"type": "thinking", "thinking": "hmm"}
    assert text == {"type": "text", "text": big[:CONTENT_SHOWN], "truncated": True}
    assert "input" not in use
    assert use["input_bytes"] == len(json.dumps({"x": big}, separators=(",", ":")))
    assert len(use["input_preview"]) <= CONTENT_SHOWN


@pytest.mark.parametrize(
    ("because", "reason", "message"),
    [
        (None, "interrupted", "stopped"),
        ((TurnEnd.BUDGET_EXCEEDED, "alice is over 50 tokens"), "budget_exceeded", None),
    ],
)
def test_an_interrupted_turn_that_an_older_cli_calls_an_execution_error(
    because: tuple[TurnEnd, str] | None, reason: str, message: str | None
) -> None:
    """2.1.275 ends a turn interrupted mid-stream as error_during_execution without a
    terminal_reason: after an interrupt that is the interrupt, with sage's reason if any."""
    result = dict(
        recorded("print_text_only.jsonl")[-1],
        is_error=True,
        subtype="error_during_execution",
        result="stopped",
    )
    result.pop("terminal_reason", None)
    plain = conversation()
    plain.initialized()
    plain.sent()
    (done,) = published(plain.receive(decode(result)[0], 0.0), "done")
    assert done["reason"] == "execution_error"  # no interrupt: what the CLI said
    conv = conversation()
    conv.initialized()
    conv.sent()
    conv.interrupting(because)
    (done,) = published(conv.receive(decode(result)[0], 0.0), "done")
    assert done["reason"] == reason
    assert done.get("message") == (because[1] if because else message)
    conv.sent()
    (after,) = published(conv.receive(decode(result)[0], 1.0), "done")
    assert after["reason"] == "execution_error"  # the next turn is not interrupted


def test_only_an_error_exit_right_after_an_interrupted_turn_is_resumable() -> None:
    """Exit 1 soon after an interrupted turn: resume; a signal, exit 0, a reason of
    sage's, a turn sent since (or still queued), or an exit long after: the session
    ends as before."""
    result = dict(
        recorded("print_text_only.jsonl")[-1], is_error=True, subtype="error_during_execution"
    )
    result.pop("terminal_reason", None)
    conv = conversation()
    conv.initialized()
    conv.sent()
    assert not conv.resumable(1, None, 0.0)  # no interrupt
    conv.interrupting()
    conv.receive(decode(result)[0], 100.0)
    assert conv.resumable(1, None, 101.0)
    assert not conv.resumable(1, None, 100.0 + INTERRUPTED_EXIT_WITHIN + 1)  # long after
    assert not conv.resumable(None, 9, 101.0)  # killed
    assert not conv.resumable(0, None, 101.0)  # a clean exit
    conv.sent()
    assert not conv.resumable(1, None, 101.0)  # a new turn went out since
    queued = conversation()
    queued.initialized()
    queued.sent()
    queued.sent()  # a second turn waits behind the first
    queued.interrupting()
    queued.receive(decode(result)[0], 100.0)
    assert not queued.resumable(1, None, 101.0)  # the resumed child would never answer it
    other = conversation()
    other.initialized()
    other.sent()
    other.interrupting()
    other.receive(decode(result)[0], 100.0)
    other.end(EndReason.STOPPED)
    assert not other.resumable(1, None, 101.0)  # sage ended it


def test_a_persons_interrupt_after_the_ledgers_keeps_the_budget_reason() -> None:
    result = dict(
        recorded("print_text_only.jsonl")[-1], is_error=True, subtype="error_during_execution"
    )
    conv = conversation()
    conv.initialized()
    conv.sent()
    conv.interrupting((TurnEnd.BUDGET_EXCEEDED, "over"))
    conv.interrupting()
    (done,) = published(conv.receive(decode(result)[0], 0.0), "done")
    assert (done["reason"], done["message"]) == ("budget_exceeded", "over")
