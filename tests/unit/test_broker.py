"""The in-process Bus: delivery, identity, drops, ACLs, limits, request/reply, stats."""

from __future__ import annotations

import anyio
import pytest
from structlog.testing import capture_logs

from bus.acl import Acl, Identity
from bus.broker import Bus
from bus.envelope import Envelope
from bus.errors import (
    AclDenied,
    BusClosed,
    NoResponders,
    PayloadTooLarge,
    RequestTimeout,
    TopicError,
)
from bus.subscription import FairSubscription, SubscriptionState

ADMIN = Identity("supervisor")
ALICE = Identity("cli:alice", principal="alice")


def test_publish_delivers_to_matching_subscriptions_only() -> None:
    """An envelope reaches every subscription whose pattern matches, and no other."""
    bus = Bus()
    exact = bus.subscribe("a.b", ADMIN)
    star = bus.subscribe("a.*", ADMIN)
    rest = bus.subscribe("a.>", ADMIN)
    other = bus.subscribe("x.>", ADMIN)
    env = bus.publish(ALICE, "a.b", {"n": 1})
    assert exact.drain() == [env]
    assert star.drain() == [env]
    assert rest.drain() == [env]
    assert other.drain() == []
    assert env.data() == {"n": 1}
    assert bus.delivered == 3
    assert bus.published == 1


def test_source_and_principal_come_from_the_identity() -> None:
    """The bus stamps source and principal from the publisher's Identity."""
    bus = Bus()
    sub = bus.subscribe(">", ADMIN)
    bob = Identity("capsule:web", principal="bob")
    bus.publish_raw(bob, "t", b'{"source":"forged","principal":"root"}')
    (env,) = sub.drain()
    assert env.source == "capsule:web"
    assert env.principal == "bob"
    assert env.data() == {"source": "forged", "principal": "root"}
    assert env.ts > 0
    assert env.reply_to is None


def test_envelope_ids_increase() -> None:
    """Envelope ids are a strictly increasing sequence."""
    bus = Bus()
    ids = [bus.publish(ADMIN, "t", i).id for i in range(5)]
    assert ids == sorted(set(ids))


def test_correlation_id_is_carried() -> None:
    """A correlation_id given to publish is in the delivered envelope."""
    bus = Bus()
    sub = bus.subscribe("t", ADMIN)
    bus.publish(ADMIN, "t", None, correlation_id="c-7")
    assert sub.drain()[0].correlation_id == "c-7"


def test_full_queue_drops_and_counts_without_blocking() -> None:
    """Past the queue limit publish returns at once; the extra envelopes are dropped and counted."""
    bus = Bus(queue_size=3)
    slow = bus.subscribe("t", ADMIN)
    roomy = bus.subscribe("t", ADMIN, limit=100)
    with capture_logs() as logs:
        for i in range(10):
            bus.publish(ADMIN, "t", i)
    assert [e.data() for e in slow.drain()] == [0, 1, 2]
    assert slow.dropped == 7
    assert slow.delivered == 3
    assert len(roomy) == 10
    assert bus.dropped == 7
    assert bus.delivered == 13
    drops = [entry for entry in logs if entry["event"] == "bus.drop"]
    assert [d["dropped"] for d in drops] == [1]


def test_drops_stay_counted_after_unsubscribe() -> None:
    """Drops of a subscription that has since closed still count in bus.dropped."""
    bus = Bus(queue_size=1)
    sub = bus.subscribe("t", ADMIN)
    bus.publish(ADMIN, "t", 1)
    bus.publish(ADMIN, "t", 2)
    sub.close()
    assert bus.dropped == 1
    assert bus.stats().subscriptions == 0


def test_closed_subscription_gets_nothing() -> None:
    """Closing a subscription unsubscribes it from the bus."""
    bus = Bus()
    sub = bus.subscribe("t", ADMIN)
    sub.close()
    assert sub.state is SubscriptionState.CLOSED
    bus.publish(ADMIN, "t", 1)
    assert len(sub) == 0
    assert bus.delivered == 0


