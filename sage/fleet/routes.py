"""Sessions anywhere: the subjects, records and checks of routing between nodes (sans-IO).

A request a node cannot answer from its own runner (a session another node
owns, ``spawn --node``) is forwarded over NATS to the owner, on the owner's
own subject prefix, with the sending node's name in it::

    sage.fleet.<node>.request.<origin>.<verb>[.<sid>]
                                                a Forwarded request, answered in
                                                the runner's reply shape
    sage.fleet.<node>.event.<sid>.<name>        a ForwardedEvent: each session
                                                event of the node's sessions

The ``<origin>`` token is what the NATS server proves: a node's user may
publish requests only with its own name there (sage/fleet/permissions.py), so
the receiver takes the sending node from the subject, never from the payload.

Two words, one meaning each (in sage/fleet): a node's **entry** in the session
registry says it runs a session; a session's **claim** in ``sage_claims`` says which
node holds it after a takeover (or took it back).  The session registry (the
``sage_sessions`` key-value bucket) holds each node's entries: the key
``<node>.<sid>`` maps to a :class:`SessionEntry` naming that node, and a node's NATS
user may write only keys under its own name (sage/fleet/permissions.py), so the
server proves whose entry it is.  A session id
with entries of several nodes is resolved by :func:`resolve`: the entry of the one
live node (a lost node's entry stays until it comes back and deletes it itself); two
live nodes' entries are a :class:`SessionConflict`, forwarded to neither.  The
``sage_claims`` bucket (key: the session id, value: a :class:`Claim`), which
every node may write, only decides failover's races (sage/fleet/failover.py),
and is never read to route anything.  Everything a subject is built from is checked
here first (node names and session ids are ``[A-Za-z0-9_-]{1,64}``), so no
``.``, ``*`` or ``>`` from a caller ever reaches a subject.  Nothing here
touches a socket: sage/fleet/router.py is the shell.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, TypeVar

import msgspec

from sage.config import NAME_PATTERN
from sage.contract.sessions import EntryState, SessionRow
from sage.contract.usage import USAGE_VERB
from sage.errors import BadRoute, SessionConflict

__all__ = (
    "APPROVAL_VERBS",
    "CLAIMS",
    "CLAIMS_STREAM",
    "KEYED_VERBS",
    "NODE_VERBS",
    "PRESENCE_VERBS",
    "REGISTRY",
    "REGISTRY_STREAM",
    "SESSION_VERBS",
    "Claim",
    "Forwarded",
    "ForwardedEvent",
    "SessionEntry",
    "approval_answer",
    "check_name",
    "claim_filter",
    "claim_key",
    "decode_claim",
    "decode_entry",
    "decode_event",
    "decode_forwarded",
    "decode_keyed",
    "event_pattern",
    "event_subject",
    "parse_event_subject",
    "parse_registry_key",
    "parse_request_subject",
    "registry_key",
    "registry_rows",
    "request_subject",
    "resolve",
    "row_of",
    "visible",
)

REGISTRY = "sage_sessions"
"""The key-value bucket: ``<node>.<sid>`` -> that node's entry: it runs the session, and whose
it is (a node may write only its own keys)."""
REGISTRY_STREAM = f"KV_{REGISTRY}"
CLAIMS = "sage_claims"
"""The key-value bucket deciding failover's races: ``<node>.<principal>.<sid>`` -> that
node's claim to that principal's session (each node writes its own keys, every write
naming the last revision of all the session's keys; never used to route)."""
CLAIMS_STREAM = f"KV_{CLAIMS}"

SESSION_VERBS = frozenset({"send", "stop", "interrupt", "session", "wake"})
"""Requests about one session, routed to the node that owns it."""
APPROVAL_VERBS = frozenset({"approve"})
"""Requests about one pending approval (``<cid>`` in place of the session id): asked of
every live node, since no registry says where an approval waits."""
PRESENCE_VERBS = frozenset({"approver"})
"""``approver.<sid>`` ``{seconds}``: someone on the sending node answers this session's
approvals for that long (its router stands in for them on the owner's bus)."""
KEYED_VERBS = SESSION_VERBS | APPROVAL_VERBS | PRESENCE_VERBS
NODE_VERBS = frozenset({"spawn", "sessions", "approvals", USAGE_VERB})
"""Requests to a node, about none of its sessions in particular (``usage``: its ledger's
rows for a fleet's usage report, sage/fleet/usage.py)."""

_NAME = re.compile(NAME_PATTERN)


def check_name(value: str, what: str) -> str:
    """``value`` if it is a node name or session id (1-64 of [A-Za-z0-9_-]), else BadRoute."""
    if not isinstance(value, str) or _NAME.match(value) is None:
        code = "invalid_session_id" if what == "session id" else "bad_request"
        raise BadRoute(f"{what} {value!r}: 1-64 of [A-Za-z0-9_-]", code=code)
    return value


def registry_key(node: str, sid: str) -> str:
    """The registry key of ``node``'s entry for ``sid``: under the node's own name, the only
    keys its NATS user may write."""
    return f"{check_name(node, 'node')}.{check_name(sid, 'session id')}"


def parse_registry_key(key: str) -> tuple[str, str] | None:
    """``(node, sid)`` of a registry key; None for a key no node could have meant."""
    parts = key.split(".")
    if len(parts) != 2 or any(_NAME.match(part) is None for part in parts):
        return None
    return parts[0], parts[1]


def request_subject(node: str, origin: str, verb: str, sid: str | None = None) -> str:
    """The subject of a request ``origin`` forwards to ``node``."""
    prefix = f"sage.fleet.{check_name(node, 'node')}.request.{check_name(origin, 'node')}"
    if verb in KEYED_VERBS:
        if sid is None:
            raise BadRoute(f"{verb} names a session or an approval")
        return f"{prefix}.{verb}.{check_name(sid, 'session id')}"
    if verb in NODE_VERBS and sid is None:
        return f"{prefix}.{verb}"
    raise BadRoute(f"no fleet request {verb!r}")


def parse_request_subject(node: str, subject: str) -> tuple[str, str, str | None]:
    """``(origin, verb, sid)`` of a request on ``node``'s own prefix; BadRoute for
    anything else (another node's prefix, no origin, an unknown verb, a bad session id).
    The origin is the server's word: a node may publish only its own there."""
    parts = subject.split(".")
    if parts[:4] != ["sage", "fleet", node, "request"] or len(parts) not in (6, 7):
        raise BadRoute(f"not a request for node {node!r}: {subject!r}")
    origin, verb = parts[4], parts[5]
    sid = parts[6] if len(parts) == 7 else None
    if request_subject(node, origin, verb, sid) != subject:  # checks every token
        raise BadRoute(f"not a request subject: {subject!r}")
    return origin, verb, sid


def event_subject(node: str, sid: str, name: str) -> str:
    return f"sage.fleet.{check_name(node, 'node')}.event.{check_name(sid, 'session id')}.{check_name(name, 'event')}"


def event_pattern(node: str, sid: str) -> str:
    return f"sage.fleet.{check_name(node, 'node')}.event.{check_name(sid, 'session id')}.*"


def parse_event_subject(subject: str) -> tuple[str, str, str]:
    """``(node, sid, name)`` of a forwarded event subject (BadRoute if it is not one)."""
    parts = subject.split(".")
    if len(parts) != 6 or parts[:2] != ["sage", "fleet"] or parts[3] != "event":
        raise BadRoute(f"not an event subject: {subject!r}")
    node, sid, name = parts[2], parts[4], parts[5]
    return check_name(node, "node"), check_name(sid, "session id"), check_name(name, "event")


class Forwarded(msgspec.Struct, frozen=True, kw_only=True):
    """A request one node forwards to another (the sending node is in the subject).

    ``principal`` is the one the sending node's bus established for the caller
    (SO_PEERCRED there; ``None``: an admin of that node), never a field the
    caller wrote: the router takes it from the local envelope.  The receiver
    takes the sending node from the subject, which the NATS server proves, and
    the principal only if that node may vouch for it (sage/fleet/vouching.py)."""

    principal: str | None
    payload: msgspec.Raw = msgspec.Raw(b"{}")

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


class ForwardedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A session event as the owning node forwards it: its principal, time, payload, and
    its envelope id on the owner's bus (what the owner's ``watch --replay`` rows carry)."""

    principal: str | None
    ts: float
    payload: msgspec.Raw
    id: int = 0

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


class SessionEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The registry's value for one session id."""

    node: str
    principal_id: str
    state: str = EntryState.RUNNING
    """An :class:`~sage.contract.sessions.EntryState` (a word another node wrote: read as it
    is, and compared with those)."""
    at: float = 0.0
    """Wall-clock seconds of the write, by the owner's clock."""
    resume: bool = False
    """Its node has ``[sessions] resume = true``: when the node is lost, another takes it."""

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


