"""sage's topic bus: a library of its own that knows nothing of Claude.

NATS-style topics with ``*`` and ``>``, a token trie with a match cache,
envelopes whose source and principal the bus sets, bounded delivery that
never blocks a publisher, request/reply with deadlines, per-identity ACLs,
and a framed wire protocol for remote clients over a Unix socket
(:class:`BusServer` serves a bus there, :class:`BusClient` connects to it).
"""

from bus.acl import Acl, Identity, pattern_covers
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
