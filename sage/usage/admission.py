"""Ask the usage ledger whether a principal may spend: the one admission check.

Every place a principal's request could lead to a model call asks here first: the
session runner's spawn, send and wake, the completion provider's generate, the hooks
capsule's ``repl.open`` and the tool bridge's and forge's calls from a REPL's
``astrid mcp serve``.  :func:`admit` sends ``sage.v1.request.usage.admit`` to the
supervisor's usage service (sage/usage/service.py), which decides from the principal's
spend across the fleet (sage/usage/budget.py) and audits each refusal.

A refusal raises :class:`BudgetRefused` with code ``budget_exceeded`` and the
ledger's message (the spend, the budget, when it resets).  A ledger that does not
answer refuses too (``budget_unknown``): a budget that cannot be checked is not
waived.  With ``[usage] ledger = false`` there is no budget and nothing is asked.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import msgspec

from bus import BusError, Envelope
from sage.config import Config
from sage.contract.codes import ErrorCode
from sage.errors import SageError

__all__ = (
    "ADMIT_TOPIC",
    "REPL_FORGE_CALL",
    "REPL_OPEN",
    "REPL_TOOL_CALL",
    "AdmitRequest",
    "Asker",
    "BudgetRefused",
    "admit",
)

ADMIT_TOPIC: Final = "sage.v1.request.usage.admit"
ADMIT_DEADLINE: Final = 5.0

# The verbs of a REPL's admissions (a headless session's are the runner's Verb values;
# ``generate`` is the completion provider's): what the audit's budget_refused names.
REPL_OPEN: Final = "repl.open"
"""The hooks capsule's ``repl.open``: a REPL started for the principal."""
REPL_TOOL_CALL: Final = "repl.tool_call"
"""The tool bridge's direct call (``astrid mcp serve``)."""
REPL_FORGE_CALL: Final = "repl.forge_call"
"""The forge's call from ``astrid mcp serve --server forge``."""


class BudgetRefused(SageError):
    """The principal may not spend now (``budget_exceeded``), or that cannot be known."""

    code = ErrorCode.BUDGET_EXCEEDED


class AdmitRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.usage.admit``: may ``principal_id`` do ``verb`` now?"""

    principal_id: str
    verb: str
    session_id: str | None = None


class Asker(Protocol):
    """What :func:`admit` needs of a capsule's context."""

    @property
    def config(self) -> Config: ...

    async def request(
        self, topic: str, payload: Any, *, deadline: float | None = ...
    ) -> Envelope: ...


async def admit(
    ctx: Asker, principal: str | None, verb: str, session_id: str | None = None
) -> None:
    """Return when ``principal`` may do ``verb`` now; raise :class:`BudgetRefused` if not.
    No principal (an operator's own request) has no budget."""
    if principal is None or not ctx.config.usage.ledger:
        return
    request = AdmitRequest(principal, verb, session_id)
    try:
        answer = await ctx.request(ADMIT_TOPIC, request, deadline=ADMIT_DEADLINE)
        reply = msgspec.json.decode(answer.payload)
    except (BusError, msgspec.DecodeError) as exc:
        raise BudgetRefused(
            f"cannot check principal {principal!r}'s budget (the usage ledger does not answer:"
            f" {exc}); nothing is admitted until it does",
            code=ErrorCode.BUDGET_UNKNOWN,
        ) from None
    if isinstance(reply, dict) and reply.get("ok") is True:
        return
    error = reply.get("error") if isinstance(reply, dict) else None
    message = reply.get("message") if isinstance(reply, dict) else None
    raise BudgetRefused(
        str(message or "refused by the usage ledger"),
        code=ErrorCode.BUDGET_EXCEEDED if error == "budget_exceeded" else ErrorCode.BUDGET_UNKNOWN,
    )
