"""A minimal host for the real Claude Code CLI, built on the sage.claude.protocol codec.

:func:`run_claude` starts ``claude -p`` in stream-json mode as a subprocess
(its own process group, a clean environment pointing at the Messages API
stand-in), writes ``initialize`` and waits for its answer, and yields a
:class:`Host`.  The host reads stdout through :class:`StreamDecoder`, drains
stderr, keeps :class:`ControlChannel` bookkeeping in both directions and
answers the CLI's control requests itself: ``mcp_message`` for the sdk
server ``sage`` (tools ``greet`` and, once added, ``wave``), ``hook_callback``
with ``{"continue": true}`` and ``can_use_tool`` per :attr:`Host.permission`.
Everything else (conversation messages, system lines, unknown lines) lands
in :attr:`Host.inbox` for the test to read in order.  On exit the process
group is killed and every stream closed.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from sage.claude.protocol import (
    CanUseToolRequest,
    ChannelState,
    ControlCancelRequest,
    ControlChannel,
    ControlOutcome,
    ControlRequest,
    ControlResponse,
    Event,
    HookCallbackRequest,
    HookMatcher,
    InvalidLine,
    LineTooLong,
    McpMessageRequest,
    Message,
    OutgoingState,
    ResultMessage,
    StreamDecoder,
    UnknownMessage,
    UnknownRequest,
    encode_control_error,
    encode_control_success,
    encode_hook_response,
    encode_initialize,
    encode_mcp_response,
    encode_permission_allow,
    encode_permission_deny,
    encode_user_turn,
)
from tests.support.standin import offline_env

__all__ = ("FINDINGS", "MCP_CONFIG", "Host", "HostClosed", "run_claude")

MCP_CONFIG = '{"mcpServers":{"sage":{"type":"sdk","name":"sage"}}}'
HOOK_ID = "hook_0"

#: Protocol findings across every host of the test session, for the summary.
FINDINGS: dict[str, Counter[str]] = {
    "unknown_messages": Counter(),
    "unknown_control_requests": Counter(),
    "control_cancels": Counter(),
    "standin_calls": Counter(),
    "stderr": Counter(),  # first line of a non-empty stderr
}

TOOLS: dict[str, dict[str, Any]] = {
    "greet": {
        "name": "greet",
        "description": "Greet someone by name.",
        "inputSchema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    },
    "wave": {
        "name": "wave",
        "description": "Wave at someone.",
        "inputSchema": {
            "type": "object",
            "properties": {"name": {"type": "string"}},
            "required": ["name"],
        },
    },
}


class HostClosed(Exception):
    """The CLI's stdout ended while the test waited for more."""


Permission = Callable[[CanUseToolRequest], tuple[bool, str]]


