"""How the runner's parts speak on the bus: the callables the runner hands them.

:class:`~capsules.runner.runner.Runner` owns publishing (whose envelope it
is, what a failed publish logs) and the per-session event history; the
administration (:mod:`capsules.runner.admin`) and the approval desk
(:mod:`capsules.runner.approval_desk`) get these as plain callables, so a test
hands them a list that records what was said.
"""

from __future__ import annotations

from typing import Any, Protocol

from bus import Envelope

__all__ = ("Audit", "Event", "Publish")


class Publish(Protocol):
    """Publish ``payload`` on ``topic``, private to ``principal`` (else the payload's
    ``principal_id``); None when the bus refused it (logged, never raised)."""

    def __call__(
        self, topic: str, payload: dict[str, Any], principal: str | None = None
    ) -> Envelope | None: ...


class Audit(Protocol):
    """Publish an audit entry ``sage.v1.audit.<kind>``."""

    def __call__(self, kind: str, payload: dict[str, Any]) -> None: ...


class Event(Protocol):
    """Publish the session event ``sage.v1.event.<sid>.<name>`` and keep it for replay."""

    def __call__(
        self, sid: str, name: str, payload: dict[str, Any], principal: str | None = None
    ) -> None: ...
