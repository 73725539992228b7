"""Tool policy: allow or deny a call by tool, principal and arguments.

The policy lives in ``<state_dir>/tools-policy.json``::

    {"default": "allow",
     "rules": [
       {"tools": "shell_*", "principals": ["alice"], "action": "allow"},
       {"tools": "fetch", "match": {"/url": "http://*"}, "action": "deny",
        "reason": "plain http is not allowed"},
       {"tools": "*", "match": {"/options/dry_run": true}, "action": "allow"}
     ]}

Rules are tried in order and the first that matches decides; when none
does, ``default`` decides.  **Without a file, or with a file that names no
default, every call is allowed** (``"default": "allow"``).  A rule matches
when all of its parts do:

- ``tools``: a glob (Python ``fnmatch``, case-sensitive: ``*``, ``?``,
  ``[...]``) over the bare tool name (``greet``); a leading ``mcp__sage__``
  in the glob is ignored, so Claude's names work too.
- ``principals`` (optional): the calling principal is one of these names;
  a call without a principal matches no rule that has this part.
- ``match`` (optional): for each RFC 6901 JSON pointer into the call's
  arguments (``/a/b``, ``/list/0``; ``~1`` for ``/`` and ``~0`` for ``~``
  in a key; ``""`` the whole arguments), the value there must match: a
  string is a glob the value must be a string matching; any other JSON
  value must be equal (``1`` equals ``1.0``, ``true`` does not equal
  ``1``).  A pointer that leads nowhere does not match.

A denying rule's ``reason`` is what Claude reads (else a text naming the
rule).  Decisions name their source: ``policy:<i>`` (the rule's index in
``rules``, from 0) or ``default``.

:class:`PolicyFile` re-reads the file when its mtime (or size or inode)
changes.  A bad file keeps the last good policy; when no good policy was
ever read from an existing file (a bad file at start), calls are denied
(source ``policy_invalid``) until the file is fixed or removed: a broken
policy fails closed, never open.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

import msgspec

from capsules.tools.catalogue import PREFIX
from sage.errors import ConfigError

__all__ = (
    "DEFAULT_POLICY",
    "Decision",
    "Matcher",
    "Policy",
    "PolicyError",
    "PolicyFile",
    "PolicyReload",
    "Rule",
    "decide",
    "found",
    "parse_pointer",
    "parse_policy",
    "resolve_pointer",
)

Action = Literal["allow", "deny"]


class PolicyError(ConfigError):
    """A policy file that cannot be used, with a message naming what is wrong."""

    code = "policy_invalid"


# -- JSON pointers (RFC 6901) ---------------------------------------------------


_BAD_ESCAPE = re.compile(r"~(?![01])")


def parse_pointer(text: str) -> tuple[str, ...]:
    """The reference tokens of a JSON pointer; raise PolicyError when it is not one."""
    if text == "":
        return ()
    if not text.startswith("/"):
        raise PolicyError(f"JSON pointer {text!r} must be empty or start with '/'")
    tokens = []
    for raw in text[1:].split("/"):
        if _BAD_ESCAPE.search(raw):
            raise PolicyError(f"JSON pointer {text!r}: '~' must be followed by 0 or 1")
        tokens.append(raw.replace("~1", "/").replace("~0", "~"))
    return tuple(tokens)


_MISSING = object()


def resolve_pointer(document: Any, tokens: tuple[str, ...]) -> Any:
    """The value ``tokens`` point at in ``document``, or ``_MISSING``."""
    value = document
    for token in tokens:
        if isinstance(value, dict):
            if token not in value:
                return _MISSING
            value = value[token]
        elif isinstance(value, list):
            # an index is 0 or digits without a leading zero; "-" (past the end) is nothing
            if not token.isdigit() or (len(token) > 1 and token[0] == "0") or not token.isascii():
                return _MISSING
            index = int(token)
            if index >= len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


def found(value: Any) -> bool:
    """Did :func:`resolve_pointer` find something?"""
    return value is not _MISSING


def _json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values: booleans are not numbers, 1 equals 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and bool(a == b)


# -- rules ----------------------------------------------------------------------


@dataclass(frozen=True)
class Matcher:
    """One ``match`` entry: a pointer into the arguments and what must be there."""

    pointer: str
    tokens: tuple[str, ...]
    expected: Any

    def matches(self, arguments: Any) -> bool:
        actual = resolve_pointer(arguments, self.tokens)
        if not found(actual):
            return False
        if isinstance(self.expected, str):
            return isinstance(actual, str) and fnmatchcase(actual, self.expected)
        return _json_equal(self.expected, actual)


@dataclass(frozen=True)
class Rule:
    tools: str
    action: Action
    principals: frozenset[str] | None = None
    match: tuple[Matcher, ...] = ()
    reason: str | None = None

    def matches(self, tool: str, principal: str | None, arguments: Any) -> bool:
        if not fnmatchcase(tool, self.tools.removeprefix(PREFIX)):
            return False
        if self.principals is not None and principal not in self.principals:
            return False
        return all(m.matches(arguments) for m in self.match)


@dataclass(frozen=True)
class Policy:
    default: Action = "allow"
    rules: tuple[Rule, ...] = ()


DEFAULT_POLICY = Policy()
"""No file: allow everything."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    source: str
    """``policy:<rule index>``, ``default`` or ``policy_invalid``."""
    reason: str = ""
    """For a denial: the text Claude reads."""


