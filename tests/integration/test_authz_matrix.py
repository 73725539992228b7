"""The authorization matrix: every topic of the contract, every kind of peer, every action.

The topics come from docs/topics.md (part 1, everything in backticks that reads
as a ``<area>.v1.<kind>...`` topic or pattern; ``<sid>``, ``*`` and ``>`` become
one concrete token).  Their *family* is the first three tokens; each family
needs a rule in :data:`RULES`, so a family added to the contract without one
fails (``no rule for topic family X``) until someone decides who may use it.

The peers, against one real supervisor over its socket (real ``SO_PEERCRED``:
forked clients that take other uids, so the test needs root):

- ``unmapped``: uid 65532, in the socket's group but mapped to no principal (its
  attempts rotate through hellos as cli, as cli for alice, as capsule, as emit);
- ``alice`` (the principal) and ``bob`` (another principal): users, uids 65533
  and 65534, bound by the default ``bus.user_publish`` / ``bus.user_subscribe``;
- ``alice_emit``: alice's uid with role ``emit`` (what ``astrid-emit`` uses):
  ``sage.v1.hook.>`` to publish, nothing to subscribe;
- ``admin``: the supervisor's own uid (root), no principal, no ACL;
- ``admin_as_alice``: the same uid, its hello naming principal alice (no ACL: not
  a user, but its envelopes and requests are alice's);
- ``capsule``: a worker capsule whose manifest publishes ``>`` and
  ``sage.v1.audit.>`` and subscribes ``>``, over the socketpair the supervisor
  made for it.

Each peer subscribes to every topic, publishes on every topic (on its own
behalf, and admins and capsules also on behalf of alice; alice also tries on
behalf of bob) and requests on every topic, answering every request it is
handed with a reply token.  What should happen is computed by :func:`may_publish`,
:func:`may_subscribe`, :func:`receives` and :func:`entitled` from the table and
the broker's rules (docs/security.md, ACLs and Request/reply):

- users publish and subscribe what their family's rule says; admins and
  capsules (within their manifest) anything;
- ``*.v1.audit.>`` is protected: never a user's to publish, whatever the ACL
  (``demo.>`` covers ``demo.v1.audit.x1``), and a capsule's only through a
  pattern inside it (``sage.v1.audit.>``, not ``>``);
- sealed topics (``sage.v1.request.install``) reach no socket connection;
- an envelope with a principal reaches only that principal's user connections,
  one without a principal reaches no user connection (admins and capsules get
  both); a user cannot publish on behalf of another principal;
- a request's reply token goes only to entitled responders: anyone but a user's
  connection, and a user's connection only for a user's request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from bus.client import BusClient, RemoteSubscription
from bus.errors import BusError
from bus.topics import pattern_matches
from tests.support.as_uid import Say, fork_as
from tests.support.daemon import Daemon, short_dir

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "topics.md"

UNMAPPED, ALICE, BOB = 65532, 65533, 65534
ACTORS = ("unmapped", "alice", "alice_emit", "bob", "admin", "admin_as_alice", "capsule")
USERS = {"alice": "alice", "alice_emit": "alice", "bob": "bob"}
"""Actors the broker treats as users (a principal and an ACL), and their principals."""
SEALED = frozenset({"sage.v1.request.install"})
"""Topics the bus delivers in-process only (docs/security.md, The secret store)."""
ANSWERED_IN_PROCESS = (
    "sage.v1.request.status",
    "sage.v1.request.capsule.*",
    "sage.v1.request.fleet.status",
    "sage.v1.request.audit.verify_fleet",
    "sage.v1.request.usage.*",
)
"""Patterns of the requests the supervisor itself answers (no capsule runs in this test):
the status, the fleet status, the fleet audit's verify, the usage ledger's admit, report
and budget (each answers a caller it refuses with an error reply), and every ``capsule.<verb>`` (an
unknown verb is answered ``unknown_request``)."""
PROBE_MODULE = "tests.integration.test_authz_matrix"
EXTRA_TOPICS = ("demo.v1.audit.x1",)
"""Not in docs/topics.md as a v1 topic: ``demo.>`` (Free topics) covering an audit topic."""


@dataclass(frozen=True)
class Rule:
    user_publish: bool
    user_subscribe: bool
    why: str


RULES: dict[str, Rule] = {
    # the default bus.user_publish: sage.v1.request.>, sage.v1.hook.>, llm.v1.request.>, demo.>
    # the default bus.user_subscribe: sage.v1.event.>, sage.v1.approver.>, hook.v1.event.>,
    # llm.v1.stream.>, demo.>
    "sage.v1.request": Rule(True, False, "users ask; only capsules and admins answer"),
    "sage.v1.hook": Rule(
        True, False, "astrid-emit and users publish hooks, the hooks capsule reads"
    ),
    "llm.v1.request": Rule(True, False, "users ask the completion provider"),
    "demo.v1.echo": Rule(True, True, "demo.> is free for users"),
    "demo.v1.audit": Rule(True, True, "demo.> covers it, but it is an audit topic"),
    "sage.v1.event": Rule(False, True, "session events, scoped to the session's principal"),
    "sage.v1.approver": Rule(
        False, True, "a session's approvers say they are there; nothing is published"
    ),
    "hook.v1.event": Rule(False, True, "validated hook events, scoped to the principal"),
    "llm.v1.stream": Rule(False, True, "the generation stream, scoped to the requester"),
    "sage.v1.audit": Rule(False, False, "the audit log: the supervisor's, admins', capsules'"),
    "forge.v1.audit": Rule(False, False, "the forge's audit entries"),
    "llm.v1.audit": Rule(False, False, "the completion provider's audit entries"),
    "sage.v1.capsules": Rule(False, False, "capsule state, between the supervisor and bridge"),
    "sage.v1.notification": Rule(False, False, "republished notifications, capsules only"),
    "sage.v1.tool": Rule(False, False, "tool calls and results between runner and bridge"),
    "sage.v1.tools": Rule(False, False, "the catalogue between bridge and runner"),
    "sage.v1.settings": Rule(False, False, "settings changes, runner to capsules"),
    "sage.v1.install": Rule(False, False, "runner and installer"),
    "sage.v1.fleet": Rule(False, False, "the node's lease, the supervisor to its runner"),
    "approval.v1.request": Rule(False, False, "approval prompts go to approvers (admins)"),
    "approval.v1.response": Rule(False, False, "answers come from approvers (admins)"),
    "forge.v1.request": Rule(False, False, "the runner's forge calls and admins' requests"),
    "tool.v1.execute": Rule(False, False, "bridge to the capsule serving a tool"),
    "tool.v1.request": Rule(False, False, "the bridge asks capsules for their tools"),
    "tool.v1.response": Rule(False, False, "capsules describe their tools"),
    "llm.v1.response": Rule(False, False, "the provider's describe answers"),
}

_CODE = re.compile(r"`([^`\n]+)`")
_TOPIC = re.compile(r"^[A-Za-z0-9_-]+\.v1\.[A-Za-z0-9_-]+(\.([A-Za-z0-9_-]+|<[A-Za-z_]+>|\*|>))*$")
_WILD = re.compile(r"^(<[A-Za-z_]+>|\*|>)$")


# -- the contract --------------------------------------------------------------------------


def documented_topics(text: str) -> list[str]:
    """Every v1 topic or pattern part 1 of docs/topics.md names, as one concrete topic each."""
    implemented = text.split("\n## 2.", 1)[0]
    topics: set[str] = set()
    for code in _CODE.findall(implemented):
        for part in re.split(r"[,\s]+", code):
            if _TOPIC.match(part):
                topics.add(".".join("x1" if _WILD.match(t) else t for t in part.split(".")))
    return sorted(topics)


def family(topic: str) -> str:
    return ".".join(topic.split(".")[:3])


def rule_for(topic: str) -> Rule:
    rule = RULES.get(family(topic))
    if rule is None:
        raise AssertionError(
            f"no rule for topic family {family(topic)} ({topic}): add one to RULES in"
            " tests/integration/test_authz_matrix.py (who may publish and subscribe it?)"
        )
    return rule


def protected(topic: str) -> bool:
    """``*.v1.audit.>``."""
    tokens = topic.split(".")
    return len(tokens) >= 4 and tokens[1:3] == ["v1", "audit"]


def may_publish(actor: str, topic: str) -> bool:
    rule = rule_for(topic)
    if actor == "unmapped":
        return False
    if actor in ("admin", "admin_as_alice"):
        return True
    if actor == "alice_emit":
        return family(topic) == "sage.v1.hook" and not protected(topic)
    if actor == "capsule":  # manifest: publish ">" and "sage.v1.audit.>"
        return not protected(topic) or topic.startswith("sage.v1.audit.")
    return rule.user_publish and not protected(topic)


def may_subscribe(actor: str, topic: str) -> bool:
    rule = rule_for(topic)
    if actor in ("unmapped", "alice_emit"):
        return False
    if actor in USERS:
        return rule.user_subscribe
    return True  # an admin; the capsule's manifest subscribes ">"


def principal_of(actor: str, on_behalf_of: str | None) -> str | None:
    """An envelope's principal: the publisher's own (``on_behalf_of`` is then ignored),
    else the one asked for."""
    if actor == "admin_as_alice":
        return "alice"
    return USERS.get(actor, on_behalf_of)


def receives(viewer: str, principal: str | None, topic: str) -> bool:
    """Whether a subscription of ``viewer`` to ``topic`` gets an envelope of ``principal``."""
    if topic in SEALED:
        return False  # every actor here is a socket connection
    if viewer in USERS:
        return principal == USERS[viewer]
    return True


def entitled(requester: str, viewer: str) -> bool:
    """Whether ``viewer`` is handed the reply token of ``requester``'s request."""
    return viewer not in USERS or requester in USERS


