"""Pending tool-call approvals: who asked, for what, until when, and who may answer.

When Claude wants a tool that is not pre-allowed, the CLI sends
``can_use_tool`` and the runner asks people: it publishes
``approval.v1.request.<cid>`` and waits.  This module keeps the table of
those waits (:class:`Approvals`), with no I/O: the runner opens an entry,
the decision comes from ``sage.v1.request.approve.<cid>`` (``astrid sage
send`` on a terminal, ``astrid sage approve``/``deny``/``approvals --watch``)
or the older ``approval.v1.response.<cid>`` topic, and the first decision
wins.  A decision for an id that is unknown, already decided or past its
deadline, or that belongs to another principal, is refused: the caller learns
that nothing happened instead of believing it approved something.

Allow rules (``astrid sage send``'s "always", ``astrid sage settings
--allow``) are tool-name patterns (``mcp__sage__*``) kept in the principal's
settings; :func:`matches` decides whether one covers a call.
"""

from __future__ import annotations

import fnmatch
import re
import time
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import anyio

from sage.errors import SageError

__all__ = (
    "RULE_PATTERN",
    "Approvals",
    "Decision",
    "Pending",
    "UnknownApproval",
    "Verdict",
    "matches",
    "rule_reach",
    "self_rule_refusal",
    "valid_rule",
)

RULE_PATTERN: Final = r"^[A-Za-z0-9_*:.-]{1,128}\Z"
ARGS_SHOWN: Final = 4096  # encoded bytes of the arguments a listing shows whole


def valid_rule(rule: str) -> bool:
    """A tool-name pattern as allow rules hold them (``*`` the only wildcard)."""
    return re.match(RULE_PATTERN, rule) is not None


RULE_REACH: Final = ("exact", "prefix", "any")
"""What an allow rule reaches, narrowest first: one tool; every tool of one MCP server
(``mcp__sage__*``); anything else with a ``*`` (``*``, ``mcp__*``, ``mcp__sage__g*``)."""
_SERVER_RULE: Final = re.compile(r"^mcp__[A-Za-z0-9_-]+?__\*\Z")


def rule_reach(rule: str) -> str:
    """``exact``, ``prefix`` or ``any``: see :data:`RULE_REACH`."""
    if "*" not in rule:
        return "exact"
    return "prefix" if _SERVER_RULE.match(rule) and rule.count("*") == 1 else "any"


def self_rule_refusal(principal: str, rules: list[str], allowed: str) -> str | None:
    """Why ``principal`` may not give itself ``rules`` under ``[limits] self_allow_rules =
    allowed``, or None when it may."""
    ceiling = RULE_REACH.index(allowed)
    wide = [r for r in rules if RULE_REACH.index(rule_reach(r)) > ceiling]
    if not wide:
        return None
    lets = {
        "exact": "exact tool names only",
        "prefix": "exact tool names and one MCP server's tools (mcp__SERVER__*)",
        "any": "any pattern",
    }[allowed]
    return (
        f"principal {principal!r} may not give itself the allow rule"
        f" {', '.join(repr(r) for r in wide)}: [limits] self_allow_rules = {allowed!r} lets a"
        f" principal add {lets}; an admin may add it"
        f" (astrid sage settings {principal} --allow '{wide[0]}')"
    )


def matches(rules: list[str] | tuple[str, ...], tool_name: str) -> str | None:
    """The first rule that allows ``tool_name``, or None."""
    for rule in rules:
        if fnmatch.fnmatchcase(tool_name, rule):  # valid rules hold no [ ] ?
            return rule
    return None


class UnknownApproval(SageError):
    """No pending approval of that id for that caller (unknown, decided or expired)."""

    code = "unknown_approval"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    reason: str
    source: str  # who decided: approver | timeout | no_approver | allow_rule
    updated_input: dict[str, Any] | None = None
    """An approver's input for the call instead of Claude's (with ``allowed`` only)."""


class Verdict(NamedTuple):
    """What the CLI is told of a tool call: run it (with ``updated_input`` when an
    approver changed it: the tool bridge checks it as any call, against the tool's
    schema and the operator's policy), or not, ``message`` being what Claude reads."""

    allowed: bool
    message: str
    updated_input: dict[str, Any] | None = None


@dataclass
class Pending:
    cid: str
    session_id: str
    principal_id: str
    tool_name: str
    arguments: dict[str, Any]
    tool_use_id: str | None
    started: float
    deadline: float
    done: anyio.Event = field(default_factory=anyio.Event)
    decision: Decision | None = None

    def row(self, now: float) -> dict[str, Any]:
        return {
            "approval_id": self.cid,
            "session_id": self.session_id,
            "principal_id": self.principal_id,
            "tool_name": self.tool_name,
            "arguments": self.arguments,
            "tool_use_id": self.tool_use_id,
            "age_s": round(now - self.started, 1),
            "expires_in_s": round(max(0.0, self.deadline - now), 1),
        }


class Approvals:
    """The table of pending approvals; see the module docstring."""

    def __init__(self, clock: Any = time.time) -> None:
        self._clock = clock
        self._pending: dict[str, Pending] = {}

    def open(
        self,
        cid: str,
        *,
        session_id: str,
        principal_id: str,
        tool_name: str,
        arguments: dict[str, Any],
        tool_use_id: str | None,
        timeout: float,
    ) -> Pending:
        now = self._clock()
        pending = Pending(
            cid, session_id, principal_id, tool_name, arguments, tool_use_id, now, now + timeout
        )
        self._pending[cid] = pending
        return pending

    def close(self, cid: str) -> None:
        self._pending.pop(cid, None)

    def check(self, cid: str, decider: str | None) -> Pending:
        """The approval ``decider`` (a principal, or None for an admin) may settle now."""
        pending = self._pending.get(cid)
        if (
            pending is None
            or pending.decision is not None
            or decider not in (None, pending.principal_id)
            or self._clock() > pending.deadline
        ):
            raise UnknownApproval(f"no pending approval {cid!r} (unknown, decided or expired)")
        return pending

    def decide(self, cid: str, decider: str | None, decision: Decision) -> Pending:
        """Settle ``cid`` for ``decider``; the call it held goes on at once."""
        pending = self.check(cid, decider)
        pending.decision = decision
        pending.done.set()
        return pending

    def listing(self, principal: str | None) -> list[dict[str, Any]]:
        """What ``principal`` may answer (an admin: everything), oldest first."""
        now = self._clock()
        return [
            p.row(now)
            for p in sorted(self._pending.values(), key=lambda p: p.started)
            if p.decision is None and principal in (None, p.principal_id) and now <= p.deadline
        ]

    def __len__(self) -> int:
        return len(self._pending)
