"""The golden transcripts of the pinned Claude Code CLI and the message kinds each holds.

Recorded by `make transcripts` (tests/e2e/record.py); decoded by tests/unit/test_protocol.py
and compared with a fresh recording by tests/e2e/test_record.py.
"""

from __future__ import annotations

from pathlib import Path

PINNED = "2.1.328"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
REFERENCE = FIXTURES / f"claude-code-{PINNED}"  # recorded by `make transcripts`

SETUP = ["control_request", "control_response", "control_request", "control_request"]
STREAM_TURN = ["system/status", "stream_event", "stream_event", "stream_event", "assistant"]
STREAM_END = ["stream_event", "stream_event", "stream_event"]
# a tool call: start, a text-less block whose input comes in two deltas; the CLI
# asks for permission and calls the tool while the message is still streaming
STREAM_TOOL_TURN = [
    "system/status",
    *["stream_event"] * 4,
    "assistant",
    "stream_event",
    "control_request",
    "stream_event",
    "stream_event",
    "control_request",
    "user",
]
EXPECTED_KINDS = {
    "api_retry_401_truncated.jsonl": [*SETUP, "system/init", *["system/api_retry"] * 4],
    "permission_prompt.jsonl": [
        *SETUP,
        "system/init",
        "assistant",
        "control_request",
        "control_request",
        "user",
        "assistant",
        "result",
    ],
    "print_text_only.jsonl": ["system/init", "assistant", "result"],
    "tool_loop_partial.jsonl": [
        *SETUP,
        "system/init",
        *STREAM_TOOL_TURN,
        *STREAM_TURN,
        *STREAM_END,
        "result",
        "system/init",
        *STREAM_TURN,
        *STREAM_END,
        "result",
    ],
    "tool_loop_with_hook_callback.jsonl": [
        *SETUP,
        "system/init",
        "assistant",
        "control_request",
        "control_request",
        "user",
        "assistant",
        "result",
    ],
}