class Claim(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """A ``sage_claims`` value: ``node`` (the writer, whose name its key starts with: the
    server proves it) took the session over, or took it back, or gives it ``back``.

    A session's claim is the latest of its keys ``<node>.<principal>.<sid>`` (the
    stream's order): session ids are each node's, so the principal is part of what
    names a session across the fleet, and one principal's claims never touch another's;
    every write names the revision it read of them all (sage/fleet/claims.py), so two
    nodes never both win, and no node writes a claim in another's name.  A lost node's
    entry in the registry may outlive the session (it stays until that node comes back
    and deletes it): a node adopts it only while the claim's holder is that node (or
    there is none), so a session taken over once is never taken from the stale entry
    again."""

    node: str
    at: float = 0.0
    principal_id: str = ""
    """Whose session it is (a claim for another principal's session is not followed)."""
    back: str = ""
    """The node it is given back to: the winner could not run it (or may not) and gave
    it back to the node it took it from; "": ``node`` holds it."""
    failed: bool = False
    """Given back for good: no other node tries again; ``back`` resumes it when it comes
    back."""

    @property
    def holder(self) -> str:
        """The node that holds the session by this claim."""
        return self.back or self.node

    def encode(self) -> bytes:
        return msgspec.json.encode(self)


def decode_claim(data: bytes) -> Claim | None:
    """A ``sage_claims`` value, or None when it cannot be used (its ``back``, when set,
    must be a node's name)."""
    claim = _of_a_node(data, Claim)
    if claim is None or (claim.back and _NAME.match(claim.back) is None):
        return None
    return claim


def claim_key(node: str, principal: str, sid: str) -> str:
    """The ``sage_claims`` key of ``node``'s claim to ``principal``'s session ``sid``:
    under its own name, the only keys its NATS user may write."""
    return f"{check_name(node, 'node')}.{check_name(principal, 'principal')}.{check_name(sid, 'session id')}"


def claim_filter(principal: str, sid: str) -> str:
    """The subject of every node's claim to ``principal``'s session ``sid``: a write names
    the last revision of them all, so it fails when any node wrote since; another
    principal's session of the same id has keys of its own."""
    return f"$KV.{CLAIMS}.*.{check_name(principal, 'principal')}.{check_name(sid, 'session id')}"


def decode_forwarded(data: bytes) -> Forwarded:
    try:
        forwarded = msgspec.json.decode(data, type=Forwarded)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRoute(f"not a forwarded request: {exc}") from None
    if forwarded.principal is not None:
        check_name(forwarded.principal, "principal")
    return forwarded


def decode_event(data: bytes) -> ForwardedEvent:
    try:
        return msgspec.json.decode(data, type=ForwardedEvent)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRoute(f"not a forwarded event: {exc}") from None


def decode_entry(sid: str, data: bytes) -> SessionEntry | None:
    """The registry entry of ``sid``, or None when it cannot be used."""
    return _of_a_node(data, SessionEntry)


_NodeNamed = TypeVar("_NodeNamed", Claim, SessionEntry)


def _of_a_node(data: bytes, kind: type[_NodeNamed]) -> _NodeNamed | None:
    """``data`` decoded as ``kind``, a value that names a node: None when it is not one,
    or its node is no valid name (a value other nodes wrote is read as hostile)."""
    try:
        value = msgspec.json.decode(data, type=kind)
        check_name(value.node, "node")
    except (msgspec.DecodeError, msgspec.ValidationError, BadRoute):
        return None
    return value


def decode_keyed(key: str, data: bytes) -> tuple[str, SessionEntry] | None:
    """``(sid, entry)`` of a registry key and value; None unless the key is
    ``<node>.<sid>`` and the entry names that same node (the key is what the server
    proves: a value naming another node is a lie, and ignored)."""
    found = parse_registry_key(key)
    if found is None:
        return None
    entry = decode_entry(found[1], data)
    if entry is None or entry.node != found[0]:
        return None
    return found[1], entry


def resolve(sid: str, entries: dict[str, SessionEntry], live: set[str]) -> SessionEntry | None:
    """The entry a request for ``sid`` follows, of the nodes' ``entries`` (node -> entry):
    the only one; of several, the one of the live node (``live``: the live nodes, needed
    only then); with none live, the latest.  Two live claimants: SessionConflict."""
    if not entries:
        return None
    if len(entries) == 1:
        return next(iter(entries.values()))
    living = sorted(node for node in entries if node in live)
    if len(living) > 1:
        raise SessionConflict(
            f"session {sid!r} is claimed by more than one live node ({', '.join(living)}):"
            " a request for it goes to none of them",
        )
    if living:
        return entries[living[0]]
    return max(entries.values(), key=lambda entry: (entry.at, entry.node))


def visible(entry: SessionEntry, principal: str | None) -> bool:
    """Whether a caller acting for ``principal`` (None: an admin) may know of it."""
    return principal is None or principal == entry.principal_id


def row_of(sid: str, entry: SessionEntry, state: str) -> dict[str, Any]:
    """A listing row for a session known only from the registry (its node cannot answer)."""
    row = SessionRow(
        session_id=sid,
        principal_id=entry.principal_id,
        pid=None,
        state=state,
        node=entry.node,
        started_at=entry.at,
    )
    return msgspec.to_builtins(row)  # type: ignore[no-any-return]


def registry_rows(
    entries: Iterable[tuple[str, SessionEntry]],
    shown: Mapping[str, str],
    listed: Collection[object],
    principal: str | None,
    moved: Collection[tuple[str, str]] = (),
) -> list[dict[str, Any]]:
    """The fleet listing's rows of the nodes that did not answer it, from the registry's
    claims ``entries`` (``(sid, entry)``, the bucket's or the registry copy's, in any
    order): ``shown`` maps each such node to the state its rows say (``lost``,
    ``stopped``, ``unreachable``, ``refused``); by node, then session id; only what
    ``principal`` may see, no session in ``listed`` (a node that answered has it:
    its adopter, say), and no ``(sid, node)`` in ``moved`` (its ``sage_claims`` names
    another node: the session left that node, and may have ended where it went)."""
    by_sid = sorted(entries, key=lambda found: found[0])
    rows: list[dict[str, Any]] = []
    for node in sorted(shown):
        rows += [
            row_of(sid, entry, shown[node])
            for sid, entry in by_sid
            if entry.node == node
            and visible(entry, principal)
            and sid not in listed
            and (sid, node) not in moved
        ]
    return rows


def approval_answer(answers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Which of the nodes' replies to an ``approve`` asked of them all is the answer: the
    holder's (its success, or its own refusal), else one of a node that could not be
    asked (it may hold it), else one of a node that does not take the caller's
    principal; None when every node said it holds no such approval.  Replies come in
    the order the nodes answered: a fast refusal must not hide the holder's answer."""
    quiet = ("unknown_approval", "fleet_unavailable", "principal_not_authenticated")
    for reply in answers:
        if reply.get("error") not in quiet:  # a success has none
            return reply
    for code in quiet[1:]:
        for reply in answers:
            if reply.get("error") == code:
                return reply
    return None
