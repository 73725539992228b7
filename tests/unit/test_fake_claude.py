"""The Claude Code test double (tests/support/fake_claude.py), run as a real subprocess.

Every test starts the script through its shebang (proving it is executable),
in a session of its own, and reads its stdout with :class:`StreamDecoder` in
a thread while another drains stderr.  :class:`Fake` is the host side: it
answers the double's control requests (the MCP handshake, ``tools/call``,
``can_use_tool``, ``hook_callback``) the way sage's session runner will, and
writes with the encoders of :mod:`sage.claude.protocol`.  Every wait has a deadline
and teardown kills the process group, so nothing can hang or leak.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from sage.claude.protocol import (
    DEFAULT_MAX_LINE_BYTES,
    AssistantMessage,
    CanUseToolRequest,
    ControlRequest,
    ControlResponse,
    Event,
    HookCallbackRequest,
    HookMatcher,
    InvalidLine,
    LineTooLong,
    McpMessageRequest,
    ResultMessage,
    StreamDecoder,
    StreamEvent,
    SystemApiRetry,
    SystemInit,
    SystemStatus,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
    UnknownBlock,
    UnknownMessage,
    UnknownRequest,
    UserMessage,
    encode_control_error,
    encode_control_success,
    encode_hook_response,
    encode_initialize,
    encode_interrupt,
    encode_mcp_notification,
    encode_mcp_response,
    encode_permission_allow,
    encode_permission_deny,
    encode_user_turn,
)
from tests.support import FAKE_CLAUDE

pytestmark = pytest.mark.timeout(30)

FAKE = FAKE_CLAUDE
BASE_ARGS = ("-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose")
MCP_CONFIG = '{"mcpServers":{"sage":{"type":"sdk","name":"sage"}}}'
MCP_ARGS = ("--mcp-config", MCP_CONFIG, "--strict-mcp-config", "--tools", "")
PARTIAL = "--include-partial-messages"
SESSION = "6f1c1f2e-3b5d-4c59-9a47-1e2d3c4b5a69"
DEADLINE = 10.0
INTERRUPTED = "[Request interrupted by user]"

TOOLS: dict[str, dict[str, Any]] = {
    name: {
        "name": name,
        "description": f"{name} someone",
        "inputSchema": {"type": "object", "properties": {"name": {"type": "string"}}},
    }
    for name in ("greet", "wave")
}


class Fake:
    """One running double and the host side of its pipes."""

    def __init__(
        self,
        *args: str,
        mode: str = "",
        env: dict[str, str] | None = None,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        drain_stderr: bool = True,
        read_stdout: bool = True,
        answer_mcp: bool = True,
    ) -> None:
        full_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"),
            "ANTHROPIC_API_KEY": "sk-test",
        }
        if mode:
            full_env["FAKE_CLAUDE_MODE"] = mode
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [str(FAKE), *BASE_ARGS, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            start_new_session=True,
        )
        self.decoder = StreamDecoder(max_line_bytes)
        self.cond = threading.Condition()
        self.events: list[Event] = []
        self.requests: list[ControlRequest] = []  # what the double asked us, in order
        self.responses: dict[str, ControlResponse] = {}
        self.stderr = bytearray()
        self.eof = False
        self.answer_mcp = answer_mcp
        self.tools = ["greet"]
        self.permission: tuple[bool, str] = (True, "")
        self.hook_output: dict[str, Any] | None = None
        self._ids = 0
        self._write_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        if read_stdout:
            self._start(self._read_stdout)
        if drain_stderr:
            self.start_stderr()

    # -- plumbing --------------------------------------------------------------

    def _start(self, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start_stderr(self) -> None:
        self._start(self._drain_stderr)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while chunk := os.read(fd, 1 << 16):
            for event in self.decoder.feed(chunk):
                self._handle(event)
            with self.cond:
                self.cond.notify_all()
        for event in self.decoder.eof():
            self._handle(event)
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def _drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        while chunk := os.read(fd, 1 << 16):
            with self.cond:
                self.stderr += chunk
                self.cond.notify_all()

    def _handle(self, event: Event) -> None:
        with self.cond:
            self.events.append(event)
            if isinstance(event, ControlResponse):
                self.responses[event.response.request_id] = event
        if isinstance(event, ControlRequest):
            line = self._answer(event)
            if line is not None:
                with contextlib.suppress(OSError):
                    self.write(line)
            with self.cond:  # after the answer: a test that saw it writes behind it
                self.requests.append(event)
                self.cond.notify_all()

    def _answer(self, msg: ControlRequest) -> bytes | None:
        rid, body = msg.request_id, msg.request
        if isinstance(body, McpMessageRequest):
            return self._mcp(rid, json.loads(bytes(body.message))) if self.answer_mcp else None
        if isinstance(body, CanUseToolRequest):
            allow, why = self.permission
            return (
                encode_permission_allow(rid, body.input)
                if allow
                else encode_permission_deny(rid, why)
            )
        if isinstance(body, HookCallbackRequest):
            return encode_hook_response(rid, self.hook_output)
        name = body.name if isinstance(body, UnknownRequest) else type(body).__name__
        return encode_control_error(rid, f"host does not handle {name}")

    def _mcp(self, rid: str, message: dict[str, Any]) -> bytes:
        method = message.get("method")
        if "id" not in message:
            return encode_control_success(rid, {"mcp_response": {"jsonrpc": "2.0", "result": {}}})
        params = message.get("params") or {}
        result: dict[str, Any]
        if method == "initialize":
            result = {
                "protocolVersion": params.get("protocolVersion"),
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "sage", "version": "0.1.0"},
            }
        elif method == "tools/list":
            result = {"tools": [TOOLS[name] for name in self.tools]}
        elif method == "tools/call" and params.get("name") == "greet":
            who = (params.get("arguments") or {}).get("name", "")
            result = {"content": [{"type": "text", "text": f"Hello, {who}!"}]}
        else:
            result = {"content": [{"type": "text", "text": "no such tool"}], "isError": True}
        return encode_mcp_response(rid, {"jsonrpc": "2.0", "id": message["id"], "result": result})

    # -- for tests -------------------------------------------------------------------

    def write(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        with self._write_lock:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()

    def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        with self._write_lock:
            self.proc.stdin.close()

    def wait_for(self, predicate: Callable[[], bool], timeout: float = DEADLINE) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    tail = [type(e).__name__ for e in self.events[-8:]]
                    raise AssertionError(
                        f"timed out; last events {tail}, eof={self.eof}, "
                        f"stderr tail {bytes(self.stderr[-500:])!r}"
                    )
                self.cond.wait(left)

    def of(self, cls: type[Any] | tuple[type[Any], ...], start: int = 0) -> list[Any]:
        with self.cond:
            return [e for e in self.events[start:] if isinstance(e, cls)]

    def until(self, cls: type[Any], start: int = 0, timeout: float = DEADLINE) -> list[Event]:
        """Events from ``start`` up to and including the first ``cls`` after it."""

        def found() -> bool:
            return any(isinstance(e, cls) for e in self.events[start:])

        self.wait_for(found, timeout)
        with self.cond:
            out = self.events[start:]
        end = next(i for i, e in enumerate(out) if isinstance(e, cls))
        return out[: end + 1]

    def mark(self) -> int:
        with self.cond:
            return len(self.events)

    def turn(self, text: str, timeout: float = DEADLINE) -> list[Event]:
        """Send a user turn; its events up to and including its result."""
        start = self.mark()
        self.write(encode_user_turn(text))
        return self.until(ResultMessage, start, timeout)

    def request(self, encode: Callable[[str], bytes]) -> ControlResponse:
        """Send a control request and wait for its answer."""
        self._ids += 1
        rid = f"req_{self._ids}"
        self.write(encode(rid))
        self.wait_for(lambda: rid in self.responses)
        return self.responses[rid]

    def initialize(self, hooks: bool = False) -> ControlResponse:
        matchers = {"PreToolUse": [HookMatcher(None, ["hook_0"])]} if hooks else None
        answer = self.request(lambda rid: encode_initialize(rid, matchers))
        assert answer.response.subtype == "success"
        return answer

    def wait_exit(self, timeout: float = DEADLINE) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(DEADLINE)
        for thread in self._threads:
            thread.join(DEADLINE)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


@pytest.fixture
def spawn() -> Iterator[Callable[..., Fake]]:
    """``spawn(*args, **options)``: a running double, killed and reaped at teardown."""
    fakes: list[Fake] = []

    def make(*args: str, **options: Any) -> Fake:
        fake = Fake(*args, **options)
        fakes.append(fake)
        return fake

    yield make
    for fake in fakes:
        fake.close()


def texts(events: list[Event]) -> list[str]:
    return [
        b.text
        for m in events
        if isinstance(m, AssistantMessage)
        for b in m.message.content
        if isinstance(b, TextBlock)
    ]


def last_result(events: list[Event]) -> ResultMessage:
    result = events[-1]
    assert isinstance(result, ResultMessage)
    return result


def stream_kinds(events: list[Event]) -> list[str]:
    return [e.event_dict()["type"] for e in events if isinstance(e, StreamEvent)]


def mcp_method(req: ControlRequest) -> str:
    assert isinstance(req.request, McpMessageRequest)
    method: str = json.loads(bytes(req.request.message))["method"]
    return method


# -- command line --------------------------------------------------------------------


def test_version() -> None:
    """--version prints the pinned version (overridable), exits 0, reads nothing."""
    out = subprocess.run(
        [str(FAKE), "--version"], capture_output=True, timeout=DEADLINE, check=True
    )
    assert out.stdout == b"2.1.328 (Claude Code)\n"
    env = {**os.environ, "FAKE_CLAUDE_VERSION": "9.9.9"}
    out = subprocess.run(
        [str(FAKE), "--version"], capture_output=True, timeout=DEADLINE, check=True, env=env
    )
    assert out.stdout == b"9.9.9 (Claude Code)\n"


def test_session_id_must_be_a_uuid() -> None:
    out = subprocess.run(
        [str(FAKE), *BASE_ARGS, "--session-id", "my-session-1"],
        capture_output=True,
        timeout=DEADLINE,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 1
    assert out.stderr == b"Error: Invalid session ID. Must be a valid UUID.\n"
    assert out.stdout == b""


# -- the protocol ---------------------------------------------------------------------


def test_initialize_then_turns(spawn: Callable[..., Fake]) -> None:
    """initialize is answered; system/init comes per turn; results count cost up."""
    fake = spawn(
        "--session-id", SESSION, "--append-system-prompt-file", "/dev/null", "--max-turns", "3"
    )
    answer = fake.initialize()
    info = msgspec.json.decode(answer.response.response)
    assert info["claude_code_version"] == "2.1.328"
    assert info["pid"] == fake.proc.pid
    assert {"commands", "models", "account", "capabilities"} <= info.keys()
    time.sleep(0.2)
    assert fake.of(SystemInit) == [], "system/init must wait for the first user turn"

    first = fake.turn("hi")
    assert [type(e) for e in first] == [SystemInit, AssistantMessage, ResultMessage]
    init = first[0]
    assert isinstance(init, SystemInit)
    assert init.session_id == SESSION
    assert init.model == "claude-sonnet-4-5"
    assert init.claude_code_version == "2.1.328"
    assert init.mcp_servers == []
    assert "Bash" in init.tools
    assert "sdk_mcp_tools_list_changed" in init.capabilities
    assert init.api_key_source == "ANTHROPIC_API_KEY"
    assert init.permission_mode == "default"
    assert init.cwd
    assert texts(first) == ["echo: hi"]
    result = last_result(first)
    assert (result.subtype, result.is_error, result.result) == ("success", False, "echo: hi")
    assert (result.num_turns, result.session_id, result.terminal_reason) == (
        1,
        SESSION,
        "completed",
    )
    assert result.total_cost_usd == pytest.approx(0.0001)
    assert result.usage is not None
    assert result.usage.output_tokens > 0

    second = fake.turn("again")
    assert [type(e) for e in second] == [SystemInit, AssistantMessage, ResultMessage]
    assert last_result(second).total_cost_usd == pytest.approx(0.0002)

    fake.close_stdin()
    assert fake.wait_exit() == 0
    fake.wait_for(lambda: fake.eof)
    assert fake.decoder.counters.invalid == 0
    assert fake.decoder.counters.unknown == 0
    assert bytes(fake.stderr) == b""


def test_resume_and_model_flags(spawn: Callable[..., Fake]) -> None:
    fake = spawn(f"--resume={SESSION}", "--model", "claude-opus-5-5", "--setting-sources", "local")
    fake.initialize()
    init = fake.turn("hi")[0]
    assert isinstance(init, SystemInit)
    assert (init.session_id, init.model) == (SESSION, "claude-opus-5-5")


def test_mcp_handshake_and_tools_list_changed(spawn: Callable[..., Fake]) -> None:
    """As the real CLI: MCP initialize before the init answer, then tools/list; list_changed re-lists."""
    fake = spawn(*MCP_ARGS, "--allowedTools", "mcp__sage__greet")
    answer = fake.initialize()
    fake.wait_for(lambda: len(fake.requests) >= 3)
    assert [mcp_method(r) for r in fake.requests] == [
        "initialize",
        "notifications/initialized",
        "tools/list",
    ]
    with fake.cond:
        order = fake.events.index(fake.requests[0]), fake.events.index(answer)
    assert order[0] < order[1], "the MCP initialize request precedes the initialize answer"
    init = fake.turn("hi")[0]
    assert isinstance(init, SystemInit)
    assert init.tools == ["mcp__sage__greet"]
    assert [(s.name, s.status, s.source) for s in init.mcp_servers] == [
        ("sage", "connected", "sdk")
    ]

    fake.tools.append("wave")
    ack = fake.request(
        lambda rid: encode_mcp_notification(rid, "sage", "notifications/tools/list_changed")
    )
    assert ack.response.subtype == "success"
    assert ack.response.response == msgspec.Raw()  # the real CLI answers without a response
    # the re-list follows the ack; on a busy machine it can come after the next mark
    fake.wait_for(lambda: [mcp_method(r) for r in fake.requests].count("tools/list") == 2)
    init = fake.turn("again")[0]
    assert isinstance(init, SystemInit)
    assert init.tools == ["mcp__sage__greet", "mcp__sage__wave"]
    assert [mcp_method(r) for r in fake.requests].count("tools/list") == 2


def test_mcp_handshake_unanswered(spawn: Callable[..., Fake]) -> None:
    """A host that never answers the MCP initialize: init reports the server failed, no tools."""
    fake = spawn(*MCP_ARGS, env={"FAKE_CLAUDE_MCP_TIMEOUT": "0.2"}, answer_mcp=False)
    fake.initialize()
    init = fake.turn("hi")[0]
    assert isinstance(init, SystemInit)
    assert init.tools == []
    assert [(s.name, s.status) for s in init.mcp_servers] == [("sage", "failed")]
    assert [mcp_method(r) for r in fake.requests] == ["initialize"]


def test_partial_messages(spawn: Callable[..., Fake]) -> None:
    """--include-partial-messages adds status and stream events in the real CLI's order."""
    fake = spawn(PARTIAL)
    fake.initialize()
    events = fake.turn("hello there")
    assert isinstance(events[0], SystemInit)
    assert isinstance(events[1], SystemStatus)
    assert events[1].status == "requesting"
    kinds = stream_kinds(events)
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    deltas = [
        e.event_dict()["delta"]["text"]
        for e in events
        if isinstance(e, StreamEvent) and e.event_dict()["type"] == "content_block_delta"
    ]
    assert len(deltas) > 1
    assert "".join(deltas) == "echo: hello there"
    i = next(i for i, e in enumerate(events) if isinstance(e, AssistantMessage))
    before, after = events[i - 1], events[i + 1]
    assert isinstance(before, StreamEvent)
    assert before.event_dict()["type"] == "content_block_delta"
    assert isinstance(after, StreamEvent)
    assert after.event_dict()["type"] == "content_block_stop"
    assert last_result(events).result == "echo: hello there"


