"""``astrid-emit``: the command Claude Code runs for a hook; forwards it to the bus.

The installer writes it as the command hooks of REPL principals (a headless
session's hooks come in-band and start no process).  It reads the hook
payload JSON on stdin, takes the principal, session and per-session token
from ``ASTRID_PRINCIPAL_ID`` / ``ASTRID_SESSION_ID`` / ``ASTRID_HOOK_TOKEN``,
and publishes ``{hook, payload, correlation_id, principal_id, session_id,
token, truncated?}`` on ``sage.v1.hook.<event>`` over the supervisor's socket
(``ASTRID_SOCKET``, else the configured one).  The claims are checked by the
supervisor (the token), not trusted.

Claude waits for every hook, so this starts fast: the standard library's C
modules only (``_socket``, ``_json``, ``_thread``, ``select``; and
:mod:`sage.errors`, which imports nothing), no ``argparse``,
no event loop, no ``msgspec``; it speaks the bus's wire protocol itself
(:mod:`bus.wire`: 4-byte big-endian length, one JSON object per frame):
``hello`` (role ``emit``), its ``welcome``, then ``pub`` and ``ping``, and waits
for the ``pong`` that says the publish was handled (an ``err`` before it is
reported), as :meth:`bus.BusClient.flush` does.  A hook input that is valid
JSON is sent as its own text, never decoded and encoded again.  Only the
config file (no ``ASTRID_SOCKET``, which every session's environment sets)
imports more: :func:`sage.config.load_config`.

It always exits 0, and soon: Claude reads a hook's exit 2 as "block the
action" and any other non-zero status as a hook error, so a hook must never
hang or break Claude, whatever its input and even when the supervisor is
down or hung.  Bounds:

- stdin: read for at most :data:`STDIN_DEADLINE` seconds and
  :data:`STDIN_LIMIT` bytes; an input cut by either, or whose JSON is over
  :data:`PAYLOAD_LIMIT` bytes, is not sent: ``payload`` is null and
  ``truncated`` true (the hook still counts as fired).  Input that is not
  JSON (binary, nested past the decoder's depth, ``NaN``, a lone surrogate)
  is sent as a string.
- the bus: :data:`DEADLINE` seconds to connect, say hello and publish.
- everything: a watchdog ends the process with status 0 after
  :data:`HARD_DEADLINE` seconds, whatever is stuck.

Nothing is ever written to stdout (Claude parses a hook's stdout) but the
``--help`` text; what went wrong goes to stderr, one line.
"""

from __future__ import annotations

import _json
import _socket
import _thread
import os
import select
import sys
import time

from sage.errors import SageError  # the one error tree: itself the standard library only

TYPE_CHECKING = False  # typing itself imports re, enum and collections: not at run time
if TYPE_CHECKING:
    from collections.abc import Sequence
    from typing import Any

__all__ = (
    "DEADLINE",
    "HARD_DEADLINE",
    "PAYLOAD_LIMIT",
    "STDIN_DEADLINE",
    "STDIN_LIMIT",
    "envelope",
    "main",
    "payload_json",
)

DEADLINE = 2.0
"""Seconds to connect, say hello and publish."""
STDIN_DEADLINE = 2.0
"""Seconds to read the hook input (Claude writes it at once and closes stdin)."""
STDIN_LIMIT = 4 * 1024 * 1024
"""Bytes of hook input read; a longer one is not sent (``truncated``)."""
HARD_DEADLINE = 6.0
"""Seconds after which the watchdog ends the process, status 0, whatever is stuck."""
PAYLOAD_LIMIT = 64 * 1024
"""Bytes of hook input JSON sent; a larger one is left out (``truncated``), as the
hooks capsule would drop it (:data:`sage.claude.hooks.PAYLOAD_LIMIT`, the same)."""
TOPIC_PREFIX = "sage.v1.hook."
MAX_FRAME = 1024 * 1024
"""Bytes of a server frame read at most (the emitter expects a few small ones)."""
_EVENT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_WHITESPACE = " \t\n\r"
_quote = _json.encode_basestring_ascii
USAGE = """usage: astrid-emit [-h] [--event EVENT] [--config CONFIG] [EVENT]

Forward a Claude Code hook (payload on stdin) to the sage bus. Always exits 0.

positional arguments:
  EVENT            hook event name, as the installer writes it (same as --event)

options:
  -h, --help       show this help message and exit
  --event EVENT, --topic EVENT
                   hook event name (default: hook_event_name from the payload)
  --config CONFIG  supervisor.toml (for the socket path)
"""


class Undelivered(SageError):
    """The bus did not take the hook; the message says why."""

    code = "hook_undelivered"


def _say(message: str) -> None:
    """One line on stderr, if there is one (never stdout: Claude parses it)."""
    try:  # noqa: SIM105 - contextlib would cost the start an import
        os.write(2, (message + "\n").encode(errors="replace"))
    except OSError:
        pass


