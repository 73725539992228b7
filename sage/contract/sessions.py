"""The contract between the session runner (capsules/runner/) and the fleet (sage/fleet/).

Both sides import this module; neither spells a runner topic, a state word, an end
reason or a payload field of what they exchange anywhere else (the runner knows
nothing of NATS, the fleet nothing of the runner's code):

- **Topics.** :func:`request_topic` builds the runner's request topics from a
  :class:`Verb` (``sage.v1.request.<verb>[.<sid>]``), :func:`request_pattern` what the
  runner subscribes; :func:`event_topic` and :func:`event_of` the session events
  (``sage.v1.event.<sid>.<name>``, names in :class:`SessionEvent`);
  :func:`fleet_topic` the requests the fleet's router answers on the local bus
  (``sage.v1.request.fleet.<verb>[.<sid>]``, :data:`CLAIMS_TOPIC` among them).
- **Payloads.** msgspec structs for each request and reply the two sides exchange:
  :class:`AdoptRequest` and :class:`AdoptReply`, :class:`YieldRequest` and
  :class:`YieldReply`, :class:`ConversationReply` (what a replica needs),
  :class:`SlotsReply` (a node's load), :class:`ClaimsRequest` and
  :class:`ClaimsReply` (which sessions another node took), :class:`SessionRow` (a
  listing row).  A reply is the bus's one reply shape (sage/replies.py): ``ok`` and
  these fields beside it.
- **States and reasons.** :class:`SessionState` (a session in the runner's table),
  :class:`RecordState` (its stored record, and a listing row's ``state`` once it
  ended), :class:`EntryState` (its claim in the fleet's registry), :class:`EndReason`
  (the ``reason`` of ``exited`` and of records).  The refusal codes are
  :class:`sage.contract.codes.ErrorCode`'s.

Sans-IO: nothing here touches the bus.
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Final, Literal

import msgspec

from sage.claude.protocol.encoder import encode_user_turn
from sage.config import NAME_PATTERN
from sage.contract.codes import ErrorCode
from sage.errors import RequestError

__all__ = (
    "APPROVALS_TOPIC",
    "CLAIMS_TOPIC",
    "EVENTS",
    "FLEET_APPROVALS_TOPIC",
    "FLEET_KEYED",
    "FLEET_SESSIONS_TOPIC",
    "FLEET_SPAWN_TOPIC",
    "FLEET_STATUS_TOPIC",
    "INSTALL_STATUS_TOPIC",
    "KEYED_VERBS",
    "LEASE_TOPIC",
    "SESSION_REJECTED_TOPIC",
    "SUPERVISOR_SOURCE",
    "AdoptReply",
    "AdoptRequest",
    "ClaimsReply",
    "ClaimsRequest",
    "ConversationReply",
    "EndReason",
    "EntryState",
    "InterruptRequest",
    "LeaseGrant",
    "RecordState",
    "SessionEvent",
    "SessionRow",
    "SessionState",
    "SlotsReply",
    "TurnEnd",
    "Verb",
    "YieldReply",
    "YieldRequest",
    "approver_topic",
    "audit_topic",
    "event_of",
    "event_pattern",
    "event_topic",
    "fleet_topic",
    "request_pattern",
    "request_topic",
    "turn_end",
    "turn_size",
    "turn_too_large",
)

_NAME = re.compile(NAME_PATTERN)

# -- topics ---------------------------------------------------------------------------


class Verb(enum.StrEnum):
    """A request the session runner answers: ``sage.v1.request.<verb>[.<key>]``."""

    SPAWN = "spawn"
    SEND = "send"
    STOP = "stop"
    INTERRUPT = "interrupt"
    WAKE = "wake"
    SESSIONS = "sessions"
    SESSION = "session"
    APPROVALS = "approvals"
    APPROVE = "approve"
    SETTINGS_SET = "settings.set"
    INSTALL = "install"
    PRINCIPALS = "principals"
    SLOTS = "slots"
    ADOPT = "adopt"
    CONVERSATION = "conversation"
    YIELD = "yield"


KEYED_VERBS: Final = frozenset(
    {
        Verb.SEND,
        Verb.STOP,
        Verb.INTERRUPT,
        Verb.WAKE,
        Verb.SESSION,
        Verb.APPROVE,
        Verb.CONVERSATION,
        Verb.YIELD,
    }
)
"""Verbs whose topic ends in a key: a session id (an approval id for ``approve``)."""

REQUEST_PREFIX: Final = "sage.v1.request"
FLEET_PREFIX: Final = f"{REQUEST_PREFIX}.fleet"
EVENT_PREFIX: Final = "sage.v1.event"
EVENTS: Final = f"{EVENT_PREFIX}.>"
"""Every session event (and ``session_rejected``)."""
SESSION_REJECTED_TOPIC: Final = f"{EVENT_PREFIX}.session_rejected"
INSTALL_STATUS_TOPIC: Final = f"{EVENT_PREFIX}.install.status"
"""A principal's install or relink, step by step (the runner relays the installer's)."""
APPROVALS_TOPIC: Final = f"{REQUEST_PREFIX}.{Verb.APPROVALS}"


def _key(value: str, what: str) -> str:
    if not isinstance(value, str) or _NAME.match(value) is None:
        code = ErrorCode.INVALID_SESSION_ID if what == "session id" else ErrorCode.BAD_REQUEST
        raise RequestError(f"{what} {value!r}: 1-64 of [A-Za-z0-9_-]", code=code)
    return value


def request_topic(verb: str, key: str | None = None) -> str:
    """The runner's topic for ``verb`` (about session or approval ``key``): a
    RequestError for a key that is no name (no ``.``, ``*`` or ``>`` reaches a topic)."""
    topic = f"{REQUEST_PREFIX}.{Verb(verb)}"
    if key is None:
        return topic
    what = "approval id" if verb == Verb.APPROVE else "session id"
    return f"{topic}.{_key(key, what)}"


def request_pattern(verb: Verb) -> str:
    """What the runner subscribes to serve ``verb``: its topic, ``.*`` for a keyed one."""
    return f"{REQUEST_PREFIX}.{verb}" + (".*" if verb in KEYED_VERBS else "")


def fleet_topic(verb: str, key: str | None = None) -> str:
    """The fleet router's local topic for ``verb``: ``sage.v1.request.fleet.<verb>[.<key>]``."""
    topic = f"{FLEET_PREFIX}.{_key(verb, 'verb')}"
    return topic if key is None else f"{topic}.{_key(key, 'session id')}"


