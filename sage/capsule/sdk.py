"""The capsule SDK: tools Claude can call, and handlers of plain topics, as decorated functions.

A capsule author writes::

    from typing import Annotated

    import msgspec

    from sage.capsule.sdk import ToolError, tool


    class GreetArgs(msgspec.Struct):
        name: Annotated[str, msgspec.Meta(description="Who to greet.")]


    @tool("greet")
    async def greet(args: GreetArgs) -> str:
        \"\"\"Greet a person by name.\"\"\"
        return f"Hello, {args.name}!"

and names the module as the manifest's ``entry`` (``entry = "my_capsule"``,
no ``:function``).  The tool's input schema is ``msgspec.json.schema`` of the
first parameter's Struct, with its top-level ``$ref`` resolved so the schema
is an object; field comments do not exist at run time, so a field's
description is given with ``Annotated[T, msgspec.Meta(description=...)]``.
The tool's description is its docstring.  A tool returns a string (one text
block), a list of content blocks (passed through) or any other JSON value
(its JSON as text); raising :class:`ToolError` gives Claude an ``isError``
result with that message, and so does any other exception (logged with its
traceback) and arguments that do not fit the Struct.  The capsule keeps
running through all of them.

:meth:`Capsule.run` speaks the tool topics of docs/topics.md: it answers
``tool.v1.request.describe`` on ``tool.v1.response.describe.<capsule>``
(also once at start, and ``{"tools": []}`` when it stops), and serves
``tool.v1.execute.<tool>`` on ``tool.v1.execute.<tool>.result``, each call in
its own task.  It needs only the :class:`Context` methods, so the same code
runs in the supervisor's process (``sage.capsule.context.CapsuleContext``) or in an
out-of-process worker.
"""

from __future__ import annotations

import contextvars
import inspect
import re
import traceback
import typing
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar

import anyio
import msgspec
import structlog
from anyio.abc import TaskGroup

from bus import BusError, Envelope
from sage.errors import SageError

__all__ = (
    "MAX_DESCRIPTION",
    "MAX_SCHEMA",
    "MAX_TOOLS",
    "TOOL_NAME",
    "Capsule",
    "Context",
    "Handler",
    "Tool",
    "ToolCall",
    "ToolError",
    "context",
    "follow",
    "input_schema",
    "required_patterns",
    "subscribe",
    "tool",
)

log = structlog.get_logger("sage.capsule.sdk")

TOOL_NAME = r"^[A-Za-z0-9_-]{1,64}$"
"""What a tool name may be; it is also one token of the tool's topics."""
MAX_TOOLS = 256
"""Tools one capsule may offer."""
MAX_DESCRIPTION = 4 * 1024
"""Bytes of a tool's description (UTF-8)."""
MAX_SCHEMA = 16 * 1024
"""Bytes of a tool's input schema, encoded as JSON."""

DESCRIBE_REQUEST = "tool.v1.request.describe"

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


_CONTEXT: contextvars.ContextVar[Context] = contextvars.ContextVar("sage_sdk_context")


def context() -> Context:
    """The context of the capsule serving the tool call or handler that runs now.

    A tool publishes and requests with it, e.g. ``await context().request(topic,
    payload)``, within its manifest's patterns like everything the capsule does.
    """
    try:
        return _CONTEXT.get()
    except LookupError:
        raise SageError(
            "sage.capsule.sdk.context() is only known while a tool or handler runs"
        ) from None


class ToolError(SageError):
    """Raised by a tool: Claude gets an ``isError`` result with this message."""

    code = "tool_error"


class ToolCall(msgspec.Struct, frozen=True):
    """The call a tool serves, for a tool that takes a second parameter."""

    call_id: str
    tool_name: str
    session_id: str | None = None
    """The session that called, when the request names it."""
    principal_id: str | None = None
    """The principal on whose behalf the call runs, when known."""


class _Manifest(Protocol):
    @property
    def name(self) -> str: ...


class Context(Protocol):
    """What the SDK needs of a capsule's context (in-process or a worker's)."""

    @property
    def manifest(self) -> _Manifest: ...

    @property
    def log(self) -> Any: ...

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> object: ...

    async def open(self, pattern: str) -> AsyncIterator[Envelope]: ...

    def reply(self, request: Envelope, payload: Any) -> object: ...

    async def request(
        self, topic: str, payload: Any, *, deadline: float | None = None
    ) -> Envelope: ...

    def ready(self) -> None: ...