def expected_request(requester: str, topic: str) -> tuple[str, frozenset[str]]:
    """The outcome of ``requester``'s request on ``topic`` and who may have answered it."""
    if requester == "unmapped":
        return "not_authorized", frozenset()
    if not may_publish(requester, topic):
        return "acl_denied", frozenset()
    principal = principal_of(requester, None)
    answerers = {
        viewer
        for viewer in ACTORS
        if may_subscribe(viewer, topic)
        and receives(viewer, principal, topic)
        and entitled(requester, viewer)
    }
    if any(pattern_matches(pattern, topic) for pattern in ANSWERED_IN_PROCESS):
        answerers.add("supervisor")
    if answerers:
        return "reply", frozenset(answerers)
    if protected(topic):
        return "timeout", frozenset()  # only the audit sink was handed the token
    return "no_responders", frozenset()


HELLOS: tuple[tuple[str, str | None], ...] = (
    ("cli", None),
    ("cli", "alice"),
    ("capsule", None),
    ("emit", None),
)
"""The hellos the unmapped uid tries in turn: each is refused."""

EMISSIONS: tuple[tuple[str, str | None], ...] = (
    ("unmapped", None),
    ("alice", None),
    ("alice", "bob"),
    ("alice_emit", None),
    ("bob", None),
    ("admin", None),
    ("admin", "alice"),
    ("admin_as_alice", None),
    ("admin_as_alice", "bob"),
    ("capsule", None),
    ("capsule", "alice"),
)
"""Each topic is published on by these (actor, on behalf of)."""


