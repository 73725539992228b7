"""sage's topic bus: a library of its own that knows nothing of Claude.

NATS-style topics with ``*`` and ``>``, a token trie with a match cache,
envelopes whose source and principal the bus sets, bounded delivery that
never blocks a publisher, request/reply with deadlines, per-identity ACLs,
and a framed wire protocol for remote clients over a Unix socket.
"""

from bus.acl import Acl, Identity, pattern_covers
from bus.broker import Bus, BusStats, Subscriber, SubscriptionStats
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
from bus.subscription import FairSubscription, Subscription, SubscriptionState
from bus.topics import pattern_matches, split_pattern, split_topic
from bus.trie import TopicTrie

__all__ = (
    "Acl",
    "AclDenied",
    "Bus",
    "BusClosed",
    "BusError",
    "BusStats",
    "ConnectionLost",
    "ConnectionStateError",
    "Envelope",
    "FairSubscription",
    "FrameError",
    "Identity",
    "NoResponders",
    "NotAuthorized",
    "PayloadTooLarge",
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
