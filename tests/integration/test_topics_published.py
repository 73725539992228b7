"""docs/topics.md says what the runner really publishes: events, audit entries, listing rows.

A real supervisor with the CLI double goes through a session's life (spawn, turns, an
interrupted turn, a refused one, an identity refresh, hibernation and a wake, a
refused spawn, a stop) while a client records every ``sage.v1.event.>`` and
``sage.v1.audit.>`` envelope and the listing's rows (live, hibernated, ended).  Then
each payload is held against its row in the doc: every key it carries is named there,
and every field the doc's ``{...}`` names without a ``?`` is there.  So a field added
to the code and not the doc (or named in the doc and not sent) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "topics.md").read_text()
ENV = {"ANTHROPIC_API_KEY": "sk-double"}
_ROW = re.compile(r"^\|\s*pub\s*\|\s*`([^`]+)`\s*\|(.*)$", re.MULTILINE)
_AUDIT_ROW = re.compile(r"^\|\s*`(sage\.v1\.audit\.[^`]+)`\s*\|(.*)$", re.MULTILINE)
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _documented() -> dict[str, str]:
    """Each published topic of the doc (``<sid>`` a placeholder) and the rest of its row."""
    rows = {topic: rest for topic, rest in _ROW.findall(DOC)}
    rows.update({topic: rest for topic, rest in _AUDIT_ROW.findall(DOC)})
    return rows


def _row_for(topic: str, rows: dict[str, str]) -> str | None:
    for pattern, rest in rows.items():
        regex = re.escape(pattern).replace(re.escape("<sid>"), r"[^.]+")
        if "<" not in pattern.replace("<sid>", "") and re.fullmatch(regex, topic):
            return rest
    return None


def _required(rest: str) -> set[str]:
    """The fields the row's first ``{...}`` names at its top level without ``?``."""
    match = re.search(r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", rest)
    if match is None:
        return set()
    top = re.sub(r"\[[^\]]*\]|\{[^{}]*\}", "", match.group(1))
    names = set()
    for part in top.split(","):
        part = part.strip()
        name = part.split(":", 1)[0].strip()
        if name and not name.endswith("?") and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            names.add(name)
    return names


def _listing_fields(kind: str) -> set[str]:
    """The listing row fields the ``sessions`` request's row names: ``live`` or ``ended``."""
    (row,) = [
        line for line in DOC.splitlines() if line.startswith("| sub | `sage.v1.request.sessions`")
    ]
    live = re.search(r"live rows \(`([^`]+)`\)", row)
    ended = re.search(r"ended ones kept \(.*?: `state` `ended`, `([^`]+)`\)", row)
    assert live, "the sessions row names no live fields"
    assert ended, "the sessions row names no ended fields"
    chosen = live if kind == "live" else ended
    return {name.strip() for name in chosen.group(1).split(",")} | (
        {"state"} if kind == "ended" else set()
    )


async def _record(sage: Sage, seen: list[tuple[str, dict[str, Any]]]) -> None:
    events = await sage.client.subscribe("sage.v1.event.>")
    audits = await sage.client.subscribe("sage.v1.audit.>")

    async def pump(sub: Any) -> None:
        async for envelope in sub:
            seen.append((envelope.topic, msgspec.json.decode(envelope.payload)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(pump, events)
        tg.start_soon(pump, audits)


async def test_what_the_runner_publishes_is_what_the_doc_says() -> None:
    """Every event, audit entry and listing row of a session's life matches its doc row."""
    config = sage_config(
        FAKE_CLAUDE,
        {"FAKE_CLAUDE_MODE": ""},
        extra="[limits]\nstop_grace = 0.5\nstdin_quota = 4096\n[sessions]\nhibernate_after = 0.5\n",
    )
    seen: list[tuple[str, dict[str, Any]]] = []
    rows: list[tuple[str, dict[str, Any]]] = []
    async with running_sage(config, env=ENV) as sage, anyio.create_task_group() as tg:
        tg.start_soon(_record, sage, seen)
        await anyio.sleep(0.2)
        events = await sage.ready("doc")
        assert (await sage.send("doc", "hello"))["ok"]
        await events.text_until_done()
        assert (await sage.send("doc", "/fault hang"))["ok"]
        await events.until("text")
        assert (await sage.request("sage.v1.request.interrupt.doc", {}))["ok"]
        await events.until("done")
        assert (await sage.send("doc", "x" * 5000))["error"] == "payload_too_large"
        listing = await sage.request("sage.v1.request.sessions", {})
        rows += [("live", row) for row in listing["sessions"]]
        reply = await sage.request(
            "sage.v1.request.settings.set", {"principal_id": "alice", "identity": "You are v2."}
        )
        assert reply["ok"], reply
        await events.until("respawned")
        await events.until("hibernated", within=10)
        listing = await sage.request("sage.v1.request.sessions", {})
        rows += [("live", row) for row in listing["sessions"]]
        assert (await sage.send("doc", "again"))["ok"]
        await events.text_until_done()
        assert (
            await sage.request(
                "sage.v1.request.spawn", {"principal_id": "alice", "session_id": "doc"}
            )
        )["error"] == "duplicate_session"
        assert (await sage.request("sage.v1.request.stop.doc", {}))["ok"]
        await events.until("exited")
        listing = await sage.request("sage.v1.request.sessions", {"all": True})
        rows += [("ended", row) for row in listing["sessions"] if row["state"] == "ended"]
        await anyio.sleep(0.3)
        tg.cancel_scope.cancel()

    documented = _documented()
    problems: list[str] = []
    names = {topic.rsplit(".", 1)[1] for topic, _ in seen}
    for needed in ("spawned", "init", "text", "done", "error", "respawned", "hibernating",
                   "hibernated", "waking", "resumed", "exited", "session_rejected", "spawn",
                   "identity_changed", "session_hibernated"):  # fmt: skip
        assert needed in names, f"the scenario published no {needed}: {sorted(names)}"
    for topic, payload in seen:
        rest = _row_for(topic, documented)
        if rest is None:
            problems.append(f"{topic}: no row in docs/topics.md")
            continue
        words = set(_WORD.findall(rest))
        extra = sorted(set(payload) - words)
        if extra:
            problems.append(f"{topic}: sends {extra}, which its row does not name")
        missing = sorted(_required(rest) - set(payload))
        if missing:
            problems.append(f"{topic}: its row names {missing}, which it does not send")
    for kind, row in rows:
        fields = _listing_fields(kind)
        if set(row) != fields:
            problems.append(
                f"a {kind} listing row ({row.get('state')}): sends {sorted(set(row) - fields)}"
                f" undocumented, lacks {sorted(fields - set(row))}"
            )
    assert not problems, "\n".join(sorted(set(problems)))