def decide(policy: Policy, tool: str, principal: str | None, arguments: Any) -> Decision:
    """The first matching rule's decision, else the default's."""
    for index, rule in enumerate(policy.rules):
        if rule.matches(tool, principal, arguments):
            allowed = rule.action == "allow"
            reason = "" if allowed else rule.reason or f"denied by tool policy rule {index}"
            return Decision(allowed, f"policy:{index}", reason)
    if policy.default == "allow":
        return Decision(True, "default")
    return Decision(False, "default", f"tool {tool!r} is denied by the tool policy's default")


# -- the file -------------------------------------------------------------------


class _RuleFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tools: str
    action: Action
    principals: list[str] | None = None
    match: dict[str, Any] = {}
    reason: str | None = None


class _PolicyFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    default: Action = "allow"
    rules: list[_RuleFile] = []


def parse_policy(data: bytes) -> Policy:
    """A policy from the file's bytes; raise PolicyError naming what is wrong."""
    try:
        raw = msgspec.json.decode(data, type=_PolicyFile)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PolicyError(str(exc)) from None
    rules = []
    for index, rule in enumerate(raw.rules):
        try:
            matchers = tuple(
                Matcher(pointer, parse_pointer(pointer), expected)
                for pointer, expected in rule.match.items()
            )
        except PolicyError as exc:
            raise PolicyError(f"{exc} - at `$.rules[{index}].match`") from None
        principals = None if rule.principals is None else frozenset(rule.principals)
        rules.append(Rule(rule.tools, rule.action, principals, matchers, rule.reason))
    return Policy(raw.default, tuple(rules))


@dataclass(frozen=True)
class PolicyReload:
    """What a re-read found: ``ok`` (a new policy, or the file is gone) or ``error``."""

    path: str
    ok: bool
    error: str = ""

    def audit(self) -> dict[str, Any]:
        """The ``sage.v1.audit.policy_reload_failed`` payload."""
        return {"path": self.path, "error": self.error}


_Stamp = tuple[int, int, int]


class PolicyFile:
    """The policy in force, from a file re-read when it changes (sync, small I/O)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.policy: Policy | None = DEFAULT_POLICY
        """The last good policy; None while a file exists that never read well."""
        self.error = ""
        """Why the file last failed to read, or empty."""
        self._stamp: _Stamp | Literal["unread"] | None = "unread"

    def decide(self, tool: str, principal: str | None, arguments: Any) -> Decision:
        if self.policy is None:
            reason = f"the tool policy {self.path} is invalid ({self.error}): calls are denied"
            return Decision(False, "policy_invalid", reason)
        return decide(self.policy, tool, principal, arguments)

    def refresh(self) -> PolicyReload | None:
        """Re-read the file if it changed since the last look; None when it did not."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            stamp: _Stamp | None = None
        except OSError as exc:
            stamp = (-1, -1, exc.errno or 0)
        else:
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return None
        first = self._stamp == "unread"
        self._stamp = stamp
        if stamp is None:
            self.policy, self.error = DEFAULT_POLICY, ""
            return None if first else PolicyReload(str(self.path), True)
        try:
            policy = parse_policy(self.path.read_bytes())
        except OSError as exc:
            return self._failed(f"cannot read: {exc.strerror}", first)
        except PolicyError as exc:
            return self._failed(str(exc), first)
        self.policy, self.error = policy, ""
        return PolicyReload(str(self.path), True)

    def _failed(self, error: str, first: bool) -> PolicyReload:
        self.error = error
        if first:
            self.policy = None  # no good policy from this file yet: fail closed
        return PolicyReload(str(self.path), False, error)
