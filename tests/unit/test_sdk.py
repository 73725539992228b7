"""The capsule SDK: tool descriptors from Structs and docstrings, and a capsule serving them."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any

import anyio
import msgspec
import pytest
import structlog
from structlog.testing import capture_logs

from bus import Acl, Bus, Envelope, Identity, Subscription
from sage.capsule.context import CapsuleContext
from sage.capsule.manifest import CapsuleManifest, load_manifest
from sage.capsule.sdk import (
    MAX_TOOLS,
    Capsule,
    Tool,
    ToolCall,
    ToolError,
    follow,
    input_schema,
    required_patterns,
)
from sage.daemon.capsule_host import CapsuleRunner, CapsuleState, capsule_folder
from sage.errors import ConfigError, SageError

# -- the Structs and functions the descriptor tests use (module level: annotations resolve)


class GreetArgs(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(description="Who to greet.")]


class Point(msgspec.Struct):
    x: int
    y: int


class Shape(msgspec.Struct):
    points: list[Point]
    origin: Point | None = None
    label: str = ""


class Tree(msgspec.Struct):
    value: int
    children: list[Tree] = []


class Pair(msgspec.Struct, array_like=True):
    a: int
    b: int


BigArgs = msgspec.defstruct(
    "BigArgs", [("x", Annotated[str, msgspec.Meta(description="d" * (17 * 1024))])]
)


async def greet(args: GreetArgs) -> str:
    """Greet a person by name.

    Says hello.
    """
    return f"Hello, {args.name}!"


async def shape(args: Shape) -> str:
    return str(len(args.points))


async def tree(args: Tree) -> str:
    return str(args.value)


async def pair(args: Pair) -> str:
    return str(args.a)


async def big(args: BigArgs) -> str:  # type: ignore[valid-type]
    return ""


async def not_a_struct(args: dict[str, Any]) -> str:
    return ""


def not_async(args: GreetArgs) -> str:
    return ""


async def three(args: GreetArgs, call: ToolCall, extra: int) -> str:
    return ""


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


# -- descriptors


def test_schema_is_the_structs_object_schema() -> None:
    """The input schema is an object at the top, with required fields and Meta descriptions."""
    schema = Tool.of("greet", greet).input_schema
    assert schema["type"] == "object"
    assert "$ref" not in schema
    assert "$defs" not in schema
    assert schema["required"] == ["name"]
    assert schema["properties"]["name"] == {"type": "string", "description": "Who to greet."}


def test_nested_struct_refs_resolve() -> None:
    """Nested Structs stay in $defs, and every $ref resolves within the schema."""
    schema = input_schema(Shape)
    assert schema["type"] == "object"
    assert schema["required"] == ["points"]
    assert set(schema["$defs"]) == {"Point"}
    refs = _refs(schema)
    assert refs
    for ref in refs:
        assert ref.startswith("#/$defs/")
        assert ref.removeprefix("#/$defs/") in schema["$defs"]


def test_recursive_struct_keeps_its_own_definition() -> None:
    """A Struct that refers to itself keeps its definition, so its $ref resolves."""
    schema = input_schema(Tree)
    assert schema["type"] == "object"
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}
    assert "Tree" in schema["$defs"]


def test_description_is_the_cleaned_docstring() -> None:
    """The tool's description is its docstring without the indentation."""
    described = Tool.of("greet", greet)
    assert described.description == "Greet a person by name.\n\nSays hello."
    assert described.descriptor() == {
        "name": "greet",
        "description": described.description,
        "inputSchema": described.input_schema,
    }
    assert Tool.of("shape", shape).description == ""


@pytest.mark.parametrize("name", ["", "a.b", "a b", "x" * 65, "grüß", "a*", "a>"])
def test_bad_tool_name_is_refused(name: str) -> None:
    """A name outside [A-Za-z0-9_-]{1,64} is a ValueError at decoration."""
    capsule = Capsule()
    with pytest.raises(ValueError, match="must match"):
        capsule.tool(name)(greet)


@pytest.mark.parametrize("name", ["greet", "a-b_C9", "x" * 64])
def test_good_tool_name_is_accepted(name: str) -> None:
    """Names of letters, digits, '-' and '_' up to 64 long are tools."""
    capsule = Capsule()
    assert capsule.tool(name)(greet) is greet
    assert list(capsule.tools) == [name]


