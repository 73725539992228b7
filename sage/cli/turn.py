"""``astrid sage send``: send one turn and follow it to its ``done``, without an event loop.

A person's turn is the command most often started, so it starts as ``astrid
status`` does: :class:`bus.blocking.BlockingClient` in the calling thread, no
anyio, no asyncio (importing them, and with them ``ssl``, cost more than the
rest of the command).  The turn's events, Ctrl-C and the answers typed at an
approval question are three things to wait for at once; a selector waits on
the bus socket and on one socketpair that both the signal (``set_wakeup_fd``)
and the question's thread write to.

Ctrl-C interrupts the turn (the session stays ready), a second one detaches
at once; an approval the turn needs is asked at the terminal, denied, or left
to ``astrid sage approve`` (``--approve``).  What it prints is
:data:`NOTES`' lines on stderr, the reply on stdout (``--json``: every event).
"""

from __future__ import annotations

import argparse
import contextlib
import queue
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from bus.blocking import BlockingClient, answer
from bus.errors import BusError, NoResponders
from bus.wire import Msg, Result, ServerFrame
from sage import replies
from sage.cli._common import printable
from sage.cli._connect import blocking, config_of, print_json
from sage.contract.sessions import turn_size, turn_too_large
from sage.errors import SageError
from sage.replies import ReplyError

__all__ = (
    "EXIT_SESSION_ENDED",
    "EXIT_TURN_FAILED",
    "NOTES",
    "WAKE_TIMEOUT",
    "ask",
    "event_line",
    "send",
)

WAKE_TIMEOUT = 180.0
"""Seconds a send (or ``watch --wake``) waits for its answer: a hibernated session is
woken first, which may wait for a live slot (``[sessions] wake_wait``, at most 60 s) and
for its new child's ``initialize`` (``[limits] init_timeout``)."""
EXIT_TURN_FAILED = 3
"""``send``'s exit code for a turn that ran and failed (the reason on stderr)."""
EXIT_SESSION_ENDED = 4
"""``send``'s exit code for a session that ended during the turn."""
EXIT_INTERRUPTED = 130
EXIT_TIMED_OUT = 124  # as timeout(1)
ARGS_SHOWN = 120  # characters of a tool call's arguments send prints
_SIGINT = bytes([signal.SIGINT])  # what set_wakeup_fd writes for a Ctrl-C
_ANSWERED = b"a"  # what the question's thread writes when a person answered


def send(args: argparse.Namespace) -> int:
    """``astrid sage send SID TEXT``: the handler."""
    text = sys.stdin.read() if args.text == "-" else args.text
    sid = args.session
    size, limit = turn_size(text), config_of(args).limits.stdin_quota
    if size > limit:  # the runner refuses it too; say so before anything is sent
        raise SageError(
            f"payload_too_large: {turn_too_large(size, limit)}", code="payload_too_large"
        )
    approve = args.approve or ("prompt" if sys.stdin.isatty() else "deny")
    with blocking(args) as client, _wakeups() as (wake, twin):
        events = client.subscribe(f"sage.v1.event.{sid}.>")
        if approve != "deny":  # present as this session's approver: calls wait for us
            client.subscribe(f"sage.v1.approver.{sid}")
        # Ctrl-C is ours from before the turn is sent: its first text may already be here
        sent, route = call_session(client, "send", sid, {"text": text}, WAKE_TIMEOUT)
        turn = _Turn(client, (wake, twin), sid, int(sent.get("turn") or 0), route=route)
        turn.json = bool(args.json)
        turn.approve = approve
        return turn.follow(events, args.timeout or None)


