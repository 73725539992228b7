"""The in-process bus: publish, subscribe, request/reply, ACLs and statistics.

:class:`Bus` matches each published topic against a :class:`TopicTrie` of
subscribers and hands the envelope to each one's ``deliver``, which never
blocks (a full in-process queue drops and counts; a remote connection has
its own slow-consumer rule).  Requests carry a random ``reply_to`` token; a
reply is routed by that token straight to the waiting requester.  The token
goes only to the subscribers entitled to answer (not a user's connection,
unless a user asked), and the broker takes a reply only from one of those.
A request to a topic nobody subscribes to fails at once with
:class:`NoResponders`.
"""

from __future__ import annotations

import itertools
import math
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import anyio
import msgspec
import structlog

from bus.acl import Identity, pattern_covers, patterns_overlap
from bus.envelope import Envelope
from bus.errors import AclDenied, BusClosed, NoResponders, PayloadTooLarge, RequestTimeout
from bus.subscription import Subscription
from bus.topics import split_pattern, split_topic
from bus.trie import TopicTrie

__all__ = ("Bus", "BusStats", "Subscriber", "SubscriptionStats")

log = structlog.get_logger("bus")
_now = time.time

_encode = msgspec.json.Encoder().encode


class Subscriber(Protocol):
    """Anything the bus can deliver to (an in-process Subscription, a remote one)."""

    pattern: str
    owner: Identity
    delivered: int
    dropped: int

    def deliver(self, envelope: Envelope) -> bool: ...


class SubscriptionStats(msgspec.Struct, frozen=True):
    pattern: str
    source: str
    delivered: int
    dropped: int
    queued: int


class BusStats(msgspec.Struct, frozen=True):
    published: int
    delivered: int
    dropped: int
    requests: int
    no_responders: int
    late_replies: int
    acl_denied: int
    subscriptions: int
    top: list[SubscriptionStats]
    scoped: int = 0
    """Deliveries withheld because the envelope belongs to another principal."""


class _Pending:
    __slots__ = ("done", "entitled", "requester", "responders", "result", "topic")

    def __init__(self, topic: str, requester: Identity) -> None:
        self.topic = topic
        self.requester = requester
        self.entitled = 0
        """Subscribers entitled to answer that the request was offered to."""
        self.responders: list[Identity] = []
        """Who the request was delivered to as a responder: the only ones who may answer."""
        self.done = anyio.Event()
        self.result: Envelope | None = None


def _is_user(identity: Identity) -> bool:
    """A user's connection: it acts for a principal and is bound by an ACL."""
    return identity.acl is not None and identity.principal is not None


