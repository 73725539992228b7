"""Which node may vouch for which principal: the check on forwarded requests and tool calls."""

from __future__ import annotations

import anyio
import pytest

from sage.config import FleetPeerConfig
from sage.errors import NotVouched
from sage.fleet.nodes import NodeRecord, decode_record
from sage.fleet.vouching import TOOL_CALL, VouchedPrincipals, check_vouched, rejected_row

DECLARED = frozenset({"alice", "bob"})


def test_a_principal_the_origin_declares_is_taken() -> None:
    """No pin: whatever the origin's record declares."""
    check_vouched("b", "alice", DECLARED, None)
    check_vouched("b", "bob", DECLARED, FleetPeerConfig())


@pytest.mark.parametrize(
    ("principal", "declared", "pin", "why"),
    [
        ("carol", DECLARED, None, "node 'b' does not authenticate principal 'carol'"),
        ("alice", frozenset(), None, "does not authenticate principal 'alice'"),
        ("alice", None, None, "node 'b' has no heartbeat record here"),
        ("bob", DECLARED, FleetPeerConfig(principals=["alice"]), "[fleet.peers.b] principals"),
        ("alice", DECLARED, FleetPeerConfig(principals=[]), "[fleet.peers.b] principals"),
        (None, DECLARED, None, "an admin's request"),
        (None, DECLARED, FleetPeerConfig(principals=["alice"]), "admins = true"),
    ],
)
def test_anything_else_is_principal_not_authenticated(
    principal: str | None,
    declared: frozenset[str] | None,
    pin: FleetPeerConfig | None,
    why: str,
) -> None:
    """Not declared, no record, outside the pin, or an admin without admins = true."""
    with pytest.raises(NotVouched) as caught:
        check_vouched("b", principal, declared, pin)
    assert caught.value.code == "principal_not_authenticated"
    assert why in str(caught.value)


def test_a_pin_narrows_but_never_widens_the_record() -> None:
    """A pinned principal the record does not declare is still refused; admins = true
    takes the origin's admins whatever the record says."""
    pin = FleetPeerConfig(principals=["alice", "carol"], admins=True)
    check_vouched("b", "alice", DECLARED, pin)
    with pytest.raises(NotVouched):
        check_vouched("b", "carol", DECLARED, pin)
    check_vouched("b", None, None, pin)


def _refusal(principal: str | None) -> NotVouched:
    with pytest.raises(NotVouched) as caught:
        check_vouched("b", principal, DECLARED, None)
    return caught.value


ROW = ["origin", "principal_id", "verb", "session_id", "subject", "reason"]


def test_a_refusal_row_has_exactly_its_fields_and_never_a_payload() -> None:
    """The row of a forwarded request, a tool call (which also names the tool) and an
    adoption: these keys in this order, the reason the refusal's text, and nothing of
    what was sent (no payload, no arguments)."""
    refusal = _refusal("carol")
    request = rejected_row("b", "carol", "send", "s1", "sage.fleet.a.request.b.send.s1", refusal)
    assert request == {
        "origin": "b",
        "principal_id": "carol",
        "verb": "send",
        "session_id": "s1",
        "subject": "sage.fleet.a.request.b.send.s1",
        "reason": "node 'b' does not authenticate principal 'carol'"
        " (not among the principals its heartbeat record declares)",
    }
    assert list(request) == ROW
    call = rejected_row("b", "carol", TOOL_CALL, None, "s", refusal, tool_name="greet")
    assert list(call) == [*ROW[:3], "tool_name", *ROW[3:]]
    assert (call["tool_name"], call["session_id"]) == ("greet", None)
    adopt = rejected_row("b", None, "adopt", "s1", "", _refusal(None))
    assert list(adopt) == ROW
    assert adopt["principal_id"] is None
    assert "an admin's request" in str(adopt["reason"])
    assert "tool_name" not in rejected_row("b", "carol", "adopt", "s1", "", refusal, "greet")


def test_a_refusal_row_cuts_the_names_a_sender_chose() -> None:
    """A tool call's principal, session id and tool name are the sender's: the row keeps
    their longest valid length, however long they came."""
    row = rejected_row("b", "p" * 500, TOOL_CALL, "s" * 500, "x", _refusal("carol"), "t" * 500)
    assert (row["principal_id"], row["session_id"], row["tool_name"]) == (
        "p" * 64,
        "s" * 64,
        "t" * 128,
    )


def _record(node: str, *principals: str) -> NodeRecord:
    return NodeRecord(
        node=node,
        host="h",
        pid=1,
        started_at=0.0,
        heartbeat_at=0.0,
        heartbeat=1.0,
        principals=list(principals),
    )


def test_a_record_declares_its_principals_and_an_old_one_none() -> None:
    """The field round-trips; a record written before it says nothing (None): it declares
    no principal, so nothing is vouched for."""
    record = _record("b", "alice", "bob")
    assert decode_record("b", record.encode()).principals == ["alice", "bob"]
    old = b'{"node":"b","host":"h","pid":1,"started_at":0,"heartbeat_at":0,"heartbeat":1}'
    assert decode_record("b", old).principals is None


