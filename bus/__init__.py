"""sage's topic bus: a library of its own that knows nothing of Claude.

NATS-style topics with ``*`` and ``>``, a token trie with a match cache,
envelopes whose source and principal the bus sets, bounded delivery that
never blocks a publisher, request/reply with deadlines, per-identity ACLs,
and a framed wire protocol for remote clients over a Unix socket
(:class:`BusServer` serves a bus there, :class:`BusClient` connects to it).

The names below are imported when first used (PEP 562), so a program that
needs the client only (the ``astrid`` CLI) does not load the broker, the
server and their logging.
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from bus.acl import Acl, Identity, pattern_covers
    from bus.blocking import BlockingClient
    from bus.broker import Bus, BusStats, Subscriber, SubscriptionStats
    from bus.client import BusClient, RemoteSubscription
    from bus.connection import ConnectionState
    from bus.envelope import Envelope, WireEnvelope
    from bus.errors import (
        AclDenied,
        BusClosed,
        BusError,
        ConnectionLost,
        ConnectionStateError,
        FrameError,
        NoResponders,
        NotAuthorized,
        PayloadTooLarge,
        RequestTimeout,
        SlowConsumer,
        TopicError,
        sole_error,
    )
    from bus.server import Authorize, BusServer
    from bus.subscription import FairSubscription, Subscription, SubscriptionState
    from bus.topics import pattern_matches, split_pattern, split_topic
    from bus.trie import TopicTrie
    from bus.unix import PeerCred

__all__ = (
    "Acl",
    "AclDenied",
    "Authorize",
    "BlockingClient",
    "Bus",
    "BusClient",
    "BusClosed",
    "BusError",
    "BusServer",
    "BusStats",
    "ConnectionLost",
    "ConnectionState",
    "ConnectionStateError",
    "Envelope",
    "FairSubscription",
    "FrameError",
    "Identity",
    "NoResponders",
    "NotAuthorized",
    "PayloadTooLarge",
    "PeerCred",
    "RemoteSubscription",
    "RequestTimeout",
    "SlowConsumer",
    "Subscriber",
    "Subscription",
    "SubscriptionState",
    "SubscriptionStats",
    "TopicError",
    "TopicTrie",
    "WireEnvelope",
    "pattern_covers",
    "pattern_matches",
    "sole_error",
    "split_pattern",
    "split_topic",
)

_EXPORTS = {
    "Acl": "bus.acl",
    "Identity": "bus.acl",
    "pattern_covers": "bus.acl",
    "BlockingClient": "bus.blocking",
    "Bus": "bus.broker",
    "BusStats": "bus.broker",
    "Subscriber": "bus.broker",
    "SubscriptionStats": "bus.broker",
    "BusClient": "bus.client",
    "RemoteSubscription": "bus.client",
    "ConnectionState": "bus.connection",
    "Envelope": "bus.envelope",
    "WireEnvelope": "bus.envelope",
    "AclDenied": "bus.errors",
    "BusClosed": "bus.errors",
    "BusError": "bus.errors",
    "ConnectionLost": "bus.errors",
    "ConnectionStateError": "bus.errors",
    "FrameError": "bus.errors",
    "NoResponders": "bus.errors",
    "NotAuthorized": "bus.errors",
    "PayloadTooLarge": "bus.errors",
    "RequestTimeout": "bus.errors",
    "SlowConsumer": "bus.errors",
    "TopicError": "bus.errors",
    "sole_error": "bus.errors",
    "Authorize": "bus.server",
    "BusServer": "bus.server",
    "FairSubscription": "bus.subscription",
    "Subscription": "bus.subscription",
    "SubscriptionState": "bus.subscription",
    "pattern_matches": "bus.topics",
    "split_pattern": "bus.topics",
    "split_topic": "bus.topics",
    "TopicTrie": "bus.trie",
    "PeerCred": "bus.unix",
}


def __getattr__(name: str) -> object:
    """Import a public name's module when the name is first used."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'bus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