FLEET_KEYED: Final = f"{FLEET_PREFIX}.*.*"
"""The router's requests about one session or approval (``sage.v1.request.fleet.send.<sid>``)."""
FLEET_SPAWN_TOPIC: Final = fleet_topic(Verb.SPAWN)
FLEET_SESSIONS_TOPIC: Final = fleet_topic(Verb.SESSIONS)
FLEET_APPROVALS_TOPIC: Final = fleet_topic(Verb.APPROVALS)
FLEET_STATUS_TOPIC: Final = fleet_topic("status")
CLAIMS_TOPIC: Final = fleet_topic("claims")
"""The runner asks at start which of its sessions another node took (:class:`ClaimsRequest`)."""
SUPERVISOR_SOURCE: Final = "supervisor"
"""The bus source of the supervisor's own envelopes (its :class:`~bus.Identity`): what a
capsule checks before it takes what only the supervisor may say."""
LEASE_TOPIC: Final = "sage.v1.fleet.lease"
"""The supervisor grants its runner the node's lease at each acknowledged heartbeat
(:class:`LeaseGrant`; sage/lease.py).  The runner takes it only from the supervisor."""


class SessionEvent(enum.StrEnum):
    """A session event's name: ``sage.v1.event.<sid>.<name>`` (docs/topics.md)."""

    SPAWNED = "spawned"
    INIT = "init"
    TEXT = "text"
    DONE = "done"
    ERROR = "error"
    EXITED = "exited"
    RESUMED = "resumed"
    RESPAWNED = "respawned"
    HIBERNATING = "hibernating"
    HIBERNATED = "hibernated"
    WAKING = "waking"
    APPROVAL_REQUEST = "approval_request"
    APPROVAL = "approval"
    TOOLS_CHANGED = "tools_changed"


