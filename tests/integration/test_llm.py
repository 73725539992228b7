"""The completion provider (``llm`` capsule) through a real supervisor and a Messages API stand-in.

The stand-in runs in the test's event loop (the harness runs the daemon in
a thread); the test subscribes ``llm.v1.stream.sage`` before it publishes a
request, and reads the events of each request id up to its one ``Done`` or
``Error``.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from bus import BusClient, RemoteSubscription
from sage.config import decode_config
from sage.security.secrets import API_KEY, SecretStore, principal_namespace
from tests.support.daemon import short_dir
from tests.support.llm_standin import (
    Cut,
    Error,
    LlmStandin,
    MidStreamError,
    Recorded,
    Slow,
    SplitToolUse,
    Text,
    retry_soon,
)
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

KEY = "sk-test-key-123"
GENERATE = "llm.v1.request.generate.sage"
STREAM = "llm.v1.stream.sage"
TERMINAL = ("Done", "Error")


class Stream:
    """``llm.v1.stream.sage`` sorted by request id."""

    def __init__(self, subscription: RemoteSubscription) -> None:
        self.subscription = subscription
        self.by_id: dict[str, list[dict[str, Any]]] = defaultdict(list)

    async def pump(self) -> None:
        envelope = await self.subscription.get()
        data = msgspec.json.decode(envelope.payload)
        self.by_id[data["request_id"]].append(data["event"])

    def ended(self, rid: str) -> bool:
        return any(is_end(e) for e in self.by_id[rid])

    async def until_end(self, rid: str, within: float = 20.0) -> list[dict[str, Any]]:
        with anyio.fail_after(within):
            while not self.ended(rid):
                await self.pump()
        return self.by_id[rid]


@asynccontextmanager
async def llm_sage(
    *,
    key: str = KEY,
    max_retries: int = 2,
    attempt_timeout: float = 10.0,
    root: Path | None = None,
    principal_key: str | None = None,
    max_concurrent: int = 8,
    principal_extra: str = "",
) -> AsyncIterator[tuple[Sage, LlmStandin, Stream]]:
    standin = LlmStandin()
    await standin.start()
    config = sage_config(
        "/bin/false",
        {},
        capsules='["llm"]',
        principal_extra=principal_extra,
        extra=(
            f'[llm]\nbase_url = "{standin.url}"\nmax_retries = {max_retries}\n'
            f"timeout = {attempt_timeout}\nmax_concurrent = {max_concurrent}\n"
        ),
    )
    if principal_key is not None:  # alice's own key, stored before the daemon starts
        root = root or short_dir()
        text = f'[supervisor]\nstate_dir = "state"\n{config}'
        store = SecretStore.open(decode_config(text, base_dir=str(root)))
        store.put(principal_namespace("alice"), API_KEY, principal_key)
    try:
        async with running_sage(config, env={"ANTHROPIC_API_KEY": key}, root=root) as sage:
            stream = Stream(await sage.client.subscribe(STREAM))
            yield sage, standin, stream
            log = sage.daemon.log()
            audit_db = sage.daemon.root / "state" / "audit.db"
            for trouble in ("Traceback", "Warning", "llm.handler_failed", "llm.generation_failed"):
                assert trouble not in log, log[-4000:]
            for secret in (key, principal_key):
                if secret:
                    assert secret not in log
                    assert secret.encode() not in audit_db.read_bytes()
    finally:
        await standin.stop()


async def generate(sage: Sage, rid: str, **fields: Any) -> dict[str, Any]:
    payload = {"request_id": rid, "messages": [{"role": "user", "content": "hi"}], **fields}
    return await sage.request(GENERATE, payload)


def sent_key(request: Recorded) -> str:
    """The key a request carried (this SDK sends an ``api_key`` as a bearer token)."""
    return request.headers.get("x-api-key") or request.headers["authorization"].removeprefix(
        "Bearer "
    )


def is_end(event: dict[str, Any]) -> bool:
    """A request's own end (a refused duplicate's Error is about the other request)."""
    return event["type"] in TERMINAL and event.get("code") != "duplicate_request_id"


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["text"] for e in events if e["type"] == "TextDelta")


def terminal(events: list[dict[str, Any]]) -> dict[str, Any]:
    ends = [e for e in events if is_end(e)]
    assert len(ends) == 1, events
    assert events[-1] is ends[0], events
    return ends[0]


def audit_rows(sage: Sage) -> list[dict[str, Any]]:
    """The ``llm.v1.audit.generate`` records in the audit db, in order."""
    db = sqlite3.connect(sage.daemon.root / "state" / "audit.db")
    try:
        rows = db.execute(
            "SELECT principal, payload FROM entries WHERE kind = 'llm.v1.audit.generate'"
            " ORDER BY seq"
        ).fetchall()
    finally:
        db.close()
    out: list[dict[str, Any]] = []
    for principal, payload in rows:
        record: dict[str, Any] = msgspec.json.decode(payload)["payload"]
        out.append({"entry_principal": principal, **record})
    return out


async def test_text_tools_errors_cancel_and_describe() -> None:
    async with llm_sage() as (sage, standin, stream):
        # text in chunks
        standin.push(Text("Hello, streaming world!", chunks=5))
        reply = await generate(sage, "text1", system="be brief")
        assert reply == {"ok": True, "request_id": "text1"}
        events = await stream.until_end("text1")
        assert [e["type"] for e in events].count("TextDelta") == 5
        assert text_of(events) == "Hello, streaming world!"
        assert terminal(events) == {"type": "Done", "stop_reason": "end_turn"}
        usages = [e for e in events if e["type"] == "Usage"]
        assert usages == [{"type": "Usage", "input_tokens": 12, "output_tokens": 5}]
        assert events[-2]["type"] == "Usage"
        sent = standin.messages[-1]
        # this SDK sends an api_key as a bearer token
        auth = sent.headers.get("x-api-key") or sent.headers["authorization"].removeprefix(
            "Bearer "
        )
        assert auth == KEY
        assert sent.body["model"] == "claude-sonnet-4-5"
        assert sent.body["system"][0]["cache_control"] == {"type": "ephemeral"}

        # tool use split over many deltas
        tool_input = {"city": "Paris", "days": [1, 2, 3], "note": 'a "quoted" word'}
        standin.push(SplitToolUse("weather", tool_input, chunks=12, id="toolu_x"))
        await generate(sage, "tool1")
        events = await stream.until_end("tool1")
        assert events[0] == {"type": "ToolCallStart", "id": "toolu_x", "name": "weather"}
        deltas = [e for e in events if e["type"] == "ToolCallDelta"]
        assert len(deltas) >= 10
        assert all(e["id"] == "toolu_x" for e in deltas)
        assert json.loads("".join(e["args_delta"] for e in deltas)) == tool_input
        assert [e["type"] for e in events[-3:]] == ["ToolCallEnd", "Usage", "Done"]
        assert events[-1]["stop_reason"] == "tool_use"
        assert events[-2] == {
            "type": "Usage",
            "input_tokens": 21,
            "output_tokens": 9,
            "cache_read_input_tokens": 7,
        }

        # 401: not retried, one Error
        before = len(standin.messages)
        standin.push(Error(401, "authentication_error", "invalid x-api-key"))
        await generate(sage, "auth1")
        end = terminal(await stream.until_end("auth1"))
        assert end["code"] == "authentication"
        assert "invalid x-api-key" in end["message"]
        assert len(standin.messages) == before + 1

        # 500, 529, 429: retried (max_retries = 2), then given up
        for status, type_, code in (
            (500, "api_error", "server_error"),
            (529, "overloaded_error", "overloaded"),
            (429, "rate_limit_error", "rate_limited"),
        ):
            before = len(standin.messages)
            standin.push(*[retry_soon(status, type_) for _ in range(3)])
            rid = f"status{status}"
            await generate(sage, rid)
            end = terminal(await stream.until_end(rid))
            assert end["code"] == code, end
            assert "gave up after 2 retries" in end["message"]
            assert len(standin.messages) == before + 3

        # an error, then a success: the retry is invisible but for the text
        standin.push(retry_soon(529, "overloaded_error"), Text("second time lucky", chunks=3))
        await generate(sage, "retry1")
        events = await stream.until_end("retry1")
        assert text_of(events) == "second time lucky"
        assert terminal(events)["type"] == "Done"

        # a stream cut mid-way
        standin.push(Cut("this will not finish", chunks=6, after=2))
        await generate(sage, "cut1")
        events = await stream.until_end("cut1")
        assert text_of(events) == "this will not finish"[: len(text_of(events))]
        assert 0 < len(text_of(events)) < len("this will not finish")
        end = terminal(events)
        assert end["code"] == "stream_incomplete", end
        assert not any(e["type"] == "Usage" for e in events)

        # an error event in the middle of the stream
        standin.push(MidStreamError("half an ans"))
        await generate(sage, "mid1")
        events = await stream.until_end("mid1")
        assert text_of(events) == "half an ans"
        end = terminal(events)
        assert end["code"] == "overloaded", end
        assert "mid-stream" in end["message"]

        # unknown model
        reply = await generate(sage, "model1", model="claude-nope")
        assert reply["ok"] is False
        assert reply["error"] == "unknown_model"
        end = terminal(await stream.until_end("model1"))
        assert end["code"] == "unknown_model"
        assert "claude-nope" in end["message"]

        # malformed
        reply = await generate(sage, "bad1", messages=[])
        assert reply["error"] == "bad_request"
        assert terminal(await stream.until_end("bad1"))["code"] == "bad_request"

        # a slow stream cancelled, and a reused id while running
        standin.push(Slow("first part, then a long pause", delay=30.0, chunks=2))
        await generate(sage, "slow1")
        with anyio.fail_after(10):
            await standin.stream_started.wait()
        reply = await generate(sage, "slow1")
        assert reply["error"] == "duplicate_request_id"
        cancelled = await sage.request("llm.v1.request.cancel.slow1", {})
        assert cancelled == {"ok": True, "request_id": "slow1"}
        events = await stream.until_end("slow1")
        errors = [e for e in events if e["type"] == "Error"]
        # the duplicate's refusal, then the first's own end
        assert [e["code"] for e in errors] == ["duplicate_request_id", "cancelled"]
        assert events[-1]["code"] == "cancelled"
        assert text_of(events).startswith("first")
        unknown = await sage.request("llm.v1.request.cancel.nothing", {})
        assert unknown["ok"] is False
        assert unknown["error"] == "unknown_request"

        # describe
        described = await sage.request("llm.v1.request.describe", {})
        (entry,) = described["providers"]
        assert entry["id"] == "sage"
        assert entry["default_model"] == "claude-sonnet-4-5"
        assert "claude-haiku-4-5" in entry["models"]
        assert entry["topics"]["generate"] == GENERATE

        # audit: one record per request, with usage and cost
        for _ in range(100):  # the audit sink commits in the background
            if len(rows := audit_rows(sage)) >= 13:
                break
            await anyio.sleep(0.1)
        by_id = {(r["request_id"], r["outcome"]): r for r in rows}
        text = by_id[("text1", "done")]
        assert text["model"] == "claude-sonnet-4-5"
        assert (text["input_tokens"], text["output_tokens"]) == (12, 5)
        assert text["cost_usd"] == round((12 * 3 + 5 * 15) / 1e6, 6)
        assert text["stop_reason"] == "end_turn"
        assert text["duration_ms"] >= 0
        assert by_id[("tool1", "done")]["cache_read_input_tokens"] == 7
        assert by_id[("auth1", "error")]["error"] == "authentication"
        assert by_id[("slow1", "cancelled")]["error"] == "cancelled"
        assert by_id[("slow1", "error")]["error"] == "duplicate_request_id"
        assert by_id[("model1", "error")]["model"] == "claude-nope"
        assert by_id[("cut1", "error")]["error"] == "stream_incomplete"
        assert len(rows) == 13, [r["request_id"] for r in rows]
        assert KEY not in json.dumps(rows)


async def test_duplicate_while_running_leaves_the_first_to_finish() -> None:
    async with llm_sage() as (sage, standin, stream):
        standin.push(Slow("one two", delay=1.0, chunks=2))
        await generate(sage, "dup1")
        with anyio.fail_after(10):
            await standin.stream_started.wait()
        assert (await generate(sage, "dup1"))["error"] == "duplicate_request_id"
        events = await stream.until_end("dup1")
        assert [e["type"] for e in events if e["type"] in TERMINAL] == ["Error", "Done"]
        assert events[-1]["type"] == "Done"
        assert text_of(events) == "one two"
        # then the id is free again
        standin.push(Text("again"))
        await generate(sage, "dup1")
        with anyio.fail_after(10):
            while events[-1]["type"] != "Done" or text_of(events) != "one twoagain":
                await stream.pump()

        # 20 at once, 8 at a time
        standin.push(*[Slow(f"answer {i}", delay=0.2, chunks=2) for i in range(20)])
        rids = [f"many{i}" for i in range(20)]
        async with anyio.create_task_group() as tg:
            for rid in rids:
                tg.start_soon(generate, sage, rid)
        texts = set()
        for rid in rids:
            events = await stream.until_end(rid, within=30)
            assert terminal(events)["type"] == "Done", events
            texts.add(text_of(events))
        assert texts == {f"answer {i}" for i in range(20)}
        assert 1 < standin.peak <= 8

        # the CLI
        standin.push(Text("from the command line", chunks=3))
        code, out, err = await sage.astrid("llm", "generate", "hi")
        assert (code, out) == (0, "from the command line\n"), err
        standin.push(Error(401, "authentication_error", "invalid x-api-key"))
        code, out, err = await sage.astrid("llm", "generate", "hi")
        assert code == 1
        assert "refused the API key" in err
        code, out, err = await sage.astrid("llm", "describe")
        assert code == 0, err
        assert "claude-sonnet-4-5" in out


async def test_no_api_key_is_an_error() -> None:
    async with llm_sage(key="") as (sage, standin, stream):
        reply = await generate(sage, "nokey")
        assert reply["ok"] is True
        end = terminal(await stream.until_end("nokey"))
        assert end["code"] == "no_api_key", end
        assert standin.messages == []


async def test_the_principals_own_key_and_a_stalled_stream() -> None:
    root = short_dir()
    try:
        async with llm_sage(
            root=root,
            principal_key="sk-alice-456",
            attempt_timeout=1.0,
            max_retries=0,
            max_concurrent=1,
        ) as (sage, standin, stream):
            # one place: a second request waits, and can be cancelled while it waits
            standin.push(Slow("only one at a time", delay=0.6, chunks=2))
            await generate(sage, "first")
            with anyio.fail_after(10):
                await standin.stream_started.wait()
            await generate(sage, "waiting")
            await anyio.sleep(0.2)  # time enough to reach the API, were it not waiting
            cancelled = await sage.request("llm.v1.request.cancel.waiting", {})
            assert cancelled["ok"], cancelled
            events = await stream.until_end("waiting")
            assert events == [{"type": "Error", "message": "cancelled", "code": "cancelled"}]
            assert len(standin.messages) == 1  # it never reached the API
            events = await stream.until_end("first")
            assert terminal(events)["type"] == "Done"
            assert text_of(events) == "only one at a time"

            # the harness's client is root (an admin, no principal): the operator's key
            standin.push(Text("with the operator's key"))
            await generate(sage, "op1")
            assert terminal(await stream.until_end("op1"))["type"] == "Done"
            assert sent_key(standin.messages[-1]) == KEY
            # a client of alice's: her own key, and her events
            async with BusClient.connect(
                sage.daemon.socket, role="cli", name="alice", principal="alice"
            ) as alice:
                own = Stream(await alice.subscribe(STREAM))
                standin.push(Text("with alice's key"))
                payload = {"request_id": "own1", "messages": [{"role": "user", "content": "hi"}]}
                reply = msgspec.json.decode((await alice.request(GENERATE, payload)).payload)
                assert reply["ok"], reply
                events = await own.until_end("own1")
                assert terminal(events)["type"] == "Done"
                assert sent_key(standin.messages[-1]) == "sk-alice-456"
            # the CLI acting for alice, with JSON output
            standin.push(Text("json out", chunks=2))
            code, out, err = await sage.astrid(
                "llm", "generate", "--principal", "alice", "--json", "hi"
            )
            assert code == 0, err
            lines = [json.loads(line) for line in out.splitlines() if line.strip()]
            kinds = [line["event"]["type"] for line in lines]
            assert kinds == ["TextDelta", "TextDelta", "Usage", "Done"], out
            assert sent_key(standin.messages[-1]) == "sk-alice-456"
            # without --principal: the uid is listed under alice only, so it acts for her
            standin.push(Text("as alice"))
            code, out, err = await sage.astrid("llm", "generate", "hi")
            assert code == 0, err
            assert out.strip() == "as alice"
            assert sent_key(standin.messages[-1]) == "sk-alice-456"
            # a stream that stalls longer than [llm] timeout
            standin.push(Slow("first, then nothing", delay=3.0, chunks=2))
            await generate(sage, "stall1")
            events = await stream.until_end("stall1")
            end = terminal(events)
            assert end["code"] == "timeout", end
            assert text_of(events) == "first, then nothing"[: len(text_of(events))]
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_generation_cut_by_shutdown_is_audited_as_stopped() -> None:
    root = short_dir()
    try:
        async with llm_sage(root=root) as (sage, standin, stream):
            standin.push(Slow("never finished", delay=30.0, chunks=2))
            await generate(sage, "shut1")
            with anyio.fail_after(10):
                await standin.stream_started.wait()
            await stream.pump()  # its first delta
            last = sage
        (row,) = audit_rows(last)
        assert (row["request_id"], row["outcome"], row["error"]) == ("shut1", "error", "stopped")
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_llm_generate_uses_the_sessions_gateway_when_llm_names_none() -> None:
    """The README's one setting, `[claude] env ANTHROPIC_BASE_URL`, serves `astrid llm
    generate` too when `[llm] base_url` is unset: the stand-in gets the request."""
    standin = LlmStandin()
    await standin.start()
    try:
        config = sage_config("/bin/false", {"ANTHROPIC_BASE_URL": standin.url}, capsules='["llm"]')
        async with running_sage(config, env={"ANTHROPIC_API_KEY": KEY}) as sage:
            code, out, err = await sage.astrid("llm", "generate", "hello")
            assert code == 0, err
            assert len(standin.messages) == 1
            assert out.strip()
    finally:
        await standin.stop()


async def test_a_principal_over_its_budget_generates_nothing() -> None:
    """A generation is counted against its principal's budget; once it is spent the next
    one ends in Error budget_exceeded before the API is called, and the ledger shows it."""
    async with llm_sage(principal_extra="budget_tokens_per_day = 15\n") as (sage, standin, _):
        async with BusClient.connect(sage.daemon.socket, principal="alice") as alice:
            stream = Stream(await alice.subscribe(STREAM))
            for rid in ("first", "second"):
                payload = {"request_id": rid, "messages": [{"role": "user", "content": "hi"}]}
                reply = msgspec.json.decode((await alice.request(GENERATE, payload)).payload)
                assert reply["ok"], reply
                events = await stream.until_end(rid)
                end = terminal(events)
                if rid == "first":
                    assert end["type"] == "Done"
                    (usage,) = [e for e in events if e["type"] == "Usage"]
                else:
                    assert end["type"] == "Error", sage.daemon.log()[-3000:]
                    assert end["code"] == "budget_exceeded"
                    assert "15 tokens" in end["message"]
        assert len(standin.messages) == 1
        code, out, err = await sage.astrid("sage", "usage", "--by", "model", "--json")
        assert code == 0, err
        (row,) = msgspec.json.decode(out)["rows"]
        counts = ("input_tokens", "output_tokens", "cache_read_input_tokens")
        assert row["tokens"] == sum(usage.get(k, 0) for k in counts) > 15
        assert (row["principal"], row["calls"]) == ("alice", 1)
