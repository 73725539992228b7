"""astrid forge against a running supervisor: list, show, run, promote, runs, rm, secrets."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import anyio
import msgspec
import pytest

from bus.client import BusClient
from tests.support.sage_harness import Sage, running_sage, sage_config

pytestmark = pytest.mark.anyio

FIB = {
    "name": "fib",
    "description": "Fibonacci.",
    "input_schema": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0}},
        "required": ["n"],
    },
    "impl": (
        "import sys, json\n"
        "n = json.loads(sys.stdin.read())['n']\n"
        "a, b = 0, 1\n"
        "for _ in range(n):\n"
        "    a, b = b, a + b\n"
        "print(json.dumps({'ok': True, 'data': {'value': a}}))\n"
    ),
    "runtime": "python",
}


async def test_the_operator_cli_drives_the_forge() -> None:
    async with running_sage(sage_config("/bin/false", {}, capsules='["forge"]')) as sage:
        async with BusClient.connect(
            sage.daemon.socket, role="cli", name="alice", principal="alice"
        ) as alice:
            reply = await alice.request(
                "forge.v1.request.call",
                {"session_id": "s1", "tool_name": "forge_tool", "arguments": FIB},
                deadline=20,
            )
        forged = msgspec.json.decode(reply.payload)
        assert forged["isError"] is False, forged

        async def astrid(*args: str, stdin: bytes | None = None) -> str:
            code, out, err = await sage.astrid("forge", *args, stdin=stdin)
            assert code == 0, (args, out, err)
            return out

        listing = json.loads(await astrid("list", "--json"))
        (row,) = [t for t in listing["tools"] if t["name"] == "fib"]
        assert (row["scope"], row["principal_id"], row["session_id"]) == ("session", "alice", "s1")
        shown = await astrid("show", "fib", "--owner", "alice", "--session", "s1")
        assert "a, b = b, a + b" in shown
        ran = json.loads(
            await astrid("run", "fib", '{"n": 10}', "--owner", "alice", "--session", "s1", "--json")
        )
        assert ran["data"] == {"value": 55}, ran
        code, _, err = await sage.astrid("forge", "run", "fib", "{not json", "--owner", "alice")
        assert code != 0
        assert "JSON" in err
        await astrid("promote", "fib", "--owner", "alice", "--session", "s1")
        listing = json.loads(await astrid("list", "--json"))
        assert {t["scope"] for t in listing["tools"] if t["name"] == "fib"} == {"session", "user"}
        runs = json.loads(await astrid("runs", "list", "fib", "--json"))
        assert runs["runs"]
        assert runs["runs"][0]["tool"] == "fib"
        await astrid("rm", "fib", "--scope", "user")
        await astrid("rm", "fib", "--scope", "session", "--owner", "alice", "--session", "s1")
        listing = json.loads(await astrid("list", "--json"))
        assert not [t for t in listing["tools"] if t["name"] == "fib"]
        # vault secrets: never echoed
        await astrid("secret", "set", "SERVICE_TOKEN", "--stdin", stdin=b"tok-0123456789")
        names = await astrid("secret", "list")
        assert "SERVICE_TOKEN" in names
        assert "tok-0123456789" not in names
        await astrid("secret", "rm", "SERVICE_TOKEN")
        assert "SERVICE_TOKEN" not in await astrid("secret", "list")


SPILL = {
    "name": "spill",
    "description": "prints more than the output cap",
    "input_schema": {"type": "object"},
    "impl": "print('y' * 20000)\n",
    "runtime": "python",
}


def _pruned(sage: Sage) -> list[dict[str, Any]]:
    db = sqlite3.connect(f"file:{sage.daemon.root / 'state' / 'audit.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT payload FROM entries WHERE kind = 'forge.v1.audit.runs_pruned' ORDER BY seq"
        ).fetchall()
    finally:
        db.close()
    out = []
    for (raw,) in rows:
        entry = msgspec.json.decode(raw)
        out.append(entry.get("payload", entry))
    return out


async def test_astrid_forge_runs_list_and_prune() -> None:
    config = sage_config(
        "/bin/false", {}, capsules='["forge"]', extra="[forge]\noutput_cap = 4096\n"
    )
    async with running_sage(config) as sage:
        async with BusClient.connect(
            sage.daemon.socket, role="cli", name="alice", principal="alice"
        ) as alice:

            async def call(topic: str, payload: dict[str, Any]) -> Any:
                reply = await alice.request(topic, payload, deadline=20)
                return msgspec.json.decode(reply.payload)

            forged = await call(
                "forge.v1.request.call",
                {"session_id": "s1", "tool_name": "forge_tool", "arguments": SPILL},
            )
            assert forged["isError"] is False, forged
            run_ids = []
            for _ in range(3):
                out = await call(
                    "forge.v1.request.call",
                    {"session_id": "s1", "tool_name": "spill", "arguments": {}},
                )
                assert out["structuredContent"]["error"] == "output_truncated"
                run_ids.append(out["structuredContent"]["meta"]["run_id"])
            # a principal lists and prunes its own runs only
            denied = await call(
                "forge.v1.request.runs.prune", {"principal_id": "bob", "older_than": 0}
            )
            assert denied["error"] == "acl_denied", denied
            mine = await call("forge.v1.request.runs.list", {})
            assert {r["run_id"] for r in mine["runs"]} == set(run_ids)

        async def astrid(*args: str) -> str:
            code, out, err = await sage.astrid("forge", "runs", *args)
            assert code == 0, (args, out, err)
            return out

        listed = json.loads(await astrid("list", "--principal", "alice", "--json"))
        assert [r["run_id"] for r in listed["runs"]] == sorted(run_ids, reverse=True)
        held = listed["total_bytes"]
        assert held > 3 * 20000
        assert "held:" in await astrid()  # `astrid forge runs` alone lists
        dry = await astrid("prune", "--principal", "alice", "--keep-bytes", "0", "--dry-run")
        assert dry.splitlines()[-1] == f"would remove 3 runs, would free {held} bytes"
        assert len(json.loads(await astrid("list", "--json"))["runs"]) == 3
        code, _, err = await sage.astrid("forge", "runs", "prune")
        assert code == 1
        assert "--older-than SECONDS, --keep-bytes N or both" in err
        code, _, err = await sage.astrid("forge", "runs", "prune", "--keep-bytes", "lots")
        assert code == 2
        assert "not a number of bytes" in err
        done = await astrid("prune", "--principal", "alice", "--older-than", "0")
        assert done.splitlines()[-1] == f"removed 3 runs, freed {held} bytes"
        assert all(run_id in done for run_id in run_ids)
        assert json.loads(await astrid("list", "--json"))["runs"] == []
        with anyio.fail_after(10):
            while True:  # the audit sink appends asynchronously
                found = _pruned(sage)
                if found:
                    break
                await anyio.sleep(0.05)
        (audit,) = found
        assert (audit["reason"], audit["count"], audit["bytes"]) == ("manual", 3, held)
        assert audit["principals"] == [{"principal": "alice", "count": 3, "bytes": held}]