# -- the peers -----------------------------------------------------------------------------


class Agent:
    """Runs inside a peer: takes commands as JSON lines and acts on its bus client.

    Every envelope a subscription hands it is noted (tag, principal, whether it
    came with a reply token); one with a reply token is answered ``{"by": name}``.
    ``client`` None (the unmapped uid): each action connects afresh and reports
    why it could not.
    """

    def __init__(self, name: str, client: BusClient | None, socket_path: str) -> None:
        self.name = name
        self.client = client
        self.socket_path = socket_path
        self.seen: list[list[Any]] = []
        self._one_at_a_time = anyio.Lock()
        self._attempts = 0

    async def serve(self, control: str) -> None:
        stream = await anyio.connect_unix(control)
        reader = BufferedByteReceiveStream(stream)
        async with anyio.create_task_group() as tg:
            self.tg = tg
            while True:
                try:
                    line = await reader.receive_until(b"\n", 1 << 24)
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    break
                command = json.loads(line)
                if command["op"] == "exit":
                    break
                result = await getattr(self, command["op"])(*command["args"])
                await stream.send(json.dumps(result).encode() + b"\n")
            tg.cancel_scope.cancel()
        await stream.aclose()

    async def _refused(self) -> str:
        async with self._one_at_a_time:  # not past the per-uid connection cap
            self._attempts += 1
            role, principal = HELLOS[self._attempts % len(HELLOS)]
            try:
                async with BusClient.connect(
                    self.socket_path, role=role, name="authz", principal=principal
                ):
                    return "connected"
            except BusError as exc:
                return exc.code

    async def subscribe(self, topics: list[str]) -> list[str]:
        out = []
        for topic in topics:
            if self.client is None:
                out.append(await self._refused())
                continue
            try:
                sub = await self.client.subscribe(topic)
            except BusError as exc:
                out.append(exc.code)
                continue
            self.tg.start_soon(self._collect, sub)
            out.append("ok")
        return out

    async def _collect(self, sub: RemoteSubscription) -> None:
        assert self.client is not None
        async for envelope in sub:
            try:
                tag = json.loads(envelope.payload).get("tag")
            except (ValueError, AttributeError):
                continue
            if not isinstance(tag, str):
                continue  # not the matrix's (an acl_denied audit entry, say)
            self.seen.append([tag, envelope.principal, envelope.reply_to is not None])
            if envelope.reply_to is not None:
                self.client.reply(envelope, {"by": self.name})

    async def publish(self, items: list[list[Any]]) -> list[str]:
        out = []
        for topic, on_behalf_of, tag in items:
            if self.client is None:
                out.append(await self._refused())
                continue
            self.client.publish(topic, {"tag": tag}, on_behalf_of=on_behalf_of)
            try:
                await self.client.flush()
                out.append("ok")
            except BusError as exc:
                out.append(exc.code)
        return out

    async def request(self, items: list[list[str]], deadline: float) -> list[list[str]]:
        out: list[list[str]] = [[] for _ in items]

        async def one(i: int, topic: str, tag: str) -> None:
            if self.client is None:
                out[i] = [await self._refused()]
                return
            try:
                reply = await self.client.request(topic, {"tag": tag}, deadline=deadline)
            except BusError as exc:
                out[i] = [exc.code]
                return
            data = reply.data()
            out[i] = ["reply", data.get("by", "supervisor") if isinstance(data, dict) else "?"]

        async with anyio.create_task_group() as tg:
            for i, (topic, tag) in enumerate(items):
                tg.start_soon(one, i, topic, tag)
        return out

    async def collected(self) -> list[list[Any]]:
        if self.client is not None:
            await self.client.flush()  # what was queued for us before this is in
            await anyio.sleep(0.05)  # and handed to the collectors
        seen, self.seen = self.seen, []
        return seen


