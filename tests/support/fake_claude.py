#!/usr/bin/env python3
"""A stand-in for ``claude -p --input-format stream-json --output-format stream-json``.

A test double of the Claude Code CLI (2.1.328) for load and fault tests,
where the real CLI cannot be made to misbehave on cue.  Standard library
only; it starts in a few tens of milliseconds.  The real CLI stays the
proof that the protocol works (tests/e2e); this double copies its wire
format, including the field order of ``result`` lines, as observed in
``tests/fixtures/claude-code-2.1.328`` and in live runs of the pinned binary.

Command line
------------
The real flags are accepted and mostly ignored: ``-p``, ``--verbose``,
``--input-format X``, ``--output-format X``, ``--mcp-config JSON|PATH``,
``--strict-mcp-config``, ``--tools X``, ``--allowedTools X``,
``--permission-prompt-tool X``, ``--include-partial-messages``,
``--append-system-prompt-file PATH``, ``--model X``, ``--max-turns N``,
``--session-id UUID``, ``--resume UUID`` / ``--resume=UUID``,
``--setting-sources X``, ``--permission-mode X`` and any other
``--flag value`` or ``--flag=value``.  The ones that matter:

- ``--version`` prints ``2.1.328 (Claude Code)`` (env ``FAKE_CLAUDE_VERSION``
  replaces the number) and exits 0.
- ``--session-id`` must be a UUID, else ``Error: Invalid session ID. Must be
  a valid UUID.`` on stderr and exit 1.  The session id is that, or the
  ``--resume`` value, or a fresh uuid4.
- ``--model`` (default ``claude-sonnet-4-5``) is reported in init and messages.
- ``--include-partial-messages`` adds ``system/status`` and ``stream_event``
  lines to every simulated API call.
- ``--mcp-config``: every server of ``"type": "sdk"`` gets the MCP handshake
  the real CLI does (below); init then lists its tools as
  ``mcp__<server>__<tool>``.
- ``--tools``: built-in tools listed in init (``""`` none, the default is the
  real CLI's built-in list).
- ``--permission-prompt-tool stdio`` with ``--allowedTools``: a ``tool``
  fault for a tool not allowed first asks the host with ``can_use_tool``.

Wire behaviour (order as the real CLI)
--------------------------------------
1. Host writes ``initialize``.  For each sdk MCP server the double first
   sends a ``control_request`` ``mcp_message`` JSON-RPC ``initialize`` (id 0),
   then answers ``initialize`` with a ``control_response`` success (a small
   object shaped like the real one: commands, models, account, pid,
   claude_code_version, capabilities ...).  When the host answers the MCP
   ``initialize`` it sends ``notifications/initialized`` and ``tools/list``
   (id 1).  A second ``initialize`` is answered with an error.
2. Nothing else until a user turn: ``system/init`` is emitted at the start of
   EVERY turn (after the ``user`` line is read), not after ``initialize``.
   Before the first init the double waits for the MCP handshake (at most
   ``FAKE_CLAUDE_MCP_TIMEOUT`` seconds, default 5, per step, or until stdin
   closes); an unfinished handshake is reported as ``"status": "failed"``
   with no tools, as the real CLI does.
3. A turn: ``system/init``, then per simulated API call (with partial
   messages) ``system/status`` requesting, ``stream_event`` message_start,
   content_block_start, content_block_delta text_delta(s), then the
   ``assistant`` message, then content_block_stop, message_delta,
   message_stop (the real CLI puts the assistant line before
   content_block_stop), and finally a ``result`` success with
   ``result`` = the reply text, ``num_turns`` = API calls in the turn,
   cumulative ``total_cost_usd`` (+0.0001 per API call), ``usage``,
   ``session_id``, ``duration_ms``.  The reply is ``echo: <user text>``.
   User lines that arrive during a turn are queued and run in order.
4. ``interrupt``: answered at once with ``{"still_queued": []}``.  If the
   running (or next queued) turn is waiting (``hang``, ``api_retry_401``,
   ``tool``/``ask``/``hook``/``unknown_request`` waiting for the host), it
   ends like the real CLI's: the partial ``assistant`` text (with
   ``"aborted": true``) if any, a ``user`` message
   ``[Request interrupted by user]``, the rest of the stream events, and a
   ``result`` ``error_during_execution``, ``is_error: true``,
   ``terminal_reason: "aborted_streaming"``, no ``result`` field.  A turn
   that is not waiting finishes normally; the interrupt is then void.
5. Host ``mcp_message`` requests (e.g. ``notifications/tools/list_changed``)
   are answered with a success without ``response``; list_changed makes the
   double send a fresh ``tools/list``, and a turn that starts after the
   notification waits for its answer, so its init lists the new tools.
   ``set_model`` / ``set_permission_mode`` succeed; other subtypes get an
   error.  ``control_response`` lines are matched to the double's requests
   by ``request_id`` (an unmatched one is noted on stderr and ignored).
6. stdin EOF: the queued turns finish (a turn waiting for a host answer, or
   in ``hang``, ends at once as interrupted), then exit 0.  Malformed stdin lines are
   noted on stderr (``fake_claude: ...``) and ignored.  SIGTERM has its
   default effect (death by signal, returncode -15 / status 143).  A broken
   stdout pipe makes the double exit 0 without a word.

Faults: a user turn whose text is ``/fault NAME [ARG]``
--------------------------------------------------------
- ``huge_line N``: one stdout line of exactly N bytes (without its newline):
  a valid ``assistant`` message whose text is ``x`` repeated, written in
  1 MiB chunks; then the turn goes on normally (echo reply and result).
- ``stderr_flood N``: N bytes to stderr in 64 KiB writes, then the turn
  finishes normally (a host that does not drain stderr deadlocks here).
- ``garbage``: five invalid lines (plain text, HTML, non-UTF-8 bytes, a JSON
  array, a truncated JSON object) and a blank line, then a normal finish.
- ``unknown``: a ``rate_limit_event``, a ``system`` of subtype
  ``brand_new`` and an ``assistant`` message with an unknown content block
  type and unknown extra fields, then a normal finish.
- ``crash [N]``: half a turn (the first stream events with partial
  messages, else a partial assistant message), then ``os._exit(N)``
  (default 1).
- ``sigkill``: half a turn, then SIGKILL to itself (returncode -9).
- ``hang``: starts the turn (with partial messages up to a first
  text_delta ``partial answer ``) and never finishes it until interrupted
  or stdin closes.
- ``api_retry_401 [SECONDS]``: ``system/api_retry`` lines (attempt 1, 2, ...
  without end, max_retries 10, error_status 401, error
  ``authentication_failed``) every SECONDS (default 0.3).  Stdin EOF does
  not stop it (as the real CLI); an interrupt does; else the host must kill.
- ``tool NAME [JSON]``: an ``assistant`` ``tool_use`` block
  ``mcp__<server>__NAME`` with input JSON (default ``{}``), then, as the
  real CLI: one ``hook_callback`` per PreToolUse callback registered in
  ``initialize`` whose matcher matches (null, ``""``, ``*`` or a regex), a
  ``can_use_tool`` if ``--permission-prompt-tool stdio`` and the tool is not
  in ``--allowedTools``, then ``mcp_message`` JSON-RPC ``tools/call`` (name
  NAME, arguments JSON, ``params._meta["claudecode/toolUseId"]``) to the
  first sdk server of ``--mcp-config`` (default ``sage``).  After the
  host's answer: a ``user`` ``tool_result`` echo, then a second API call
  replying ``tool: <result text>`` (``tool error: <text>`` if the result is
  an error or the request failed, ``tool denied: <message>`` if refused
  by can_use_tool, ``tool blocked: <reason>`` if a hook answered
  ``decision: block``, ``continue: false`` or permissionDecision ``deny``).
- ``ask NAME [JSON]``: an ``assistant`` ``tool_use`` block NAME, matching
  PreToolUse hooks, then ``can_use_tool`` (tool_name NAME, input JSON,
  tool_use_id, permission_suggestions ``[]``); reply ``allowed`` or
  ``denied: <message>`` (an error answer counts as a denial with its text);
  a denial is listed in the result's ``permission_denials``.
- ``hook [JSON]``: a ``hook_callback`` (callback_id: the first PreToolUse
  id registered in initialize, else ``hook_0``; input a PreToolUse payload
  for ``mcp__sage__greet``, JSON merged into it); reply
  ``hook: <compact JSON of the answer's response>`` (``hook error: <text>``).
- ``cancel [SECONDS]``: a ``can_use_tool`` that the double withdraws with a
  ``control_cancel_request`` after SECONDS (default 0.3), then listens 1 s
  more; reply ``cancel: no answer`` (right: the host wrote nothing for it)
  or ``cancel: answered (...)``.
- ``unknown_request``: a ``control_request`` of subtype ``brand_new_request``;
  reply ``unknown_request: ok`` or ``unknown_request error: <text>``.
- ``history``: reply ``history: N: T1 | T2 | ...``, the user texts of the
  earlier turns of this conversation as its transcript holds them (this
  child's and earlier children's), ``N`` their number.
An unknown fault name is noted on stderr and answered with the echo reply.

Start-up modes: env ``FAKE_CLAUDE_MODE``, comma-separated
----------------------------------------------------------
- ``no_init``: never answer ``initialize``; read and ignore all of stdin,
  exit 0 at EOF.
- ``ignore_sigterm``: SIGTERM is ignored (SIG_IGN); only SIGKILL ends it.
- ``exit_after_interrupt``: an interrupted turn's result has no
  ``terminal_reason``, and the double exits 1 right after it (as 2.1.275 does
  when a turn is interrupted between a tool's result and the next call).
- ``grandchild``: at start spawn ``sleep`` (env
  ``FAKE_CLAUDE_GRANDCHILD_SECONDS``, default 3600) in the same process
  group, stdin from /dev/null, inheriting stdout and stderr, so the pipes
  stay open after the double exits.  Its pid is noted on stderr
  (``fake_claude: grandchild pid N``).  Kill the process group.
- ``exit_on_init=N``: exit with code N (default 1) right after answering
  ``initialize``.
- ``stderr_banner``: write ``apiKeyHelper failed: exited 1`` to stderr at
  start (what the real CLI prints for a failing apiKeyHelper).
- ``permission_mode=M``: run in permission mode M whatever ``--permission-mode``
  says (a release that ignores the flag); the ``initialize`` answer and
  ``system/init`` both say M.
- ``init_permission_mode=M``: the ``initialize`` answer says the mode asked
  for, ``system/init`` says M (a mode changed after the handshake).
- ``resume_fails``: with ``--resume ID``, fail as below even when the transcript
  is there.

Transcripts, as the real CLI keeps them
---------------------------------------
The conversation is a file, ``$HOME/.claude/projects/<cwd>/<session id>.jsonl``
(``<cwd>``: the working folder's real path, every character but [A-Za-z0-9] a
``-``).  Nothing is written before the first user turn (a session that never
spoke has no file, as with the real CLI); each turn appends its ``user`` line
when it starts and its ``assistant`` line when it finishes.  ``--resume ID``
with no such file does what the real CLI (2.1.328) does: before reading
stdin, an error ``result`` (``subtype`` ``error_during_execution``,
``errors`` ``["No conversation found with session ID: ID"]``) on stdout and
that message on stderr, then exit 1.  The fault ``history`` reads the file, so
a test sees which earlier turns a resumed child carries.  A home that cannot
be written is noted on stderr and the turn goes on.

Known differences from the real CLI
-----------------------------------
- No Messages API, no settings, no command hooks.  The transcript holds only
  ``user`` and ``assistant`` lines.  Slash commands, agents and models in
  init and in the initialize answer are short stand-in lists.
- The real CLI (2.1.328, seen live) exits 1, not 0, when stdin closes after
  an interrupted turn; the double always exits 0 at EOF.
- The real CLI's wait for an unanswered MCP handshake has no known bound;
  the double's is ``FAKE_CLAUDE_MCP_TIMEOUT``.
- ``terminal_reason`` of an interrupted turn is always ``aborted_streaming``
  (what the real CLI reports for streaming and api_retry waits; a wait for
  a host answer was not observed).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

VERSION = os.environ.get("FAKE_CLAUDE_VERSION", "2.1.328")
DEFAULT_MODEL = "claude-sonnet-4-5"
COST_PER_CALL = 0.0001
INTERRUPTED = "[Request interrupted by user]"
PARTIAL_TEXT = "partial answer "
MODES = (
    "no_init",
    "ignore_sigterm",
    "grandchild",
    "exit_on_init",
    "stderr_banner",
    "permission_mode",
    "init_permission_mode",
    "resume_fails",
    "exit_after_interrupt",
)

BUILTIN_TOOLS = [
    "Task", "Bash", "CronCreate", "CronDelete", "CronList", "Edit", "EnterWorktree",
    "ExitWorktree", "ListAgents", "Monitor", "NotebookEdit", "Read", "ReportFindings",
    "ScheduleWakeup", "SendMessage", "Skill", "TaskStop", "ToolSearch", "WebFetch",
    "WebSearch", "Workflow", "Write",
]  # fmt: skip
CAPABILITIES = [
    "interrupt_receipt_v1", "interrupt_cancel_queued_v1", "msg_lifecycle_v1",
    "sdk_mcp_tools_list_changed", "sdk_mcp_manifests", "mcp_read_resource_v1",
]  # fmt: skip
BOOL_FLAGS = {
    "-p", "--print", "--verbose", "--strict-mcp-config", "--include-partial-messages",
    "--no-session-persistence", "--dangerously-skip-permissions", "-c", "--continue",
    "--replay-user-messages", "--fork-session", "-d", "--debug",
}  # fmt: skip
VALUE_FLAGS = {
    "--input-format", "--output-format", "--mcp-config", "--tools", "--allowedTools",
    "--allowed-tools", "--disallowedTools", "--disallowed-tools", "--permission-prompt-tool",
    "--append-system-prompt", "--append-system-prompt-file", "--system-prompt",
    "--system-prompt-file", "--model", "--fallback-model", "--max-turns", "--session-id",
    "--resume", "-r", "--setting-sources", "--settings", "--permission-mode", "--add-dir",
    "--agents",
}  # fmt: skip
_HEX = frozenset("0123456789abcdefABCDEF")


# -- low-level output -----------------------------------------------------------

_out_lock = threading.Lock()


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_raw(data: bytes) -> None:
    """Write bytes to stdout as one unit; a broken pipe ends the process quietly."""
    with _out_lock:
        try:
            _write_all(1, data)
        except OSError:
            os._exit(0)  # the host is gone


def dumps(obj: Any) -> bytes:
    try:
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # lone surrogates: escape them, as JSON.stringify does
        return json.dumps(obj, separators=(",", ":")).encode()


def emit(obj: Any) -> None:
    write_raw(dumps(obj) + b"\n")


def write_stderr(data: bytes | memoryview) -> bool:
    """Write to stderr; False if it is closed."""
    try:
        _write_all(2, data)
    except OSError:
        return False
    return True


def note(text: str) -> None:
    """A diagnostic line on stderr (``fake_claude: ...``); never fails."""
    write_stderr(f"fake_claude: {text}\n".encode(errors="replace"))


def new_uuid() -> str:
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def is_uuid(s: str) -> bool:
    if len(s) != 36:
        return False
    dashes = (8, 13, 18, 23)
    return all((c == "-") if i in dashes else (c in _HEX) for i, c in enumerate(s))


def timestamp() -> str:
    now = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"


def chunks(text: str, n: int) -> list[str]:
    """``text`` in at most ``n`` pieces (at least one, possibly empty)."""
    size = max(1, -(-len(text) // n))
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


def words(value: Any) -> list[str]:
    return [w for w in re.split(r"[,\s]+", value) if w] if isinstance(value, str) else []


def matches(matcher: Any, tool: str) -> bool:
    """Whether a hook matcher (None, "", "*", a name or a regex) covers ``tool``."""
    if matcher in (None, "", "*"):
        return True
    if not isinstance(matcher, str):
        return False
    try:
        return matcher == tool or re.fullmatch(matcher, tool) is not None
    except re.error:
        return False


def text_of(content: Any) -> str:
    """The text of a content list (or string)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(b.get("text", "") for b in content if isinstance(b, dict))


