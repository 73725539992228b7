"""The hooks capsule: validates astrid-emit's hook envelopes and republishes them.

Claude Code runs ``astrid-emit`` for each command hook; it publishes
``{hook, payload, correlation_id, principal_id, session_id, token, truncated?}`` on
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

Floods: any allowed uid may publish on ``sage.v1.hook.>``, so the
subscription is a :class:`bus.FairSubscription` keyed by :func:`source_key`
(the publisher's uid): each uid has a queue of ``[bus] queue_size``
envelopes, served in turn, and a flooding uid overflows only its own.  Its
drops are reported on ``sage.v1.audit.hook_flood`` ``{source, dropped,
window}``: within :data:`FLOOD_TICK` of the first, then at most once per
source per :data:`FLOOD_WINDOW` with the count since the last.

REPL sessions (``astrid sage repl``) get their token from here:
``sage.v1.request.repl.open`` ``{principal_id}`` (the principal's users or an
admin) mints a session id ``repl-<hex>`` and a token, stores its hash like
the runner does (``kind: "repl"``) and replies ``{ok, session_id, token,
home}`` to the requester only; ``sage.v1.request.repl.close``
``{session_id}`` scrubs it.  A principal may hold at most ``[limits]
max_repl_tokens_per_principal`` live REPL tokens (``too_many_repl_sessions``
past it).  A REPL token expires :data:`REPL_TOKEN_TTL` after minting, closed
or not: it then validates no hook, counts for no limit, and is scrubbed (at
a ``repl.open``, every :data:`REPL_SCRUB_EVERY`, at every start; the runner
also clears all tokens when it starts).

The token is never published or logged.  When the state store cannot be
read the envelope is dropped (logged, not audited: it is no spoof).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from bus import BusError, Envelope, FairSubscription
from capsules.hooks.validate import (
    HookRejected,
    event_name,
    parse,
    republished,
    spoof_report,
    verify,
)
from sage import replies
from sage.capsule.context import CapsuleContext
from sage.claude.hooks import NOTIFICATION_TOPIC, SPOOF_TOPIC, hash_token, mint_token
from sage.errors import SageError
from sage.security.denials import DenialLimiter
from sage.usage.admission import REPL_OPEN, admit

__all__ = ("AUDIT_BURST", "HookGate", "run")

SUBSCRIBE = "sage.v1.hook.>"
REPL_SUBSCRIBE = "sage.v1.request.repl.*"
REPL_TOKEN_TTL = 24 * 3600.0
"""Seconds a REPL token lives: past it, it validates no hook, counts for no
cap, and is scrubbed (a crashed ``astrid sage repl`` never closed it)."""
REPL_SCRUB_EVERY = 3600.0
"""Seconds between two scrubs of expired REPL tokens while the capsule runs."""
TOKENS = "hook_tokens"
AUDIT_BURST = 20
"""Spoof reports published per source per :data:`AUDIT_WINDOW` seconds."""
AUDIT_WINDOW = 60.0
FLOOD_TOPIC = "sage.v1.audit.hook_flood"
FLOOD_WINDOW = 60.0
"""Seconds between two flood reports for one source (the first is at once)."""
FLOOD_TICK = 1.0
"""Seconds between two looks at the queue's drop counts."""


def source_key(envelope: Envelope) -> str:
    """Whose lane an envelope goes to: the publisher's uid for a socket connection
    (``emit:1001`` and ``cli:1001`` share ``uid:1001``), else its source."""
    role, _, uid = envelope.source.partition(":")
    if role and uid.isdigit():
        return f"uid:{uid}"
    return envelope.source