async def probe_main(ctx: Any) -> None:
    """The worker capsule's entry: an :class:`Agent` on the socketpair the supervisor made."""
    ctx.ready()
    await Agent("capsule", ctx.client, "").serve(os.environ["AUTHZ_CONTROL"])


def fork_agent(name: str, uid: int | None, socket_path: Path, control: Path) -> int:
    """A peer forked from the test (no exec), under ``uid`` unless None (root, an admin);
    it answers on its control connection, so the pipe of :func:`fork_as` is not read."""

    async def agent(say: Say) -> None:
        if name == "unmapped":
            await Agent(name, None, str(socket_path)).serve(str(control))
            return
        principal = "alice" if name == "admin_as_alice" else None
        role = "emit" if name == "alice_emit" else "cli"
        async with BusClient.connect(
            socket_path, role=role, name=f"authz-{name}", principal=principal
        ) as client:
            await Agent(name, client, str(socket_path)).serve(str(control))

    pid, pipe = fork_as(uid, agent)
    os.close(pipe)
    return pid


class Peer:
    """The test's end of one agent's control connection."""

    def __init__(self, name: str, listener: socket.socket) -> None:
        self.name = name
        self.listener = listener
        self.conn: socket.socket | None = None
        self.buffer = b""

    def accept(self, timeout: float) -> None:
        self.listener.settimeout(timeout)
        self.conn, _ = self.listener.accept()
        self.conn.settimeout(60)

    def call(self, op: str, *args: Any) -> Any:
        assert self.conn is not None, f"{self.name} never connected"
        self.conn.sendall(json.dumps({"op": op, "args": args}).encode() + b"\n")
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(1 << 20)
            assert chunk, f"agent {self.name} went away"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, Peer]]:
    if os.getuid() != 0:
        pytest.fail("the authorization matrix needs root: its peers take other uids")
    root = short_dir()
    root.chmod(0o755)  # the other uids reach the state folder (0750, group nogroup)
    control = root / "ctl"
    control.mkdir()
    control.chmod(0o777)
    listeners: dict[str, socket.socket] = {}
    for name in ACTORS:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(control / name))
        os.chmod(control / name, 0o777)
        listener.listen(1)
        listeners[name] = listener
    probe = root / "probe"
    probe.mkdir()
    (probe / "Capsule.toml").write_text(
        '[package]\nname = "authz-probe"\nversion = "0.1.0"\n'
        '[publish]\npatterns = [">", "sage.v1.audit.>"]\n'
        '[subscribe]\npatterns = [">"]\n'
        "[worker]\n"
        f"command = {json.dumps([sys.executable, '-m', 'sage.capsule.worker', f'{PROBE_MODULE}:probe_main'])}\n"
        f"env = {{ PYTHONPATH = {json.dumps(str(ROOT))},"
        f" AUTHZ_CONTROL = {json.dumps(str(control / 'capsule'))} }}\n"
    )
    daemon = Daemon(
        root,
        f"capsules = [{json.dumps(str(probe))}]\n"
        '[socket]\ngroup = "nogroup"\n'
        f'[[principals]]\nname = "alice"\nuids = [{ALICE}]\n'
        f'[[principals]]\nname = "bob"\nuids = [{BOB}]\n',
    )
    pids: list[int] = []
    out: dict[str, Peer] = {}
    try:
        daemon.start()
        uids = {
            "unmapped": UNMAPPED,
            "alice": ALICE,
            "alice_emit": ALICE,
            "bob": BOB,
            "admin": None,
            "admin_as_alice": None,
        }
        for name, uid in uids.items():
            pids.append(fork_agent(name, uid, daemon.socket, control / name))
        for name in ACTORS:
            out[name] = Peer(name, listeners[name])
            out[name].accept(20)
        yield out
        assert daemon.proc is not None
        assert daemon.proc.poll() is None, "the supervisor died"
    finally:
        for peer in out.values():
            if peer.conn is not None:
                with contextlib.suppress(OSError):
                    peer.conn.sendall(b'{"op": "exit", "args": []}\n')
                peer.conn.close()
        for pid in pids:
            deadline = time.monotonic() + 5
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                if time.monotonic() > deadline:
                    with contextlib.suppress(OSError):
                        os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.02)
        for listener in listeners.values():
            listener.close()
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)


