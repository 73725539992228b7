"""Sealed topics: envelopes that may carry a secret never leave the process."""

from __future__ import annotations

import anyio
import pytest

from bus import Bus, Identity
from bus.acl import patterns_overlap

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("a", "b", "overlap"),
    [
        ("sage.v1.request.install", ">", True),
        ("sage.v1.request.install", "sage.v1.request.*", True),
        ("sage.v1.request.install", "sage.*.request.>", True),
        ("sage.v1.request.install", "sage.v1.request.install.x", False),
        ("sage.v1.request.install", "sage.v1.request.spawn", False),
        ("sage.v1.request.install", "sage.v1.request", False),
        ("a.*.c", "a.b.*", True),
        ("a.>", "b.>", False),
    ],
)
def test_overlap(a: str, b: str, overlap: bool) -> None:
    assert patterns_overlap(a, b) is overlap
    assert patterns_overlap(b, a) is overlap


class _Remote:
    """A remote subscriber as the socket server adds it (owner has a uid)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.owner = Identity("remote-admin", uid=0)
        self.got: list[str] = []
        self.dropped = 0
        self.delivered = 0

    def deliver(self, envelope: object) -> bool:
        self.got.append(envelope.topic)  # type: ignore[attr-defined]
        return True


async def test_remote_subscribers_never_get_sealed_envelopes() -> None:
    bus = Bus(sealed=("sage.v1.request.install",))
    me = Identity("cli")
    inside = bus.subscribe("sage.v1.request.install", Identity("runner"))
    everything = _Remote(">")
    bus.add(everything)
    bus.publish(me, "sage.v1.request.install", {"api_key": "sk-secret"})
    bus.publish(me, "sage.v1.request.spawn", {})
    with anyio.fail_after(1):
        envelope = await inside.get()
    assert b"sk-secret" in envelope.payload  # in-process: delivered
    assert everything.got == ["sage.v1.request.spawn"]  # remote: withheld
    bus.remove(everything)
    assert not bus._sealed_off