def test_interrupt_when_idle(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    answer = fake.request(encode_interrupt)
    assert answer.response.subtype == "success"
    assert msgspec.json.decode(answer.response.response) == {"still_queued": []}
    assert last_result(fake.turn("still there?")).subtype == "success"


def test_unsupported_control_request_and_second_initialize(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    again = fake.request(lambda rid: encode_initialize(rid))
    assert again.response.subtype == "error"
    odd = fake.request(
        lambda rid: (
            b'{"type":"control_request","request_id":"%s","request":{"subtype":"warp"}}\n'
            % rid.encode()
        )
    )
    assert odd.response.subtype == "error"
    assert odd.response.error == "Unsupported control request subtype: warp"


def test_malformed_stdin_and_unmatched_response_are_ignored(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    fake.write(b"not json\n[1,2]\n\n")
    fake.write(encode_control_success("nobody-asked", {"x": 1}))
    assert texts(fake.turn("fine")) == ["echo: fine"]
    notes = (
        b"fake_claude: ignoring malformed stdin line",
        b"fake_claude: ignoring stdin line that is not an object",
        b"fake_claude: unmatched control_response 'nobody-asked'",
    )
    # stderr is read by a thread of its own: it may come after the turn's stdout
    fake.wait_for(lambda: all(note in fake.stderr for note in notes))


def test_queued_turns_run_in_order(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    start = fake.mark()
    fake.write(encode_user_turn("one") + encode_user_turn("two") + encode_user_turn("three"))
    fake.wait_for(lambda: len(fake.of(ResultMessage, start)) == 3)
    assert [r.result for r in fake.of(ResultMessage, start)] == [
        "echo: one",
        "echo: two",
        "echo: three",
    ]
    assert len(fake.of(SystemInit, start)) == 3


def test_broken_stdout_pipe_exits_quietly(spawn: Callable[..., Fake]) -> None:
    fake = spawn(read_stdout=False)
    assert fake.proc.stdout is not None
    fake.proc.stdout.close()
    with contextlib.suppress(BrokenPipeError):
        fake.write(encode_initialize("req_init") + encode_user_turn("anyone?"))
    assert fake.wait_exit() == 0
    fake.close()
    assert b"Traceback" not in fake.stderr


# -- faults ------------------------------------------------------------------------------


def test_huge_line(spawn: Callable[..., Fake]) -> None:
    """huge_line N: one line of exactly N bytes, reported once as LineTooLong; the turn goes on."""
    fake = spawn(max_line_bytes=1 << 20)
    fake.initialize()
    events = fake.turn("/fault huge_line 20_000_000", timeout=20)
    too_long = [e for e in events if isinstance(e, LineTooLong)]
    assert len(too_long) == 1
    assert too_long[0].limit == 1 << 20
    assert fake.decoder.counters.skipped_bytes == 20_000_000
    assert fake.decoder.counters.invalid == 0
    assert texts(events) == ["echo: /fault huge_line 20_000_000"]
    assert last_result(events).subtype == "success"


def test_huge_line_is_valid_json(spawn: Callable[..., Fake]) -> None:
    """Under the limit the same fault decodes as an assistant message of N-byte line."""
    fake = spawn()
    fake.initialize()
    events = fake.turn("/fault huge_line 100000")
    (huge, echo) = texts(events)
    assert set(huge) == {"x"}
    assert 99_000 < len(huge) < 100_000
    assert echo == "echo: /fault huge_line 100000"


def test_stderr_flood_with_concurrent_drain(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    size = 8 << 20
    events = fake.turn("/fault stderr_flood 8388608", timeout=20)
    assert last_result(events).subtype == "success"
    fake.wait_for(lambda: len(fake.stderr) >= size)
    assert len(fake.stderr) == size


def test_stderr_flood_blocks_a_host_that_does_not_drain(spawn: Callable[..., Fake]) -> None:
    fake = spawn(drain_stderr=False)
    fake.initialize()
    start = fake.mark()
    fake.write(encode_user_turn("/fault stderr_flood 1048576"))
    time.sleep(0.5)
    assert fake.of(ResultMessage, start) == [], "the double should be stuck writing stderr"
    fake.start_stderr()
    events = fake.until(ResultMessage, start)
    assert last_result(events).subtype == "success"
    fake.wait_for(lambda: len(fake.stderr) >= 1 << 20)


def test_garbage(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    events = fake.turn("/fault garbage")
    invalid = [e for e in events if isinstance(e, InvalidLine)]
    assert len(invalid) == 5
    assert fake.decoder.counters.invalid == 5
    assert {e.reason for e in invalid} >= {"not a JSON object"}
    assert texts(events) == ["echo: /fault garbage"]
    assert last_result(events).subtype == "success"


def test_unknown_types(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    events = fake.turn("/fault unknown")
    unknown = [(e.type, e.subtype) for e in events if isinstance(e, UnknownMessage)]
    assert unknown == [("rate_limit_event", None), ("system", "brand_new")]
    assert fake.decoder.counters.unknown == 2
    odd = next(
        e for e in events if isinstance(e, AssistantMessage) and e.message.id == "msg_unknown"
    )
    blocks = odd.message.content
    assert isinstance(blocks[0], UnknownBlock)
    assert blocks[0].block_type == "brand_new_block"
    assert blocks[1] == TextBlock("after the unknown block")
    assert last_result(events).result == "echo: /fault unknown"


def test_crash(spawn: Callable[..., Fake]) -> None:
    fake = spawn(PARTIAL)
    fake.initialize()
    fake.write(encode_user_turn("/fault crash 3"))
    assert fake.wait_exit() == 3
    fake.wait_for(lambda: fake.eof)
    assert fake.of(StreamEvent), "half a turn was streamed"
    assert fake.of(ResultMessage) == []


def test_crash_without_partial_messages(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    fake.write(encode_user_turn("/fault crash"))
    assert fake.wait_exit() == 1
    fake.wait_for(lambda: fake.eof)
    assert texts(fake.events) == ["partial answer "]
    assert fake.of(ResultMessage) == []


def test_sigkill(spawn: Callable[..., Fake]) -> None:
    fake = spawn(PARTIAL)
    fake.initialize()
    fake.write(encode_user_turn("/fault sigkill"))
    assert fake.wait_exit() == -signal.SIGKILL
    fake.wait_for(lambda: fake.eof)
    assert fake.of(StreamEvent)
    assert fake.of(ResultMessage) == []


def test_hang_then_interrupt(spawn: Callable[..., Fake]) -> None:
    """hang streams a first delta and waits; interrupt ends the turn as the real CLI does."""
    fake = spawn(PARTIAL)
    fake.initialize()
    start = fake.mark()
    fake.write(encode_user_turn("/fault hang"))
    fake.wait_for(lambda: "content_block_delta" in stream_kinds(fake.events[start:]))
    time.sleep(0.1)
    assert fake.of(ResultMessage, start) == []
    answer = fake.request(encode_interrupt)
    assert msgspec.json.decode(answer.response.response) == {"still_queued": []}
    events = fake.until(ResultMessage, start)
    assert events.index(answer) < next(
        i for i, e in enumerate(events) if isinstance(e, AssistantMessage)
    ), "the interrupt is answered before the turn ends"
    assert texts(events) == ["partial answer "]
    (marker,) = [e for e in events if isinstance(e, UserMessage)]
    assert marker.message.content == [TextBlock(INTERRUPTED)]
    assert stream_kinds(events)[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    result = last_result(events)
    assert (result.subtype, result.is_error) == ("error_during_execution", True)
    assert result.terminal_reason == "aborted_streaming"
    assert result.result is None
    assert last_result(fake.turn("next")).result == "echo: next"


def test_hang_ends_at_stdin_eof(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    fake.write(encode_user_turn("/fault hang"))
    fake.until(SystemInit)
    fake.close_stdin()
    assert fake.wait_exit() == 0
    fake.wait_for(lambda: fake.eof)
    (result,) = fake.of(ResultMessage)
    assert result.subtype == "error_during_execution"


def test_api_retry_401(spawn: Callable[..., Fake]) -> None:
    """api_retry lines every 0.3 s until interrupted; after stdin EOF they go on until killed."""
    fake = spawn()
    fake.initialize()
    start = fake.mark()
    t0 = time.monotonic()
    fake.write(encode_user_turn("/fault api_retry_401"))
    fake.wait_for(lambda: len(fake.of(SystemApiRetry, start)) >= 2)
    assert time.monotonic() - t0 >= 0.25
    retries = fake.of(SystemApiRetry, start)
    assert [r.attempt for r in retries[:2]] == [1, 2]
    assert all(r.error_status == 401 and r.error == "authentication_failed" for r in retries)
    assert retries[0].max_retries == 10
    assert fake.of(ResultMessage, start) == []
    fake.request(encode_interrupt)
    events = fake.until(ResultMessage, start)
    assert [e.message.content for e in events if isinstance(e, UserMessage)] == [
        [TextBlock(INTERRUPTED)]
    ]
    assert last_result(events).terminal_reason == "aborted_streaming"

    start = fake.mark()
    fake.write(encode_user_turn("/fault api_retry_401 0.05"))
    fake.wait_for(lambda: len(fake.of(SystemApiRetry, start)) >= 1)
    fake.close_stdin()
    seen = len(fake.of(SystemApiRetry, start))
    fake.wait_for(lambda: len(fake.of(SystemApiRetry, start)) >= seen + 3)
    assert fake.proc.poll() is None, "stdin EOF does not end the retries"
    fake.proc.terminate()
    assert fake.wait_exit() == -signal.SIGTERM


def test_tool_call_round_trip_with_hook(spawn: Callable[..., Fake]) -> None:
    """tool: tool_use, the registered PreToolUse hook, tools/call, the tool_result echo, the reply."""
    fake = spawn(*MCP_ARGS, "--allowedTools", "mcp__sage__greet")
    fake.initialize(hooks=True)
    fake.wait_for(lambda: len(fake.requests) >= 3)
    handshake = len(fake.requests)
    events = fake.turn('/fault tool greet {"name": "Ada"}')
    (use,) = [
        b
        for e in events
        if isinstance(e, AssistantMessage)
        for b in e.message.content
        if isinstance(b, ToolUseBlock)
    ]
    assert (use.name, use.input) == ("mcp__sage__greet", {"name": "Ada"})
    asked = fake.requests[handshake:]
    assert [type(r.request) for r in asked] == [HookCallbackRequest, McpMessageRequest]
    hook = asked[0].request
    assert isinstance(hook, HookCallbackRequest)
    assert (hook.callback_id, hook.tool_use_id) == ("hook_0", use.id)
    assert hook.input["hook_event_name"] == "PreToolUse"
    assert hook.input["tool_name"] == "mcp__sage__greet"
    assert hook.input["tool_input"] == {"name": "Ada"}
    call = asked[1].request
    assert isinstance(call, McpMessageRequest)
    assert call.server_name == "sage"
    rpc = json.loads(bytes(call.message))
    assert rpc["method"] == "tools/call"
    assert rpc["params"]["name"] == "greet"
    assert rpc["params"]["arguments"] == {"name": "Ada"}
    assert rpc["params"]["_meta"]["claudecode/toolUseId"] == use.id
    (echo,) = [
        b
        for e in events
        if isinstance(e, UserMessage) and isinstance(e.message.content, list)
        for b in e.message.content
        if isinstance(b, ToolResultBlock)
    ]
    assert echo.tool_use_id == use.id
    assert not echo.is_error
    assert texts(events) == ["tool: Hello, Ada!"]
    result = last_result(events)
    assert (result.result, result.num_turns) == ("tool: Hello, Ada!", 2)
    assert result.total_cost_usd == pytest.approx(0.0002)


def test_tool_call_blocked_by_hook(spawn: Callable[..., Fake]) -> None:
    fake = spawn(*MCP_ARGS)
    fake.hook_output = {"decision": "block", "reason": "not today"}
    fake.initialize(hooks=True)
    events = fake.turn("/fault tool greet")
    assert last_result(events).result == "tool blocked: not today"
    assert "tools/call" not in [
        mcp_method(r) for r in fake.requests if isinstance(r.request, McpMessageRequest)
    ]


def test_tool_call_asks_permission_and_is_denied(spawn: Callable[..., Fake]) -> None:
    """With --permission-prompt-tool stdio and the tool not allowed, the host is asked first."""
    fake = spawn(*MCP_ARGS, "--permission-prompt-tool", "stdio")
    fake.permission = (False, "no greetings")
    fake.initialize()
    events = fake.turn('/fault tool greet {"name": "Ada"}')
    (ask,) = [r.request for r in fake.requests if isinstance(r.request, CanUseToolRequest)]
    assert (ask.tool_name, ask.input) == ("mcp__sage__greet", {"name": "Ada"})
    assert "tools/call" not in [
        mcp_method(r) for r in fake.requests if isinstance(r.request, McpMessageRequest)
    ]
    result = last_result(events)
    assert result.result == "tool denied: no greetings"
    assert [(d.tool_name, d.tool_input) for d in result.permission_denials] == [
        ("mcp__sage__greet", {"name": "Ada"})
    ]


def test_tool_error_answer(spawn: Callable[..., Fake]) -> None:
    fake = spawn(*MCP_ARGS)
    fake.initialize()
    events = fake.turn("/fault tool nosuch {}")
    assert last_result(events).result == "tool error: no such tool"


@pytest.mark.parametrize(("allow", "reply"), [(True, "allowed"), (False, "denied: nope")])
def test_ask(spawn: Callable[..., Fake], allow: bool, reply: str) -> None:
    fake = spawn()
    fake.permission = (allow, "nope")
    fake.initialize()
    events = fake.turn('/fault ask Bash {"command": "ls"}')
    (req,) = fake.requests
    body = req.request
    assert isinstance(body, CanUseToolRequest)
    assert (body.tool_name, body.input, body.permission_suggestions) == (
        "Bash",
        {"command": "ls"},
        [],
    )
    assert body.tool_use_id is not None
    assert body.tool_use_id.startswith("toolu_")
    result = last_result(events)
    assert result.result == reply
    assert len(result.permission_denials) == (0 if allow else 1)


def test_hook(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    events = fake.turn('/fault hook {"tool_name": "Bash"}')
    (req,) = fake.requests
    body = req.request
    assert isinstance(body, HookCallbackRequest)
    assert body.callback_id == "hook_0"
    assert body.input["hook_event_name"] == "PreToolUse"
    assert body.input["tool_name"] == "Bash"
    assert last_result(events).result == 'hook: {"continue":true}'


def test_unknown_request(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    events = fake.turn("/fault unknown_request")
    (req,) = fake.requests
    assert isinstance(req.request, UnknownRequest)
    assert req.request.name == "brand_new_request"
    assert (
        last_result(events).result
        == "unknown_request error: host does not handle brand_new_request"
    )


def test_interrupt_while_waiting_for_the_host(spawn: Callable[..., Fake]) -> None:
    """A turn waiting for an unanswered tools/call ends on interrupt."""
    fake = spawn(*MCP_ARGS, answer_mcp=False, env={"FAKE_CLAUDE_MCP_TIMEOUT": "0.1"})
    fake.initialize()
    start = fake.mark()
    fake.write(encode_user_turn("/fault tool greet"))
    fake.wait_for(lambda: any(isinstance(e, ControlRequest) for e in fake.events[start:]))
    fake.request(encode_interrupt)
    result = last_result(fake.until(ResultMessage, start))
    assert result.subtype == "error_during_execution"


def test_unknown_fault_answers_normally(spawn: Callable[..., Fake]) -> None:
    fake = spawn()
    fake.initialize()
    assert last_result(fake.turn("/fault warp 9")).result == "echo: /fault warp 9"
    fake.wait_for(lambda: b"unknown fault 'warp'" in fake.stderr)  # read by its own thread


# -- start-up modes ---------------------------------------------------------------------------


def test_mode_no_init(spawn: Callable[..., Fake]) -> None:
    fake = spawn(mode="no_init")
    fake.write(encode_initialize("req_init") + encode_user_turn("hello?"))
    time.sleep(0.5)
    assert fake.events == []
    fake.close_stdin()
    assert fake.wait_exit() == 0


def test_mode_ignore_sigterm(spawn: Callable[..., Fake]) -> None:
    fake = spawn(mode="ignore_sigterm")
    fake.initialize()
    fake.proc.terminate()
    time.sleep(0.3)
    assert fake.proc.poll() is None
    assert last_result(fake.turn("alive")).result == "echo: alive"
    fake.proc.kill()
    assert fake.wait_exit() == -signal.SIGKILL


def test_sigterm_default_and_stderr_banner(spawn: Callable[..., Fake]) -> None:
    fake = spawn(mode="stderr_banner")
    fake.initialize()
    fake.wait_for(lambda: b"\n" in fake.stderr)
    assert bytes(fake.stderr) == b"apiKeyHelper failed: exited 1\n"
    fake.proc.terminate()
    assert fake.wait_exit() == -signal.SIGTERM


def test_mode_grandchild(spawn: Callable[..., Fake]) -> None:
    """The grandchild keeps stdout open after the double exits, until the group is killed."""
    fake = spawn(mode="grandchild")
    fake.wait_for(lambda: b"grandchild pid" in fake.stderr)
    pid = int(bytes(fake.stderr).split(b"grandchild pid ")[1].split()[0])
    assert os.getpgid(pid) == fake.proc.pid
    fake.initialize()
    assert last_result(fake.turn("hi")).subtype == "success"
    fake.close_stdin()
    assert fake.wait_exit() == 0
    time.sleep(0.3)
    assert not fake.eof, "the grandchild still holds stdout"
    os.killpg(fake.proc.pid, signal.SIGKILL)
    fake.wait_for(lambda: fake.eof)


def test_mode_exit_on_init(spawn: Callable[..., Fake]) -> None:
    fake = spawn(mode="exit_on_init=7")
    fake.initialize()
    assert fake.wait_exit() == 7