# -- command line and environment -------------------------------------------------


def parse_args(argv: list[str]) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if arg in ("--version", "-v"):
            sys.stdout.write(f"{VERSION} (Claude Code)\n")
            sys.stdout.flush()
            sys.exit(0)
        if arg.startswith("--") and "=" in arg:
            key, _, value = arg.partition("=")
            opts[key] = value
        elif arg in BOOL_FLAGS:
            opts[arg] = True
        elif arg in VALUE_FLAGS:
            if i >= len(argv):
                sys.stderr.write(f"error: option '{arg} <value>' argument missing\n")
                sys.exit(1)
            opts[arg] = argv[i]
            i += 1
        elif arg.startswith("-"):
            if i < len(argv) and not argv[i].startswith("-"):
                opts[arg] = argv[i]
                i += 1
            else:
                opts[arg] = True
        # a positional prompt is ignored: stream-json input comes on stdin
    return opts


def parse_modes(spec: str) -> dict[str, str]:
    modes: dict[str, str] = {}
    for item in spec.split(","):
        name, _, value = item.strip().partition("=")
        if name.strip():
            modes[name.strip()] = value.strip()
    for name in modes:
        if name not in MODES:
            note(f"unknown FAKE_CLAUDE_MODE {name!r} ignored")
    return modes