@pytest.mark.anyio
async def test_consumer_receives_in_order_and_stops_after_close() -> None:
    """async-for yields envelopes in publish order and ends once closed and drained."""
    bus = Bus()
    sub = bus.subscribe("t", ADMIN)
    got: list[int] = []

    async def consume() -> None:
        async for env in sub:
            got.append(env.data())

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        await anyio.wait_all_tasks_blocked()
        for i in range(5):
            bus.publish(ADMIN, "t", i)
        await anyio.wait_all_tasks_blocked()
        bus.publish(ADMIN, "t", 5)
        sub.close()
    assert got == [0, 1, 2, 3, 4, 5]


def _fair(bus: Bus, limit: int) -> FairSubscription:
    sub = FairSubscription("t", ADMIN, limit, key=lambda e: e.source, on_close=bus.remove)
    bus.add(sub)
    return sub


@pytest.mark.anyio
async def test_a_fair_subscription_bounds_each_source_and_serves_them_in_turn() -> None:
    """A flooding source fills its own lane only: another source's envelopes are
    all queued and served between the flood's, and the drops are counted per source."""
    bus = Bus()
    sub = _fair(bus, 3)
    bob, carol = Identity("emit:1001"), Identity("emit:1002")
    for i in range(10):
        bus.publish(bob, "t", f"b{i}")
    bus.publish(carol, "t", "c0")
    bus.publish(carol, "t", "c1")
    assert len(sub) == 5
    assert sub.dropped == 7
    assert sub.take_drops() == {"emit:1001": 7}
    assert sub.take_drops() == {}
    got = [sub.get_nowait(), await sub.get(), await sub.__anext__()]
    assert [e.data() for e in got if e is not None] == ["b0", "c0", "b1"]
    bus.publish(bob, "t", "b10")  # a freed slot in bob's lane
    assert [e.data() for e in sub.drain()] == ["c1", "b2", "b10"]
    assert len(sub) == 0
    sub.close()
    bus.publish(carol, "t", "late")
    assert len(sub) == 0
    with pytest.raises(anyio.EndOfStream):
        await sub.get()


def test_malformed_or_wildcard_topic_is_refused() -> None:
    """Publishing to a malformed topic or a wildcard raises TopicError and delivers nothing."""
    bus = Bus()
    sub = bus.subscribe(">", ADMIN)
    for topic in ("a.*", "a.>", "a..b", ""):
        with pytest.raises(TopicError):
            bus.publish(ADMIN, topic, 1)
    assert len(sub) == 0
    with pytest.raises(TopicError):
        bus.subscribe("a.>.b", ADMIN)


def test_acl_refuses_publish_and_subscribe() -> None:
    """A restricted identity gets AclDenied outside its lists; refusals are counted and hooked."""
    bus = Bus()
    seen: list[tuple[str, str, str]] = []
    bus.on_denied(lambda action, who, details: seen.append((action, who.source, details["topic"])))
    web = Identity("capsule:web", acl=Acl(publish=["tool.web.>"], subscribe=["tool.web.*"]))
    everything = bus.subscribe(">", ADMIN)
    bus.publish(web, "tool.web.result", 1)
    with pytest.raises(AclDenied):
        bus.publish(web, "tool.shell.result", 1)
    bus.subscribe("tool.web.call", web)
    with pytest.raises(AclDenied):
        bus.subscribe("tool.>", web)
    with pytest.raises(TopicError):
        bus.publish(web, "tool.web.*", 1)
    assert [e.topic for e in everything.drain()] == ["tool.web.result"]
    assert bus.acl_denied == 2
    assert seen == [
        ("publish", "capsule:web", "tool.shell.result"),
        ("subscribe", "capsule:web", "tool.>"),
    ]
    assert bus.stats().acl_denied == 2


