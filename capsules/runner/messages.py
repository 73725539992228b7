"""Payloads of the runner's requests, as msgspec types (docs/topics.md lists them).

Those it exchanges with the fleet (adopt, yield, ...) are the contract's
(sage/contract/sessions.py), named here too for the runner's handlers."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from sage.contract.sessions import AdoptRequest as AdoptRequest
from sage.contract.sessions import InterruptRequest as InterruptRequest
from sage.contract.sessions import YieldRequest as YieldRequest

__all__ = (
    "ApprovalResponse",
    "ApproveRequest",
    "IdentitySaved",
    "SendRequest",
    "SessionRequest",
    "SessionsRequest",
    "SettingsPatch",
    "SpawnRequest",
    "ToolResult",
    "ToolsChanged",
    "ToolsList",
    "WakeRequest",
)


class SpawnRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.spawn``."""

    principal_id: str
    session_id: str | None = None
    initial_message: str | None = None
    cwd: str | None = None
    """Working folder (absolute), inside the principal's home or ``work_roots``."""
    model: str | None = None
    """``--model``: the principal's ``model`` or one of its ``models``."""


class SessionsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.sessions``: the sessions in the table (hibernated ones too);
    ``all`` adds the ended ones kept.  One page of ``limit`` rows from ``offset``."""

    all: bool = False
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=2000)] = 1000
    """Rows per page: 1000 rows stay well under the bus's 1 MiB payload limit."""


class SessionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.session.<sid>``: one session, live or ended, with its last
    ``replay`` events (at most 256)."""

    replay: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0


class WakeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.wake.<sid>``: wake a hibernated session (no fields)."""


class SendRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.send.<sid>``: one user turn."""

    text: str
    session_id: str | None = None


class SettingsPatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """``sage.v1.request.settings.set``: a partial patch of a principal's settings."""

    principal_id: str
    interaction_mode: Literal["headless", "repl"] | None = None
    auth_mode: Literal["api_key", "subscription"] | None = None
    model: str | None = None
    max_turns: Annotated[int, msgspec.Meta(ge=0, le=10_000)] | None = None
    allow_add: list[str] | None = None
    """Tool-name patterns (``mcp__sage__*``) to allow without asking, from now on."""
    allow_remove: list[str] | None = None
    """Allow rules to drop."""
    identity: Annotated[str, msgspec.Meta(max_length=65536)] | None = None
    """Text appended to the system prompt of the principal's sessions from now on (its
    live sessions respawn with ``--resume`` to take it up); ``""``: the config's again."""


class ApprovalResponse(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``approval.v1.response.<cid>`` (published; the answer nobody hears): a typo such
    as ``allowd`` is refused and audited, never read as a denial."""

    allowed: bool
    reason: Annotated[str, msgspec.Meta(max_length=1000)] | None = None


class ApproveRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.approve.<cid>``: decide one pending approval; ``always`` (with
    ``allowed``) also adds ``rule`` (default: the tool's name) to the principal's allow
    rules; ``updated_input`` (with ``allowed``) runs the call with that input instead of
    Claude's, which the tool bridge checks like any call's (schema, the operator's
    policy)."""

    allowed: bool
    reason: Annotated[str, msgspec.Meta(max_length=1000)] | None = None
    always: bool = False
    rule: str | None = None
    updated_input: dict[str, Any] | None = None


class ApprovalsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.approvals``: the pending approvals the caller may answer."""


class ToolResult(msgspec.Struct, frozen=True, rename={"is_error": "isError"}):
    """``sage.v1.tool.result.<cid>`` from the tool bridge."""

    content: list[dict[str, Any]] = []
    is_error: bool = False


class ToolsList(msgspec.Struct, frozen=True):
    """``sage.v1.tools.list``: the catalogue (names prefixed ``mcp__sage__``)."""

    tools: list[dict[str, Any]] = []


class ToolsChanged(msgspec.Struct, frozen=True):
    """``sage.v1.tools.changed``: tell sessions (one, or all) to list tools again."""

    session_id: str | None = None
    names: list[str] = []
    server: str = "sage"  # the sdk MCP server whose list changed: "sage" or "forge"


class IdentitySaved(msgspec.Struct, frozen=True):
    """``tool.v1.execute.save_identity.result``."""

    success: bool = False
    principal_id: str | None = None  # informational only: the publisher's identity decides


class InstallRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.install``: provision a principal (a sealed topic: it may carry a key)."""

    principal_id: str
    interaction_mode: Literal["headless", "repl"] | None = None
    auth_mode: Literal["api_key", "subscription"] | None = None
    model: str | None = None
    max_turns: Annotated[int, msgspec.Meta(ge=0, le=10_000)] | None = None
    force: bool = False
    api_key: str | None = None


class InstallComplete(msgspec.Struct, frozen=True):
    """``sage.v1.install.complete`` from the installer capsule."""

    principal_id: str
    success: bool
    request_id: str | None = None
    home_path: str | None = None
    error: str | None = None
    changed: list[str] = []


class InstallStatus(msgspec.Struct, frozen=True):
    """``sage.v1.install.status``: one step of an install or relink."""

    principal_id: str
    step: str
    request_id: str | None = None