class Host:
    """The host side of one CLI process; see the module docstring."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.decoder = StreamDecoder()
        self.channel = ControlChannel("host")
        self.inbox: list[Message] = []
        self.invalid: list[InvalidLine | LineTooLong] = []
        self.unknown: list[UnknownMessage] = []
        self.stderr = bytearray()
        self.stdout = bytearray()  # every byte the CLI wrote, for recording transcripts
        self.tools: list[str] = ["greet"]
        self.mcp_methods: list[str] = []
        self.tool_calls: list[dict[str, Any]] = []
        self.hook_callbacks: list[HookCallbackRequest] = []
        self.permission_requests: list[CanUseToolRequest] = []
        self.unknown_requests: list[UnknownRequest] = []
        self.cancels: list[str] = []
        self.log: list[str] = []  # ordered: what happened on the control channel
        #: can_use_tool policy: "allow", "deny" or a callable -> (allow, message).
        self.permission: str | Permission = "allow"
        self.eof = False
        self._cursor = 0
        self._outcomes: dict[str, ControlOutcome] = {}
        self._changed = anyio.Event()
        self._write_lock = anyio.Lock()

    # -- for tests -------------------------------------------------------------

    async def write(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        async with self._write_lock:
            await self.proc.stdin.send(line)

    async def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        async with self._write_lock:
            await self.proc.stdin.aclose()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait for ``predicate`` to hold (checked whenever stdout delivered something)."""
        while not predicate():
            if self.eof:
                raise HostClosed(f"CLI stdout closed; stderr tail: {self.stderr[-2000:]!r}")
            await self._changed.wait()

    async def next(self) -> Message:
        """The next non-control message from stdout."""
        await self.wait_until(lambda: len(self.inbox) > self._cursor)
        msg = self.inbox[self._cursor]
        self._cursor += 1
        return msg

    async def until(self, cls: type[Any] | tuple[type[Any], ...]) -> list[Message]:
        """Messages up to and including the first instance of ``cls``."""
        out: list[Message] = []
        while True:
            msg = await self.next()
            out.append(msg)
            if isinstance(msg, cls):
                return out

    async def turn(self, text: str) -> list[Message]:
        """Send a user turn; return its messages, the last one its ``result``."""
        await self.write(encode_user_turn(text))
        return await self.until(ResultMessage)

    async def request(
        self, subtype: str, encode: Callable[[str], bytes], request_id: str | None = None
    ) -> ControlOutcome:
        """Send a control request (``encode(request_id)``) and wait for its answer."""
        request_id = self.channel.open_request(subtype, request_id=request_id)
        self.log.append(f"-> {subtype} {request_id}")
        await self.write(encode(request_id))
        await self.wait_until(lambda: request_id in self._outcomes)
        return self._outcomes.pop(request_id)

    async def wait(self) -> int:
        """Wait for the process to exit; its return code."""
        return await self.proc.wait()

    # -- reading -----------------------------------------------------------------

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def read_stdout(self) -> None:
        assert self.proc.stdout is not None
        try:
            async for chunk in self.proc.stdout:
                self.stdout += chunk
                for event in self.decoder.feed(chunk):
                    await self._handle(event)
                self._notify()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        for event in self.decoder.eof():
            await self._handle(event)
        self.eof = True
        self._notify()

    async def drain_stderr(self) -> None:
        assert self.proc.stderr is not None
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            async for chunk in self.proc.stderr:
                self.stderr += chunk

    async def _handle(self, event: Event) -> None:
        if isinstance(event, InvalidLine | LineTooLong):
            self.invalid.append(event)
            return
        if isinstance(event, UnknownMessage):
            self.unknown.append(event)
            FINDINGS["unknown_messages"][f"{event.type}/{event.subtype}"] += 1
        if isinstance(event, ControlRequest):
            await self._answer(event)
            return
        if isinstance(event, ControlResponse):
            outcome = self.channel.receive_response(event)
            if outcome is not None:
                self.log.append(f"<- response {outcome.request_id} {outcome.state.value}")
                self._outcomes[outcome.request_id] = outcome
            else:
                self.log.append(f"<- unmatched response {event.response.request_id}")
            return
        if isinstance(event, ControlCancelRequest):
            self.channel.receive_cancel(event)
            self.cancels.append(event.request_id)
            FINDINGS["control_cancels"]["control_cancel_request"] += 1
            self.log.append(f"<- cancel {event.request_id}")
            return
        self.inbox.append(event)

    # -- answering the CLI ---------------------------------------------------------

    async def _answer(self, msg: ControlRequest) -> None:
        self.channel.receive_request(msg)
        rid = msg.request_id
        body = msg.request
        if isinstance(body, McpMessageRequest):
            line = self._mcp(rid, body)
        elif isinstance(body, HookCallbackRequest):
            self.hook_callbacks.append(body)
            self.log.append(f"<- hook_callback {body.callback_id}")
            line = encode_hook_response(rid)
        elif isinstance(body, CanUseToolRequest):
            self.permission_requests.append(body)
            allow, why = self._decide(body)
            self.log.append(f"<- can_use_tool {body.tool_name} {'allow' if allow else 'deny'}")
            if allow:
                line = encode_permission_allow(rid, body.input)
            else:
                line = encode_permission_deny(rid, why)
        else:
            name = body.name if isinstance(body, UnknownRequest) else type(body).__name__
            if isinstance(body, UnknownRequest):
                self.unknown_requests.append(body)
            FINDINGS["unknown_control_requests"][name] += 1
            self.log.append(f"<- unexpected request {name}")
            line = encode_control_error(rid, f"host does not handle {name}")
        if self.channel.answer(rid):
            await self.write(line)

    def _decide(self, req: CanUseToolRequest) -> tuple[bool, str]:
        if callable(self.permission):
            return self.permission(req)
        return self.permission == "allow", "denied by the test host"

    def _mcp(self, rid: str, body: McpMessageRequest) -> bytes:
        if body.server_name != "sage":
            return encode_control_error(rid, f"no sdk MCP server {body.server_name!r}")
        message = json.loads(bytes(body.message))
        method = message.get("method", "")
        self.mcp_methods.append(method)
        self.log.append(f"<- mcp {method}")
        if "id" not in message:  # a notification: acknowledge it
            return encode_control_success(rid, {"mcp_response": {"jsonrpc": "2.0", "result": {}}})
        params = message.get("params") or {}
        result: dict[str, Any] | None = None
        error: dict[str, Any] | None = None
        if method == "initialize":
            result = {
                "protocolVersion": params.get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "sage", "version": "0.1.0"},
            }
        elif method == "tools/list":
            result = {"tools": [TOOLS[name] for name in self.tools]}
        elif method == "tools/call":
            self.tool_calls.append(params)
            name = params.get("name")
            who = (params.get("arguments") or {}).get("name", "")
            if name == "greet":
                result = {"content": [{"type": "text", "text": f"Hello, {who}!"}]}
            elif name == "wave" and "wave" in self.tools:
                result = {"content": [{"type": "text", "text": f"*waves at {who}*"}]}
            else:
                result = {"content": [{"type": "text", "text": f"no tool {name}"}], "isError": True}
        else:
            error = {"code": -32601, "message": f"method not found: {method}"}
        reply: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
        if error is not None:
            reply["error"] = error
        else:
            reply["result"] = result
        return encode_mcp_response(rid, reply)


