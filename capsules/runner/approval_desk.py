"""The approval desk: tool calls the CLI asks about, the people who decide them, hooks.

When Claude wants a tool that is not pre-allowed, the CLI sends
``can_use_tool``; :meth:`ApprovalDesk.can_use_tool` decides it: an allow
rule of the principal, else the people listening on
``approval.v1.request.*`` or the session's own approver (the first decision
wins, by ``sage.v1.request.approve.<cid>`` or ``approval.v1.response.<cid>``),
else deny.  Each outcome is an ``approval`` event and a ``tool_call``
audit.  The requests ``sage.v1.request.approvals`` (what the caller may
answer) and ``sage.v1.request.approve.<cid>`` are answered here too, and the
CLI's in-band hook callbacks are checked (:func:`sage.claude.hooks.in_band_hook`)
and relayed as ``hook.v1.event.<mapped>``, the payload the hooks capsule gives a
command hook (:func:`sage.claude.hooks.hook_event`, ``decision_source: "in_band"``);
a callback the runner never registered, or one whose input names another hook or
another Claude session, is dropped and audited as
``sage.v1.audit.hook_spoof_attempt`` (source ``claude:<sid>``, at most
:data:`AUDIT_BURST` reports per session per minute).  The CLI
is answered ``{"continue": true}`` either way: a hook never stops a session.

The pending calls are kept in :class:`~capsules.runner.approvals.Approvals`
(a table, no I/O); this module is its thin async shell.  It gets what it
needs explicitly: the capsule's context (bus, config), the principals' allow
rules (:class:`Rules`, the runner's :class:`~capsules.runner.admin.Admin`),
and the publish, event and audit callables.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
import uuid
from typing import Any, Protocol

import anyio
import msgspec

from bus import Envelope, Subscription
from capsules.runner.approvals import (
    Approvals,
    Decision,
    Pending,
    UnknownApproval,
    Verdict,
    matches,
    valid_rule,
)
from capsules.runner.claude_process import SessionError
from capsules.runner.command import Launch
from capsules.runner.messages import ApprovalResponse, ApprovalsRequest, ApproveRequest
from capsules.runner.outbox import Audit, Event, Publish
from sage.capsule.context import CapsuleContext
from sage.claude.hooks import (
    NOTIFICATION_TOPIC,
    HookRejected,
    event_name,
    hook_event,
    in_band_hook,
    spoof_report,
)
from sage.claude.protocol import CanUseToolRequest, HookCallbackRequest
from sage.contract.sessions import approver_topic
from sage.security.denials import DenialLimiter

__all__ = ("AUDIT_BURST", "ApprovalDesk", "Asker", "HookSession", "Rules")

AUDIT_BURST = 20
"""In-band spoof reports published per session per :data:`AUDIT_WINDOW` seconds
(the hooks capsule's bound for a publisher)."""
AUDIT_WINDOW = 60.0

#: decision_source in tool_call audit entries, as before approvals had a table
_SOURCES = {"approver": "approval", "timeout": "approval_timeout"}


class Turns(Protocol):
    @property
    def finished(self) -> int: ...


class Asker(Protocol):
    """The session whose CLI asks (a :class:`~capsules.runner.claude_process.ClaudeProcess`)."""

    @property
    def session_id(self) -> str: ...

    @property
    def principal_id(self) -> str: ...

    @property
    def turn(self) -> Turns: ...


class HookSession(Asker, Protocol):
    """The session whose CLI sends a hook: its launch names its Claude session and
    the token a hook input must not leak."""

    @property
    def launch(self) -> Launch: ...


class Rules(Protocol):
    """A principal's allow rules, read and changed (saved and audited)."""

    def allow_rules(self, principal: str) -> list[str]: ...

    async def change_rules(
        self, name: str, *, add: list[str], remove: list[str], requester: str | None
    ) -> list[str]: ...


class ApprovalDesk:
    """Decides the tool calls sessions ask about; see the module docstring."""

    def __init__(
        self,
        ctx: CapsuleContext,
        *,
        rules: Rules,
        publish: Publish,
        event: Event,
        audit: Audit,
        approvals: Approvals | None = None,
    ) -> None:
        self.ctx = ctx
        self.rules = rules
        self._publish = publish
        self._event = event
        self.audit = audit
        self.approvals = approvals if approvals is not None else Approvals()
        self.spoofs = DenialLimiter(burst=AUDIT_BURST, window=AUDIT_WINDOW)

    async def can_use_tool(self, proc: Asker, request: CanUseToolRequest) -> Verdict:
        """Decide a tool call that is not pre-allowed: an allow rule of the principal,
        else the people listening on ``approval.v1.request.*`` (the first decision
        wins, by ``sage.v1.request.approve.<cid>`` or ``approval.v1.response.<cid>``),
        else deny; each outcome is an ``approval`` event and a ``tool_call`` audit."""
        cid = uuid.uuid4().hex
        topic = f"approval.v1.request.{cid}"
        timeout = self.ctx.config.limits.approval_timeout
        rule = matches(self.rules.allow_rules(proc.principal_id), request.tool_name)
        if rule is not None:
            decision = Decision(True, "", "allow_rule")
        elif not (
            self.ctx.bus.has_subscribers(topic)
            or self.ctx.bus.has_subscribers(
                approver_topic(proc.session_id), principal=proc.principal_id
            )
        ):  # nobody who may answer: no admin or capsule, no approver of the session's own
            decision = Decision(False, "no approver is listening", "no_approver")
        else:
            pending = self.approvals.open(
                cid,
                session_id=proc.session_id,
                principal_id=proc.principal_id,
                tool_name=request.tool_name,
                arguments=request.input,
                tool_use_id=request.tool_use_id,
                timeout=timeout,
            )
            try:
                with self.ctx.subscribe(f"approval.v1.response.{cid}") as answers:
                    asked = {
                        "approval_id": cid,
                        "session_id": proc.session_id,
                        "principal_id": proc.principal_id,
                        "tool_name": request.tool_name,
                        "arguments": request.input,
                        "tool_use_id": request.tool_use_id,
                        "expires_at": pending.deadline,
                    }
                    self._publish(topic, asked)
                    # the session's own clients (astrid sage send, watch) see it too,
                    # and answer with sage.v1.request.approve.<cid>
                    self._event(
                        proc.session_id,
                        "approval_request",
                        {**asked, "turn": proc.turn.finished + 1},
                        proc.principal_id,
                    )
                    with anyio.move_on_after(timeout):
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(self._published_answers, answers, pending)
                            await pending.done.wait()
                            tg.cancel_scope.cancel()
            finally:
                self.approvals.close(cid)
            decision = pending.decision or Decision(False, "no approver answered", "timeout")
        self._event(
            proc.session_id,
            "approval",
            {
                "approval_id": cid,
                "tool_name": request.tool_name,
                "tool_use_id": request.tool_use_id,
                "allowed": decision.allowed,
                "source": decision.source,
                "reason": decision.reason,
                **({"rule": rule} if rule is not None else {}),
                **({"input_updated": True} if decision.updated_input is not None else {}),
                "turn": proc.turn.finished + 1,
            },
            proc.principal_id,
        )
        self.audit(
            "tool_call",
            {
                "principal_id": proc.principal_id,
                "session_id": proc.session_id,
                "call_id": cid,
                "tool_use_id": request.tool_use_id,
                "tool_name": request.tool_name,
                "allowed": decision.allowed,
                "decision_source": _SOURCES.get(decision.source, decision.source),
                **({"rule": rule} if rule is not None else {}),
                **(
                    {"input_updated": True, "updated_input_sha256": _digest(decision.updated_input)}
                    if decision.updated_input is not None
                    else {}
                ),
            },
        )
        why = decision.reason or ("" if decision.allowed else "denied by approver")
        return Verdict(decision.allowed, why, decision.updated_input)

    async def _published_answers(self, answers: Subscription, pending: Pending) -> None:
        """The older way to answer: a publish on ``approval.v1.response.<cid>``."""
        async for answer in answers:
            try:
                msg = msgspec.json.decode(answer.payload, type=ApprovalResponse)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                # a typo (allowd) must not pass for a decision, nor vanish unseen
                self.audit(
                    "approval_malformed",
                    {"approval_id": pending.cid, "source": answer.source, "error": str(exc)},
                )
                continue
            with contextlib.suppress(UnknownApproval):
                self.approvals.decide(
                    pending.cid,
                    answer.principal,
                    Decision(msg.allowed, msg.reason or "", "approver"),
                )
                return

    async def listing(self, request: Envelope) -> dict[str, Any]:
        msgspec.json.decode(request.payload or b"{}", type=ApprovalsRequest)
        return {"ok": True, "approvals": self.approvals.listing(request.principal)}

    async def approve(self, request: Envelope) -> dict[str, Any]:
        cid = request.topic.rsplit(".", 1)[1]
        req = msgspec.json.decode(request.payload, type=ApproveRequest)
        rule = req.rule or None
        if req.always and not req.allowed:
            raise SessionError("bad_request", "always applies to an approval, not a denial")
        if req.updated_input is not None and not req.allowed:
            raise SessionError("bad_request", "updated_input applies to an approval, not a denial")
        if rule is not None and not valid_rule(rule):
            raise SessionError("bad_request", f"{rule!r} is not a tool-name pattern")
        try:
            pending = self.approvals.check(cid, request.principal)
            added = None
            if req.always:  # the rule first: the next call of the turn must find it
                added = rule or pending.tool_name
                await self.rules.change_rules(
                    pending.principal_id, add=[added], remove=[], requester=request.principal
                )
            self.approvals.decide(
                cid,
                request.principal,
                Decision(req.allowed, req.reason or "", "approver", req.updated_input),
            )
        except UnknownApproval as exc:
            raise SessionError("unknown_approval", str(exc)) from None
        return {
            "ok": True,
            "approval_id": cid,
            "allowed": req.allowed,
            "session_id": pending.session_id,
            "tool_name": pending.tool_name,
            **({"rule_added": added} if added is not None else {}),
            **({"input_updated": True} if req.updated_input is not None else {}),
        }

    async def hook_callback(
        self, proc: HookSession, request: HookCallbackRequest
    ) -> dict[str, Any]:
        """Check an in-band hook and publish it, or audit it as a spoof; always go on."""
        launch = proc.launch
        try:
            hook = in_band_hook(
                request.callback_id, request.input, launch.claude_session, proc.session_id
            )
        except HookRejected as rejection:
            rejection.claimed_principal = proc.principal_id
            self._spoof(rejection, f"claude:{proc.session_id}")
            return {"continue": True}
        payload = hook_event(
            hook,
            request.input,
            correlation_id=request.tool_use_id,
            principal_id=proc.principal_id,
            session_id=proc.session_id,
            decision_source="in_band",
            token=launch.env.get("ASTRID_HOOK_TOKEN", ""),
        )
        self._publish(f"hook.v1.event.{event_name(hook)}", payload, proc.principal_id)
        if hook == "Notification":
            self._publish(NOTIFICATION_TOPIC, payload, proc.principal_id)
        return {"continue": True}

    def _spoof(self, rejection: HookRejected, source: str) -> None:
        suppressed = self.spoofs.admit(source, time.monotonic())
        if suppressed is not None:
            self.audit(
                "hook_spoof_attempt",
                {**spoof_report(rejection, source), "suppressed_before": suppressed},
            )


def _digest(value: dict[str, Any] | None) -> str:
    """What the audit keeps of an approver's input: its digest (the input may hold what
    an audit row must not), enough to match it with the call the bridge audits."""
    return hashlib.sha256(msgspec.json.encode(value)).hexdigest()
