"""The offline model `make standin` serves (tests/support/echo_model.py): what it answers."""

from __future__ import annotations

from typing import Any

from tests.support.echo_model import prompt_of, reply_to
from tests.support.standin import Recorded, Text, ToolUse

GREET = "mcp__sage__greet"


def request(*content: Any, tools: tuple[str, ...] = (GREET,)) -> Recorded:
    body = {
        "messages": [{"role": "user", "content": list(content)}],
        "tools": [{"name": name} for name in tools],
    }
    return Recorded(method="POST", path="/v1/messages", headers={}, body=body, raw=b"")


def text(value: str) -> dict[str, str]:
    return {"type": "text", "text": value}


def test_a_prompt_is_echoed_without_the_clis_reminders() -> None:
    asked = request(text("<system-reminder>skills</system-reminder>"), text("hello there"))
    assert prompt_of(asked) == "hello there"
    assert reply_to(asked) == Text("echo: hello there")


def test_greet_calls_the_offered_greet_tool_for_the_name_given() -> None:
    assert reply_to(request(text("greet Grace please"))) == ToolUse(GREET, {"name": "Grace"})
    assert reply_to(request(text("greet with the greet tool"))) == ToolUse(GREET, {"name": "Ada"})
    assert reply_to(request(text("Greet"))) == ToolUse(GREET, {"name": "Ada"})


def test_no_greet_tool_offered_means_an_echo() -> None:
    assert reply_to(request(text("greet Ada"), tools=("Bash",))) == Text("echo: greet Ada")


def test_tool_results_are_said_back() -> None:
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [text("Hello, Ada!")]}
    assert reply_to(request(result)) == Text("Hello, Ada!")
    bare = {"type": "tool_result", "tool_use_id": "t1", "content": "Hi"}
    assert reply_to(request(bare)) == Text("Hi")