def event_topic(sid: str, name: str) -> str:
    return f"{EVENT_PREFIX}.{sid}.{name}"


def event_pattern(sid: str) -> str:
    """Every event of session ``sid``."""
    return f"{EVENT_PREFIX}.{sid}.>"


def event_of(topic: str) -> tuple[str, str] | None:
    """``(sid, name)`` of a session event topic ``sage.v1.event.<sid>.<name>``; None for
    anything else (``session_rejected``, a name that is no name)."""
    parts = topic.split(".")
    if len(parts) != 5 or parts[:3] != ["sage", "v1", "event"]:
        return None
    if _NAME.match(parts[3]) is None or _NAME.match(parts[4]) is None:
        return None
    return parts[3], parts[4]


def approver_topic(sid: str) -> str:
    """Subscribed by a client that answers session ``sid``'s approvals."""
    return f"sage.v1.approver.{sid}"


def audit_topic(kind: str) -> str:
    return f"sage.v1.audit.{kind}"


# -- states and reasons ---------------------------------------------------------------


class SessionState(enum.Enum):
    """A session in the runner's table (capsules/runner/sessions.py has its table)."""

    STARTING = "starting"
    RUNNING = "running"
    RESPAWNING = "respawning"
    STOPPING = "stopping"
    ENDED = "ended"
    INTERRUPTED = "interrupted"
    HIBERNATING = "hibernating"
    HIBERNATED = "hibernated"
    WAKING = "waking"


class RecordState(enum.StrEnum):
    """A session record's ``state`` in the state store (and an ended row's in a listing)."""

    RUNNING = "running"
    INTERRUPTED = "interrupted"
    HIBERNATED = "hibernated"
    ENDED = "ended"


class EntryState(enum.StrEnum):
    """A session's claim in the fleet's registry (``sage_sessions``): what a node that
    adopts it does with it."""

    RUNNING = "running"
    HIBERNATED = "hibernated"  # asleep on its node: adopted asleep
    ADOPTING = "adopting"  # a node won it and is restoring it


class EndReason(enum.StrEnum):
    """Why a child, or a whole session, ended: the ``reason`` of ``exited`` events and
    of session records (docs/topics.md); the values are part of the interface."""

    STOPPED = "stopped"  # sage.v1.request.stop.<sid>
    RESPAWN = "respawn"  # stopped to run again (an identity refresh); never a session's end
    HIBERNATE = "hibernate"  # stopped while idle, to wake later; never a session's end
    EXITED = "exited"  # the child exited with code 0 on its own
    CRASHED = "crashed"  # the child exited non-zero, or was killed, on its own
    AUTH_FAILED = "auth_failed"
    PERMISSION_MODE_MISMATCH = "permission_mode_mismatch"
    INIT_TIMEOUT = "init_timeout"
    INIT_FAILED = "init_failed"
    LINE_TOO_LONG = "line_too_long"
    SUPERVISOR_SHUTDOWN = "supervisor_shutdown"  # the supervisor stops (record: interrupted)
    SUPERVISOR_RESTART = "supervisor_restart"  # the next supervisor did not resume it
    RESUME_FAILED = "resume_failed"  # a prefix: "resume_failed: <message>"
    RESPAWN_ABANDONED = "respawn_abandoned"
    FAILED_OVER = "failed_over"  # another node of the fleet took it while this one was lost
    FENCED = "fenced"  # killed at once: the node lost its fleet lease; never a session's end

    @property
    def gentle(self) -> bool:
        """Whether a running turn is interrupted first (else the child is stopped at once)."""
        return self in (EndReason.STOPPED, EndReason.RESPAWN, EndReason.HIBERNATE)

    @property
    def planned(self) -> bool:
        """A stop the runner asked for to go on with the session (an operator's stop
        overrides it)."""
        return self in (EndReason.RESPAWN, EndReason.HIBERNATE, EndReason.FENCED)