def test_payload_over_limit_is_refused() -> None:
    """A payload larger than max_payload raises PayloadTooLarge; one at the limit passes."""
    bus = Bus(max_payload=10)
    sub = bus.subscribe("t", ADMIN)
    bus.publish_raw(ADMIN, "t", b'"' + b"x" * 8 + b'"')
    with pytest.raises(PayloadTooLarge):
        bus.publish_raw(ADMIN, "t", b'"' + b"x" * 9 + b'"')
    with pytest.raises(PayloadTooLarge):
        bus.publish(ADMIN, "t", "x" * 100)
    assert len(sub) == 1


def _responder(bus: Bus, pattern: str, who: Identity) -> object:
    sub = bus.subscribe(pattern, who)

    async def serve() -> None:
        async for env in sub:
            assert env.reply_to is not None
            bus.reply(who, env.reply_to, {"echo": env.data()})

    return serve


@pytest.mark.anyio
async def test_request_gets_the_reply() -> None:
    """request() returns the responder's reply, stamped with the responder's identity."""
    bus = Bus()
    svc = Identity("capsule:echo", principal="svc")
    serve = _responder(bus, "svc.echo", svc)
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)  # type: ignore[arg-type]
        reply = await bus.request(ALICE, "svc.echo", [1, 2], deadline=2)
        tg.cancel_scope.cancel()
    assert reply.data() == {"echo": [1, 2]}
    assert reply.source == "capsule:echo"
    assert reply.principal == "svc"
    assert reply.topic == "svc.echo"
    assert bus.requests == 1


@pytest.mark.anyio
async def test_request_without_subscribers_fails_at_once() -> None:
    """A request nobody listens to raises NoResponders without waiting for the deadline."""
    bus = Bus(request_timeout=30)
    with anyio.fail_after(1):
        with pytest.raises(NoResponders):
            await bus.request(ADMIN, "nobody.home", 1)
    assert bus.no_responders == 1
    assert bus.stats().no_responders == 1


@pytest.mark.anyio
async def test_request_times_out_and_late_reply_is_counted() -> None:
    """No reply by the deadline raises RequestTimeout; a reply after that returns False and counts."""
    bus = Bus()
    sub = bus.subscribe("svc.slow", ADMIN)
    with pytest.raises(RequestTimeout):
        await bus.request(ALICE, "svc.slow", 1, deadline=0.05)
    (env,) = sub.drain()
    assert env.reply_to is not None
    assert bus.reply(ADMIN, env.reply_to, "too late") is False
    assert bus.late_replies == 1


@pytest.mark.anyio
async def test_second_reply_is_late() -> None:
    """Only the first reply to a request counts; the second is a late reply."""
    bus = Bus()
    sub = bus.subscribe("svc", ADMIN)
    results: list[bool] = []

    async def answer_twice() -> None:
        env = await sub.get()
        assert env.reply_to is not None
        results.append(bus.reply(ADMIN, env.reply_to, 1))
        results.append(bus.reply(ADMIN, env.reply_to, 2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer_twice)
        reply = await bus.request(ADMIN, "svc", 0, deadline=2)
    assert reply.data() == 1
    assert results == [True, False]
    assert bus.late_replies == 1


@pytest.mark.anyio
async def test_only_the_reply_token_routes_a_reply() -> None:
    """A reply to a guessed token or the topic is refused; tokens are long and distinct."""
    bus = Bus()
    sub = bus.subscribe("svc", ADMIN)
    tokens: list[str] = []
    guessed: list[bool] = []

    async def answer() -> None:
        for _ in range(2):
            env = await sub.get()
            assert env.reply_to is not None
            tokens.append(env.reply_to)
            guessed.append(bus.reply(ADMIN, "svc", "guess"))
            guessed.append(bus.reply(ADMIN, str(env.id), "guess"))
            bus.reply(ADMIN, env.reply_to, "real")

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer)
        first = await bus.request(ADMIN, "svc", 0, deadline=2)
        second = await bus.request(ADMIN, "svc", 0, deadline=2)
    assert first.data() == second.data() == "real"
    assert guessed == [False] * 4
    assert len(set(tokens)) == 2
    assert all(len(t) >= 16 for t in tokens)