@dataclass(frozen=True)
class Tool:
    """One tool: its descriptor, checked against the caps, and the function serving it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    fn: Callable[..., Awaitable[Any]]
    args_type: type[msgspec.Struct]
    takes_call: bool

    @classmethod
    def of(cls, name: str, fn: Callable[..., Awaitable[Any]]) -> Tool:
        """Build a tool from ``async def fn(args: SomeStruct[, call: ToolCall])``.

        Raises ValueError for a bad name or a descriptor over a cap, TypeError
        for a function of the wrong shape.
        """
        if not isinstance(name, str) or not re.match(TOOL_NAME, name):
            raise ValueError(f"tool name {name!r} must match {TOOL_NAME}")
        where = f"tool {name!r} ({getattr(fn, '__qualname__', fn)!r})"
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"{where} must be an async function")
        params = list(inspect.signature(fn).parameters.values())
        if not 1 <= len(params) <= 2 or any(
            p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params
        ):
            raise TypeError(f"{where} must take (args: SomeStruct) or (args, call: ToolCall)")
        try:
            hints = typing.get_type_hints(fn)
        except NameError as exc:
            raise TypeError(f"{where}: cannot resolve its annotations: {exc}") from exc
        args_type = hints.get(params[0].name)
        if not (isinstance(args_type, type) and issubclass(args_type, msgspec.Struct)):
            raise TypeError(f"{where}: its first parameter must be annotated with a msgspec.Struct")
        description = inspect.cleandoc(fn.__doc__ or "")
        if len(description.encode()) > MAX_DESCRIPTION:
            raise ValueError(f"{where}: the description is over {MAX_DESCRIPTION} bytes")
        schema = input_schema(args_type)
        if schema.get("type") != "object":
            raise TypeError(f"{where}: the arguments Struct must encode as an object")
        if len(msgspec.json.encode(schema)) > MAX_SCHEMA:
            raise ValueError(f"{where}: the input schema is over {MAX_SCHEMA} bytes")
        return cls(name, description, schema, fn, args_type, len(params) == 2)

    def descriptor(self) -> dict[str, Any]:
        """The ToolDescriptor the capsule publishes in its describe response."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
        }

    async def call(self, arguments: Any, call: ToolCall, *, logger: Any = log) -> dict[str, Any]:
        """Run the tool on ``arguments``; always a result ``{"content", "is_error"}``.

        An exception other than ToolError is logged on ``logger`` with its traceback.
        """
        try:
            args = msgspec.convert(arguments, self.args_type)
        except msgspec.ValidationError as exc:
            return _error(f"invalid arguments: {exc}")
        try:
            value = await (self.fn(args, call) if self.takes_call else self.fn(args))
            return {"content": _content(value), "is_error": False}
        except ToolError as exc:
            return _error(str(exc))
        except Exception as exc:
            logger.error(
                "sdk.tool_failed",
                tool=self.name,
                call_id=call.call_id,
                error=f"{type(exc).__name__}: {exc}",
                trace=traceback.format_exc(limit=8),
            )
            return _error(f"{type(exc).__name__}: {exc}")


def input_schema(args_type: type[msgspec.Struct]) -> dict[str, Any]:
    """``msgspec.json.schema`` of ``args_type`` with the top-level ``$ref`` resolved.

    The result is the Struct's own object schema; ``$defs`` stays at the top
    (minus the Struct itself, unless it refers to itself) for nested Structs.
    """
    schema: dict[str, Any] = msgspec.json.schema(args_type)
    defs: dict[str, Any] = dict(schema.get("$defs", {}))
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/$defs/"):
        return schema
    key = ref.removeprefix("#/$defs/")
    top: dict[str, Any] = dict(defs[key])
    if msgspec.json.encode(ref) not in msgspec.json.encode(defs):  # not self-referring
        del defs[key]
    if defs:
        top["$defs"] = defs
    return top


class _ExecuteRequest(msgspec.Struct, frozen=True):
    type: str = ""
    call_id: str = ""
    tool_name: str = ""
    arguments: Any = msgspec.field(default_factory=dict)
    session_id: str | None = None
    principal_id: str | None = None


