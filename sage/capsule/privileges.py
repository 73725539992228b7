"""Which patterns of an installed capsule reach beyond its own tools, and who granted them.

An installed capsule's manifest is its ACL on the bus.  What a tool capsule
needs is fixed (:func:`sage.capsule.sdk.required_patterns`): the describe
request and its own describe answer, and the execute topic and result of each
tool it names.  Every other pattern that could match a topic of sage's own
namespaces (:data:`RESERVED`: requests, sessions' events and tool calls,
approvals, hooks, other capsules' tool calls, completions, the forge, the
audit log) is **privileged**: with ``[publish] patterns = ["sage.v1.request.>"]``
and ``[subscribe] patterns = ["sage.v1.event.>"]`` a capsule could list every
principal's sessions, send turns into them and read the replies.  Patterns of
namespaces of its own (``demo.v1.echo``, ``myapp.>``) are not.

``astrid capsule install`` refuses a privileged pattern unless it is given
``--allow-privileged``, and then records the grant in
``<state_dir>/capsule_grants.json`` (0600): the patterns, when, by which uid.
The supervisor starts an installed capsule only when each privileged pattern
of its manifest is granted (a manifest edited afterwards is refused), shows
the grants in ``astrid capsule list`` and audits each start of a capsule that
holds one (``sage.v1.audit.capsule_privileged``).  Pure but for the grants
file's read and write.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

import msgspec

from bus.acl import pattern_covers, patterns_overlap
from bus.topics import split_pattern
from sage.errors import ConfigError
from sage.files import read_private, write_replace

__all__ = (
    "RESERVED",
    "Grant",
    "Privilege",
    "check_granted",
    "grant",
    "grants",
    "privileges",
    "revoke",
    "ungranted",
)

Kind = Literal["publish", "subscribe"]

RESERVED: Final[dict[str, str]] = {
    "sage.>": "sage's requests, sessions' events and tool calls (every principal's)",
    "tool.>": "other capsules' tool calls",
    "approval.>": "approval prompts and answers",
    "hook.>": "sessions' hook events",
    "llm.>": "the completion provider",
    "forge.>": "forged tools",
    "*.v1.audit.>": "the audit log",
}
"""sage's own namespaces, each with what a pattern reaching into it reaches."""

AUDIT: Final = "*.v1.audit.>"
"""Reached only by a pattern inside it: the bus lets a capsule write audit topics only
when its manifest names an audit pattern explicitly (``Bus(protected=...)``), so
``myapp.v1.>`` does not reach ``myapp.v1.audit.x``."""

GRANTS_FILE: Final = "capsule_grants.json"


@dataclass(frozen=True)
class Privilege:
    """One privileged pattern of a manifest: ``[kind] pattern`` and what it reaches."""

    kind: Kind
    pattern: str
    reaches: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.pattern!r} reaches {self.reaches}"


def _own(kind: Kind, pattern: str, capsule: str) -> bool:
    """Whether ``pattern`` is one of the tool topics a capsule named ``capsule`` owns."""
    tokens = split_pattern(pattern)
    if any(t in ("*", ">") for t in tokens):
        return False
    if kind == "subscribe":
        return tokens == ("tool", "v1", "request", "describe") or (
            len(tokens) == 4 and tokens[:3] == ("tool", "v1", "execute")
        )
    return tokens == ("tool", "v1", "response", "describe", capsule) or (
        len(tokens) == 5 and tokens[:3] == ("tool", "v1", "execute") and tokens[4] == "result"
    )


def privileges(capsule: str, publish: list[str], subscribe: list[str]) -> list[Privilege]:
    """The privileged patterns of capsule ``capsule``'s manifest, in manifest order."""
    found: list[Privilege] = []
    sides: tuple[tuple[Kind, list[str]], ...] = (("publish", publish), ("subscribe", subscribe))
    for kind, patterns in sides:
        for pattern in patterns:
            if _own(kind, pattern, capsule):
                continue
            reached = [
                what
                for ns, what in RESERVED.items()
                if (pattern_covers(ns, pattern) if ns == AUDIT else patterns_overlap(pattern, ns))
            ]
            if reached:
                found.append(Privilege(kind, pattern, "; ".join(reached)))
    return found


class Grant(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The privileged patterns an admin granted one installed capsule."""

    publish: list[str] = []
    subscribe: list[str] = []
    granted_at: float = 0.0
    granted_by: int = -1
    """The uid that ran ``astrid capsule install --allow-privileged``."""

    def covers(self, privilege: Privilege) -> bool:
        return privilege.pattern in (
            self.publish if privilege.kind == "publish" else self.subscribe
        )


def _path(state_dir: Path) -> Path:
    return state_dir / GRANTS_FILE


def grants(state_dir: Path) -> dict[str, Grant]:
    """The grants by capsule name (none when the file is missing)."""
    try:
        data = read_private(_path(state_dir), what="capsule grants", error=ConfigError)
    except FileNotFoundError:
        return {}
    try:
        return msgspec.json.decode(data, type=dict[str, Grant])
    except msgspec.MsgspecError as exc:
        raise ConfigError(f"{_path(state_dir)}: not a capsule grants file: {exc}") from None


def _save(state_dir: Path, table: dict[str, Grant]) -> None:
    write_replace(_path(state_dir), msgspec.json.format(msgspec.json.encode(table)) + b"\n")


def grant(state_dir: Path, capsule: str, privileged: list[Privilege]) -> Grant | None:
    """Record ``privileged`` as granted to ``capsule`` (replacing an older grant; none
    when it holds no privileged pattern); the grant."""
    table = grants(state_dir)
    if not privileged:
        if table.pop(capsule, None) is not None:
            _save(state_dir, table)
        return None
    given = Grant(
        publish=[p.pattern for p in privileged if p.kind == "publish"],
        subscribe=[p.pattern for p in privileged if p.kind == "subscribe"],
        granted_at=time.time(),
        granted_by=os.geteuid(),
    )
    table[capsule] = given
    _save(state_dir, table)
    return given


def revoke(state_dir: Path, capsule: str) -> None:
    """Forget ``capsule``'s grant (it was removed)."""
    table = grants(state_dir)
    if table.pop(capsule, None) is not None:
        _save(state_dir, table)


def ungranted(privileged: list[Privilege], given: Grant | None) -> list[Privilege]:
    """Those of ``privileged`` that ``given`` does not cover."""
    return [p for p in privileged if given is None or not given.covers(p)]


def check_granted(
    state_dir: Path, capsule: str, publish: list[str], subscribe: list[str]
) -> Grant | None:
    """The grant that lets installed capsule ``capsule`` run with these patterns (None: it
    needs none); ConfigError naming each privileged pattern no grant covers."""
    privileged = privileges(capsule, publish, subscribe)
    if not privileged:
        return None
    given = grants(state_dir).get(capsule)
    missing = ungranted(privileged, given)
    if missing:
        raise ConfigError(
            f"capsule {capsule!r} asks for privileged patterns nobody granted: "
            + ", ".join(str(p) for p in missing)
            + " (install it with --allow-privileged to grant them)"
        )
    return given
