"""The tool catalogue: which capsule offers which tool, after caps and checks.

Pure and synchronous: the bridge (bridge.py) feeds it each capsule's
describe response (``{"tools": [ToolDescriptor]}``) and publishes what it
returns.  A descriptor is ``{"name", "description", "inputSchema"}``; it is
kept only when its name matches ``^[A-Za-z0-9_-]{1,64}$``, its description
is a string of at most 4 KiB (UTF-8), and its ``inputSchema`` is a JSON
object with ``"type": "object"`` of at most 16 KiB encoded that compiles
(``fastjsonschema``, remote ``$ref`` refused).  A capsule may offer 256
tools; entries past that are dropped with one rejection for all of them.
An offending tool is dropped and the rest kept; each drop is a
:class:`Rejection` the bridge logs and audits.

Names are global: when two capsules offer the same name, the first keeps
it and the second's offer is rejected.  The second's tool is remembered, so
it takes the name over when the first stops offering it.  A capsule's new
response replaces all of its tools.  Every operation returns a
:class:`Change`: the names whose tool appeared, went or changed, and the
rejections, so the bridge publishes only when something changed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import fastjsonschema
import msgspec

from sage.errors import RequestError

__all__ = (
    "MAX_DESCRIPTION",
    "MAX_SCHEMA",
    "MAX_TOOLS",
    "PREFIX",
    "Catalogue",
    "Change",
    "Rejection",
    "SchemaCache",
    "SchemaError",
    "Tool",
    "valid_name",
)

MAX_TOOLS = 256
"""Tools one capsule may offer."""
MAX_DESCRIPTION = 4 * 1024
"""Longest description, in UTF-8 bytes."""
MAX_SCHEMA = 16 * 1024
"""Longest inputSchema, in bytes of encoded JSON."""
PREFIX = "mcp__sage__"
"""What Claude sees before a tool's name (the in-band MCP server is ``sage``)."""

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_SHOWN = 100  # characters of an offending name or error kept in a rejection

Validator = Callable[[Any], Any]


def valid_name(name: object) -> bool:
    """Is ``name`` a tool name: ``^[A-Za-z0-9_-]{1,64}$``?"""
    return isinstance(name, str) and _NAME.match(name) is not None


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


class SchemaError(RequestError):
    """An inputSchema that does not compile."""

    code = "bad_schema"


class _NoRemoteRefs(Mapping[str, Callable[[str], Any]]):
    """fastjsonschema's ``handlers``: claims every URI scheme, fetches none.

    Without a handler for a scheme fastjsonschema opens the URI with urllib,
    so a schema's ``$ref`` could make the supervisor read files or URLs.
    """

    def __getitem__(self, scheme: str) -> Callable[[str], Any]:
        return _refuse_remote

    def __contains__(self, scheme: object) -> bool:
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _refuse_remote(uri: str) -> Any:
    raise SchemaError(f"remote $ref {uri!r} is not allowed")


class SchemaCache:
    """Compiled validators, one per distinct schema (keyed by its sorted encoding)."""

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._validators: dict[bytes, Validator] = {}

    def __len__(self) -> int:
        return len(self._validators)

    def compile(self, key: bytes) -> Validator:
        """The validator of the schema whose sorted JSON encoding is ``key``."""
        validator = self._validators.get(key)
        if validator is None:
            # a fresh copy: fastjsonschema rewrites the $refs of what it compiles
            schema = msgspec.json.decode(key)
            try:
                validator = fastjsonschema.compile(
                    schema, handlers=_NoRemoteRefs(), use_default=False
                )
            except Exception as exc:  # any failure to compile rejects the tool
                raise SchemaError(_short(f"{type(exc).__name__}: {exc}")) from exc
            if len(self._validators) >= self.limit:
                self._validators.clear()
            self._validators[key] = validator
        return validator


@dataclass(frozen=True)
class Tool:
    """One tool as the catalogue keeps it."""

    name: str
    capsule: str
    description: str
    input_schema: dict[str, Any]
    schema_key: bytes = field(repr=False)
    """The schema's sorted JSON encoding: equal keys, equal schemas."""
    validator: Validator = field(repr=False, compare=False)
    node: str = ""
    """The fleet node serving the tool ("": this node; see fleet.py)."""

    def check(self, arguments: Any) -> str | None:
        """Why ``arguments`` break the inputSchema, or None when they do not."""
        try:
            self.validator(arguments)
        except fastjsonschema.JsonSchemaValueException as exc:
            return str(exc.message)
        except Exception as exc:  # a validator that fails is a refusal, never a pass
            return f"cannot be checked: {type(exc).__name__}: {exc}"
        return None

    def mcp(self) -> dict[str, Any]:
        """The tool as ``sage.v1.tools.list`` and MCP ``tools/list`` show it."""
        return {
            "name": PREFIX + self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }

    def same_as(self, other: Tool | None) -> bool:
        return (
            other is not None
            and self.capsule == other.capsule
            and self.node == other.node
            and self.description == other.description
            and self.schema_key == other.schema_key
        )


@dataclass(frozen=True)
class Rejection:
    """A tool (or a whole response: ``tool`` None) the catalogue dropped, and why."""

    capsule: str
    tool: str | None
    reason: str

    def audit(self) -> dict[str, Any]:
        """The ``sage.v1.audit.tool_rejected`` payload."""
        return {"capsule": self.capsule, "tool": self.tool, "reason": self.reason}


@dataclass(frozen=True)
class Change:
    """What one operation did: names (bare, sorted) that changed, and rejections."""

    changed: list[str] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)