def test_description_over_the_cap_is_refused() -> None:
    """A docstring over 4 KiB is refused when the tool is made."""

    async def wordy(args: GreetArgs) -> str:
        return ""

    wordy.__doc__ = "w" * (4 * 1024 + 1)
    with pytest.raises(ValueError, match="description is over 4096"):
        Tool.of("wordy", wordy)
    wordy.__doc__ = "w" * (4 * 1024)
    assert len(Tool.of("wordy", wordy).description) == 4096


def test_schema_over_the_cap_is_refused() -> None:
    """An input schema over 16 KiB encoded is refused when the tool is made."""
    with pytest.raises(ValueError, match="schema is over 16384"):
        Tool.of("big", big)


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (not_async, "async function"),
        (not_a_struct, "msgspec.Struct"),
        (three, "must take"),
        (pair, "as an object"),
    ],
)
def test_tool_of_the_wrong_shape_is_refused(fn: Any, expected: str) -> None:
    """A sync function, a non-Struct argument, extra parameters or an array Struct: TypeError."""
    with pytest.raises(TypeError, match=expected):
        Tool.of("t", fn)


def test_duplicate_and_too_many_tools_are_refused() -> None:
    """Two functions with one tool name, or more than 256 tools, are refused."""
    capsule = Capsule()
    capsule.tool("t")(greet)
    with pytest.raises(ValueError, match="defined twice"):
        capsule.tool("t")(shape)
    many = Capsule([Tool.of(f"t{i}", greet) for i in range(MAX_TOOLS)])
    with pytest.raises(ValueError, match="at most 256"):
        many.tool("one_more")(greet)


