"""astrid forge against a running supervisor: list, show, run, promote, runs, rm, secrets."""

from __future__ import annotations

import json

import msgspec
import pytest

from bus.client import BusClient
from tests.integration.sage_harness import running_sage, sage_config

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


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


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
        runs = json.loads(await astrid("runs", "fib", "--json"))
        assert runs["runs"]
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