def _error(message: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": message}], "is_error": True}


def _content(value: Any) -> list[Any]:
    """A tool's return value as MCP content blocks."""
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if isinstance(value, list) and all(
        isinstance(block, dict) and isinstance(block.get("type"), str) for block in value
    ):
        return value
    return [{"type": "text", "text": msgspec.json.encode(value).decode()}]


Handler = Callable[[Any, Envelope], Awaitable[None]]
"""``async def handler(ctx, envelope)`` for a plain topic."""


@dataclass
class _Recorded:
    tools: dict[str, Tool]
    handlers: list[tuple[str, Handler]]


_registry: dict[str, _Recorded] = {}
"""What the decorators recorded, by the decorated function's module."""


def _recorded(module: str) -> _Recorded:
    return _registry.setdefault(module, _Recorded({}, []))


def _add_tool(tools: dict[str, Tool], new: Tool) -> None:
    old = tools.get(new.name)
    # the same function decorated again (a module reloaded) replaces the old one
    if old is not None and old.fn.__qualname__ != new.fn.__qualname__:
        raise ValueError(
            f"tool {new.name!r} is defined twice: {old.fn.__qualname__} and {new.fn.__qualname__}"
        )
    if old is None and len(tools) >= MAX_TOOLS:
        raise ValueError(f"a capsule may offer at most {MAX_TOOLS} tools")
    tools[new.name] = new


def _add_handler(handlers: list[tuple[str, Handler]], pattern: str, fn: Handler) -> None:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"handler {fn.__qualname__!r} must be an async function (ctx, envelope)")
    handlers[:] = [(p, h) for p, h in handlers if (p, h.__qualname__) != (pattern, fn.__qualname__)]
    handlers.append((pattern, fn))


def tool(name: str) -> Callable[[F], F]:
    """Offer ``async def f(args: SomeStruct[, call: ToolCall])`` to Claude as tool ``name``.

    The name and the descriptor are checked here, when the module is
    imported; the function is returned unchanged.
    """

    def decorate(fn: F) -> F:
        _add_tool(_recorded(fn.__module__).tools, Tool.of(name, fn))
        return fn

    return decorate


def subscribe(pattern: str) -> Callable[[F], F]:
    """Call ``async def handler(ctx, envelope)`` for each envelope on ``pattern``.

    Envelopes of one pattern are handled one after another, in order; an
    exception is logged and the next envelope is handled.
    """

    def decorate(fn: F) -> F:
        _add_handler(_recorded(fn.__module__).handlers, pattern, fn)
        return fn

    return decorate