def claude_command(
    claude_bin: Path,
    *,
    allowed_tools: Sequence[str] = ("mcp__sage__greet",),
    permission_prompt: bool = False,
    extra: Sequence[str] = (),
) -> list[str]:
    cmd = [
        str(claude_bin),
        "-p",
        "--input-format",
        "stream-json",
        "--output-format",
        "stream-json",
        "--verbose",
        "--mcp-config",
        MCP_CONFIG,
        "--strict-mcp-config",
        "--tools",
        "",
    ]
    if allowed_tools:
        cmd += ["--allowedTools", ",".join(allowed_tools)]
    if permission_prompt:
        cmd += ["--permission-prompt-tool", "stdio"]
    return cmd + list(extra)


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    return {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "ANTHROPIC_API_KEY": "sk-test",
        **offline_env(base_url),
    }


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


@asynccontextmanager
async def run_claude(
    claude_bin: Path,
    base_url: str,
    home: Path,
    *,
    allowed_tools: Sequence[str] = ("mcp__sage__greet",),
    permission_prompt: bool = False,
    hooks: bool = True,
    extra: Sequence[str] = (),
) -> AsyncIterator[Host]:
    """Start the CLI, initialize it, yield its :class:`Host`; kill it on exit."""
    cmd = claude_command(
        claude_bin, allowed_tools=allowed_tools, permission_prompt=permission_prompt, extra=extra
    )
    proc = await anyio.open_process(
        cmd, env=claude_env(home, base_url), cwd=home, start_new_session=True
    )
    host = Host(proc)
    ok = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(host.read_stdout)
            tg.start_soon(host.drain_stderr)
            try:
                matchers = {"PreToolUse": [HookMatcher(None, [HOOK_ID])]} if hooks else None
                outcome = await host.request(
                    "initialize", lambda rid: encode_initialize(rid, matchers), "req_init"
                )
                assert outcome.state is OutgoingState.COMPLETED, outcome
                yield host
                ok = True
            finally:
                _kill_group(proc.pid)
                with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                    await proc.wait()
    finally:
        with anyio.CancelScope(shield=True):
            await proc.aclose()
        if host.channel.state is ChannelState.OPEN:
            host.channel.fail_all("process ended")
    if host.stderr:
        FINDINGS["stderr"][bytes(host.stderr).decode(errors="replace").splitlines()[0][:200]] += 1
    if ok:
        assert not host.invalid, f"decoder saw invalid lines: {host.invalid!r}"
        assert host.decoder.counters.invalid == 0