# -- payloads -------------------------------------------------------------------------


class LeaseGrant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.fleet.lease``: the node may run its children until ``until`` (seconds
    of the host's monotonic clock, which the supervisor and the runner share); ``term``
    the lease's length (sage/lease.py, ``lease_term``)."""

    until: float
    term: Annotated[float, msgspec.Meta(gt=0)]


class AdoptRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.adopt`` (the supervisor's fleet side only, never a principal):
    run a session another node lost under its own id, ``--resume`` on its conversation
    (``fresh``: no transcript was kept, a new conversation of the same id)."""

    session_id: str
    principal_id: str
    claude_session: str
    from_node: str
    cwd: str = ""
    model: str = ""
    turns: int = 0
    cost_usd: Annotated[float, msgspec.Meta(ge=0, le=1e9)] = 0.0
    """Of its earlier children, on the lost node: the session's cost goes on."""
    started_at: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """When it was spawned (its age goes on); 0: now."""
    fresh: bool = False
    asleep: bool = False
    """It was hibernated on the lost node: it is kept hibernated here (no child, no slot)
    until a send wakes it."""


class AdoptReply(msgspec.Struct, frozen=True, kw_only=True):
    """The runner's answer to an adoption: the session runs here (``pid``), or sleeps."""

    session_id: str
    pid: int | None
    hibernated: bool = False


class YieldRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.yield.<sid>`` (the supervisor's fleet side only, never a
    principal): another node of the fleet, ``node``, runs the session now; this node's
    copy ends ``failed_over``."""

    node: str


class YieldReply(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    node: str


class InterruptRequest(msgspec.Struct, frozen=True):
    """``sage.v1.request.interrupt.<sid>``: ``{}`` from a person (Ctrl-C, ``astrid sage
    interrupt``); the usage ledger (the supervisor, never a principal) names ``why``:
    the running turn's ``done`` then says ``budget_exceeded`` and ``message``."""

    why: Literal["budget_exceeded"] | None = None
    message: Annotated[str, msgspec.Meta(max_length=1000)] = ""


class ConversationReply(msgspec.Struct, frozen=True, kw_only=True):
    """``sage.v1.request.conversation.<sid>`` (the supervisor only): what a replica of a
    live session's conversation needs."""

    session_id: str
    principal_id: str
    claude_session: str
    cwd: str = ""
    model: str = ""
    turns: int = 0
    cost_usd: float = 0.0
    started_at: float = 0.0


class SlotsReply(msgspec.Struct, frozen=True, kw_only=True):
    """``sage.v1.request.slots`` (admins): the host's load, which a fleet node's
    heartbeat carries (sage/fleet/nodes.py, ``NodeLoad``)."""

    live: int
    max_live: int | None
    idle: int
    hibernated: int
    waiting: int = 0
    states: dict[str, int] = {}
    """Sessions by the state their listing row shows (``ready``, ``busy``, ``hibernated``,
    ...): the metrics' ``sage_sessions`` gauge."""


class ClaimsRequest(msgspec.Struct, frozen=True):
    """``sage.v1.request.fleet.claims`` (the runner at start, an admin): of these
    sessions it left live, which does another node run now?"""

    session_ids: list[str] = []
    principals: dict[str, str] = {}
    """Session id -> its principal: a session is named across the fleet by both (two
    principals may each have a session of one id on two nodes)."""


class ClaimsReply(msgspec.Struct, frozen=True, kw_only=True):
    """Session id -> the node that runs it now; the others are claimed for this node."""

    elsewhere: dict[str, str] = {}


class SessionRow(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """What every row of a sessions listing says (``sage.v1.request.sessions``, and the
    fleet's listing, whose rows name their ``node``); a runner's rows say more (turns,
    cost, times, an ended one's reason), which a reader that needs only this ignores."""

    session_id: str
    principal_id: str = ""
    pid: int | None = None
    state: str = ""
    """A live row: its child's state (``starting``, ``ready``, ``busy``, ...) or the
    session's (``hibernated``, ``waking``); an ended one: :attr:`RecordState.ENDED`; a
    fleet row its node could not give: the node's state (``lost``, ``unreachable``, ...)."""
    node: str | None = None
    started_at: float | None = None


# -- a turn's size ----------------------------------------------------------------------


def turn_size(text: str) -> int:
    """The bytes a send of ``text`` writes to the child's stdin (the encoded user line),
    which ``[limits] stdin_quota`` bounds; the CLI checks it before it sends."""
    return len(encode_user_turn(text))


def turn_too_large(size: int, limit: int) -> str:
    """Why a turn is refused ``payload_too_large``: its size and the limit, named."""
    return (
        f"the turn is {size} bytes encoded, over the limit of {limit}"
        " ([limits] stdin_quota); send it in parts, or as a file the session can read"
    )


# -- how a turn ended ---------------------------------------------------------------------


class TurnEnd(enum.StrEnum):
    """Why a turn ended: the ``reason`` of a ``done`` event, which ``astrid sage send``
    prints and maps to its exit code (docs/topics.md, docs/operations.md)."""

    COMPLETED = "completed"
    INTERRUPTED = "interrupted"  # an interrupt (Ctrl-C, sage.v1.request.interrupt)
    AUTH_FAILED = "auth_failed"  # the Messages API refused the key (401, 403)
    RATE_LIMITED = "rate_limited"  # 429, after the CLI's own retries
    OVERLOADED = "overloaded"  # 529, after the CLI's own retries
    PAYLOAD_TOO_LARGE = "payload_too_large"  # 413: the request was too large for the API
    API_REFUSED = "api_refused"  # another 4xx: the API refused the request
    API_ERROR = "api_error"  # a 5xx, or an API failure with no status
    MAX_TURNS = "max_turns"  # the principal's max_turns was reached
    EXECUTION_ERROR = "execution_error"  # the CLI failed during the turn
    FAILED = "failed"  # an error result of a kind not named above
    BUDGET_EXCEEDED = "budget_exceeded"  # sage interrupted it: the principal is over a budget


_BY_STATUS: Final = {
    401: TurnEnd.AUTH_FAILED,
    403: TurnEnd.AUTH_FAILED,
    413: TurnEnd.PAYLOAD_TOO_LARGE,
    429: TurnEnd.RATE_LIMITED,
    529: TurnEnd.OVERLOADED,
}


def turn_end(
    *,
    is_error: bool,
    subtype: str,
    api_error_status: int | None = None,
    terminal_reason: str | None = None,
) -> TurnEnd:
    """What a ``result`` says of its turn.  The CLI reports an API failure as subtype
    ``success`` with ``is_error`` and the HTTP status (seen with 2.1.328), so the
    status decides before the subtype does."""
    if not is_error:
        return TurnEnd.COMPLETED
    if terminal_reason is not None and terminal_reason.startswith("aborted"):
        return TurnEnd.INTERRUPTED
    if api_error_status is not None:
        if api_error_status in _BY_STATUS:
            return _BY_STATUS[api_error_status]
        return TurnEnd.API_REFUSED if 400 <= api_error_status < 500 else TurnEnd.API_ERROR
    if terminal_reason == "api_error":
        return TurnEnd.API_ERROR
    if subtype == "error_max_turns":
        return TurnEnd.MAX_TURNS
    if subtype == "error_during_execution":
        return TurnEnd.EXECUTION_ERROR
    return TurnEnd.FAILED