class _Bucket:
    """The node bucket as the checker sees it, counting its reads."""

    def __init__(self) -> None:
        self.records: dict[str, NodeRecord] = {}
        self.reads = 0

    async def read(self, node: str) -> NodeRecord | None:
        self.reads += 1
        return self.records.get(node)


@pytest.mark.anyio
async def test_records_are_read_once_while_fresh_and_again_for_a_new_principal() -> None:
    """A taken principal costs no read while the record is fresh; one not held is read
    again once reread_after has passed (just added on the origin), and a flood of
    undeclared ones costs no more reads; past the ttl a removed one is refused."""
    bucket = _Bucket()
    now = [100.0]
    vouched = VouchedPrincipals(bucket.read, {}, ttl=2.0, clock=lambda: now[0], reread_after=0.25)
    bucket.records["b"] = _record("b", "alice")
    await vouched.check("b", "alice")
    await vouched.check("b", "alice")
    assert bucket.reads == 1
    for _ in range(100):
        with pytest.raises(NotVouched):
            await vouched.check("b", "bob")
    assert bucket.reads == 1
    bucket.records["b"] = _record("b", "alice", "bob")  # bob added on b
    with pytest.raises(NotVouched):  # its record was read 0 s ago
        await vouched.check("b", "bob")
    now[0] += 0.3
    await vouched.check("b", "bob")
    assert bucket.reads == 2
    bucket.records["b"] = _record("b", "bob")  # alice removed on b
    await vouched.check("b", "alice")  # still held, within the ttl
    now[0] += 2.5
    with pytest.raises(NotVouched):
        await vouched.check("b", "alice")
    with pytest.raises(NotVouched, match="no heartbeat record"):
        await vouched.check("c", "alice")


@pytest.mark.anyio
async def test_admins_and_pins_come_from_this_nodes_config() -> None:
    """An admin needs admins = true (no read of the bucket); a pin bounds the record."""
    bucket = _Bucket()
    bucket.records["b"] = _record("b", "alice", "bob")
    pins = {"b": FleetPeerConfig(principals=["alice"], admins=True)}
    vouched = VouchedPrincipals(bucket.read, pins, ttl=2.0)
    await vouched.check("b", None)
    assert bucket.reads == 0
    await vouched.check("b", "alice")
    with pytest.raises(NotVouched, match=r"\[fleet.peers.b\] principals"):
        await vouched.check("b", "bob")
    with pytest.raises(NotVouched, match="admins = true"):
        await VouchedPrincipals(bucket.read, {}, ttl=2.0).check("b", None)


@pytest.mark.anyio
async def test_a_bucket_that_cannot_be_read_is_not_a_refusal() -> None:
    """The reader's error goes through (the caller answers fleet_unavailable, no audit)."""

    async def broken(node: str) -> NodeRecord | None:
        raise TimeoutError("nats: timeout")

    with pytest.raises(TimeoutError):
        await VouchedPrincipals(broken, {}, ttl=2.0).check("b", "alice")


class _SlowBucket(_Bucket):
    """A bucket whose reads wait until ``release`` is set (or fail with ``error``)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = anyio.Event()
        self.error: Exception | None = None

    async def read(self, node: str) -> NodeRecord | None:
        self.reads += 1
        await self.release.wait()
        if self.error is not None:
            raise self.error
        return self.records.get(node)


@pytest.mark.anyio
async def test_concurrent_checks_of_one_origin_share_one_read() -> None:
    """Fifty requests of b naming a principal not held at once: one read of b's record,
    whose answer each takes (taken or refused); c's check reads c's record beside it.
    A read that fails fails every check that waited on it, and the next check reads."""
    bucket = _SlowBucket()
    bucket.records["b"] = _record("b", "alice")
    bucket.records["c"] = _record("c", "alice")
    vouched = VouchedPrincipals(bucket.read, {}, ttl=2.0)
    outcomes: list[str] = []

    async def check(origin: str, principal: str) -> None:
        try:
            await vouched.check(origin, principal)
            outcomes.append("taken")
        except NotVouched:
            outcomes.append("refused")

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(check, "b", "alice" if i % 2 else "bob")
        tg.start_soon(check, "c", "alice")
        await anyio.wait_all_tasks_blocked()
        assert bucket.reads == 2  # b's once, c's once
        bucket.release.set()
    assert bucket.reads == 2
    assert (outcomes.count("taken"), outcomes.count("refused")) == (26, 25)

    bucket.release = anyio.Event()
    bucket.error = TimeoutError("nats: timeout")
    failed: list[BaseException] = []

    async def failing() -> None:
        try:
            await vouched.check("d", "alice")
        except TimeoutError as exc:
            failed.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(failing)
        await anyio.wait_all_tasks_blocked()
        bucket.release.set()
    assert (bucket.reads, len(failed)) == (3, 10)
    bucket.error = None
    with pytest.raises(NotVouched, match="no heartbeat record"):
        await vouched.check("d", "alice")
    assert bucket.reads == 4