def call_session(
    client: BlockingClient, verb: str, sid: str, payload: Any, deadline: float
) -> tuple[dict[str, Any], str]:
    """A request about session ``sid``, as :func:`sage.cli.sage_cmd.call_session` asks it
    (the local runner and the fleet's router at once; the runner's answer wins unless it
    is ``unknown_session``); the reply, and which of the two answered (its topic prefix,
    for the requests that follow about the same session)."""
    local, fleet = f"sage.v1.request.{verb}.{sid}", f"sage.v1.request.fleet.{verb}.{sid}"
    runner = client.begin(local, payload, deadline=deadline)
    router = client.begin(fleet, payload, deadline=deadline + 5.0)
    try:
        return replies.parse(client.result(runner, deadline).payload), "sage.v1.request"
    except NoResponders:
        raise SageError(
            "no session runner is running (is `runner` in supervisor.capsules?)"
        ) from None
    except ReplyError as exc:
        if exc.code != "unknown_session":
            raise
        try:  # a session of another node: the router forwarded it
            found = replies.parse(client.result(router, deadline + 5.0).payload)
        except NoResponders:  # not in a fleet: the runner's answer stands
            raise exc from None
        return found, "sage.v1.request.fleet"


@contextlib.contextmanager
def _wakeups() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A socket that becomes readable at a Ctrl-C (the signal's wakeup fd) or when a
    thread writes to its twin (the second); SIGINT raises nothing while they are open."""
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    before = signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    try:
        yield reader, writer
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, before)
        reader.close()
        writer.close()


class _Turn:
    """One sent turn: prints its events, ends at its ``done``."""

    def __init__(
        self,
        client: BlockingClient,
        wake: tuple[socket.socket, socket.socket],
        sid: str,
        number: int,
        *,
        route: str,
    ) -> None:
        self.client = client
        self.wake, self.twin = wake
        self.sid = sid
        self.number = number  # events of earlier turns still running are not ours
        self.route = route  # where requests about the session go: its node's runner
        self.json = False
        self.approve = "deny"  # prompt | deny | ask
        self.interrupted = False
        self.questions: list[dict[str, Any]] = []  # approvals to ask, one at a time
        self.asking = False
        self.answers: queue.SimpleQueue[tuple[str, dict[str, Any] | None]] = queue.SimpleQueue()
        self.calls: dict[int, Callable[[Result], None]] = {}

    def follow(self, events: int, timeout: float | None) -> int:
        """Print the turn's events until its end; its exit code."""
        end = None if timeout is None else time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(self.client.fileno(), selectors.EVENT_READ, "bus")
            selector.register(self.wake, selectors.EVENT_READ, "wake")
            frames = self.client.take()  # what came while the send was answered
            while True:
                for frame in frames:
                    code = self._frame(frame, events)
                    if code is not None:
                        return code
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    print(
                        f"\nastrid: the turn did not end within {timeout:g} s;"
                        f" session {self.sid} goes on",
                        file=sys.stderr,
                    )
                    return EXIT_TIMED_OUT
                frames = []
                for key, _ in selector.select(left):
                    if key.data == "bus":
                        frames = self.client.receive(0.0)
                    elif self._woken():
                        print(f"astrid: detached; session {self.sid} goes on", file=sys.stderr)
                        return EXIT_INTERRUPTED

    def _frame(self, frame: ServerFrame, events: int) -> int | None:
        if isinstance(frame, Result):
            call = self.calls.pop(frame.rid, None)
            if call is not None:
                call(frame)
            return None  # else an answer nobody waits for (the router's, dropped)
        if isinstance(frame, Msg) and frame.sid == events:
            envelope = frame.env.to_envelope()
            name = envelope.topic.rsplit(".", 1)[1]
            return self._event(name, envelope.ts, msgspec.json.decode(envelope.payload))
        return None  # the approver subscription's requests: being present is its use

    def _event(self, name: str, ts: float, data: Any) -> int | None:
        out = sys.stdout
        if name in ("text", "done") and int(data.get("turn") or self.number) < self.number:
            return None  # the tail of an earlier turn of this session
        if self.json:
            print_json(event_line(name, ts, data))
        elif name == "text":
            out.write(data.get("delta", ""))
            out.flush()
        elif name in NOTES:
            print(NOTES[name](data), file=sys.stderr, flush=True)
            if name == "approval" and data.get("source") == "no_approver":
                print(
                    "  (astrid sage send --approve prompt|ask waits for an answer)",
                    file=sys.stderr,
                    flush=True,
                )
        if name == "approval_request":
            self._approval(data)
        if name == "done":
            if not self.json:
                out.write("\n")
            if self.interrupted:
                print(f"astrid: turn {self.number} interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            if data.get("is_error"):
                reason = data.get("reason") or data.get("subtype") or "failed"
                said = f": {printable(str(data['message']))}" if data.get("message") else ""
                print(f"astrid: the turn failed: {reason}{said}", file=sys.stderr)
                return EXIT_TURN_FAILED
            return 0
        if name in ("exited", "error"):
            print(f"astrid: session {self.sid}: {data.get('reason')}", file=sys.stderr)
            return EXIT_SESSION_ENDED if name == "exited" else EXIT_TURN_FAILED
        return None

    def _woken(self) -> bool:
        """Read the wakeups: Ctrl-Cs and answers typed.  True: detach now."""
        with contextlib.suppress(BlockingIOError):
            while data := self.wake.recv(256):
                for byte in data:
                    if bytes([byte]) == _SIGINT and self._ctrl_c():
                        return True
        while not self.answers.empty():
            cid, reply = self.answers.get()
            self.asking = False
            if reply is not None:
                self._answer(cid, reply)
            self._next_question()
        return False

    def _ctrl_c(self) -> bool:
        if self.interrupted:  # a second Ctrl-C: leave the turn to itself
            return True
        self.interrupted = True
        print(
            "\nastrid: interrupting the turn (Ctrl-C again to detach)", file=sys.stderr, flush=True
        )
        self._call(f"{self.route}.interrupt.{self.sid}", {}, "interrupt failed")
        return False

    def _approval(self, request: dict[str, Any]) -> None:
        """Answer an approval this turn needs: ask at the terminal, deny, or leave it."""
        cid = str(request.get("approval_id", ""))
        if self.approve == "ask":
            print(
                f"[approval] waiting: `astrid sage approve {cid}` or `astrid sage deny {cid}`",
                file=sys.stderr,
                flush=True,
            )
        elif self.approve == "deny":  # another approver made it wait: answer for us
            self._answer(cid, {"allowed": False, "reason": "denied: nobody to ask"})
        else:
            self.questions.append(request)
            self._next_question()

    def _next_question(self) -> None:
        """Ask the next question in a daemon thread (``input`` blocks; a question left
        open when the turn ends must not keep astrid waiting for a line at exit)."""
        if self.asking or not self.questions:
            return
        request = self.questions.pop(0)
        self.asking = True
        twin = self.twin

        def run() -> None:
            reply = None
            try:
                reply = ask(request)
            finally:
                self.answers.put((str(request.get("approval_id", "")), reply))
                with contextlib.suppress(OSError):  # the turn may be over: nobody waits
                    twin.send(_ANSWERED)

        threading.Thread(target=run, name="astrid-approval", daemon=True).start()

    def _answer(self, cid: str, reply: dict[str, Any]) -> None:
        self._call(f"sage.v1.request.approve.{cid}", reply, "the answer was not taken")

    def _call(self, topic: str, payload: Any, failed: str) -> None:
        """A request whose answer the loop takes as it comes; a failure is one line."""

        def done(frame: Result) -> None:
            try:
                replies.parse(answer(frame).payload)
            except (SageError, BusError) as exc:
                print(f"astrid: {failed}: {exc}", file=sys.stderr, flush=True)

        try:
            self.calls[self.client.begin(topic, payload, deadline=10.0)] = done
        except BusError as exc:
            print(f"astrid: {failed}: {exc}", file=sys.stderr, flush=True)


def ask(request: dict[str, Any], *, where: bool = False) -> dict[str, Any] | None:
    """The approval question at the terminal (run in a thread: input blocks); ``where``:
    name the session and principal (``approvals --watch`` asks for many)."""
    tool = str(request.get("tool_name", "?"))
    args = msgspec.json.encode(request.get("arguments", {})).decode()
    if len(args) > ARGS_SHOWN:
        args = args[: ARGS_SHOWN - 3] + "..."
    left = max(0.0, float(request.get("expires_at") or 0.0) - time.time())
    principal = request.get("principal_id", "")
    session = printable(f" in session {request.get('session_id')} of {principal}") if where else ""
    sys.stderr.write(
        f"\n[approval] Claude wants to run {tool} {args}{session}\n"
        f"  y = yes, a = yes, and always for {principal} ({tool}), n = no"
        f" ({left:.0f} s to answer)\n"
    )
    while True:
        sys.stderr.write("allow? [y/a/n] ")
        sys.stderr.flush()
        try:
            line = sys.stdin.readline()
        except (OSError, ValueError):
            return None
        if not line:
            return None  # the terminal closed: leave it to time out
        choice = line.strip().lower()
        if choice in ("y", "yes"):
            return {"allowed": True}
        if choice in ("a", "always"):
            return {"allowed": True, "always": True}
        if choice in ("n", "no"):
            sys.stderr.write("reason (optional, Enter for none): ")
            sys.stderr.flush()
            reason = sys.stdin.readline().strip()
            return {"allowed": False, **({"reason": reason} if reason else {})}


def event_line(name: str, ts: float | None, data: Any) -> dict[str, Any]:
    """One session event as ``send --json`` and ``watch`` both print it."""
    return {"event": name, "ts": ts or time.time(), "data": data}


def age(seconds: float) -> str:
    """A duration as the listing shows it: ``42s``, ``12m``, ``3h``."""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h"


def _tool_use(data: dict[str, Any]) -> str:
    args = data.get("input_preview") or msgspec.json.encode(data.get("input", {})).decode()
    if len(args) > ARGS_SHOWN:
        args = args[: ARGS_SHOWN - 3] + "..."
    return f"[tool] {data.get('name', '?')} {args}"


def _tool_result(data: dict[str, Any]) -> str:
    took = data.get("duration_ms")
    when = f" ({took} ms)" if took is not None else ""
    return f"[tool] {data.get('name') or data.get('tool_use_id')} {'error' if data.get('is_error') else 'ok'}{when}"


def retry_line(data: dict[str, Any]) -> str:
    """An API retry, one line: ``[api] retrying (A/M): ERROR (HTTP S), next try in N s``."""
    status = f" (HTTP {data['status']})" if data.get("status") else ""
    delay = (data.get("delay_ms") or 0) / 1000
    return (
        f"[api] retrying ({data.get('attempt')}/{data.get('max_retries')}):"
        f" {data.get('error') or 'error'}{status}, next try in {delay:.1f} s"
    )


def _waking(data: dict[str, Any]) -> str:
    since = data.get("hibernated_at")
    ago = f" (hibernated {age(time.time() - float(since))} ago)" if since else ""
    return f"[session] resuming {data.get('session_id', '')}{ago}"


def _approval_line(data: dict[str, Any]) -> str:
    source = str(data.get("source", ""))
    if source == "timeout":
        verdict = "timed out: denied"
    elif data.get("allowed"):
        verdict = f"allowed by the rule {data['rule']}" if data.get("rule") else "allowed"
    else:
        reason = data.get("reason") or ""
        verdict = "denied" + (f": {reason}" if reason else "")
    return f"[approval] {data.get('tool_name')} {verdict}"


def _budget_warning(data: dict[str, Any]) -> str:
    return (
        f"astrid: principal {printable(data.get('principal_id', ''))} has used 80% of its"
        f" budget_{printable(data.get('budget', ''))} ({data.get('spent')} of {data.get('limit')})"
    )


def _budget_exceeded(data: dict[str, Any]) -> str:
    return f"astrid: {printable(data.get('message', 'over a budget'))}"


NOTES: dict[str, Callable[[dict[str, Any]], str]] = {
    "tool_use": _tool_use,
    "tool_result": _tool_result,
    "retry": retry_line,
    "approval": _approval_line,
    "waking": _waking,
    "budget_warning": _budget_warning,
    "budget_exceeded": _budget_exceeded,
}
"""Events send prints on stderr, one line each, beside the reply on stdout."""