@pytest.mark.anyio
async def test_request_is_acl_checked() -> None:
    """A request to a topic the identity may not publish to raises AclDenied."""
    bus = Bus()
    bus.subscribe("svc", ADMIN)
    limited = Identity("capsule:x", acl=Acl(publish=["other"]))
    with pytest.raises(AclDenied):
        await bus.request(limited, "svc", 1, deadline=1)


@pytest.mark.anyio
async def test_close_ends_waiting_requests_and_refuses_work() -> None:
    """Closing the bus wakes a waiting request with BusClosed and refuses new publishes."""
    bus = Bus()
    sub = bus.subscribe("svc", ADMIN)

    async def close_soon() -> None:
        await sub.get()
        bus.close()

    async with anyio.create_task_group() as tg:
        tg.start_soon(close_soon)
        with pytest.raises(BusClosed):
            await bus.request(ADMIN, "svc", 1, deadline=5)
    assert sub.state is SubscriptionState.CLOSED
    with pytest.raises(BusClosed):
        bus.publish(ADMIN, "svc", 1)
    with pytest.raises(BusClosed):
        bus.subscribe("svc", ADMIN)


def test_stats_report_counts_and_top_subscriptions() -> None:
    """stats() reports totals and subscriptions ordered by drops, then deliveries."""
    bus = Bus(queue_size=2)
    quiet = bus.subscribe("q", Identity("quiet"))
    busy = bus.subscribe("b", Identity("busy"), limit=100)
    lossy = bus.subscribe("b", Identity("lossy"))
    for _ in range(5):
        bus.publish(ADMIN, "b", 0)
    stats = bus.stats()
    assert stats.published == 5
    assert stats.delivered == 7
    assert stats.dropped == 3
    assert stats.subscriptions == 3
    assert [(s.source, s.delivered, s.dropped, s.queued) for s in stats.top] == [
        ("lossy", 2, 3, 2),
        ("busy", 5, 0, 5),
        ("quiet", 0, 0, 0),
    ]
    assert len(bus.stats(top=1).top) == 1
    assert quiet.pattern == "q"
    assert isinstance(busy.drain()[0], Envelope)
    assert len(lossy) == 2


def test_an_envelope_of_a_principal_reaches_only_its_users_capsules_and_admins() -> None:
    """Per-principal scoping: alice's session events are not bob's to read."""
    bus = Bus()
    users = Acl(publish=["demo.>"], subscribe=["demo.>"])
    alice = Identity("cli:1000", principal="alice", acl=users)
    bob = Identity("cli:1001", principal="bob", acl=users)
    capsule = Identity("capsule:runner", acl=Acl(publish=["demo.>"], subscribe=["demo.>"]))
    admin_as_bob = Identity("cli:0", principal="bob")  # an admin uid that named a principal
    subs = {
        name: bus.subscribe("demo.>", who)
        for name, who in (
            ("alice", alice),
            ("bob", bob),
            ("capsule", capsule),
            ("admin", ADMIN),
            ("admin_as_bob", admin_as_bob),
        )
    }

    def seen() -> set[str]:
        return {name for name, sub in subs.items() if sub.drain()}

    env = bus.publish(capsule, "demo.event", {"n": 1}, on_behalf_of="alice")
    assert env.principal == "alice"
    assert seen() == {"alice", "capsule", "admin", "admin_as_bob"}
    bus.publish(alice, "demo.mine", {})  # a user's own envelope carries its principal
    assert seen() == {"alice", "capsule", "admin", "admin_as_bob"}
    # a user cannot publish on behalf of someone else
    assert bus.publish(bob, "demo.x", {}, on_behalf_of="alice").principal == "bob"
    assert seen() == {"bob", "capsule", "admin", "admin_as_bob"}
    bus.publish(capsule, "demo.nobodys", {})  # no principal: not for users
    assert seen() == {"capsule", "admin", "admin_as_bob"}
    bus.publish(ADMIN, "demo.nobodys", {})
    assert seen() == {"capsule", "admin", "admin_as_bob"}
    assert bus.stats().scoped == 7