def spawn_grandchild() -> None:
    """A ``sleep`` in our process group that holds our stdout and stderr open."""
    seconds = os.environ.get("FAKE_CLAUDE_GRANDCHILD_SECONDS", "3600")
    actions = [(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
    try:
        pid = os.posix_spawnp("sleep", ["sleep", seconds], os.environ, file_actions=actions)
    except OSError:
        argv = [sys.executable, "-c", f"import time; time.sleep({float(seconds)})"]
        pid = os.posix_spawn(sys.executable, argv, os.environ, file_actions=actions)
    note(f"grandchild pid {pid}")


def sdk_servers(value: Any) -> list[str]:
    """Names of the ``sdk`` servers of --mcp-config (inline JSON or a file name)."""
    if not isinstance(value, str) or not value:
        return []
    try:
        config = json.loads(value)
    except ValueError:
        try:
            with open(value, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            note(f"--mcp-config unreadable: {exc}")
            return []
    servers = config.get("mcpServers") if isinstance(config, dict) else None
    if not isinstance(servers, dict):
        return []
    return [n for n, c in servers.items() if isinstance(c, dict) and c.get("type") == "sdk"]


# -- the transcript ------------------------------------------------------------------


def transcript_path(session_id: str) -> str:
    """Where the real CLI keeps this conversation: under HOME, by working folder."""
    folder = re.sub(r"[^A-Za-z0-9]", "-", os.path.realpath(os.getcwd()))
    home = os.environ.get("HOME") or "/nonexistent"
    return os.path.join(home, ".claude", "projects", folder, f"{session_id}.jsonl")


def transcript_texts(session_id: str) -> list[str]:
    """The user texts of the conversation's turns so far, in order."""
    texts: list[str] = []
    try:
        with open(transcript_path(session_id), encoding="utf-8") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(entry, dict) or entry.get("type") != "user":
                    continue
                message = entry.get("message")  # a planted transcript may hold anything
                if isinstance(message, dict):
                    texts.append(text_of(message.get("content")))
    except OSError:
        pass
    return texts


# -- the session ---------------------------------------------------------------------


class Aborted(Exception):
    """The turn was interrupted (or stdin closed while it waited for the host)."""


class Session:
    """The process: stdin reader (main thread), turn worker, MCP client threads."""

    def __init__(self, opts: dict[str, Any], modes: dict[str, str]) -> None:
        self.modes = modes
        sid = opts.get("--session-id")
        resume = opts.get("--resume", opts.get("-r"))
        self.session_id = (
            next((v for v in (sid, resume) if isinstance(v, str) and v), None) or new_uuid()
        )
        model = opts.get("--model")
        self.model = model if isinstance(model, str) and model else DEFAULT_MODEL
        mode = modes.get("permission_mode") or opts.get("--permission-mode")
        self.permission_mode = mode if isinstance(mode, str) and mode else "default"
        self.init_permission_mode = modes.get("init_permission_mode") or self.permission_mode
        self.partial = opts.get("--include-partial-messages") is True
        self.cwd = os.getcwd()
        self.key_source = "ANTHROPIC_API_KEY" if os.environ.get("ANTHROPIC_API_KEY") else "none"
        tools = opts.get("--tools")
        names = words(tools)
        if not isinstance(tools, str) or "default" in names:
            self.builtin_tools = list(BUILTIN_TOOLS)
        else:
            self.builtin_tools = names
        self.allowed = set(words(opts.get("--allowedTools", opts.get("--allowed-tools"))))
        self.ask_host = opts.get("--permission-prompt-tool") == "stdio"
        self.servers = sdk_servers(opts.get("--mcp-config"))
        # server -> {"status": "pending" | "connected" | "failed", "tools": [full names],
        #            "refreshing": tools/list requests after list_changed still running}
        self.mcp: dict[str, dict[str, Any]] = {
            s: {"status": "pending", "tools": [], "refreshing": 0} for s in self.servers
        }
        self.jsonrpc_ids: dict[str, int] = {}  # server -> next JSON-RPC id
        self.mcp_timeout = float(os.environ.get("FAKE_CLAUDE_MCP_TIMEOUT", "5"))
        self.hooks: dict[str, Any] = {}
        self.initialized = False
        # Everything below is shared between threads and guarded by cv.
        self.cv = threading.Condition()
        self.pending: set[str] = set()  # ids of our requests not yet answered
        self.responses: dict[str, dict[str, Any]] = {}  # answered: id -> response body
        self.queue: deque[str] = deque()
        self.busy = 0  # queued + running turns
        self.interrupt = False
        self.stdin_closed = False
        # Only the turn worker touches these.
        self.transcript = transcript_path(self.session_id)
        self.cost = 0.0
        self.results = 0
        self.msg_seq = 0
        self.tool_seq = 0

    # -- writing -------------------------------------------------------------------

    def record(self, role: str, text: str) -> None:
        """Append one line to the conversation's transcript (made on the first turn)."""
        entry = {
            "type": role,
            "message": {"role": role, "content": text},
            "sessionId": self.session_id,
            "timestamp": timestamp(),
        }
        try:
            os.makedirs(os.path.dirname(self.transcript), mode=0o700, exist_ok=True)
            with open(self.transcript, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry, separators=(",", ":")) + "\n")
        except OSError as exc:
            note(f"transcript not written: {exc}")

    def success(self, rid: str, response: Any = None) -> None:
        body: dict[str, Any] = {"subtype": "success", "request_id": rid}
        if response is not None:
            body["response"] = response
        emit({"type": "control_response", "response": body})

    def error(self, rid: str, text: str) -> None:
        body = {"subtype": "error", "request_id": rid, "error": text}
        emit({"type": "control_response", "response": body})

    def system(self, subtype: str, **fields: Any) -> None:
        emit(
            {
                "type": "system",
                "subtype": subtype,
                **fields,
                "session_id": self.session_id,
                "uuid": new_uuid(),
            }
        )

    def stream(self, msg_id: str, kind: str, **fields: Any) -> None:
        """A stream_event (only with --include-partial-messages)."""
        if self.partial:
            event = {"type": kind, **fields}
            emit({"type": "stream_event", "event": event, **self.meta(), "api_message_id": msg_id})

    def meta(self) -> dict[str, Any]:
        return {"parent_tool_use_id": None, "session_id": self.session_id, "uuid": new_uuid()}

    def assistant(self, msg_id: str, content: list[Any], **extra: Any) -> dict[str, Any]:
        message = {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 12, "output_tokens": 1},
            "context_management": None,
        }
        return {
            "type": "assistant",
            "message": message,
            **self.meta(),
            "timestamp": timestamp(),
            **extra,
        }

    def user(self, content: list[Any], **extra: Any) -> None:
        message = {"role": "user", "content": content}
        emit({"type": "user", "message": message, **self.meta(), "timestamp": timestamp(), **extra})

    # -- our requests to the host ------------------------------------------------------

    def send_request(self, request: dict[str, Any]) -> str:
        rid = new_uuid()
        with self.cv:
            self.pending.add(rid)
        emit({"type": "control_request", "request_id": rid, "request": request})
        return rid

    def wait_response(
        self, rid: str, *, timeout: float | None = None, interruptible: bool = True
    ) -> tuple[str, dict[str, Any]]:
        """("ok" | "error", the response body) or ("timeout" | "closed" | "interrupted", {})."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while True:
                body = self.responses.pop(rid, None)
                if body is not None:
                    return ("ok" if body.get("subtype") == "success" else "error"), body
                status = ""
                if interruptible and self.interrupt:
                    status = "interrupted"
                elif self.stdin_closed:
                    status = "closed"
                elif deadline is not None and time.monotonic() >= deadline:
                    status = "timeout"
                if status:
                    self.pending.discard(rid)
                    return status, {}
                self.cv.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def call(self, request: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Ask the host during a turn: ("ok" | "error", body); raise Aborted."""
        status, body = self.wait_response(self.send_request(request))
        if status in ("interrupted", "closed"):
            raise Aborted
        return status, body

    def sleep(self, seconds: float) -> None:
        """Sleep; raise Aborted on an interrupt (stdin EOF does not wake it)."""
        deadline = time.monotonic() + seconds
        with self.cv:
            while not self.interrupt:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(left)
        raise Aborted

    # -- stdin (the main thread) ----------------------------------------------------------

    def run(self) -> None:
        worker = threading.Thread(target=self.work, name="turns", daemon=True)
        if "no_init" not in self.modes:
            worker.start()
        stdin = sys.stdin.buffer
        while True:
            try:
                line = stdin.readline()
            except OSError:
                break
            if not line:
                break
            if "no_init" not in self.modes:
                self.handle_line(line)
        with self.cv:
            self.stdin_closed = True
            self.cv.notify_all()
        if worker.is_alive():
            worker.join()
        os._exit(0)

    def handle_line(self, line: bytes) -> None:
        stripped = line.strip()
        if not stripped:
            return
        try:
            msg = json.loads(stripped)
        except ValueError:
            note(f"ignoring malformed stdin line {stripped[:80]!r}")
            return
        if not isinstance(msg, dict):
            note(f"ignoring stdin line that is not an object {stripped[:80]!r}")
            return
        kind = msg.get("type")
        if kind == "control_request":
            self.on_control_request(msg)
        elif kind == "control_response":
            self.on_control_response(msg)
        elif kind == "user":
            self.on_user(msg)
        else:
            note(f"ignoring stdin message of type {kind!r}")

    def on_control_response(self, msg: dict[str, Any]) -> None:
        body = msg.get("response")
        rid = body.get("request_id") if isinstance(body, dict) else None
        with self.cv:
            if isinstance(body, dict) and isinstance(rid, str) and rid in self.pending:
                self.pending.discard(rid)
                self.responses[rid] = body
                self.cv.notify_all()
                return
        note(f"unmatched control_response {rid!r} ignored")

    def on_control_request(self, msg: dict[str, Any]) -> None:
        rid = msg.get("request_id")
        req = msg.get("request")
        if not isinstance(rid, str) or not isinstance(req, dict):
            note("ignoring control_request without request_id or request")
            return
        sub = req.get("subtype")
        if sub == "initialize":
            self.on_initialize(rid, req)
        elif sub == "interrupt":
            self.success(rid, {"still_queued": []})  # answered before the turn ends
            with self.cv:
                if self.busy:
                    self.interrupt = True
                    self.cv.notify_all()
        elif sub == "mcp_message":
            self.on_host_mcp(rid, req)
        elif sub == "set_model":
            model = req.get("model")
            self.model = model if isinstance(model, str) and model else DEFAULT_MODEL
            self.success(rid)
        elif sub == "set_permission_mode":
            mode = req.get("mode")
            self.permission_mode = mode if isinstance(mode, str) else self.permission_mode
            self.success(rid)
        else:
            self.error(rid, f"Unsupported control request subtype: {sub}")

    def on_initialize(self, rid: str, req: dict[str, Any]) -> None:
        if self.initialized:
            self.error(rid, "Already initialized")
            return
        self.initialized = True
        hooks = req.get("hooks")
        self.hooks = hooks if isinstance(hooks, dict) else {}
        # As the real CLI: the MCP initialize requests go out before the answer.
        params = self.mcp_init_params()
        first = {s: self.send_request(self.mcp_request(s, "initialize", params)) for s in self.mcp}
        self.success(rid, self.initialize_response())
        if "exit_on_init" in self.modes:
            os._exit(int(self.modes["exit_on_init"] or 1))
        for server, mrid in first.items():
            threading.Thread(target=self.mcp_handshake, args=(server, mrid), daemon=True).start()

    def on_host_mcp(self, rid: str, req: dict[str, Any]) -> None:
        server = req.get("server_name")
        if server not in self.mcp:
            self.error(rid, f"SDK MCP server not found: {server}")
            return
        message = req.get("message")
        method = message.get("method") if isinstance(message, dict) else None
        if method == "notifications/tools/list_changed":
            with self.cv:  # a turn that starts after this waits for the new list
                self.mcp[server]["refreshing"] += 1
            threading.Thread(target=self.mcp_refresh, args=(server,), daemon=True).start()
        self.success(rid)

    def on_user(self, msg: dict[str, Any]) -> None:
        body = msg.get("message")
        content = body.get("content") if isinstance(body, dict) else None
        if not isinstance(content, str | list):
            note("ignoring user message without content")
            return
        with self.cv:
            self.queue.append(text_of(content))
            self.busy += 1
            self.cv.notify_all()

    # -- the MCP client side of sdk servers ------------------------------------------------

    def mcp_init_params(self) -> dict[str, Any]:
        info = {
            "name": "claude-code",
            "title": "Claude Code",
            "description": "Anthropic's agentic coding tool",
            "websiteUrl": "https://claude.com/claude-code",
            "version": VERSION,
        }
        return {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": info}

    def mcp_request(self, server: str, method: str, params: Any = None) -> dict[str, Any]:
        message: dict[str, Any] = {"method": method}
        if params is not None:
            message["params"] = params
        message["jsonrpc"] = "2.0"
        if not method.startswith("notifications/"):
            with self.cv:
                message["id"] = self.jsonrpc_ids.get(server, 0)
                self.jsonrpc_ids[server] = message["id"] + 1
        return {"subtype": "mcp_message", "server_name": server, "message": message}

    def mcp_result(self, rid: str) -> Any:
        """The JSON-RPC ``result`` the host answered to ``rid`` (None if none came)."""
        status, body = self.wait_response(rid, timeout=self.mcp_timeout, interruptible=False)
        response = body.get("response") if status == "ok" else None
        reply = response.get("mcp_response") if isinstance(response, dict) else None
        return reply.get("result") if isinstance(reply, dict) else None

    def mcp_set(self, server: str, status: str, tools: list[str] | None = None) -> None:
        with self.cv:
            self.mcp[server]["status"] = status
            if tools is not None:
                self.mcp[server]["tools"] = tools
            self.cv.notify_all()

    def mcp_handshake(self, server: str, init_rid: str) -> None:
        if not isinstance(self.mcp_result(init_rid), dict):
            self.mcp_set(server, "failed")
            return
        rid = self.send_request(self.mcp_request(server, "notifications/initialized"))
        self.wait_response(rid, timeout=self.mcp_timeout, interruptible=False)
        if not self.mcp_list_tools(server):
            self.mcp_set(server, "failed")

    def mcp_list_tools(self, server: str) -> bool:
        result = self.mcp_result(self.send_request(self.mcp_request(server, "tools/list")))
        tools = result.get("tools") if isinstance(result, dict) else None
        if not isinstance(tools, list):
            return False
        names = [t["name"] for t in tools if isinstance(t, dict) and isinstance(t.get("name"), str)]
        self.mcp_set(server, "connected", [f"mcp__{server}__{n}" for n in names])
        return True

    def mcp_refresh(self, server: str) -> None:
        try:
            self.mcp_list_tools(server)
        finally:
            with self.cv:
                self.mcp[server]["refreshing"] -= 1
                self.cv.notify_all()

    def wait_mcp(self) -> None:
        """Before a turn's init: let handshakes and re-lists finish (each step has a timeout)."""

        def busy(state: dict[str, Any]) -> bool:
            return bool(state["status"] == "pending" or state["refreshing"] > 0)

        with self.cv:
            while self.initialized and not self.stdin_closed and any(map(busy, self.mcp.values())):
                self.cv.wait()
            for state in self.mcp.values():
                if state["status"] == "pending":
                    state["status"] = "failed"

    # -- what the CLI reports ----------------------------------------------------------------

    def initialize_response(self) -> dict[str, Any]:
        model = {
            "value": "default",
            "resolvedModel": self.model,
            "displayName": "Default (recommended)",
            "description": "Use the default model",
            "supportsEffort": True,
        }
        account = {
            "tokenSource": "none",
            "apiKeySource": self.key_source,
            "apiProvider": "firstParty",
        }
        return {
            "commands": [],
            "agents": [{"name": "general-purpose", "description": "General-purpose agent."}],
            "output_style": "default",
            "available_output_styles": ["default"],
            "models": [model],
            "account": account,
            "pid": os.getpid(),
            "claude_code_version": VERSION,
            "current_permission_mode": self.permission_mode,
            "hook_on_failure_supported": True,
            "analytics_disabled": True,
            "fast_mode_state": "off",
            "session_state": "idle",
            "capabilities": ["mcp_call_result_not_for_model_v1"],
        }

    def system_init(self) -> None:
        with self.cv:
            tools = list(self.builtin_tools)
            servers = []
            for name, state in self.mcp.items():
                tools += state["tools"] if state["status"] == "connected" else []
                servers.append({"name": name, "status": state["status"], "source": "sdk"})
        emit(
            {
                "type": "system",
                "subtype": "init",
                "cwd": self.cwd,
                "session_id": self.session_id,
                "tools": tools,
                "mcp_servers": servers,
                "model": self.model,
                "permissionMode": self.init_permission_mode,
                "slash_commands": ["compact", "context", "cost", "init"],
                "apiKeySource": self.key_source,
                "claude_code_version": VERSION,
                "output_style": "default",
                "agents": ["general-purpose"],
                "skills": [],
                "plugins": [],
                "capabilities": CAPABILITIES,
                "analytics_disabled": True,
                "uuid": new_uuid(),
                "original_cwd": self.cwd,
                "additional_directories": [],
                "fast_mode_state": "off",
            }
        )

    # -- the turn worker -------------------------------------------------------------------------

    def work(self) -> None:
        while True:
            with self.cv:
                while not self.queue and not self.stdin_closed:
                    self.cv.wait()
                if not self.queue:
                    return
                text = self.queue.popleft()
            try:
                Turn(self, text).run()
            except Exception:  # a bug in the double: say so and serve the next turn
                import traceback

                note(f"turn failed:\n{traceback.format_exc()}")
            finally:
                with self.cv:
                    self.busy -= 1
                    self.interrupt = False


class Turn:
    """One user turn: its simulated API calls, usage and ending."""

    def __init__(self, session: Session, text: str) -> None:
        self.s = session
        self.text = text
        self.start = time.monotonic()
        self.calls = 0
        self.denials: list[dict[str, Any]] = []
        self.msg_id = ""
        self.partial_text = ""  # streamed by a call that has not finished
        self.block_open = False
        self.earlier: list[str] = []  # user texts of the conversation's earlier turns

    def run(self) -> None:
        s = self.s
        s.wait_mcp()
        s.system_init()
        self.earlier = transcript_texts(s.session_id)
        s.record("user", self.text)
        try:
            if not self.text.startswith("/fault"):
                self.echo()
                return
            _, name, arg = [*self.text.split(None, 2), "", ""][:3]
            handler = getattr(self, f"fault_{name}", None) if name.isidentifier() else None
            if handler is None:
                note(f"unknown fault {name!r}: answering normally")
                self.echo()
                return
            try:
                handler(arg.strip())
            except ValueError as exc:  # a bad numeric argument
                self.finish(f"fault error: {exc}")
        except Aborted:
            self.aborted()

    # -- simulated API calls ----------------------------------------------------------------

    def open_call(self) -> str:
        s = self.s
        s.msg_seq += 1
        self.calls += 1
        s.cost = round(s.cost + COST_PER_CALL, 10)
        self.msg_id = msg_id = f"msg_fake{s.msg_seq:04d}"
        if s.partial:
            s.system("status", status="requesting")
        message = s.assistant(msg_id, [])["message"]
        del message["context_management"]
        s.stream(msg_id, "message_start", message=message)
        return msg_id

    def close_call(self, stop_reason: str | None) -> None:
        s, msg_id = self.s, self.msg_id
        s.stream(msg_id, "content_block_stop", index=0)
        delta = {"stop_reason": stop_reason, "stop_sequence": None}
        s.stream(msg_id, "message_delta", delta=delta, usage={"output_tokens": 5})
        s.stream(msg_id, "message_stop")
        self.block_open = False

    def text_call(self, text: str) -> None:
        s = self.s
        msg_id = self.open_call()
        s.stream(msg_id, "content_block_start", index=0, content_block={"type": "text", "text": ""})
        for piece in chunks(text, 3):
            delta = {"type": "text_delta", "text": piece}
            s.stream(msg_id, "content_block_delta", index=0, delta=delta)
        emit(s.assistant(msg_id, [{"type": "text", "text": text}]))
        self.close_call("end_turn")

    def tool_use_call(self, tool_use_id: str, name: str, args: Any) -> None:
        s = self.s
        msg_id = self.open_call()
        block = {"type": "tool_use", "id": tool_use_id, "name": name, "input": {}}
        s.stream(msg_id, "content_block_start", index=0, content_block=block)
        delta = {"type": "input_json_delta", "partial_json": json.dumps(args)}
        s.stream(msg_id, "content_block_delta", index=0, delta=delta)
        emit(s.assistant(msg_id, [{**block, "input": args}]))
        self.close_call("tool_use")

    def start_streaming(self) -> None:
        """Half a text call: with partial messages, up to its first text_delta."""
        s = self.s
        msg_id = self.open_call()
        s.stream(msg_id, "content_block_start", index=0, content_block={"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": PARTIAL_TEXT}
        s.stream(msg_id, "content_block_delta", index=0, delta=delta)
        self.partial_text = PARTIAL_TEXT
        self.block_open = True

    def half_turn(self) -> None:
        """What crash and sigkill leave behind: stream events, or a partial assistant."""
        if self.s.partial:
            self.start_streaming()
        else:
            emit(self.s.assistant(self.open_call(), [{"type": "text", "text": PARTIAL_TEXT}]))

    # -- endings ------------------------------------------------------------------------------

    def result(
        self, subtype: str, text: str | None, terminal: str | None, stop: str | None
    ) -> None:
        s = self.s
        error = subtype != "success"
        usage = {
            "input_tokens": 12 * self.calls,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 5 * self.calls,
            "server_tool_use": {"web_search_requests": 0, "web_fetch_requests": 0},
            "service_tier": "standard",
        }
        per_model = {
            "inputTokens": 12 * self.calls,
            "outputTokens": 5 * self.calls,
            "costUSD": s.cost,
            "contextWindow": 200000,
        }
        # the real CLI's field order: "type" is not first
        msg: dict[str, Any] = {
            "duration_api_ms": 7 * self.calls,
            "stop_reason": stop,
            "session_id": s.session_id,
            "total_cost_usd": s.cost,  # cumulative over the session, as the real CLI
            "usage": usage,
            "modelUsage": {s.model: per_model},
            "permission_denials": self.denials,
            "terminal_reason": terminal,
            "fast_mode_state": "off",
            "is_error": error,
            "num_turns": self.calls + (1 if error else 0),
            "subtype": subtype,
        }
        if error:
            msg["errors"] = [f"[ede_diagnostic] result_type=user stop_reason={stop}"]
        else:
            msg["api_error_status"] = None
            msg["result"] = text
        msg["type"] = "result"
        msg["duration_ms"] = int((time.monotonic() - self.start) * 1000)
        msg["uuid"] = new_uuid()
        msg["queued_turn_count"] = 0
        msg["result_index"] = s.results
        s.results += 1
        emit(msg)

    def finish(self, text: str) -> None:
        """A last API call answering ``text``, then the success result."""
        self.text_call(text)
        self.s.record("assistant", text)
        self.result("success", text, "completed", "end_turn")

    def echo(self) -> None:
        self.finish(f"echo: {self.text}")

    def aborted(self) -> None:
        """The real CLI's interrupted turn: partial text, the marker, an error result."""
        s = self.s
        if self.partial_text:
            content = [{"type": "text", "text": self.partial_text}]
            emit(s.assistant(self.msg_id, content, aborted=True))
        s.user([{"type": "text", "text": INTERRUPTED}])
        if self.block_open:
            self.close_call(None)
        if "exit_after_interrupt" in s.modes:  # as 2.1.275 between a tool and a call
            self.result("error_during_execution", None, None, None)
            os._exit(1)
        self.result("error_during_execution", None, "aborted_streaming", None)

    # -- tool plumbing -------------------------------------------------------------------------

    def new_tool_id(self) -> str:
        self.s.tool_seq += 1
        return f"toolu_fake{self.s.tool_seq:04d}{os.urandom(4).hex()}"

    def parse_tool(self, arg: str) -> tuple[str, Any] | None:
        name, _, raw = arg.partition(" ")
        if not name:
            self.finish("fault error: a tool name is needed")
            return None
        try:
            return name, (json.loads(raw) if raw.strip() else {})
        except ValueError as exc:
            self.finish(f"fault error: bad JSON arguments: {exc}")
            return None

    def hook_input(self, tool: str, args: Any, tool_use_id: str) -> dict[str, Any]:
        s = self.s
        return {
            "session_id": s.session_id,
            "transcript_path": f"{s.cwd}/.claude/projects/{s.session_id}.jsonl",
            "cwd": s.cwd,
            "permission_mode": s.permission_mode,
            "hook_event_name": "PreToolUse",
            "tool_name": tool,
            "tool_input": args,
            "tool_use_id": tool_use_id,
        }

    def hook_ids(self, tool: str | None) -> list[str]:
        """PreToolUse callback ids registered in initialize (matching ``tool`` if given)."""
        entries = self.s.hooks.get("PreToolUse")
        ids: list[str] = []
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and (tool is None or matches(entry.get("matcher"), tool)):
                ids += [i for i in entry.get("hookCallbackIds") or [] if isinstance(i, str)]
        return ids

    def pre_tool_hooks(self, tool: str, args: Any, tool_use_id: str) -> str | None:
        """Call the matching PreToolUse callbacks; the reason if one blocked the tool."""
        for cid in self.hook_ids(tool):
            request = {
                "subtype": "hook_callback",
                "callback_id": cid,
                "input": self.hook_input(tool, args, tool_use_id),
                "tool_use_id": tool_use_id,
            }
            status, body = self.s.call(request)
            out = body.get("response") if status == "ok" else None
            if not isinstance(out, dict):
                continue
            specific = out.get("hookSpecificOutput")
            specific = specific if isinstance(specific, dict) else {}
            decision = specific.get("permissionDecision")
            if out.get("decision") == "block" or out.get("continue") is False or decision == "deny":
                why = specific.get("permissionDecisionReason") or out.get("reason")
                return str(why or out.get("stopReason") or "blocked by hook")
        return None

    def can_use_tool(self, tool: str, args: Any, tool_use_id: str) -> tuple[bool, str]:
        request = {
            "subtype": "can_use_tool",
            "tool_name": tool,
            "input": args,
            "permission_suggestions": [],
            "tool_use_id": tool_use_id,
        }
        status, body = self.s.call(request)
        if status != "ok":
            return False, str(body.get("error") or "permission request failed")
        answer = body.get("response")
        answer = answer if isinstance(answer, dict) else {}
        if answer.get("behavior") == "allow":
            return True, ""
        return False, str(answer.get("message") or "denied")

    def tool_result(self, tool_use_id: str, content: list[Any], is_error: bool) -> None:
        block: dict[str, Any] = {"tool_use_id": tool_use_id, "type": "tool_result"}
        block["content"] = content
        if is_error:
            block["is_error"] = True
        self.s.user([block], tool_use_result=content)

    def refuse(self, tool: str, args: Any, tool_use_id: str, why: str, reply: str) -> None:
        self.tool_result(tool_use_id, [{"type": "text", "text": why}], True)
        self.finish(reply)

    # -- faults ---------------------------------------------------------------------------------

    def fault_huge_line(self, arg: str) -> None:
        size = int(arg or "0")
        marker = "FAKE-CLAUDE-FILL-MARKER"
        msg = self.s.assistant(f"msg_huge{self.s.msg_seq:04d}", [{"type": "text", "text": marker}])
        head, _, tail = dumps(msg).partition(marker.encode())
        fill = max(0, size - len(head) - len(tail))
        block = memoryview(b"x" * (1 << 20))
        with _out_lock:
            try:
                _write_all(1, head)
                while fill > 0:
                    n = min(fill, len(block))
                    _write_all(1, block[:n])
                    fill -= n
                _write_all(1, tail + b"\n")
            except OSError:
                os._exit(0)  # the host is gone
        self.echo()

    def fault_stderr_flood(self, arg: str) -> None:
        left = int(arg or "0")
        line = b"stderr flood: a host that does not drain stderr blocks this write\n"
        block = memoryview((line * (65536 // len(line) + 1))[:65536])
        while left > 0:
            n = min(left, len(block))
            if not write_stderr(block[:n]):
                break
            left -= n
        self.echo()

    def fault_garbage(self, arg: str) -> None:
        write_raw(
            b"this is not json\n"
            b"<html><body>502 Bad Gateway</body></html>\n"
            b"\n"
            b"\xff\xfe not utf-8 \xc3\x28\n"
            b"[1,2,3]\n"
            b'{"type":"assistant","message":{"id":"msg_trunc","content":[{"type":"te\n'
        )
        self.echo()

    def fault_unknown(self, arg: str) -> None:
        s = self.s
        info = {
            "status": "allowed",
            "resetsAt": int(time.time()) + 3600,
            "rateLimitType": "five_hour",
        }
        emit(
            {
                "type": "rate_limit_event",
                "rate_limit_info": info,
                "uuid": new_uuid(),
                "session_id": s.session_id,
            }
        )
        s.system("brand_new", detail={"level": 3})
        content = [
            {"type": "brand_new_block", "payload": {"a": 1}},
            {"type": "text", "text": "after the unknown block"},
        ]
        msg = s.assistant("msg_unknown", content, brand_new_top_field={"nested": [1, 2]})
        msg["message"]["brand_new_body_field"] = "surprise"
        emit(msg)
        self.echo()

    def fault_history(self, arg: str) -> None:
        self.finish(f"history: {len(self.earlier)}: {' | '.join(self.earlier)}")

    def fault_crash(self, arg: str) -> None:
        code = int(arg or "1")
        self.half_turn()
        os._exit(code)

    def fault_sigkill(self, arg: str) -> None:
        self.half_turn()
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # not reached

    def fault_hang(self, arg: str) -> None:
        self.start_streaming()
        with self.s.cv:
            while not (self.s.interrupt or self.s.stdin_closed):
                self.s.cv.wait()
        raise Aborted

    def fault_api_retry_401(self, arg: str) -> None:
        s = self.s
        interval = float(arg or "0.3")
        if s.partial:
            s.system("status", status="requesting")
        attempt = 0
        while True:
            attempt += 1
            delay = min(500 * 2 ** min(attempt - 1, 10), 32000) + 33 * attempt
            s.system(
                "api_retry",
                attempt=attempt,
                max_retries=10,
                retry_delay_ms=delay,
                error_status=401,
                error="authentication_failed",
            )
            s.sleep(interval)

    def fault_tool(self, arg: str) -> None:
        parsed = self.parse_tool(arg)
        if parsed is None:
            return
        name, args = parsed
        s = self.s
        server = s.servers[0] if s.servers else "sage"
        full = f"mcp__{server}__{name}"
        tool_use_id = self.new_tool_id()
        self.tool_use_call(tool_use_id, full, args)
        blocked = self.pre_tool_hooks(full, args, tool_use_id)
        if blocked is not None:
            self.refuse(full, args, tool_use_id, blocked, f"tool blocked: {blocked}")
            return
        rules = s.allowed
        if s.ask_host and not ({full, f"mcp__{server}", f"mcp__{server}__*"} & rules):
            ok, why = self.can_use_tool(full, args, tool_use_id)
            if not ok:
                self.denials.append(
                    {"tool_name": full, "tool_use_id": tool_use_id, "tool_input": args}
                )
                self.refuse(full, args, tool_use_id, why, f"tool denied: {why}")
                return
        request = s.mcp_request(server, "tools/call", {"name": name, "arguments": args})
        meta = {"claudecode/toolUseId": tool_use_id, "progressToken": request["message"]["id"]}
        request["message"]["params"]["_meta"] = meta
        status, body = s.call(request)
        response = body.get("response") if status == "ok" else None
        reply = response.get("mcp_response") if isinstance(response, dict) else None
        result = reply.get("result") if isinstance(reply, dict) else None
        if isinstance(result, dict):
            raw = result.get("content")
            content = raw if isinstance(raw, list) else []
            is_error = bool(result.get("isError"))
        else:
            reason: Any
            if status != "ok":
                reason = body.get("error")
            elif isinstance(reply, dict) and isinstance(reply.get("error"), dict):
                reason = reply["error"].get("message")
            else:
                reason = "no result"
            content, is_error = [{"type": "text", "text": str(reason)}], True
        self.tool_result(tool_use_id, content, is_error)
        text = text_of(content)
        self.finish(f"tool error: {text}" if is_error else f"tool: {text}")

    def fault_ask(self, arg: str) -> None:
        parsed = self.parse_tool(arg)
        if parsed is None:
            return
        name, args = parsed
        tool_use_id = self.new_tool_id()
        self.tool_use_call(tool_use_id, name, args)
        blocked = self.pre_tool_hooks(name, args, tool_use_id)
        if blocked is not None:
            self.refuse(name, args, tool_use_id, blocked, f"tool blocked: {blocked}")
            return
        ok, why = self.can_use_tool(name, args, tool_use_id)
        if ok:
            self.tool_result(tool_use_id, [{"type": "text", "text": "allowed"}], False)
            self.finish("allowed")
        else:
            self.denials.append({"tool_name": name, "tool_use_id": tool_use_id, "tool_input": args})
            self.refuse(name, args, tool_use_id, why, f"denied: {why}")

    def fault_hook(self, arg: str) -> None:
        try:
            extra = json.loads(arg) if arg else {}
        except ValueError as exc:
            self.finish(f"fault error: bad JSON: {exc}")
            return
        tool_use_id = self.new_tool_id()
        payload = self.hook_input("mcp__sage__greet", {}, tool_use_id)
        if isinstance(extra, dict):
            payload.update(extra)
        cid = (self.hook_ids(None) or ["hook_0"])[0]
        request = {
            "subtype": "hook_callback",
            "callback_id": cid,
            "input": payload,
            "tool_use_id": tool_use_id,
        }
        status, body = self.s.call(request)
        if status == "ok":
            answer = json.dumps(body.get("response"), separators=(",", ":"), ensure_ascii=False)
            self.finish(f"hook: {answer}")
        else:
            self.finish(f"hook error: {body.get('error')}")

    def fault_cancel(self, arg: str) -> None:
        """A can_use_tool the double withdraws after ARG seconds (default 0.3) with a
        control_cancel_request; the host must then write nothing for it."""
        delay = float(arg) if arg else 0.3
        tool_use_id = self.new_tool_id()
        rid = self.s.send_request(
            {
                "subtype": "can_use_tool",
                "tool_name": "mcp__sage__greet",
                "input": {"name": "cancelled"},
                "tool_use_id": tool_use_id,
                "permission_suggestions": [],
            }
        )
        status, _ = self.s.wait_response(rid, timeout=delay)
        if status != "timeout":
            self.finish(f"cancel: answered before the cancel ({status})")
            return
        with self.s.cv:
            self.s.pending.add(rid)  # still listen: an answer now would be a host bug
        emit({"type": "control_cancel_request", "request_id": rid})
        status, _ = self.s.wait_response(rid, timeout=1.0)
        self.finish("cancel: no answer" if status == "timeout" else f"cancel: answered ({status})")

    def fault_unknown_request(self, arg: str) -> None:
        status, body = self.s.call({"subtype": "brand_new_request", "detail": {"x": 1}})
        if status == "ok":
            self.finish("unknown_request: ok")
        else:
            self.finish(f"unknown_request error: {body.get('error')}")


def main(argv: list[str]) -> None:
    opts = parse_args(argv)
    sid = opts.get("--session-id")
    if sid is not None and not (isinstance(sid, str) and is_uuid(sid)):
        sys.stderr.write("Error: Invalid session ID. Must be a valid UUID.\n")
        sys.stderr.flush()
        sys.exit(1)
    modes = parse_modes(os.environ.get("FAKE_CLAUDE_MODE", ""))
    if "stderr_banner" in modes:
        write_stderr(b"apiKeyHelper failed: exited 1\n")
    if "ignore_sigterm" in modes:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "grandchild" in modes:
        spawn_grandchild()
    resume = opts.get("--resume", opts.get("-r"))
    if isinstance(resume, str) and (
        "resume_fails" in modes or not os.path.isfile(transcript_path(resume))
    ):
        no_transcript(resume)
    Session(opts, modes).run()


def no_transcript(session_id: str) -> None:
    """What the real CLI does for ``--resume`` of a conversation it has no transcript of."""
    message = f"No conversation found with session ID: {session_id}"
    result = {
        "type": "result",
        "subtype": "error_during_execution",
        "duration_ms": 0,
        "duration_api_ms": 0,
        "is_error": True,
        "num_turns": 0,
        "stop_reason": None,
        "session_id": session_id,
        "total_cost_usd": 0,
        "permission_denials": [],
        "uuid": new_uuid(),
        "errors": [message],
    }
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    write_stderr(message.encode())
    sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
