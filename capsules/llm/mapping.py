"""Requests in: ``llm.v1.request.generate.sage`` payloads checked and turned into
the Messages API's arguments.  Pure (no I/O), so every rule is a unit test.

A request is ``{request_id, model?, messages, tools?, system?, max_tokens?}``.
``messages`` are Messages-API-shaped: ``{role: "user"|"assistant", content}``
with ``content`` a string or a list of blocks ``text``, ``image`` (base64 or
url source), ``tool_use`` (a tool call the model made) and ``tool_result``
(the answer to one).  Anything else is refused before a byte goes out, with
msgspec's message naming the place (``at `$.messages[0].content[1]```).

The system prompt and the last tool are marked ``cache_control: ephemeral``,
so a conversation that repeats them is billed at the cache-read price.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from sage.config import LlmConfig
from sage.errors import RequestError

__all__ = (
    "REQUEST_ID",
    "BadRequest",
    "GenerateRequest",
    "UnknownModel",
    "api_arguments",
    "offered_models",
    "parse_request",
)

REQUEST_ID = r"^[A-Za-z0-9_-]{1,64}\Z"
_REQUEST_ID = re.compile(REQUEST_ID)
_EPHEMERAL: dict[str, str] = {"type": "ephemeral"}


class _Block(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """A content block; ``type`` is the tag (msgspec refuses unknown types)."""


class TextBlock(_Block, frozen=True, tag="text", tag_field="type"):
    text: str


class Base64Source(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="base64"):
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="url"):
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://")]


class ImageBlock(_Block, frozen=True, tag="image", tag_field="type"):
    source: Base64Source | UrlSource


class ToolUseBlock(_Block, frozen=True, tag="tool_use", tag_field="type"):
    id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}\Z")]
    input: dict[str, Any]


class ToolResultBlock(_Block, frozen=True, tag="tool_result", tag_field="type"):
    tool_use_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    content: str | list[TextBlock | ImageBlock] = ""
    is_error: bool = False


Block: TypeAlias = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock


class Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], msgspec.Meta(min_length=1)]


class ToolSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]{1,128}\Z")]
    input_schema: dict[str, Any]
    description: str = ""


class GenerateRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``llm.v1.request.generate.sage``."""

    request_id: Annotated[str, msgspec.Meta(pattern=REQUEST_ID)]
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    model: str | None = None
    tools: list[ToolSpec] | None = None
    system: str | Annotated[list[TextBlock], msgspec.Meta(min_length=1)] | None = None
    max_tokens: Annotated[int, msgspec.Meta(gt=0, le=1_000_000)] | None = None


@dataclass(frozen=True)
class BadRequest:
    """A payload that is not a request; ``request_id`` when one could be read from it."""

    message: str
    request_id: str | None = None


_decoder = msgspec.json.Decoder(GenerateRequest)


def parse_request(payload: bytes) -> GenerateRequest | BadRequest:
    """The request, or why it is not one (naming its id when the id itself is fine)."""
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as exc:
        return BadRequest(f"malformed request: {exc}", _request_id_of(payload))
    except msgspec.DecodeError as exc:
        return BadRequest(f"malformed request: not JSON ({exc})")


def _request_id_of(payload: bytes) -> str | None:
    try:
        data = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None
    rid = data.get("request_id") if isinstance(data, dict) else None
    return rid if isinstance(rid, str) and _REQUEST_ID.match(rid) else None


def offered_models(config: LlmConfig) -> list[str]:
    """``[llm] models``, plus the default model if the list forgot it."""
    return list(dict.fromkeys([*config.models, config.model]))


class UnknownModel(RequestError):
    """A request names a model the provider does not offer."""

    code = "unknown_model"


def api_arguments(request: GenerateRequest, config: LlmConfig) -> dict[str, Any]:
    """Keyword arguments for ``messages.create`` (all but ``stream``).

    Raises :class:`UnknownModel` for a model the provider does not offer."""
    model = request.model or config.model
    offered = offered_models(config)
    if model not in offered:
        raise UnknownModel(f"unknown model {model!r} (offered: {', '.join(offered)})")
    arguments: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens or config.max_tokens,
        "messages": [_message(m) for m in request.messages],
    }
    if request.system is not None:
        arguments["system"] = _cached_last(_system_blocks(request.system))
    if request.tools:
        arguments["tools"] = _cached_last([msgspec.to_builtins(t) for t in request.tools])
    return arguments


def _message(message: Message) -> dict[str, Any]:
    content = message.content
    return {
        "role": message.role,
        "content": content if isinstance(content, str) else msgspec.to_builtins(content),
    }


def _system_blocks(system: str | Sequence[TextBlock]) -> list[dict[str, Any]]:
    if isinstance(system, str):
        return [{"type": "text", "text": system}]
    return [msgspec.to_builtins(block) for block in system]


def _cached_last(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark the last item as a prompt-cache breakpoint: everything up to it is cached."""
    if items:
        items[-1] = {**items[-1], "cache_control": dict(_EPHEMERAL)}
    return items