@pytest.mark.anyio
async def test_a_request_on_behalf_of_a_principal_carries_it_and_a_user_cannot_forge_it() -> None:
    """request(on_behalf_of=) stamps the request envelope like publish() does."""
    bus = Bus()
    svc = Identity("capsule:forge")
    sub = bus.subscribe("svc.who", svc)
    capsule = Identity("capsule:runner", acl=Acl(publish=["svc.>"], subscribe=[]))

    async def serve() -> None:
        async for env in sub:
            assert env.reply_to is not None
            bus.reply(svc, env.reply_to, {"principal": env.principal})

    async with anyio.create_task_group() as tg:
        tg.start_soon(serve)
        mine = await bus.request(capsule, "svc.who", {}, deadline=2, on_behalf_of="alice")
        public = await bus.request(capsule, "svc.who", {}, deadline=2)
        own = await bus.request(ALICE, "svc.who", {}, deadline=2, on_behalf_of="bob")
        tg.cancel_scope.cancel()
    assert mine.data() == {"principal": "alice"}
    assert public.data() == {"principal": None}
    assert own.data() == {"principal": "alice"}  # a user's own principal wins


def test_protected_topics_only_for_trusted_publishers_and_explicit_capsule_grants() -> None:
    """An audit topic is open to the process and admins, to a capsule whose manifest names an
    audit pattern, and never to a user or astrid-emit, whatever their ACL says."""
    bus = Bus(protected=("*.v1.audit.>",))
    sink = bus.subscribe("*.v1.audit.>", ADMIN)
    wide = Acl(publish=["demo.>", "sage.v1.audit.>"], subscribe=[])
    user = Identity("cli:1000", principal="bob", acl=wide, uid=1000)
    emit = Identity("emit:1000", principal="bob", acl=Acl(publish=[">"]), uid=1000)
    admin = Identity("cli:0", uid=0)
    granted = Identity("capsule:tools", acl=Acl(publish=["sage.v1.audit.>", "demo.>"]))
    wildcard = Identity("capsule:demo", acl=Acl(publish=["demo.>", "sage.>"]))
    for who, topic in (
        (user, "demo.v1.audit.x"),
        (user, "sage.v1.audit.tool_call"),  # even when the operator's ACL names it
        (emit, "sage.v1.audit.x"),
        (granted, "demo.v1.audit.x"),  # granted sage's audit topics, not demo's
        (wildcard, "demo.v1.audit.x"),
        (wildcard, "sage.v1.audit.x"),
    ):
        with pytest.raises(AclDenied):
            bus.publish(who, topic, {})
    bus.publish(ADMIN, "sage.v1.audit.started", {})
    bus.publish(admin, "demo.v1.audit.x", {})
    bus.publish(granted, "sage.v1.audit.tool_call", {})
    bus.publish(user, "demo.v1.other", {})  # the rest of demo.> stays the user's
    assert [(e.topic, e.source) for e in sink.drain()] == [
        ("sage.v1.audit.started", "supervisor"),
        ("demo.v1.audit.x", "cli:0"),
        ("sage.v1.audit.tool_call", "capsule:tools"),
    ]
    assert bus.acl_denied == 6


