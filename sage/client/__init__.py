"""sage for programs: spawn sessions, stream typed messages, decide tool calls in code.

Shaped like the Claude Agent SDK (docs/client.md has the porting guide)::

    from sage.client import connect, Allow, Deny

    async with connect() as sage:
        session = await sage.spawn("alice")
        async for message in session.send("hi"):
            ...
"""

from __future__ import annotations

from sage.client._client import (
    Allow,
    CanUseTool,
    Deny,
    Sage,
    Session,
    SessionEnded,
    ToolPermissionContext,
    connect,
    query,
)
from sage.client.messages import (
    ApprovalDecision,
    ApprovalInfo,
    ApprovalRequest,
    AssistantMessage,
    ContentBlock,
    Message,
    RedactedThinkingBlock,
    ResultMessage,
    Retry,
    SessionInfo,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    UserMessage,
)
from sage.contract.usage import BudgetRow, ReportRow, UsageReport
from sage.errors import SageError

__all__ = (
    "Allow",
    "ApprovalDecision",
    "ApprovalInfo",
    "ApprovalRequest",
    "AssistantMessage",
    "BudgetRow",
    "CanUseTool",
    "ContentBlock",
    "Deny",
    "Message",
    "RedactedThinkingBlock",
    "ReportRow",
    "ResultMessage",
    "Retry",
    "Sage",
    "SageError",
    "Session",
    "SessionEnded",
    "SessionInfo",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ToolPermissionContext",
    "ToolResultBlock",
    "ToolUseBlock",
    "UsageReport",
    "UserMessage",
    "connect",
    "query",
)