class HookGate:
    """The capsule's state: counters and the per-source audit limiter."""

    def __init__(self, ctx: CapsuleContext, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = ctx
        self.log = ctx.log
        self.clock = clock
        self.limiter = DenialLimiter(burst=AUDIT_BURST, window=AUDIT_WINDOW)
        self.republished = 0
        self.rejected = 0
        self.flood_dropped = 0
        """Envelopes the queue dropped (a source over its share), all sources."""
        self._flood_pending: dict[str, int] = {}
        self._flood_reported: dict[str, float] = {}

    async def run(self) -> None:
        bus = self.ctx.bus
        # one lane per uid: a flooding uid fills its own lane only (L2)
        envelopes = FairSubscription(
            SUBSCRIBE,
            self.ctx.identity,
            self.ctx.config.bus.queue_size,
            key=source_key,
            on_close=bus.remove,
        )
        bus.add(envelopes)
        try:
            repl = self.ctx.subscribe(REPL_SUBSCRIBE)
            await self._scrub_old_repl_tokens()
            self.ctx.ready()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._serve_repl, repl)
                tg.start_soon(self._watch_floods, envelopes)
                tg.start_soon(self._scrub_repl_tokens_hourly)
                await self._serve_hooks(envelopes)
                tg.cancel_scope.cancel()
        finally:
            envelopes.close()

    async def _serve_hooks(self, envelopes: Any) -> None:
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
            if _expired(record, time.time()):
                await self._forget(claim.session_id)
                record = None  # a REPL token past its lifetime: as if closed
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

    # -- REPL sessions: tokens for `astrid sage repl` ------------------------------

    async def _serve_repl(self, requests: Any) -> None:
        async for request in requests:
            try:
                reply = await self._repl(request)
            except SageError as exc:
                reply = replies.error("state_failed", str(exc))
            if request.reply_to is not None:
                try:
                    self.ctx.reply(request, reply)
                except BusError as exc:
                    self.log.error("hooks.repl_reply_failed", error=str(exc))

    async def _repl(self, request: Envelope) -> dict[str, Any]:
        """``repl.open`` ``{principal_id}`` mints a session id and token (reply only,
        to the requester); ``repl.close`` ``{session_id}`` scrubs it."""
        try:
            data = msgspec.json.decode(request.payload, type=dict[str, Any])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return replies.error("bad_request", "not a JSON object")
        if request.topic.endswith(".open"):
            name = data.get("principal_id")
            if not isinstance(name, str) or self.ctx.config.principal(name) is None:
                return replies.error("unknown_principal", f"no principal {name!r}")
            if request.principal not in (None, name):
                return replies.error("not_authorized", f"you may not act for {name!r}")
            try:  # a principal at or past a budget starts no REPL (sage/usage/admission.py)
                await admit(self.ctx, name, REPL_OPEN)
            except SageError as exc:
                return replies.from_error(exc)
            live = await self._live_repl_tokens(name)
            cap = self.ctx.config.limits.max_repl_tokens_per_principal
            if live >= cap:
                return replies.error(
                    "too_many_repl_sessions",
                    f"principal {name!r} has {live} live repl sessions"
                    f" (limits.max_repl_tokens_per_principal = {cap}); end one"
                    f" (exit its astrid sage repl) or wait {REPL_TOKEN_TTL / 3600:g} h"
                    " for it to expire",
                )
            token = mint_token()
            sid = f"repl-{secrets.token_hex(8)}"
            record = {
                "sha256": hash_token(token),
                "principal_id": name,
                "kind": "repl",
                "created_at": time.time(),
            }
            await self.ctx.state.put(TOKENS, sid, record)
            principal = self.ctx.config.principal(name)
            assert principal is not None
            home = str(self.ctx.config.home_of(principal))
            return replies.ok(session_id=sid, token=token, home=home)
        claimed = data.get("session_id")
        sid = claimed if isinstance(claimed, str) else ""
        if not sid.startswith("repl-"):
            return replies.error("bad_request", "session_id must be a repl session")
        record = await self.ctx.state.get(TOKENS, sid)
        if not isinstance(record, dict) or request.principal not in (
            None,
            record.get("principal_id"),
        ):
            return replies.error("unknown_session", f"no repl session {sid!r}")
        await self.ctx.state.delete(TOKENS, sid)
        return replies.ok(session_id=sid)

    async def _live_repl_tokens(self, principal: str) -> int:
        """The principal's REPL tokens within their lifetime; expired ones are scrubbed."""
        live = 0
        now = time.time()
        for key, value in await self.ctx.state.items(TOKENS):
            if _expired(value, now):
                await self.ctx.state.delete(TOKENS, key)
            elif (
                isinstance(value, dict)
                and value.get("kind") == "repl"
                and value.get("principal_id") == principal
            ):
                live += 1
        return live

    async def _forget(self, sid: str) -> None:
        try:
            await self.ctx.state.delete(TOKENS, sid)
        except SageError as exc:
            self.log.error("hooks.scrub_failed", error=str(exc))

    async def _scrub_old_repl_tokens(self) -> None:
        try:
            now = time.time()
            for key, value in await self.ctx.state.items(TOKENS):
                if _expired(value, now):
                    await self.ctx.state.delete(TOKENS, key)
        except SageError as exc:
            self.log.error("hooks.scrub_failed", error=str(exc))

    async def _scrub_repl_tokens_hourly(self) -> None:
        while True:
            await anyio.sleep(REPL_SCRUB_EVERY)
            await self._scrub_old_repl_tokens()

    # -- floods: envelopes dropped because their source's lane was full ----------

    async def _watch_floods(self, envelopes: FairSubscription) -> None:
        while True:
            await anyio.sleep(FLOOD_TICK)
            self.report_floods(envelopes.take_drops())

    def report_floods(self, drops: dict[str, int]) -> None:
        """Audit the drops per source: at once the first time, then at most one
        report per source per :data:`FLOOD_WINDOW` with the count since the last."""
        now = self.clock()
        pending = self._flood_pending
        for source, count in drops.items():
            pending[source] = pending.get(source, 0) + count
            self.flood_dropped += count
        reported = self._flood_reported
        for source in [s for s, t in reported.items() if now - t >= FLOOD_WINDOW]:
            if source not in pending:
                del reported[source]  # quiet for a window: forgotten
        for source, count in list(pending.items()):
            last = reported.get(source)
            if last is not None and now - last < FLOOD_WINDOW:
                continue
            del pending[source]
            reported[source] = now
            report = {"source": source, "dropped": count, "window": FLOOD_WINDOW}
            self.log.warning("hooks.flood_dropped", **report)
            try:
                self.ctx.publish(FLOOD_TOPIC, report)
            except BusError as exc:
                self.log.error("hooks.audit_failed", reason="flood", error=str(exc))

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
            self.log.error("hooks.audit_failed", reason=rejection.code, error=str(exc))


def _expired(record: Any, now: float) -> bool:
    """A REPL token record past :data:`REPL_TOKEN_TTL` (or with no usable time)."""
    if not isinstance(record, dict) or record.get("kind") != "repl":
        return False  # the runner's records end with their session
    created = record.get("created_at")
    if not isinstance(created, int | float):
        return True
    return bool(now - created > REPL_TOKEN_TTL)


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point (``capsules.hooks.capsule:run``)."""
    await HookGate(ctx).run()