# -- the tests -----------------------------------------------------------------------------


def topics() -> list[str]:
    return [*documented_topics(DOC.read_text()), *EXTRA_TOPICS]


def test_every_topic_family_has_a_rule() -> None:
    """A family added to docs/topics.md without a rule here fails by name."""
    found = topics()
    assert len({family(t) for t in found}) >= 20, "docs/topics.md's topics went missing"
    missing = sorted({family(t) for t in found} - set(RULES))
    assert not missing, f"no rule for topic family {', '.join(missing)} (add one to RULES)"
    unused = sorted(set(RULES) - {family(t) for t in found})
    assert not unused, f"rules for families no longer in docs/topics.md: {unused}"


def test_the_expectations_can_fail() -> None:
    """An undocumented family is refused by name; the rules disagree where they must."""
    added = DOC.read_text().replace(
        "| pub | `sage.v1.capsules.changed` |",
        "| pub | `sage.v1.capsules.changed` |\n| pub | `wiki.v1.page.<name>` |",
    )
    assert "wiki.v1.page.x1" in documented_topics(added)
    with pytest.raises(AssertionError, match=r"no rule for topic family wiki\.v1\.page"):
        may_publish("alice", "wiki.v1.page.x1")
    assert "sage.v1.request.install" in topics()
    assert may_publish("alice", "demo.v1.echo")
    assert not may_publish("alice", "demo.v1.audit.x1")
    assert may_publish("capsule", "sage.v1.audit.spawn")
    assert not may_publish("capsule", "forge.v1.audit.x1")
    assert expected_request("admin", "sage.v1.request.install") == ("no_responders", frozenset())
    assert not receives("bob", "alice", "demo.v1.echo")
    assert not receives("alice", None, "x")