class Bus:
    """A topic bus in one process.  Not thread-safe: use it from its event loop."""

    def __init__(
        self,
        *,
        max_payload: int = 1024 * 1024,
        queue_size: int = 1024,
        request_timeout: float = 5.0,
        sealed: tuple[str, ...] = (),
        protected: tuple[str, ...] = (),
    ) -> None:
        self.max_payload = max_payload
        self.sealed = sealed
        """Patterns whose envelopes carry secrets: only in-process subscribers get them."""
        for pattern in protected:
            split_pattern(pattern)
        self.protected = protected
        """Patterns only trusted publishers may use (the audit topics), see :meth:`may_write`."""
        self.queue_size = queue_size
        self.request_timeout = request_timeout
        self._trie: TopicTrie[Subscriber] = TopicTrie()
        self._match = self._trie.cache
        self._valid: set[str] = set()
        self._ids = itertools.count(1)
        self._subscribers: dict[int, Subscriber] = {}
        self._pending: dict[str, _Pending] = {}
        self._closed = False
        self._sealed_off: set[int] = set()
        self._sealed_topics: dict[str, bool] = {}
        self._protected_topics: dict[str, bool] = {}
        self._audit_hook: Callable[[str, Identity, dict[str, Any]], None] | None = None
        self.published = 0
        self._delivered_gone = 0
        self.requests = 0
        self.no_responders = 0
        self.late_replies = 0
        self.acl_denied = 0
        self.scoped = 0
        self._dropped_gone = 0

    # -- subscribing -------------------------------------------------------

    def subscribe(self, pattern: str, owner: Identity, *, limit: int | None = None) -> Subscription:
        """A new bounded subscription to ``pattern``; close it to unsubscribe."""
        self._check_subscribe(pattern, owner)
        sub = Subscription(pattern, owner, limit or self.queue_size, on_close=self.remove)
        self._add(sub)
        return sub

    def add(self, subscriber: Subscriber) -> None:
        """Attach a subscriber that is not a Subscription (e.g. a remote one).

        Remote subscribers never get envelopes on sealed topics, not even an
        admin's ``>``: those are delivered inside the process only."""
        self._check_subscribe(subscriber.pattern, subscriber.owner)
        self._add(subscriber)
        if any(patterns_overlap(sealed, subscriber.pattern) for sealed in self.sealed):
            self._sealed_off.add(id(subscriber))

    def remove(self, subscriber: Subscriber) -> None:
        self._sealed_off.discard(id(subscriber))
        if self._subscribers.pop(id(subscriber), None) is not None:
            self._trie.remove(subscriber.pattern, subscriber)
            self._dropped_gone += subscriber.dropped
            self._delivered_gone += subscriber.delivered

    def _add(self, subscriber: Subscriber) -> None:
        if self._closed:
            raise BusClosed("the bus is closed")
        self._trie.insert(subscriber.pattern, subscriber)
        self._subscribers[id(subscriber)] = subscriber

    def _check_subscribe(self, pattern: str, owner: Identity) -> None:
        split_pattern(pattern)
        if owner.acl is not None and not owner.acl.may_subscribe(pattern):
            self.acl_denied += 1
            self._on_denied("subscribe", owner, pattern)
            raise AclDenied(f"{owner.source} may not subscribe to {pattern!r}")

    # -- publishing --------------------------------------------------------

    def publish(
        self,
        owner: Identity,
        topic: str,
        payload: Any,
        *,
        correlation_id: str | None = None,
        on_behalf_of: str | None = None,
    ) -> Envelope:
        """Publish a Python value (encoded to JSON once) and return its envelope."""
        return self.publish_raw(
            owner, topic, _encode(payload), correlation_id=correlation_id, on_behalf_of=on_behalf_of
        )

    def publish_raw(
        self,
        owner: Identity,
        topic: str,
        payload: bytes,
        *,
        correlation_id: str | None = None,
        reply_to: str | None = None,
        on_behalf_of: str | None = None,
    ) -> Envelope:
        """Publish JSON text that is already encoded (and valid JSON).

        This is the hot path: checks are inlined and cached by topic.

        An envelope carries a principal: the publisher's own, or, for a
        publisher without one (a capsule, an admin), ``on_behalf_of``.  A
        user's connection (one with a principal and an ACL) gets an envelope
        only if it carries that same principal: not another principal's, and
        not one without a principal (the supervisor's, a capsule's or an
        admin's own).  Capsules (no principal) and admins (no ACL) see
        everything their ACL covers.
        """
        if self._closed:
            raise BusClosed("the bus is closed")
        acl = owner.acl
        if acl is None:
            if topic not in self._valid:
                split_topic(topic)
                if len(self._valid) > 8192:
                    self._valid.clear()
                self._valid.add(topic)
        elif not acl.may_publish(topic) or (self.protected and not self.may_write(owner, topic)):
            self.acl_denied += 1
            self._on_denied("publish", owner, topic)
            raise AclDenied(f"{owner.source} may not publish to {topic!r}")
        if len(payload) > self.max_payload:
            _check_size(payload, self.max_payload)
        principal = owner.principal if owner.principal is not None else on_behalf_of
        envelope = Envelope(
            next(self._ids),
            topic,
            payload,
            owner.source,
            principal,
            correlation_id,
            reply_to,
            _now(),
        )
        self.published += 1
        subs = self._match.get(topic)
        if subs is None:
            subs = self._trie.match(topic)
        if reply_to is not None:
            self._fan_out_request(envelope, subs)
            return envelope
        sealed_off = self._sealed_off
        for sub in subs:
            if sealed_off and id(sub) in sealed_off and self._is_sealed(topic):
                self.scoped += 1  # a secret-bearing topic: in-process subscribers only
                continue
            viewer = sub.owner
            who = viewer.principal
            if who is not None and who != principal and viewer.acl is not None:
                self.scoped += 1  # another principal's envelope, or nobody's: not for this user
                continue
            if not sub.deliver(envelope) and _is_power_of_ten(sub.dropped):
                log.warning(
                    "bus.drop",
                    pattern=sub.pattern,
                    subscriber=sub.owner.source,
                    dropped=sub.dropped,
                )
        return envelope

    def _fan_out_request(self, envelope: Envelope, subs: Iterable[Subscriber]) -> None:
        """Deliver a request: the same scoping as a publish, and the reply token only to
        the subscribers entitled to answer, who are noted on the pending request.

        Entitled: the process's parts, capsules and admins (whoever is not a
        user's connection); a user's connection only for a user's request (of
        its own principal, by the scoping).  Other subscribers get the
        request without ``reply_to``, as a plain message."""
        pending = self._pending.get(envelope.reply_to or "")
        requester_is_user = pending is not None and _is_user(pending.requester)
        principal = envelope.principal
        plain: Envelope | None = None
        for sub in subs:
            viewer = sub.owner
            if id(sub) in self._sealed_off and self._is_sealed(envelope.topic):
                self.scoped += 1
                continue
            if viewer.acl is not None and viewer.principal not in (None, principal):
                self.scoped += 1
                continue
            if pending is not None and (requester_is_user or not _is_user(viewer)):
                pending.entitled += 1
                delivered = sub.deliver(envelope)
                if delivered and viewer not in pending.responders:
                    pending.responders.append(viewer)
            else:
                if plain is None:
                    plain = msgspec.structs.replace(envelope, reply_to=None)
                delivered = sub.deliver(plain)
            if not delivered and _is_power_of_ten(sub.dropped):
                log.warning(
                    "bus.drop", pattern=sub.pattern, subscriber=viewer.source, dropped=sub.dropped
                )

    def _is_sealed(self, topic: str) -> bool:
        hit = self._sealed_topics.get(topic)
        if hit is None:
            hit = any(patterns_overlap(sealed, topic) for sealed in self.sealed)
            if len(self._sealed_topics) > 4096:
                self._sealed_topics.clear()
            self._sealed_topics[topic] = hit
        return hit

    def may_write(self, owner: Identity, topic: str) -> bool:
        """Whether ``owner`` may publish on ``topic`` as far as :attr:`protected` goes.

        A protected topic (an audit topic) is open to publishers without an
        ACL (the process's own parts, admins) and to an in-process publisher
        (no uid, no principal: a capsule) whose ACL grants it by a pattern that
        itself lies inside a protected pattern (``sage.v1.audit.>``, not
        ``demo.>``).  Never to a socket peer with an ACL (a user, ``emit``),
        whatever its ACL says."""
        acl = owner.acl
        if acl is None or not self._is_protected(topic):
            return True
        if owner.uid is not None or owner.principal is not None:
            return False
        return any(
            pattern_covers(granted, topic)
            and any(pattern_covers(protected, granted) for protected in self.protected)
            for granted in acl.publish
        )

    def _is_protected(self, topic: str) -> bool:
        hit = self._protected_topics.get(topic)
        if hit is None:
            hit = any(pattern_covers(protected, topic) for protected in self.protected)
            if len(self._protected_topics) > 4096:
                self._protected_topics.clear()
            self._protected_topics[topic] = hit
        return hit

    def _check_publish(self, owner: Identity, topic: str, payload: bytes) -> None:
        if self._closed:
            raise BusClosed("the bus is closed")
        acl = owner.acl
        if acl is None:
            split_topic(topic)
        elif not acl.may_publish(topic) or (self.protected and not self.may_write(owner, topic)):
            self.acl_denied += 1
            self._on_denied("publish", owner, topic)
            raise AclDenied(f"{owner.source} may not publish to {topic!r}")
        _check_size(payload, self.max_payload)

    def has_subscribers(
        self, topic: str, *, principal: str | None = None, besides: Identity | None = None
    ) -> bool:
        """Whether anyone subscribes to ``topic``; with ``principal``, anyone who would
        receive an envelope of that principal (another principal's user does not);
        ``besides``: anyone but that owner."""
        subs = self._trie.match(topic)
        if besides is not None:
            subs = tuple(sub for sub in subs if sub.owner != besides)
        if principal is None:
            return bool(subs)
        return any(
            sub.owner.acl is None or sub.owner.principal in (None, principal) for sub in subs
        )

    # -- request / reply ---------------------------------------------------

    async def request(
        self,
        owner: Identity,
        topic: str,
        payload: Any,
        *,
        deadline: float | None = None,
        on_behalf_of: str | None = None,
    ) -> Envelope:
        """Publish a request and wait up to ``deadline`` seconds for the first reply.

        ``on_behalf_of`` sets the request envelope's principal as for :meth:`publish`."""
        return await self.request_raw(
            owner, topic, _encode(payload), deadline=deadline, on_behalf_of=on_behalf_of
        )

    async def request_raw(
        self,
        owner: Identity,
        topic: str,
        payload: bytes,
        *,
        deadline: float | None = None,
        on_behalf_of: str | None = None,
    ) -> Envelope:
        token = secrets.token_urlsafe(12)
        pending = _Pending(topic, owner)
        self._pending[token] = pending
        try:
            self.requests += 1
            self._check_publish(owner, topic, payload)
            if not self.has_subscribers(topic):
                self.no_responders += 1
                raise NoResponders(f"no responders on {topic!r}")
            self.publish_raw(owner, topic, payload, reply_to=token, on_behalf_of=on_behalf_of)
            if not pending.entitled:
                self.no_responders += 1  # subscribers, but none that may answer
                raise NoResponders(f"no responders on {topic!r} may answer this request")
            seconds = self.request_timeout if deadline is None else deadline
            with anyio.move_on_after(seconds):
                await pending.done.wait()
            if pending.result is None:
                if self._closed:
                    raise BusClosed("the bus closed while the request waited")
                raise RequestTimeout(f"no reply on {topic!r} within {seconds:g} s")
            return pending.result
        finally:
            self._pending.pop(token, None)

    def reply(self, owner: Identity, reply_to: str, payload: Any) -> bool:
        """Answer the request whose token is ``reply_to``; False when nobody waits."""
        return self.reply_raw(owner, reply_to, _encode(payload))

    def reply_raw(self, owner: Identity, reply_to: str, payload: bytes) -> bool:
        """Answer a request; only a subscriber it was delivered to as a responder may
        (AclDenied for anyone else, counted and audited like any refusal)."""
        _check_size(payload, self.max_payload)
        pending = self._pending.get(reply_to)
        if pending is None or pending.result is not None:
            self.late_replies += 1
            return False
        if owner not in pending.responders:
            self.acl_denied += 1
            self._on_denied("reply", owner, pending.topic)
            raise AclDenied(
                f"{owner.source} may not answer this request on {pending.topic!r}:"
                " it was not delivered to it as a responder"
            )
        pending.result = Envelope(
            id=next(self._ids),
            topic=pending.topic,
            payload=payload,
            source=owner.source,
            principal=owner.principal,
            correlation_id=reply_to,
            ts=_now(),
        )
        pending.done.set()
        return True

    # -- audit of refusals -------------------------------------------------

    def on_denied(self, hook: Callable[[str, Identity, dict[str, Any]], None]) -> None:
        """Call ``hook(action, identity, details)`` when an ACL refuses something."""
        self._audit_hook = hook

    def _on_denied(self, action: str, owner: Identity, topic: str) -> None:
        log.warning("bus.acl_denied", action=action, source=owner.source, topic=topic)
        if self._audit_hook is not None:
            self._audit_hook(action, owner, {"topic": topic})

    # -- statistics and lifetime -------------------------------------------

    @property
    def delivered(self) -> int:
        """Envelopes handed to subscribers, counted by the subscribers themselves."""
        return self._delivered_gone + sum(s.delivered for s in self._subscribers.values())

    @property
    def dropped(self) -> int:
        return self._dropped_gone + sum(s.dropped for s in self._subscribers.values())

    def stats(self, top: int = 10) -> BusStats:
        subs = sorted(
            self._subscribers.values(), key=lambda s: (s.dropped, s.delivered), reverse=True
        )
        return BusStats(
            published=self.published,
            delivered=self.delivered,
            dropped=self.dropped,
            requests=self.requests,
            no_responders=self.no_responders,
            late_replies=self.late_replies,
            acl_denied=self.acl_denied,
            scoped=self.scoped,
            subscriptions=len(self._subscribers),
            top=[
                SubscriptionStats(
                    pattern=s.pattern,
                    source=s.owner.source,
                    delivered=s.delivered,
                    dropped=s.dropped,
                    queued=len(s) if isinstance(s, Subscription) else 0,
                )
                for s in subs[:top]
            ],
        )

    def close(self) -> None:
        """Refuse new work and end every in-process subscription."""
        self._closed = True
        for sub in list(self._subscribers.values()):
            if isinstance(sub, Subscription):
                sub.close()
        for pending in self._pending.values():
            pending.done.set()


def _check_size(payload: bytes, limit: int) -> None:
    if len(payload) > limit:
        raise PayloadTooLarge(f"payload of {len(payload)} bytes is over the limit of {limit}")


def _is_power_of_ten(n: int) -> bool:
    return n > 0 and 10 ** round(math.log10(n)) == n