def _watchdog(seconds: float) -> None:
    def expire() -> None:
        time.sleep(seconds)
        _say(f"astrid-emit: gave up after {seconds:g} s; nothing more sent")
        os._exit(0)

    _thread.start_new_thread(expire, ())


# -- JSON, with the C scanner the json package uses (without importing it) --------


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: the bus refuses them


class _Context:
    """What ``_json.make_scanner`` reads of ``json.JSONDecoder``: its defaults, and no
    ``NaN``/``Infinity``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = staticmethod(_refuse_constant)


# typeshed types the argument as the scanner class itself; any object with these does
_scan = _json.make_scanner(_Context())  # type: ignore[arg-type]


def _decode(text: str) -> Any:
    """The JSON value ``text`` holds; ValueError (or RecursionError) if it holds none.

    The C scanner alone decides a valid text.  On anything else it reports
    through ``json.decoder`` (when that is not imported it returns an error
    without an exception: a SystemError), so a text it refuses is decided by
    ``json.loads`` (imported then: a hook input is JSON as a rule)."""
    start = len(text) - len(text.lstrip(_WHITESPACE))
    try:
        value, end = _scan(text, start)
        if not text[end:].strip(_WHITESPACE):
            return value
    except RecursionError:
        raise
    except Exception:  # json.loads below says what is wrong
        pass
    import json

    return json.loads(text, parse_constant=_refuse_constant)


def payload_json(raw: bytes) -> bytes:
    """The hook input as JSON text for the envelope: its own text when it is one JSON
    value the bus takes, else the input as a JSON string; never raises."""
    if not raw.strip():
        return b"{}"
    try:
        text = raw.decode()
        _decode(text)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        return _quote(raw.decode(errors="replace")).encode()
    if "\\u" not in text:
        return raw
    # an escape might be a lone surrogate, which the bus refuses: say it in UTF-8
    # (json is imported for this rare input only)
    import json

    try:
        return json.dumps(json.loads(text), ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # a lone surrogate cannot be UTF-8
        return _quote(text).encode()


def envelope(event: str, payload: bytes | None) -> bytes:
    """The JSON text of the hook envelope; ``payload`` None: left out (``truncated``)."""
    env = os.environ
    fields = (
        b'{"hook":%s,"payload":%s,"correlation_id":null,"principal_id":%s,'
        b'"session_id":%s,"token":%s'
        % (
            _quote(event).encode(),
            b"null" if payload is None else payload,
            _quote(env.get("ASTRID_PRINCIPAL_ID", "")).encode(),
            _quote(env.get("ASTRID_SESSION_ID", "")).encode(),
            _quote(env.get("ASTRID_HOOK_TOKEN", "")).encode(),
        )
    )
    return fields + (b',"truncated":true}' if payload is None else b"}")


# -- the wire (bus/wire.py): a 4-byte big-endian length, then a JSON object ---------


def _frame(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


HELLO = _frame(b'{"t":"hello","role":"emit","version":1,"name":"astrid-emit"}')
PING = _frame(b'{"t":"ping","n":1}')


def publish_frames(topic: str, env: bytes) -> bytes:
    """The ``pub`` of ``env`` on ``topic``, then the ``ping`` whose ``pong`` confirms it."""
    return _frame(b'{"t":"pub","topic":%s,"payload":%s}' % (_quote(topic).encode(), env)) + PING


class _Connection:
    """A blocking Unix-socket connection with one deadline for everything."""

    def __init__(self, path: str, deadline: float) -> None:
        self.deadline = deadline
        self.buffer = b""
        self.sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        self._arm()
        self.sock.connect(path)

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out")
        self.sock.settimeout(left)

    def send(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)

    def frame(self) -> dict[str, Any]:
        """The next frame from the server, decoded."""
        while True:
            if len(self.buffer) >= 4:
                size = int.from_bytes(self.buffer[:4], "big")
                if size > MAX_FRAME:
                    raise Undelivered(f"a frame of {size} bytes from the server")
                if len(self.buffer) >= 4 + size:
                    body, self.buffer = self.buffer[4 : 4 + size], self.buffer[4 + size :]
                    try:
                        frame = _decode(body.decode())
                    except (ValueError, RecursionError):
                        raise Undelivered("a frame the server sent is not JSON") from None
                    if not isinstance(frame, dict):
                        raise Undelivered("a frame the server sent is not an object")
                    return frame
            self._arm()
            chunk = self.sock.recv(65536)
            if not chunk:
                raise Undelivered("the supervisor closed the connection")
            self.buffer += chunk

    def until(self, kind: str) -> dict[str, Any]:
        """Read up to the first frame of ``kind``; an ``err`` before it is raised."""
        while True:
            frame = self.frame()
            if frame.get("t") == kind:
                return frame
            if frame.get("t") == "err":
                raise Undelivered(str(frame.get("message") or frame.get("code")))

    def close(self) -> None:
        self.sock.close()


def send(socket_path: str, topic: str, env: bytes, deadline: float = DEADLINE) -> None:
    """Publish ``env`` on ``topic`` and wait until the supervisor handled it."""
    conn = _Connection(socket_path, time.monotonic() + deadline)
    try:
        conn.send(HELLO)
        conn.until("welcome")
        conn.send(publish_frames(topic, env))
        conn.until("pong")
    finally:
        conn.close()


# -- stdin, the command line, main ------------------------------------------------------


def _read_stdin() -> tuple[bytes, bool]:
    """The hook input and whether it was cut (too long, or stdin never ended)."""
    try:
        if sys.stdin is None or os.isatty(0):
            return b"", False
    except OSError:  # fd 0 closed
        return b"", False
    chunks: list[bytes] = []
    size = 0
    end = time.monotonic() + STDIN_DEADLINE
    try:
        while size <= STDIN_LIMIT:
            left = end - time.monotonic()
            if left <= 0:
                _say(f"astrid-emit: gave up reading stdin after {STDIN_DEADLINE:g} s")
                return b"".join(chunks), True
            readable, _, _ = select.select([0], [], [], left)
            if not readable:
                continue
            chunk = os.read(0, 1024 * 1024)
            if not chunk:
                return b"".join(chunks), False
            chunks.append(chunk)
            size += len(chunk)
    except (OSError, ValueError) as exc:
        _say(f"astrid-emit: stdin unreadable ({type(exc).__name__})")
        return b"".join(chunks), True
    return b"", True


class BadCommandLine(SageError):
    """A command line astrid-emit cannot read (said, and exit 0: never argparse's 2)."""

    code = "bad_command_line"


def parse_args(argv: Sequence[str]) -> dict[str, str | None] | None:
    """``{event, config}`` from the command line; None for ``--help``.  A bad one raises
    BadCommandLine (never argparse's exit 2: Claude reads it as "block")."""
    out: dict[str, str | None] = {"event": None, "name": None, "config": None}
    options = {"--event": "event", "--topic": "event", "--config": "config"}
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            return None
        key, eq, value = arg.partition("=")
        if key in options:
            if not eq:
                if not args:
                    raise BadCommandLine(f"argument {key}: expected one argument")
                value = args.pop(0)
            out[options[key]] = value
        elif arg.startswith("-") and arg != "-":
            raise BadCommandLine(f"unrecognized arguments: {arg}")
        elif out["name"] is None:
            out["name"] = arg
        else:
            raise BadCommandLine(f"unrecognized arguments: {arg}")
    return {"event": out["event"] or out["name"], "config": out["config"]}


def _socket_path(config: str | None) -> str:
    path = os.environ.get("ASTRID_SOCKET")
    if path:
        return path
    # only without ASTRID_SOCKET (every session sets it): the config file says
    from sage.config import load_config

    return str(load_config(config).socket_path)


def _emit(argv: Sequence[str]) -> None:
    try:
        args = parse_args(argv)
    except BadCommandLine as exc:
        _say(f"astrid-emit: {exc}; nothing sent")
        return
    if args is None:
        os.write(1, USAGE.encode())
        return
    raw, cut = _read_stdin()
    event = args["event"]
    if event and event.startswith(TOPIC_PREFIX):
        event = event.removeprefix(TOPIC_PREFIX)
    payload = None if cut else payload_json(raw)
    if not event and payload is not None:
        try:
            named = _decode(payload.decode())
        except (ValueError, RecursionError):
            named = None
        if isinstance(named, dict):
            event = named.get("hook_event_name")
    if not isinstance(event, str) or not 0 < len(event) <= 64 or set(event) - _EVENT_CHARS:
        _say(f"astrid-emit: no valid hook event name ({str(event)[:80]!r}); nothing sent")
        return
    # an input the capsule would drop anyway (and the bus refuses an envelope
    # over [bus] max_payload): the hook is reported without it
    if payload is not None and len(payload) > PAYLOAD_LIMIT:
        payload = None
    try:
        send(_socket_path(args["config"]), TOPIC_PREFIX + event, envelope(event, payload))
    except (SageError, OSError) as exc:  # Undelivered, the config's errors, the socket's
        _say(f"astrid-emit: hook {event} not delivered: {exc}")


def main(argv: Sequence[str] | None = None) -> int:
    """Always 0 (see the module's text)."""
    _watchdog(HARD_DEADLINE)
    try:
        _emit(sys.argv[1:] if argv is None else argv)
    except SystemExit:
        pass
    except BaseException as exc:  # a hook never fails Claude
        # the type only: the text could quote the input or a claim
        _say(f"astrid-emit: hook not delivered: {type(exc).__name__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