def test_from_module_collects_the_decorated_functions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Module-level @tool and @subscribe record into that module's capsule."""
    (tmp_path / "sdk_collect_capsule.py").write_text(
        "import msgspec\n"
        "from sage.capsule.sdk import subscribe, tool\n"
        "class A(msgspec.Struct):\n    n: int\n"
        "@tool('one')\nasync def one(args: A) -> str:\n    '''One.'''\n    return ''\n"
        "@tool('two')\nasync def two(args: A) -> str:\n    return ''\n"
        "@subscribe('demo.v1.>')\nasync def seen(ctx, envelope):\n    pass\n"
    )
    (tmp_path / "sdk_empty_capsule.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sdk_collect_capsule  # type: ignore[import-not-found]
    import sdk_empty_capsule  # type: ignore[import-not-found]

    capsule = Capsule.from_module(sdk_collect_capsule)
    assert [t["name"] for t in capsule.describe()["tools"]] == ["one", "two"]
    assert required_patterns(capsule, "c") == (
        ["tool.v1.response.describe.c", "tool.v1.execute.one.result", "tool.v1.execute.two.result"],
        ["tool.v1.request.describe", "tool.v1.execute.one", "tool.v1.execute.two", "demo.v1.>"],
    )
    with pytest.raises(ValueError, match="no @tool or @subscribe"):
        Capsule.from_module(sdk_empty_capsule)
    for name in ("sdk_collect_capsule", "sdk_empty_capsule"):
        monkeypatch.delitem(sys.modules, name)


# -- serving on a real bus


class Served:
    """A capsule running on a bus, seen from the tool bridge's side."""

    def __init__(self, bus: Bus, results: Subscription, describes: Subscription) -> None:
        self.bus = bus
        self.bridge = Identity("bridge")
        self.results = results
        self.describes = describes

    def execute(self, name: str, payload: Any) -> None:
        self.bus.publish(self.bridge, f"tool.v1.execute.{name}", payload)

    def call(self, name: str, call_id: str, arguments: Any) -> None:
        self.execute(
            name,
            {
                "type": "tool_execute_request",
                "call_id": call_id,
                "tool_name": name,
                "arguments": arguments,
            },
        )

    async def result(self) -> dict[str, Any]:
        with anyio.fail_after(2):
            envelope: Envelope = await self.results.get()
        data: dict[str, Any] = envelope.data()
        data["topic"] = envelope.topic
        return data

    async def describe(self) -> dict[str, Any]:
        with anyio.fail_after(2):
            data: dict[str, Any] = (await self.describes.get()).data()
        return data


@asynccontextmanager
async def serving(
    capsule: Capsule,
    *,
    subscribe: tuple[str, ...] = (),
    publish: tuple[str, ...] = (),
    bus: Bus | None = None,
) -> AsyncIterator[Served]:
    """Run ``capsule`` as capsule ``t`` with the ACL required_patterns names (and more)."""
    bus = bus or Bus()
    needed, subs = required_patterns(capsule, "t")
    identity = Identity("capsule:t", acl=Acl([*needed, *publish], [*subs, *subscribe]))
    manifest = msgspec.convert({"package": {"name": "t", "entry": "x"}}, CapsuleManifest)
    ready = anyio.Event()
    ctx = CapsuleContext(bus, identity, manifest, ready=ready)
    bridge = Identity("bridge")
    with (
        bus.subscribe("tool.v1.execute.*.result", bridge) as results,
        bus.subscribe("tool.v1.response.describe.t", bridge) as describes,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(capsule.run, ctx)
            with anyio.fail_after(2):
                await ready.wait()
            yield Served(bus, results, describes)
            tg.cancel_scope.cancel()
        ctx.close()


def _tools() -> Capsule:
    capsule = Capsule()
    capsule.tool("greet")(greet)

    @capsule.tool("refuse")
    async def refuse(args: GreetArgs) -> str:
        raise ToolError(f"will not greet {args.name}")

    @capsule.tool("crash")
    async def crash(args: GreetArgs) -> str:
        raise RuntimeError("boom")

    @capsule.tool("whoami")
    async def whoami(args: GreetArgs, call: ToolCall) -> dict[str, Any]:
        return msgspec.structs.asdict(call)

    @capsule.tool("blocks")
    async def blocks(args: GreetArgs) -> list[dict[str, Any]]:
        return [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]

    @capsule.tool("numbers")
    async def numbers(args: GreetArgs) -> list[int]:
        return [1, 2]

    return capsule


@pytest.mark.anyio
async def test_describe_at_start_on_request_and_empty_on_cancel() -> None:
    """The capsule describes itself when it starts, on each request, and empties it at the end."""
    capsule = _tools()
    async with serving(capsule) as served:
        first = await served.describe()
        assert first == capsule.describe()
        assert [t["name"] for t in first["tools"]][:2] == ["greet", "refuse"]
        assert first["tools"][0]["inputSchema"]["type"] == "object"
        served.bus.publish(served.bridge, "tool.v1.request.describe", {})
        assert await served.describe() == first
    assert await served.describe() == {"tools": []}


@pytest.mark.anyio
async def test_execute_answers_with_the_call_id() -> None:
    """A call gets its text result on the tool's result topic, with its call id."""
    async with serving(_tools()) as served:
        served.call("greet", "c1", {"name": "Ada"})
        assert await served.result() == {
            "call_id": "c1",
            "content": [{"type": "text", "text": "Hello, Ada!"}],
            "is_error": False,
            "topic": "tool.v1.execute.greet.result",
        }


@pytest.mark.anyio
async def test_results_are_converted_to_content() -> None:
    """Content blocks pass through; other JSON values become their JSON text."""
    async with serving(_tools()) as served:
        served.call("blocks", "b", {"name": "x"})
        assert (await served.result())["content"] == [
            {"type": "text", "text": "a"},
            {"type": "text", "text": "b"},
        ]
        served.call("numbers", "n", {"name": "x"})
        assert (await served.result())["content"] == [{"type": "text", "text": "[1,2]"}]


@pytest.mark.anyio
async def test_tool_gets_the_call() -> None:
    """A tool with a second parameter gets the call id, its name and the session."""
    async with serving(_tools()) as served:
        served.execute(
            "whoami",
            {
                "type": "tool_execute_request",
                "call_id": "w1",
                "tool_name": "whoami",
                "arguments": {"name": "x"},
                "session_id": "s1",
                "principal_id": "alice",
            },
        )
        result = await served.result()
        assert msgspec.json.decode(result["content"][0]["text"]) == {
            "call_id": "w1",
            "tool_name": "whoami",
            "session_id": "s1",
            "principal_id": "alice",
        }


@pytest.mark.anyio
async def test_tool_error_is_an_error_result() -> None:
    """A ToolError becomes an is_error result with its message."""
    async with serving(_tools()) as served:
        served.call("refuse", "r1", {"name": "Bob"})
        result = await served.result()
        assert result["is_error"] is True
        assert result["content"] == [{"type": "text", "text": "will not greet Bob"}]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ({}, "invalid arguments: Object missing required field `name`"),
        ({"name": 3}, "invalid arguments: Expected `str`, got `int` - at `$.name`"),
        ([1], "invalid arguments: Expected `object`, got `array`"),
    ],
)
async def test_bad_arguments_are_an_error_result(arguments: Any, expected: str) -> None:
    """Arguments that do not fit the Struct are an is_error result naming the problem."""
    async with serving(_tools()) as served:
        served.call("greet", "a1", arguments)
        result = await served.result()
        assert result["is_error"] is True
        assert result["content"][0]["text"] == expected