class Catalogue:
    """Every capsule's offered tools, and which capsule owns each name."""

    def __init__(self, schemas: SchemaCache | None = None) -> None:
        self.schemas = schemas if schemas is not None else SchemaCache()
        self._offers: dict[str, dict[str, Tool]] = {}
        """capsule -> its valid tools by name, capsules in the order they first offered."""
        self._owners: dict[str, str] = {}
        """tool name -> the capsule that owns it."""

    # -- reading ----------------------------------------------------------

    def get(self, name: str) -> Tool | None:
        """The tool that answers to ``name`` (bare), if any."""
        capsule = self._owners.get(name)
        return None if capsule is None else self._offers[capsule][name]

    def tools(self) -> list[Tool]:
        """The tools in force, sorted by name."""
        return [self._offers[self._owners[name]][name] for name in sorted(self._owners)]

    def mcp_tools(self) -> list[dict[str, Any]]:
        """The ``sage.v1.tools.list`` payload's ``tools``."""
        return [tool.mcp() for tool in self.tools()]

    def capsules(self) -> list[str]:
        """Capsules with an offer on record (possibly of no tools)."""
        return list(self._offers)

    def clashes(self) -> list[dict[str, str]]:
        """Offered tools not in force because another capsule owns their name:
        ``{"name", "capsule", "owner"}`` each, sorted by name then capsule."""
        return sorted(
            (
                {"name": name, "capsule": capsule, "owner": self._owners[name]}
                for capsule, offered in self._offers.items()
                for name in offered
                if self._owners.get(name, capsule) != capsule
            ),
            key=lambda row: (row["name"], row["capsule"]),
        )

    # -- changing ---------------------------------------------------------

    def offer(self, capsule: str, response: Any) -> Change:
        """Replace ``capsule``'s tools with those of its describe ``response``."""
        tools = response.get("tools") if isinstance(response, dict) else None
        if not isinstance(tools, list):
            reason = 'a describe response must be {"tools": [...]}; it was ignored'
            return Change(rejected=[Rejection(capsule, None, reason)])
        offered: dict[str, Tool] = {}
        rejected: list[Rejection] = []
        for entry in tools[:MAX_TOOLS]:
            tool = self._check(capsule, entry, offered, rejected)
            if tool is not None:
                offered[tool.name] = tool
        if len(tools) > MAX_TOOLS:
            reason = f"{len(tools)} tools offered, over the cap of {MAX_TOOLS}: the rest dropped"
            rejected.append(Rejection(capsule, None, reason))
        before = self._snapshot()
        self._offers[capsule] = offered
        self._assign()
        for name in offered:
            owner = self._owners.get(name)
            if owner != capsule:
                rejected.append(Rejection(capsule, name, f"the name is taken by capsule {owner}"))
        return Change(self._diff(before), rejected)

    def remove(self, capsule: str) -> Change:
        """Forget ``capsule``'s tools (it stopped or failed)."""
        if capsule not in self._offers:
            return Change()
        before = self._snapshot()
        del self._offers[capsule]
        self._assign()
        return Change(self._diff(before))

    # -- inside -----------------------------------------------------------

    def _check(
        self, capsule: str, entry: Any, offered: dict[str, Tool], rejected: list[Rejection]
    ) -> Tool | None:
        def reject(tool: str | None, reason: str) -> None:
            rejected.append(Rejection(capsule, tool, reason))

        if not isinstance(entry, dict):
            reject(None, "a tool descriptor must be a JSON object")
            return None
        name = entry.get("name")
        if not valid_name(name):
            shown = _short(name) if isinstance(name, str) else None
            reject(shown, "the tool name must match ^[A-Za-z0-9_-]{1,64}$")
            return None
        assert isinstance(name, str)
        if name in offered:
            reject(name, "the capsule offers this name twice: the first one is kept")
            return None
        description = entry.get("description", "")
        if not isinstance(description, str):
            reject(name, "description must be a string")
            return None
        size = len(description.encode())
        if size > MAX_DESCRIPTION:
            reject(name, f"description is {size} bytes, over the cap of {MAX_DESCRIPTION}")
            return None
        schema = entry.get("inputSchema")
        if not isinstance(schema, dict):
            reject(name, "inputSchema must be a JSON object")
            return None
        if schema.get("type") != "object":
            reject(name, 'inputSchema must have "type": "object"')
            return None
        key = msgspec.json.encode(schema, order="sorted")
        if len(key) > MAX_SCHEMA:
            reject(name, f"inputSchema is {len(key)} bytes, over the cap of {MAX_SCHEMA}")
            return None
        try:
            validator = self.schemas.compile(key)
        except SchemaError as exc:
            reject(name, f"inputSchema does not compile: {exc}")
            return None
        return Tool(name, capsule, description, schema, key, validator)

    def _assign(self) -> None:
        """First claim keeps a name; a name let go goes to the next capsule offering it."""
        owners = self._owners
        for name, capsule in list(owners.items()):
            if name not in self._offers.get(capsule, {}):
                del owners[name]
        for capsule, offered in self._offers.items():
            for name in offered:
                owners.setdefault(name, capsule)

    def _snapshot(self) -> dict[str, Tool]:
        return {tool.name: tool for tool in self.tools()}

    def _diff(self, before: dict[str, Tool]) -> list[str]:
        after = self._snapshot()
        return sorted(
            name
            for name in before.keys() | after.keys()
            if not (name in after and after[name].same_as(before.get(name)))
        )