def _diff(expected: dict[Any, Any], actual: dict[Any, Any], what: str) -> list[str]:
    return [
        f"{what} {key}: expected {expected[key]!r}, got {actual.get(key)!r}"
        for key in sorted(expected, key=str)
        if expected[key] != actual.get(key)
    ]


@pytest.mark.timeout(120)
def test_the_matrix_holds_over_the_real_socket(peers: dict[str, Peer]) -> None:
    every = topics()
    started = time.monotonic()
    problems: list[str] = []

    # subscribe: every peer to every topic (they stay subscribed for what follows)
    subscribed: dict[str, set[str]] = {}
    for actor in ACTORS:
        got = peers[actor].call("subscribe", every)
        expected = {(actor, t): "ok" if may_subscribe(actor, t) else _refusal(actor) for t in every}
        problems += _diff(
            expected, dict(zip(((actor, t) for t in every), got, strict=True)), "subscribe"
        )
        subscribed[actor] = {t for t, outcome in zip(every, got, strict=True) if outcome == "ok"}

    # publish: each emission on every topic; who saw what
    sightings: dict[str, set[tuple[str, str | None, bool]]] = {a: set() for a in ACTORS}
    wanted: dict[str, set[tuple[str, str | None, bool]]] = {a: set() for a in ACTORS}
    for actor in ACTORS:
        items: list[tuple[str, str | None, str]] = [
            (t, obo, f"pub|{actor}|{obo}|{t}") for a, obo in EMISSIONS if a == actor for t in every
        ]
        got = peers[actor].call("publish", items)
        published = {
            (actor, obo, t): "ok" if may_publish(actor, t) else _refusal(actor)
            for t, obo, _ in items
        }
        actual = {(actor, obo, t): outcome for (t, obo, _), outcome in zip(items, got, strict=True)}
        problems += _diff(published, actual, "publish")
        for (topic, obo, tag), outcome in zip(items, got, strict=True):
            if outcome != "ok":
                continue
            principal = principal_of(actor, obo)
            for viewer in ACTORS:
                if topic in subscribed[viewer] and receives(viewer, principal, topic):
                    wanted[viewer].add((tag, principal, False))
    for viewer in ACTORS:
        sightings[viewer] = {(t, p, r) for t, p, r in peers[viewer].call("collected")}
        problems += [f"{viewer} saw {s}, not expected" for s in sightings[viewer] - wanted[viewer]]
        problems += [f"{viewer} missed {s}" for s in wanted[viewer] - sightings[viewer]]

    # request: every peer on every topic, answered by whoever was handed the token
    deadline = 1.5
    wanted = {a: set() for a in ACTORS}
    for actor in ACTORS:
        asked = [(t, f"req|{actor}|{t}") for t in every]
        got = peers[actor].call("request", asked, deadline)
        for (topic, tag), outcome in zip(asked, got, strict=True):
            code, answerers = expected_request(actor, topic)
            if outcome[0] != code or (code == "reply" and outcome[1] not in answerers):
                problems.append(
                    f"request by {actor} on {topic}: expected {code} from {sorted(answerers)},"
                    f" got {outcome}"
                )
            if code in ("not_authorized", "acl_denied"):
                continue
            principal = principal_of(actor, None)
            for viewer in ACTORS:
                if topic in subscribed[viewer] and receives(viewer, principal, topic):
                    wanted[viewer].add((tag, principal, entitled(actor, viewer)))
    for viewer in ACTORS:
        seen = {(t, p, r) for t, p, r in peers[viewer].call("collected")}
        problems += [f"{viewer} was handed {s}, not expected" for s in seen - wanted[viewer]]
        problems += [f"{viewer} was not handed {s}" for s in wanted[viewer] - seen]

    assert not problems, f"{len(problems)} cells differ:\n" + "\n".join(problems[:60])
    # the matrix really ran: every actor had allowed and refused cells
    assert subscribed["alice"]
    assert len(subscribed["alice"]) < len(every)
    assert subscribed["admin"] == set(every) == subscribed["capsule"]
    assert not subscribed["unmapped"]
    assert not subscribed["alice_emit"]
    assert time.monotonic() - started < 60


def _refusal(actor: str) -> str:
    return "not_authorized" if actor == "unmapped" else "acl_denied"