@pytest.mark.anyio
async def test_exception_is_an_error_result_and_the_capsule_goes_on() -> None:
    """Any other exception is logged and answered as an is_error; later calls still work."""
    with capture_logs() as logs:
        async with serving(_tools()) as served:
            served.call("crash", "x1", {"name": "x"})
            result = await served.result()
            assert result["is_error"] is True
            assert result["content"][0]["text"] == "RuntimeError: boom"
            served.call("greet", "x2", {"name": "again"})
            assert (await served.result())["is_error"] is False
    failed = [e for e in logs if e["event"] == "sdk.tool_failed"]
    assert len(failed) == 1
    assert failed[0]["call_id"] == "x1"
    assert "RuntimeError: boom" in failed[0]["trace"]


@pytest.mark.anyio
async def test_calls_run_concurrently() -> None:
    """A slow call does not hold up the next: both run at once."""
    capsule = Capsule()
    started: list[str] = []
    gate = anyio.Event()

    @capsule.tool("wait")
    async def wait(args: GreetArgs) -> str:
        started.append(args.name)
        if len(started) == 2:
            gate.set()
        await gate.wait()
        return args.name

    async with serving(capsule) as served:
        served.call("wait", "w1", {"name": "one"})
        served.call("wait", "w2", {"name": "two"})
        results = [await served.result(), await served.result()]
        assert sorted(r["call_id"] for r in results) == ["w1", "w2"]
        assert all(r["is_error"] is False for r in results)


@pytest.mark.anyio
async def test_requests_of_another_shape_are_ignored() -> None:
    """Payloads that are not tool_execute_request with a call id get no answer, only a log."""
    with capture_logs() as logs:
        async with serving(_tools()) as served:
            served.execute("greet", {"type": "other", "call_id": "o1", "arguments": {}})
            served.execute("greet", {"type": "tool_execute_request", "arguments": {}})
            served.execute("greet", [1, 2])
            served.execute("greet", {"type": "tool_execute_request", "call_id": 5})
            served.call("greet", "good", {"name": "x"})
            assert (await served.result())["call_id"] == "good"
            await anyio.wait_all_tasks_blocked()
            assert len(served.results) == 0
    assert sum(e["event"] == "sdk.bad_execute_request" for e in logs) == 4


@pytest.mark.anyio
async def test_result_over_the_payload_limit_is_an_error_result() -> None:
    """A result the bus refuses as too large is answered with an is_error saying so."""
    capsule = Capsule()

    @capsule.tool("huge")
    async def huge(args: GreetArgs) -> str:
        return "h" * 5000

    async with serving(capsule, bus=Bus(max_payload=4096)) as served:
        served.call("huge", "h1", {"name": "x"})
        result = await served.result()
        assert result["is_error"] is True
        assert "could not be sent" in result["content"][0]["text"]


