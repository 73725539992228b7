"""The completion provider: one Messages API stream per ``llm.v1`` request.

``llm.v1.request.generate.sage`` starts a generation in a task of its own
(mapping.py checks it; a bad one is refused at once).  It waits for one of
``[llm] max_concurrent`` places, finds the API key (the principal's, from
the secret store, else the operator's), streams the answer with the
``anthropic`` SDK (its timeout and bounded retries) and publishes every
event on ``llm.v1.stream.sage`` on behalf of the requester's principal, so
other principals' users never see it (events.py maps them, errors.py
translates failures).  Each request ends with exactly one ``Done`` or
``Error`` and one ``llm.v1.audit.generate`` record.

``llm.v1.request.cancel.<request_id>`` cancels a generation of the same
principal (an admin or capsule may cancel any): it ends with
``Error{code: "cancelled"}``.  ``llm.v1.request.describe`` is answered with
the provider entry.  The key never leaves this module: not in events, logs
or audit records.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anthropic
import anyio
import anyio.abc
import httpx2
import msgspec
from anthropic.types import RawMessageStreamEvent

from bus import BusError, Envelope
from capsules.llm.errors import error_event, scrub
from capsules.llm.events import (
    Done,
    Error,
    IncompleteStream,
    StreamEvent,
    StreamMapper,
    Usage,
    stream_payload,
)
from capsules.llm.mapping import (
    BadRequest,
    GenerateRequest,
    UnknownModel,
    api_arguments,
    offered_models,
    parse_request,
)
from sage import replies
from sage.capsule.context import CapsuleContext
from sage.capsule.sdk import follow
from sage.config import Config
from sage.errors import SageError
from sage.usage.admission import admit
from sage.usage.pricing import cost_usd

__all__ = ("PROVIDER_ID", "CompletionProvider", "provider_entry", "run")

PROVIDER_ID = "sage"
GENERATE = f"llm.v1.request.generate.{PROVIDER_ID}"
DESCRIBE = "llm.v1.request.describe"
CANCEL = "llm.v1.request.cancel.*"
STREAM = f"llm.v1.stream.{PROVIDER_ID}"
DESCRIBED = "llm.v1.response.describe"
AUDIT = "llm.v1.audit.generate"
MAX_WAITING = 1024
"""Generations admitted (running or waiting for a place); more are refused (``busy``)."""
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_CLOSE_WITHIN = 5.0


def provider_entry(config: Config) -> dict[str, Any]:
    """The ``ProviderEntry`` of ``llm.v1.response.describe.<cid>``."""
    llm = config.llm
    return {
        "id": PROVIDER_ID,
        "name": "Anthropic Messages API (sage)",
        "models": offered_models(llm),
        "default_model": llm.model,
        "max_tokens": llm.max_tokens,
        "context_window": llm.context_window,
        "capabilities": ["text", "streaming", "tools", "images", "prompt_caching", "cancel"],
        "topics": {
            "generate": GENERATE,
            "stream": STREAM,
            "cancel": "llm.v1.request.cancel.<request_id>",
        },
    }


def lookup_api_key(config: Config, principal: str | None) -> str | None:
    """The principal's own key from the secret store; the operator's for the operator
    (no principal) and for a principal configured with ``operator_key = true``
    (blocking)."""
    from sage.claude.homes import read_api_key
    from sage.security.secrets import API_KEY, SecretStore, principal_namespace

    if principal is None:
        return read_api_key(config)
    if config.secrets_path.exists():
        key = SecretStore.open(config).get(principal_namespace(principal), API_KEY)
        if key:
            return key
    configured = config.principal(principal)
    return read_api_key(config) if configured is not None and configured.operator_key else None


KeyLookup = Callable[[Config, str | None], str | None]


@dataclass
class Generation:
    """One admitted request, from arrival to its terminal event."""

    request: GenerateRequest
    principal: str | None
    model: str
    arguments: dict[str, Any]
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    started: float = field(default_factory=time.monotonic)
    usage: Usage | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


class CompletionProvider:
    """The capsule's state: generations in flight and the concurrency limit."""

    def __init__(self, ctx: CapsuleContext, *, api_key: KeyLookup = lookup_api_key) -> None:
        self.ctx = ctx
        self.log = ctx.log
        self._api_key = api_key
        self.limiter = anyio.CapacityLimiter(ctx.config.llm.max_concurrent)
        self.running: dict[tuple[str | None, str], Generation] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self) -> None:
        ctx = self.ctx
        generate = ctx.subscribe(GENERATE)
        describe = ctx.subscribe(DESCRIBE)
        cancel = ctx.subscribe(CANCEL)
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(follow, generate, self._on_generate, self.log, "llm.handler_failed")
                tg.start_soon(follow, describe, self._on_describe, self.log, "llm.handler_failed")
                tg.start_soon(follow, cancel, self._on_cancel, self.log, "llm.handler_failed")
                ctx.ready()
        finally:
            self._tg = None

    # -- describe and cancel ----------------------------------------------

    def _on_describe(self, envelope: Envelope) -> None:
        entry = {"providers": [provider_entry(self.ctx.config)]}
        cid = envelope.correlation_id or ""
        cid = cid if _TOKEN.match(cid) else PROVIDER_ID
        self._publish(f"{DESCRIBED}.{cid}", entry)
        self._reply(envelope, entry)

    def _on_cancel(self, envelope: Envelope) -> None:
        request_id = envelope.topic.rsplit(".", 1)[1]
        principal = envelope.principal
        hits = [
            gen
            for (owner, rid), gen in self.running.items()
            if rid == request_id and (principal is None or owner == principal)
        ]
        for gen in hits:
            gen.scope.cancel()
        self.log.info("llm.cancel", request_id=request_id, principal=principal, found=len(hits))
        if hits:
            self._reply(envelope, replies.ok(request_id=request_id))
        else:
            self._reply(
                envelope,
                replies.error("unknown_request", f"no generation {request_id} is running"),
            )

    # -- generate ---------------------------------------------------------

    def _on_generate(self, envelope: Envelope) -> None:
        principal = envelope.principal
        parsed = parse_request(envelope.payload)
        if isinstance(parsed, BadRequest):
            self._refuse(envelope, parsed.request_id, Error(parsed.message, "bad_request"))
            return
        key = (principal, parsed.request_id)
        if key in self.running:
            message = (
                f"request id {parsed.request_id} is already running: this request is refused,"
                " the running one goes on"
            )
            self._refuse(envelope, parsed.request_id, Error(message, "duplicate_request_id"))
            return
        if len(self.running) >= MAX_WAITING:
            message = f"too many generations in flight ({MAX_WAITING}); try again later"
            self._refuse(envelope, parsed.request_id, Error(message, "busy"))
            return
        config = self.ctx.config.llm
        try:
            arguments = api_arguments(parsed, config)
        except UnknownModel as exc:
            self._refuse(envelope, parsed.request_id, Error(str(exc), exc.code))
            return
        gen = Generation(parsed, principal, arguments["model"], arguments)
        self.running[key] = gen
        assert self._tg is not None
        self._tg.start_soon(self._generate, gen)
        self._reply(envelope, replies.ok(request_id=parsed.request_id))

    def _refuse(self, envelope: Envelope, request_id: str | None, error: Error) -> None:
        """A request that never starts: its Error event (when it has an id), audit, reply."""
        principal = envelope.principal
        self.log.warning(
            "llm.request_refused", request_id=request_id, principal=principal, code=error.code
        )
        if request_id is not None:
            self._emit(request_id, principal, error)
            model = None
            if isinstance(data := _loads(envelope.payload), dict):
                model = data.get("model") if isinstance(data.get("model"), str) else None
            self._audit(request_id, principal, model, None, error, 0.0)
        extra = {} if request_id is None else {"request_id": request_id}
        self._reply(envelope, replies.error(error.code, error.message, **extra))

    async def _generate(self, gen: Generation) -> None:
        terminal: Done | Error | None = None
        try:
            with gen.scope:
                async with self.limiter:
                    terminal = await self._stream(gen)
            if terminal is None:  # the scope was cancelled by a cancel request
                terminal = Error("cancelled", "cancelled")
        except anyio.get_cancelled_exc_class():
            terminal = Error("the completion provider stopped", "stopped")
            raise
        except Exception as exc:  # a bug: end this request, never the provider's task group
            self.log.error(
                "llm.generation_failed", request_id=gen.request_id, error=type(exc).__name__
            )
            terminal = Error("the completion provider failed", "error")
        finally:
            del self.running[(gen.principal, gen.request_id)]
            if terminal is None:  # an unexpected exception: still one terminal event
                terminal = Error("the completion provider failed", "error")
            self._finish(gen, terminal)  # synchronous: a cancellation cannot cut it

    async def _stream(self, gen: Generation) -> Done | Error:
        """Run the request; publish its deltas; return the terminal event (not yet sent)."""
        config = self.ctx.config
        llm = config.llm
        try:  # a principal over a budget generates nothing (sage/usage/admission.py)
            await admit(self.ctx, gen.principal, "generate")
        except SageError as exc:
            return Error(str(exc), str(exc.code))
        try:
            api_key = await anyio.to_thread.run_sync(self._api_key, config, gen.principal)
        except SageError as exc:
            return Error(f"cannot read the API key: {exc}", "api_key_unreadable")
        if not api_key:
            return Error(
                "no API key: none is stored for this principal (astrid sage install); the"
                " operator's (claude.api_key_file, $CREDENTIALS_DIRECTORY or"
                " $ANTHROPIC_API_KEY) serves the operator, and a principal only with"
                " operator_key = true",
                "no_api_key",
            )
        mapper = StreamMapper()
        client = anthropic.AsyncAnthropic(
            api_key=api_key,
            base_url=config.messages_api or None,  # [llm] base_url, else the sessions'.
            timeout=llm.timeout,
            max_retries=llm.max_retries,
        )
        stream: anthropic.AsyncStream[RawMessageStreamEvent] | None = None
        try:
            stream = await client.messages.create(**gen.arguments, stream=True)
            async for raw in stream:
                for event in mapper.feed(raw):
                    self._emit(gen.request_id, gen.principal, event)
            usage, done = mapper.finish()
        except (anthropic.AnthropicError, httpx2.HTTPError, IncompleteStream) as exc:
            gen.usage = mapper.usage() if mapper.started else None
            error = error_event(
                exc,
                max_retries=llm.max_retries,
                timeout=llm.timeout,
                mid_stream=stream is not None,
            )
            return Error(scrub(error.message, api_key), error.code)
        except Exception as exc:  # a bug or an SDK surprise: logged without the key
            gen.usage = mapper.usage() if mapper.started else None
            self.log.error(
                "llm.generation_failed",
                request_id=gen.request_id,
                error=scrub(f"{type(exc).__name__}: {exc}", api_key),
            )
            return Error(f"generation failed ({type(exc).__name__})", "error")
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_CLOSE_WITHIN):
                if stream is not None:
                    await stream.close()
                await client.close()
        gen.usage = usage
        self._emit(gen.request_id, gen.principal, usage)
        return done

    def _finish(self, gen: Generation, terminal: Done | Error) -> None:
        self._emit(gen.request_id, gen.principal, terminal)
        duration = time.monotonic() - gen.started
        self._audit(gen.request_id, gen.principal, gen.model, gen.usage, terminal, duration)
        self.log.info(
            "llm.generation_ended",
            request_id=gen.request_id,
            principal=gen.principal,
            model=gen.model,
            outcome=_outcome(terminal),
            code=terminal.code if isinstance(terminal, Error) else None,
            duration_ms=round(duration * 1000),
        )

    # -- publishing -------------------------------------------------------

    def _emit(self, request_id: str, principal: str | None, event: StreamEvent) -> None:
        try:
            self.ctx.publish(STREAM, stream_payload(request_id, event), on_behalf_of=principal)
        except BusError as exc:
            self.log.error("llm.publish_failed", request_id=request_id, error=str(exc))

    def _audit(
        self,
        request_id: str,
        principal: str | None,
        model: str | None,
        usage: Usage | None,
        terminal: Done | Error,
        duration: float,
    ) -> None:
        usage = usage or Usage(0, 0)
        record: dict[str, Any] = {
            "request_id": request_id,
            "principal_id": principal,
            "model": model,
            "input_tokens": usage.input_tokens,
            "output_tokens": usage.output_tokens,
            "cache_read_input_tokens": usage.cache_read_input_tokens,
            "cache_creation_input_tokens": usage.cache_creation_input_tokens,
            "cost_usd": cost_usd(model, usage) if model else None,
            "outcome": _outcome(terminal),
            "duration_ms": round(duration * 1000),
        }
        if isinstance(terminal, Error):
            record["error"] = terminal.code
            record["message"] = terminal.message
        else:
            record["stop_reason"] = terminal.stop_reason
        try:
            self.ctx.publish(AUDIT, record, on_behalf_of=principal)
        except BusError as exc:
            self.log.error("llm.audit_failed", request_id=request_id, error=str(exc))

    def _publish(self, topic: str, payload: Any) -> None:
        try:
            self.ctx.publish(topic, payload)
        except BusError as exc:
            self.log.error("llm.publish_failed", topic=topic, error=str(exc))

    def _reply(self, envelope: Envelope, payload: Any) -> None:
        try:
            self.ctx.reply(envelope, payload)
        except BusError as exc:
            self.log.error("llm.reply_failed", topic=envelope.topic, error=str(exc))


def _outcome(terminal: Done | Error) -> str:
    if isinstance(terminal, Done):
        return "done"
    return "cancelled" if terminal.code == "cancelled" else "error"


def _loads(payload: bytes) -> Any:
    try:
        return msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return None


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point (``capsules.llm.capsule:run``)."""
    await CompletionProvider(ctx).run()
