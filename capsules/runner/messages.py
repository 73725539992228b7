"""Payloads of the runner's requests, as msgspec types (docs/topics.md lists them)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = (
    "ApprovalResponse",
    "IdentitySaved",
    "SendRequest",
    "SettingsPatch",
    "SpawnRequest",
    "ToolResult",
    "ToolsChanged",
    "ToolsList",
)


class SpawnRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.spawn``."""

    principal_id: str
    session_id: str | None = None
    initial_message: str | None = None


class SessionsRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.sessions``: live sessions; ``all`` adds the ended ones kept."""

    all: bool = False


class SessionRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``sage.v1.request.session.<sid>``: one session, live or ended, with its last
    ``replay`` events (at most 256)."""

    replay: Annotated[int, msgspec.Meta(ge=0, le=256)] = 0


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


class ApprovalResponse(msgspec.Struct, frozen=True):
    """``approval.v1.response.<cid>``."""

    allowed: bool
    reason: str | None = None


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