@pytest.mark.anyio
async def test_a_request_on_a_protected_topic_is_refused_to_a_user() -> None:
    """Requests are checked as publishes, protected topics included."""
    bus = Bus(protected=("*.v1.audit.>",))
    bus.subscribe("demo.v1.audit.q", ADMIN)
    user = Identity("cli:1000", principal="bob", acl=Acl(publish=["demo.>"]), uid=1000)
    with pytest.raises(AclDenied):
        await bus.request(user, "demo.v1.audit.q", {}, deadline=1)


@pytest.mark.anyio
async def test_only_subscribers_entitled_to_a_request_get_its_token_and_may_answer() -> None:
    """An admin's request for bob reaches bob's connection without reply_to, and a reply
    from bob (with a token he got elsewhere) is refused; the capsule's is taken."""
    bus = Bus()
    user_acl = Acl(publish=["demo.>"], subscribe=["demo.>"])
    bob = Identity("cli:1001", principal="bob", acl=user_acl, uid=1001)
    bob2 = Identity("cli:1001", principal="bob", acl=Acl(["demo.>"], ["demo.>"]), uid=1001)
    capsule = Identity("capsule:svc", acl=Acl(publish=[], subscribe=["demo.>"]))
    admin_as_bob = Identity("cli:0", principal="bob", uid=0)
    bobs = bus.subscribe("demo.>", bob)
    svc = bus.subscribe("demo.q", capsule)
    refused: list[str] = []

    async def answer() -> None:
        request = await svc.get()
        assert request.reply_to is not None
        seen = bobs.drain()
        assert [e.reply_to for e in seen] == [None]  # bob saw the request, not its token
        try:
            bus.reply(bob, request.reply_to, {"from": "bob"})
        except AclDenied as exc:
            refused.append(str(exc))
        bus.reply(capsule, request.reply_to, {"from": "capsule"})

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer)
        reply = await bus.request(admin_as_bob, "demo.q", {}, deadline=2)
    assert reply.data() == {"from": "capsule"}
    assert len(refused) == 1
    assert "not delivered to it as a responder" in refused[0]
    assert bus.acl_denied == 1

    # a user's own request: that principal's connections are entitled (equal identities too)
    async def own() -> None:
        request = await bobs.get()
        assert request.reply_to is not None
        bus.reply(bob2, request.reply_to, {"from": "bob"})

    svc.close()
    async with anyio.create_task_group() as tg:
        tg.start_soon(own)
        reply = await bus.request(bob, "demo.mine", {}, deadline=2)
    assert reply.data() == {"from": "bob"}


@pytest.mark.anyio
async def test_a_request_only_users_could_see_but_not_answer_has_no_responders() -> None:
    """Subscribers that may not answer do not count: no_responders at once, not a timeout."""
    bus = Bus()
    bob = Identity("cli:1001", principal="bob", acl=Acl(["demo.>"], ["demo.>"]), uid=1001)
    seen = bus.subscribe("demo.>", bob)
    with anyio.fail_after(1), pytest.raises(NoResponders, match="may answer"):
        await bus.request(Identity("cli:0", principal="bob", uid=0), "demo.q", {}, deadline=5)
    assert [e.reply_to for e in seen.drain()] == [None]
    assert bus.no_responders == 1


def test_has_subscribers_besides_one_owner() -> None:
    """A part that follows every event (the fleet router) can ask whether anyone else
    still follows one session's."""
    bus = Bus()
    router = Identity("fleet")
    everything = bus.subscribe("sage.v1.event.>", router)
    assert bus.has_subscribers("sage.v1.event.s1.exited")
    assert not bus.has_subscribers("sage.v1.event.s1.exited", besides=router)
    watcher = bus.subscribe("sage.v1.event.s1.>", Identity("cli:0"))
    assert bus.has_subscribers("sage.v1.event.s1.exited", besides=router)
    assert not bus.has_subscribers("sage.v1.event.s2.exited", besides=router)
    watcher.close()
    everything.close()
    assert not bus.has_subscribers("sage.v1.event.s1.exited")
