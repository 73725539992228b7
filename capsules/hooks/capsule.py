"""The hooks capsule: validates astrid-emit's hook envelopes and republishes them.

Claude Code runs ``astrid-emit`` for each command hook; it publishes
``{hook, payload, correlation_id, principal_id, session_id, token}`` on
``sage.v1.hook.<Hook>`` (the CamelCase event name, e.g. ``PreToolUse``).
Any process of a uid allowed on the socket can publish there, so every
field is a claim until the token proves it: the session runner minted the
token for that session and keeps only its SHA-256 in the state store
(namespace ``hook_tokens``, key the session id, value ``{"sha256",
"principal_id"}``), deleted when the session ends.

Envelopes are handled one at a time, in order (validate.py has the checks):

- valid: ``hook.v1.event.<mapped>`` ``{hook, payload, correlation_id,
  principal_id, session_id, decision_source: "token"}`` (``truncated:
  true`` and ``payload: null`` when the hook input's JSON is over 64 KiB),
  published on behalf of the principal; a ``Notification`` hook is also
  published, with the same payload, on ``sage.v1.notification``.
- invalid: nothing is republished; ``sage.v1.audit.hook_spoof_attempt``
  ``{claimed_principal, claimed_session, hook, reason, source,
  suppressed_before}`` (claims cut to 128 characters; ``source`` is the
  bus identity of the publisher, e.g. ``emit:1000``).  At most
  :data:`AUDIT_BURST` reports per source per minute are published (and
  logged); the rest are counted, and the next report published for that
  source says how many were left out (``suppressed_before``).

The token is never published or logged.  When the state store cannot be
read the envelope is dropped (logged, not audited: it is no spoof).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from bus import BusError, Envelope
from capsules.hooks.validate import (
    HookRejected,
    event_name,
    parse,
    republished,
    spoof_report,
    verify,
)
from sage.capsules import CapsuleContext
from sage.errors import SageError
from sage.supervisor import DenialLimiter

__all__ = ("AUDIT_BURST", "HookGate", "run")

SUBSCRIBE = "sage.v1.hook.>"
NOTIFICATION_TOPIC = "sage.v1.notification"
SPOOF_TOPIC = "sage.v1.audit.hook_spoof_attempt"
TOKENS = "hook_tokens"
AUDIT_BURST = 20
"""Spoof reports published per source per :data:`AUDIT_WINDOW` seconds."""
AUDIT_WINDOW = 60.0


class HookGate:
    """The capsule's state: counters and the per-source audit limiter."""

    def __init__(self, ctx: CapsuleContext, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.log = ctx.log
        self.clock = clock
        self.limiter = DenialLimiter(burst=AUDIT_BURST, window=AUDIT_WINDOW)
        self.republished = 0
        self.rejected = 0

    async def run(self) -> None:
        envelopes = self.ctx.subscribe(SUBSCRIBE)
        self.ctx.ready()
        async for envelope in envelopes:
            try:
                await self.handle(envelope)
            except Exception as exc:  # one bad envelope never stops the capsule
                # the exception's type only: its text could quote a claim
                self.log.error(
                    "hooks.handler_failed", topic=envelope.topic, error=type(exc).__name__
                )

    async def handle(self, envelope: Envelope) -> bool:
        """Republish a valid envelope (True) or audit an invalid one (False)."""
        try:
            claim = parse(envelope.topic, envelope.payload)
            try:
                record = await self.ctx.state.get(TOKENS, claim.session_id)
            except SageError as exc:
                self.log.error(
                    "hooks.state_unavailable", session_id=claim.session_id, error=str(exc)
                )
                return False
            principal = verify(claim, record, envelope.principal)
        except HookRejected as rejection:
            self._reject(rejection, envelope.source)
            return False
        payload = republished(claim, principal)
        name = event_name(claim.hook)
        try:
            self.ctx.publish(f"hook.v1.event.{name}", payload, on_behalf_of=principal)
            if claim.hook == "Notification":
                self.ctx.publish(NOTIFICATION_TOPIC, payload, on_behalf_of=principal)
        except BusError as exc:
            self.log.error("hooks.not_republished", hook=claim.hook, error=str(exc))
            return False
        self.republished += 1
        return True

    def _reject(self, rejection: HookRejected, source: str) -> None:
        self.rejected += 1
        suppressed = self.limiter.admit(source, self.clock())
        if suppressed is None:
            return
        report: dict[str, Any] = spoof_report(rejection, source)
        self.log.warning("hooks.spoof_attempt", **report, suppressed_before=suppressed)
        try:
            self.ctx.publish(SPOOF_TOPIC, {**report, "suppressed_before": suppressed})
        except BusError as exc:
            self.log.error("hooks.audit_failed", reason=rejection.reason, error=str(exc))


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point (``capsules.hooks.capsule:run``)."""
    await HookGate(ctx).run()