@pytest.mark.anyio
async def test_subscribe_handlers_get_envelopes_and_survive_errors() -> None:
    """@subscribe handlers see their topic in order; an exception does not end them."""
    capsule = Capsule()
    seen: list[Any] = []
    done = anyio.Event()

    @capsule.subscribe("demo.v1.>")
    async def on_demo(ctx: Any, envelope: Envelope) -> None:
        data = envelope.data()
        if data == "bad":
            raise ValueError("bad one")
        seen.append(data)
        if len(seen) == 2:
            done.set()

    with capture_logs() as logs:
        async with serving(capsule) as served:
            for payload in (1, "bad", 2):
                served.bus.publish(served.bridge, "demo.v1.x", payload)
            with anyio.fail_after(2):
                await done.wait()
    assert seen == [1, 2]
    assert [e["error"] for e in logs if e["event"] == "sdk.handler_failed"] == [
        "ValueError: bad one"
    ]


# -- through the supervisor's loader


@pytest.mark.anyio
async def test_greeter_runs_through_the_capsule_runner() -> None:
    """capsules/greeter (entry without ':') loads and answers greet and shout."""
    manifest = load_manifest(capsule_folder("greeter"))
    assert manifest.package.entry == "capsules.greeter"
    import capsules.greeter

    publish, subscribe = required_patterns(Capsule.from_module(capsules.greeter), "greeter")
    assert manifest.publish.patterns == publish
    assert manifest.subscribe.patterns == subscribe

    bus = Bus()
    runner = CapsuleRunner(bus, manifest, lambda t, p: None)
    bridge = Identity("bridge")
    with (
        bus.subscribe("tool.v1.execute.*.result", bridge) as results,
        bus.subscribe("tool.v1.response.describe.greeter", bridge) as describes,
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            with anyio.fail_after(2):
                await runner.ready.wait()
                described = (await describes.get()).data()
                assert [t["name"] for t in described["tools"]] == ["greet", "shout"]
                greet_tool = described["tools"][0]
                assert greet_tool["description"] == "Greet a person by name."
                assert greet_tool["inputSchema"]["properties"]["name"]["description"] == (
                    "Who to greet."
                )
                for name, args in (("greet", {"name": "Ada"}), ("shout", {"text": " "})):
                    bus.publish(
                        bridge,
                        f"tool.v1.execute.{name}",
                        {
                            "type": "tool_execute_request",
                            "call_id": name,
                            "tool_name": name,
                            "arguments": args,
                        },
                    )
                    result = (await results.get()).data()
                    assert result["call_id"] == name
                    if name == "greet":
                        assert result["content"][0]["text"] == "Hello, Ada!"
                        assert result["is_error"] is False
                    else:
                        assert result["is_error"] is True
                        assert "nothing to shout" in result["content"][0]["text"]
            assert runner.state is CapsuleState.RUNNING
            tg.cancel_scope.cancel()
        assert (await describes.get()).data() == {"tools": []}


@pytest.mark.anyio
async def test_entry_naming_a_capsule_instance_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry 'module:attr' whose attr is a Capsule runs that capsule."""
    (tmp_path / "sdk_instance_capsule.py").write_text(
        "import msgspec\n"
        "from sage.capsule.sdk import Capsule\n"
        "capsule = Capsule()\n"
        "class A(msgspec.Struct):\n    n: int\n"
        "@capsule.tool('double')\nasync def double(args: A) -> str:\n"
        "    return str(2 * args.n)\n"
    )
    (tmp_path / "inst").mkdir()
    (tmp_path / "inst" / "Capsule.toml").write_text(
        '[package]\nname = "inst"\nentry = "sdk_instance_capsule:capsule"\n'
        '[publish]\npatterns = ["tool.v1.>"]\n[subscribe]\npatterns = ["tool.v1.>"]\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sdk_instance_capsule", raising=False)
    bus = Bus()
    runner = CapsuleRunner(bus, load_manifest(tmp_path / "inst"), lambda t, p: None)
    bridge = Identity("bridge")
    with bus.subscribe("tool.v1.execute.double.result", bridge) as results:
        async with anyio.create_task_group() as tg:
            tg.start_soon(runner.run)
            with anyio.fail_after(2):
                await runner.ready.wait()
                bus.publish(
                    bridge,
                    "tool.v1.execute.double",
                    {"type": "tool_execute_request", "call_id": "d", "arguments": {"n": 21}},
                )
                assert (await results.get()).data()["content"][0]["text"] == "42"
            tg.cancel_scope.cancel()
    monkeypatch.delitem(sys.modules, "sdk_instance_capsule")


@pytest.mark.parametrize(
    ("entry", "ok"),
    [
        ("capsules.greeter", True),
        ("capsules.echo:run", True),
        ("a.b.c:f_1", True),
        ("", False),
        ("a:", False),
        ("a:b:c", False),
        ("a..b", False),
        ("a b", False),
        ("../x", False),
    ],
)
def test_entry_is_a_module_or_module_function(tmp_path: Path, entry: str, ok: bool) -> None:
    """load_manifest takes 'module' or 'module:function' and refuses anything else."""
    (tmp_path / "Capsule.toml").write_text(f'[package]\nname = "x"\nentry = "{entry}"\n')
    if ok:
        assert load_manifest(tmp_path).package.entry == entry
    else:
        with pytest.raises(ConfigError, match="'module' or 'module:function'"):
            load_manifest(tmp_path)


def test_module_entry_without_tools_is_refused(tmp_path: Path) -> None:
    """An entry module with no @tool or @subscribe functions fails when the runner is built."""
    (tmp_path / "Capsule.toml").write_text('[package]\nname = "x"\nentry = "capsules.echo"\n')
    with pytest.raises(ConfigError, match="no @tool or @subscribe"):
        CapsuleRunner(Bus(), load_manifest(tmp_path), lambda t, p: None)


@pytest.mark.anyio
async def test_a_tool_publishes_and_requests_through_its_context() -> None:
    """sage.capsule.sdk.context(): the running capsule's bus, within its manifest."""
    from sage.capsule.sdk import context

    capsule = Capsule()

    @capsule.tool("relay")
    async def relay(args: GreetArgs) -> str:
        context().publish("demo.note", {"to": args.name})
        answer = await context().request("demo.lookup", {"name": args.name}, deadline=2)
        return str(answer.data()["found"])

    @capsule.tool("forbidden")
    async def forbidden(args: GreetArgs) -> str:
        context().publish("sage.v1.tool.result.x", {})
        return "not refused"

    bus = Bus()
    other = Identity("other")
    with bus.subscribe("demo.note", other) as notes, bus.subscribe("demo.lookup", other) as asks:

        async def answer() -> None:
            request = await asks.get()
            bus.reply(other, request.reply_to or "", {"found": f"yes, {request.data()['name']}"})

        async with anyio.create_task_group() as tg:
            tg.start_soon(answer)
            async with serving(capsule, publish=("demo.note", "demo.lookup"), bus=bus) as served:
                served.call("relay", "r1", {"name": "Ada"})
                result = await served.result()
                assert result["content"] == [{"type": "text", "text": "yes, Ada"}]
                assert notes.get_nowait() is not None
                served.call("forbidden", "f1", {"name": "Ada"})
                refused = await served.result()
                assert refused["is_error"] is True
                assert "AclDenied" in refused["content"][0]["text"]
    with pytest.raises(SageError, match="only known while a tool or handler runs"):
        context()


@pytest.mark.anyio
async def test_follow_logs_a_failing_envelope_with_its_traceback_and_goes_on() -> None:
    """One bad envelope is logged (``log.exception``: error and traceback) and never stops
    the subscription: the envelopes after it are handled, in order."""

    async def envelopes() -> AsyncIterator[Envelope]:
        for n, topic in enumerate(("t.a", "t.bad", "t.c")):
            yield Envelope(id=n, topic=topic, payload=b"{}", source="test")

    seen: list[str] = []

    def handler(envelope: Envelope) -> None:
        if envelope.topic == "t.bad":
            raise KeyError("boom")
        seen.append(envelope.topic)

    log = structlog.get_logger("test")
    with capture_logs() as logs:
        await follow(envelopes(), handler, log, "x.handler_failed")
    assert seen == ["t.a", "t.c"]
    assert logs == [
        {
            "event": "x.handler_failed",
            "topic": "t.bad",
            "error": "KeyError: 'boom'",
            "exc_info": True,
            "log_level": "error",
        }
    ]