class Capsule:
    """A capsule's tools and handlers, and the loop that serves them on the bus."""

    def __init__(
        self, tools: Iterable[Tool] = (), handlers: Iterable[tuple[str, Handler]] = ()
    ) -> None:
        self.tools: dict[str, Tool] = {}
        self.handlers: list[tuple[str, Handler]] = []
        for one in tools:
            _add_tool(self.tools, one)
        for pattern, fn in handlers:
            _add_handler(self.handlers, pattern, fn)

    @classmethod
    def from_module(cls, module: ModuleType) -> Capsule:
        """The capsule made of the ``@tool`` and ``@subscribe`` functions of ``module``.

        Raises ValueError when the module has none.
        """
        recorded = _registry.get(module.__name__)
        if recorded is None or not (recorded.tools or recorded.handlers):
            raise ValueError(f"module {module.__name__} has no @tool or @subscribe functions")
        return cls(recorded.tools.values(), recorded.handlers)

    def tool(self, name: str) -> Callable[[F], F]:
        """Like :func:`tool`, for this capsule only."""

        def decorate(fn: F) -> F:
            _add_tool(self.tools, Tool.of(name, fn))
            return fn

        return decorate

    def subscribe(self, pattern: str) -> Callable[[F], F]:
        """Like :func:`subscribe`, for this capsule only."""

        def decorate(fn: F) -> F:
            _add_handler(self.handlers, pattern, fn)
            return fn

        return decorate

    def describe(self) -> dict[str, Any]:
        """The describe response: ``{"tools": [ToolDescriptor]}``."""
        return {"tools": [one.descriptor() for one in self.tools.values()]}

    async def run(self, ctx: Context) -> None:
        """Serve the tools and handlers until cancelled or every subscription ends."""
        describe_topic = f"tool.v1.response.describe.{ctx.manifest.name}"
        describe_requests = await ctx.open(DESCRIBE_REQUEST)
        executes = [
            (one, await ctx.open(f"tool.v1.execute.{one.name}")) for one in self.tools.values()
        ]
        topics = [(fn, await ctx.open(pattern)) for pattern, fn in self.handlers]
        try:
            async with anyio.create_task_group() as tg:
                ctx.publish(describe_topic, self.describe())
                ctx.ready()
                tg.start_soon(self._answer_describe, ctx, describe_requests, describe_topic)
                for one, requests in executes:
                    tg.start_soon(self._serve_tool, ctx, one, requests, tg)
                for fn, envelopes in topics:
                    tg.start_soon(self._serve_handler, ctx, fn, envelopes)
        finally:
            try:  # best effort: a closed bus cannot hear it
                ctx.publish(describe_topic, {"tools": []})
            except Exception as exc:
                ctx.log.info("sdk.describe_empty_failed", error=str(exc))

    async def _answer_describe(
        self, ctx: Context, requests: AsyncIterator[Envelope], topic: str
    ) -> None:
        async for _ in requests:
            ctx.publish(topic, self.describe())

    async def _serve_tool(
        self,
        ctx: Context,
        served: Tool,
        requests: AsyncIterator[Envelope],
        tg: TaskGroup,
    ) -> None:
        async for envelope in requests:
            try:
                request = msgspec.json.decode(envelope.payload, type=_ExecuteRequest)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                ctx.log.warning("sdk.bad_execute_request", tool=served.name, error=str(exc))
                continue
            if request.type != "tool_execute_request" or not request.call_id:
                ctx.log.warning(
                    "sdk.bad_execute_request",
                    tool=served.name,
                    error="not a tool_execute_request with a call_id",
                )
                continue
            tg.start_soon(self._execute, ctx, served, request, envelope.principal)

    async def _execute(
        self, ctx: Context, served: Tool, request: _ExecuteRequest, principal: str | None
    ) -> None:
        _CONTEXT.set(ctx)  # this task's: every call runs in a task of its own
        call = ToolCall(
            request.call_id,
            served.name,
            session_id=request.session_id,
            principal_id=request.principal_id or principal,
        )
        result = await served.call(request.arguments, call, logger=ctx.log)
        topic = f"tool.v1.execute.{served.name}.result"
        try:
            ctx.publish(topic, {"call_id": call.call_id, **result})
        except (BusError, TypeError) as exc:  # over the payload limit, or not JSON
            ctx.log.warning("sdk.result_refused", tool=served.name, error=str(exc))
            try:
                ctx.publish(
                    topic,
                    {"call_id": call.call_id, **_error(f"the result could not be sent: {exc}")},
                )
            except BusError as again:
                ctx.log.error("sdk.result_lost", tool=served.name, error=str(again))

    async def _serve_handler(
        self, ctx: Context, fn: Handler, envelopes: AsyncIterator[Envelope]
    ) -> None:
        _CONTEXT.set(ctx)
        async for envelope in envelopes:
            try:
                await fn(ctx, envelope)
            except Exception as exc:
                ctx.log.error(
                    "sdk.handler_failed",
                    handler=fn.__qualname__,
                    topic=envelope.topic,
                    error=f"{type(exc).__name__}: {exc}",
                    trace=traceback.format_exc(limit=8),
                )


async def follow(
    envelopes: AsyncIterator[Envelope], handler: Callable[[Envelope], object], log: Any, event: str
) -> None:
    """Hand each envelope to the synchronous ``handler``, in order, until the subscription ends.

    One that raises is logged as ``event`` with its topic, the error and its
    traceback (``log.exception``), and the next envelope goes on: one bad
    envelope never stops a capsule.
    """
    async for envelope in envelopes:
        try:
            handler(envelope)
        except Exception as exc:
            log.exception(event, topic=envelope.topic, error=f"{type(exc).__name__}: {exc}")


def required_patterns(capsule: Capsule, name: str) -> tuple[list[str], list[str]]:
    """The (publish, subscribe) patterns capsule ``name``'s manifest must allow."""
    publish = [f"tool.v1.response.describe.{name}"]
    subscribe = [DESCRIBE_REQUEST]
    for one in capsule.tools:
        publish.append(f"tool.v1.execute.{one}.result")
        subscribe.append(f"tool.v1.execute.{one}")
    subscribe.extend(pattern for pattern, _ in capsule.handlers if pattern not in subscribe)
    return publish, subscribe
