"""Findings of the security review (issue 14) about the bus, pinned over the real socket.

A real supervisor process, and clients forked to run as two other uids
(alice 65533, bob 65534, group nogroup), so the server's ``SO_PEERCRED``
decides who is a user and who is an admin (the test's own uid, root).
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from bus.client import BusClient
from tests.support.daemon import Daemon, short_dir

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as two other uids")

ALICE, BOB = 65533, 65534

Script = Callable[[BusClient], Awaitable[Any]]


class Child:
    """A client forked to run as another uid; its script's result comes back as JSON."""

    def __init__(self, uid: int, socket_path: Path, script: Script) -> None:
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: no exec, the interpreter is already loaded
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(uid)

                async def main() -> Any:
                    async with BusClient.connect(socket_path, role="cli", name="t") as client:
                        return await script(client)

                out = {"ok": anyio.run(main)}
            except BaseException as exc:  # report, never return into pytest
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(write, json.dumps(out).encode())
            os._exit(0)
        os.close(write)
        self._read = read

    def result(self, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        chunks = []
        os.set_blocking(self._read, False)
        while True:
            try:
                chunk = os.read(self._read, 65536)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.kill(self.pid, 9)
                    raise AssertionError("the child did not finish") from None
                time.sleep(0.02)
                continue
            if not chunk:
                break
            chunks.append(chunk)
        os.close(self._read)
        os.waitpid(self.pid, 0)
        out = json.loads(b"".join(chunks))
        assert "ok" in out, out["error"]
        return out["ok"]


def mailbox() -> Path:
    """A folder the other uids may write to (a child says "subscribed" by a file in it)."""
    folder = short_dir()
    folder.chmod(0o777)
    return folder


def wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 10
    while not path.exists():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def run_as(uid: int, daemon: Daemon, script: Script) -> Any:
    return Child(uid, daemon.socket, script).result()


def start(extra: str = "") -> Daemon:
    root = short_dir()
    root.chmod(0o755)  # the other uids must reach the state folder (0750, group nogroup)
    return Daemon(
        root,
        'capsules = ["echo", "tools", "greeter", "hooks"]\n'
        f"{extra}\n"
        '[socket]\ngroup = "nogroup"\n'
        f'[[principals]]\nname = "alice"\nuids = [{ALICE}]\n'
        f'[[principals]]\nname = "bob"\nuids = [{BOB}]\n',
    ).start()


def stop(d: Daemon) -> None:
    assert d.proc is not None
    assert d.proc.poll() is None, "the supervisor died"
    assert d.stop() == 0


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = start()
    yield d
    stop(d)


@pytest.fixture
def limited() -> Iterator[Daemon]:
    """A supervisor whose audit sink takes 20 entries a second from a publisher, 50 at once."""
    d = start("[audit]\nrate_per_source = 20.0\nburst_per_source = 50")
    yield d
    stop(d)


def audit_rows(daemon: Daemon) -> list[tuple[str, str, str, dict[str, Any]]]:
    """(kind, principal, session, payload) of every committed entry."""
    db = sqlite3.connect(f"file:{daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT kind, principal, session, payload FROM entries").fetchall()
    finally:
        db.close()
    return [(k, p, s, json.loads(payload)) for k, p, s, payload in rows]


def admin_request(daemon: Daemon, topic: str, payload: Any, *extra: str) -> Any:
    result = daemon.astrid("bus", "request", topic, json.dumps(payload), "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# -- M1: the audit log is written by the supervisor and its capsules, not by users ----------


def test_a_user_cannot_write_the_audit_log_through_a_wildcard(daemon: Daemon) -> None:
    """demo.> is in the default user ACL; demo.v1.audit.<x> is still refused and not recorded."""

    async def forge(client: BusClient) -> list[str]:
        outcomes = []
        for topic in ("demo.v1.audit.forged", "sage.v1.audit.tool_call"):
            client.publish(topic, {"session_id": "alice-session", "principal_id": "alice"})
            try:
                await client.flush()
                outcomes.append("accepted")
            except Exception as exc:
                outcomes.append(type(exc).__name__)
        return outcomes

    assert run_as(BOB, daemon, forge) == ["AclDenied", "AclDenied"]
    admin_request(daemon, "sage.v1.request.status", {})  # everything before is settled
    rows = audit_rows(daemon)
    assert not [r for r in rows if r[0] in ("demo.v1.audit.forged", "sage.v1.audit.tool_call")]
    assert not [r for r in rows if r[2] == "alice-session"]
    denied = [r[3]["payload"] for r in rows if r[0] == "sage.v1.audit.acl_denied"]
    assert {d["topic"] for d in denied} >= {"demo.v1.audit.forged", "sage.v1.audit.tool_call"}
    assert all(d["principal"] == "bob" for d in denied)


def test_a_tool_call_naming_another_principals_session_is_refused(daemon: Daemon) -> None:
    """bob's sage.v1.request.tool.call with alice's session id: refused, her id never audited."""
    opened = admin_request(daemon, "sage.v1.request.repl.open", {"principal_id": "alice"})
    alice_sid = opened["payload"]["session_id"]
    deadline = time.monotonic() + 20
    while not admin_request(daemon, "sage.v1.request.tools", {})["payload"]["tools"]:
        assert time.monotonic() < deadline, "the greeter's tools never appeared"
        time.sleep(0.1)

    def call(sid: str) -> Script:
        async def script(client: BusClient) -> Any:
            payload = {"tool_name": "greet", "arguments": {"name": "Ada"}, "session_id": sid}
            reply = await client.request("sage.v1.request.tool.call", payload, deadline=10)
            return reply.data()

        return script

    foreign = run_as(BOB, daemon, call(alice_sid))
    assert foreign["isError"] is True
    assert "unknown_session" in foreign["content"][0]["text"]
    unknown = run_as(BOB, daemon, call("repl-0000000000000000"))
    assert (
        unknown["content"][0]["text"].replace("repl-0000000000000000", alice_sid)
        == (foreign["content"][0]["text"])
    )  # another's session and no session look the same
    own = run_as(ALICE, daemon, call(alice_sid))
    assert own["isError"] is False, own
    admin_request(daemon, "sage.v1.request.status", {})
    calls = [(p, s, d["payload"]) for k, p, s, d in audit_rows(daemon) if k.endswith("tool_call")]
    assert [(p, s) for p, s, _ in calls if s == alice_sid] == [("alice", alice_sid)]
    refused = [c for p, _, c in calls if p == "bob"]
    assert len(refused) == 2
    assert all(c["decision_source"] == "foreign_session" for c in refused)
    assert all(c["session_id"] is None and not c["allowed"] for c in refused)


def test_audit_writes_are_rate_limited_per_source_and_the_drops_reported(
    limited: Daemon,
) -> None:
    """An admin may write audit entries (attributed), but past its bucket they are dropped,
    counted, and the count is written as an entry of the sink's own."""
    sent = 400

    async def flood(client: BusClient) -> None:
        for i in range(sent):
            client.publish("demo.v1.audit.flood", {"i": i})
        await client.flush()

    async def main() -> None:
        async with BusClient.connect(limited.socket) as client:
            await flood(client)

    daemon = limited
    anyio.run(main)
    deadline = time.monotonic() + 10
    while True:
        rows = audit_rows(daemon)
        stored = [r for r in rows if r[0] == "demo.v1.audit.flood"]
        reports = [r[3]["payload"] for r in rows if r[0] == "sage.v1.audit.audit_rate_limited"]
        dropped = sum(r["dropped"] for r in reports)
        if len(stored) + dropped == sent or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert 50 <= len(stored) < 150, len(stored)  # the burst, and what 20/s refilled meanwhile
    assert len(stored) + dropped == sent
    assert all(r["source"].startswith("cli:") for r in reports)
    assert all(r[3]["source"].startswith("cli:") for r in stored)
    assert daemon.status()["audit"]["rate_limited"] == dropped
    assert daemon.astrid("audit", "verify").returncode == 0


# -- M2: an envelope without a principal is not a user's -----------------------------------


def test_an_envelope_without_a_principal_never_reaches_a_user(daemon: Daemon) -> None:
    """An admin's own publish (astrid llm generate's stream, astrid bus pub) has no principal:
    admins and capsules get it, alice's connection does not; one for alice she gets."""
    ready = mailbox() / "ready"

    async def listen(client: BusClient) -> list[list[Any]]:
        got: list[list[Any]] = []
        demo = await client.subscribe("demo.>")
        stream = await client.subscribe("llm.v1.stream.>")
        ready.write_text("yes")

        last = ["llm.v1.stream.sage", "alice"]  # the last publish: all before it are in

        async def collect(sub: Any, scope: anyio.CancelScope) -> None:
            async for envelope in sub:
                got.append([envelope.topic, envelope.principal])
                if got[-1] == last:
                    scope.cancel()

        with anyio.move_on_after(30):  # four astrid starts, however loaded the machine
            async with anyio.create_task_group() as tg:
                tg.start_soon(collect, demo, tg.cancel_scope)
                tg.start_soon(collect, stream, tg.cancel_scope)
        return got

    alice = Child(ALICE, daemon.socket, listen)
    wait_for(ready, "alice never subscribed")
    for topic, extra in (
        ("llm.v1.stream.sage", ()),
        ("demo.v1.note", ()),
        ("demo.v1.for_alice", ("--principal", "alice")),
        ("llm.v1.stream.sage", ("--principal", "alice")),
    ):
        result = daemon.astrid("bus", "pub", topic, '{"text": "x"}', *extra)
        assert result.returncode == 0, result.stderr
    assert sorted(alice.result(), key=str) == [
        ["demo.v1.for_alice", "alice"],
        ["llm.v1.stream.sage", "alice"],
    ]
    assert daemon.status()["bus"]["scoped"] >= 2


# -- L5: only a responder entitled to a request may answer it ----------------------------


def test_a_user_cannot_answer_an_admins_request(daemon: Daemon) -> None:
    """bob listens on demo.> and answers every request he sees: an admin's request (even one
    made for bob) reaches him without its reply token, so the answer is the capsule's or none;
    bob still answers bob's own requests."""
    ready = mailbox() / "ready"

    async def hijack(client: BusClient) -> list[Any]:
        seen: list[Any] = []
        sub = await client.subscribe("demo.>")
        ready.write_text("yes")
        with anyio.move_on_after(6):
            async for envelope in sub:
                if envelope.reply_to is None:
                    seen.append([envelope.topic, None])
                    continue
                client.reply(envelope, {"from": "bob"})
                try:
                    await client.flush()
                    seen.append([envelope.topic, "answered"])
                except Exception as exc:
                    seen.append([envelope.topic, type(exc).__name__])
        return seen

    bob = Child(BOB, daemon.socket, hijack)
    wait_for(ready, "bob never subscribed")
    for _ in range(3):
        asked = daemon.astrid(
            "bus", "request", "demo.v1.only_bob_listens", "{}", "--principal", "bob",
            "--timeout", "0.5",
        )  # fmt: skip
        assert asked.returncode != 0, asked.stdout
        assert "bob" not in asked.stdout
        assert "no responders" in asked.stderr  # at once: nobody who may answer listens
        echoed = daemon.astrid("bus", "request", "demo.v1.echo", '{"x": 1}', "--principal", "bob")
        assert echoed.returncode == 0, echoed.stderr
        assert json.loads(echoed.stdout) == {"echo": {"x": 1}}

    async def ask(client: BusClient) -> Any:
        return (await client.request("demo.v1.bobs_own", {}, deadline=5)).data()

    assert run_as(BOB, daemon, ask) == {"from": "bob"}
    seen = bob.result()
    assert [s for s in seen if s[0] != "demo.v1.bobs_own"] == [
        [topic, None] for _ in range(3) for topic in ("demo.v1.only_bob_listens", "demo.v1.echo")
    ]
    assert ["demo.v1.bobs_own", "answered"] in seen
