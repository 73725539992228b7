"""What the session runner uses of a CapsuleContext, in memory: the config (a fleet node
``a`` with principal alice), a state store, what it published, and the fleet's answer to
its claims question (``claims``; None: no answer, as with NATS away).  For the runner's
handlers tested without a bus or processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from bus import Envelope, NoResponders
from sage.config import Config, FleetConfig, PrincipalConfig, SupervisorConfig
from sage.contract.sessions import CLAIMS_TOPIC
from sage.usage.admission import ADMIT_TOPIC

__all__ = ("MemoryState", "RunnerContext", "admitted")


def admitted() -> Envelope:
    """The usage ledger's answer to ``sage.v1.request.usage.admit`` when nothing is over."""
    return Envelope(id=1, topic=ADMIT_TOPIC, payload=b'{"ok":true}', source="supervisor")


class MemoryState:
    """The state store, in memory."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, str], Any] = {}

    async def put(self, namespace: str, key: str, value: Any) -> None:
        self.data[namespace, key] = value

    async def get(self, namespace: str, key: str) -> Any:
        return self.data.get((namespace, key))

    async def delete(self, namespace: str, key: str) -> None:
        self.data.pop((namespace, key), None)

    async def items(self, namespace: str) -> list[tuple[str, Any]]:
        return [(k, v) for (n, k), v in self.data.items() if n == namespace]


class RunnerContext:
    """What the runner uses of a CapsuleContext here; the fleet's claims answer is
    ``claims`` (None: no answer, as with NATS away)."""

    def __init__(self, tmp: Path) -> None:
        self.config = Config(
            supervisor=SupervisorConfig(state_dir=str(tmp)),
            fleet=FleetConfig(url="nats://127.0.0.1:4222", node="a"),
            principals=[PrincipalConfig(name="alice")],
        )
        self.state = MemoryState()
        self.published: list[tuple[str, Any]] = []
        self.claims: dict[str, Any] | None = None
        self.asked: list[Any] = []

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> Envelope:
        self.published.append((topic, payload))
        return Envelope(id=len(self.published), topic=topic, payload=b"{}", source="runner")

    async def request(self, topic: str, payload: Any, *, deadline: float | None = None) -> Any:
        if topic == ADMIT_TOPIC:  # the usage ledger: no budget here
            return admitted()
        assert topic == CLAIMS_TOPIC
        self.asked.append(payload)
        if self.claims is None:
            raise NoResponders("nobody answers")
        return Envelope(id=1, topic=topic, payload=msgspec.json.encode(self.claims), source="f")
