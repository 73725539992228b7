"""What a capsule's code gets: :class:`CapsuleContext`, the bus as the capsule, within
the ACL its manifest declares, with the supervisor's config and state store.

Capsule authors import it from here; the supervisor's capsule host
(sage/daemon/capsule_host.py) makes one for each run of an in-process capsule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import structlog

from bus import Bus, Envelope, Identity, Subscription
from sage.capsule.manifest import CapsuleManifest
from sage.config import Config
from sage.errors import StateError
from sage.state import StateStore

__all__ = ("CapsuleContext",)

log = structlog.get_logger("sage.daemon.capsule_host")

T = TypeVar("T")


class CapsuleContext:
    """What a capsule's code gets: the bus, as the capsule, within its ACL."""

    def __init__(
        self,
        bus: Bus,
        identity: Identity,
        manifest: CapsuleManifest,
        *,
        config_of: Callable[[], Config] = Config,
        state_of: Callable[[], StateStore | None] = lambda: None,
        ready: anyio.Event | None = None,
    ) -> None:
        self.bus = bus
        self._ready = ready
        self.identity = identity
        self.manifest = manifest
        self.log = log.bind(capsule=manifest.name)
        self._subscriptions: list[Subscription] = []
        self._config_of = config_of
        self._state_of = state_of

    def ready(self) -> None:
        """Say the capsule serves its topics; the supervisor reports READY after all have."""
        if self._ready is not None:
            self._ready.set()

    @property
    def config(self) -> Config:
        """The supervisor's config as it is now (a reload replaces it)."""
        return self._config_of()

    @property
    def state(self) -> StateStore:
        """The supervisor's state store, for records that outlive a restart."""
        store = self._state_of()
        if store is None:
            raise StateError("the state store is not open")
        return store

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> Envelope:
        """Publish as the capsule; ``on_behalf_of`` makes the envelope private to
        that principal (its users see it, other users do not)."""
        return self.bus.publish(self.identity, topic, payload, on_behalf_of=on_behalf_of)

    def subscribe(self, pattern: str) -> Subscription:
        """A subscription that lasts until the capsule's run ends (or it is closed)."""
        sub = self.bus.subscribe(pattern, self.identity)
        self._subscriptions.append(sub)
        return sub

    async def open(self, pattern: str) -> Subscription:
        """:meth:`subscribe` as the SDK calls it: async, so the same capsule code
        runs against a remote bus, where subscribing is a round trip."""
        return self.subscribe(pattern)

    def close(self) -> None:
        """End every subscription this run opened (called by the runner)."""
        for sub in self._subscriptions:
            sub.close()
        self._subscriptions.clear()

    def reply(self, request: Envelope, payload: Any) -> bool:
        if request.reply_to is None:
            return False
        return self.bus.reply(self.identity, request.reply_to, payload)

    async def request(
        self,
        topic: str,
        payload: Any,
        *,
        deadline: float | None = None,
        on_behalf_of: str | None = None,
    ) -> Envelope:
        """Request as the capsule; ``on_behalf_of`` as for :meth:`publish`."""
        return await self.bus.request(
            self.identity, topic, payload, deadline=deadline, on_behalf_of=on_behalf_of
        )

    async def ask(
        self,
        answers: str,
        send: Callable[[], object],
        answer: Callable[[Envelope], T | None],
        *,
        deadline: float,
    ) -> T | None:
        """Ask over plain topics: subscribe to ``answers``, ``send()``, then wait.

        For a question whose answer comes as a publish on a topic of its own
        (``...result.<cid>``) rather than as a bus reply.  Subscribing first means
        no answer is missed however fast it comes.  ``answer`` turns each envelope
        on ``answers`` into the answer, or None to keep waiting (another request's
        answer, a progress step).  None when no answer came within ``deadline``
        seconds; what ``send`` raises is raised.
        """
        with self.bus.subscribe(answers, self.identity) as envelopes:
            send()
            with anyio.move_on_after(deadline):
                async for envelope in envelopes:
                    found = answer(envelope)
                    if found is not None:
                        return found
        return None
