"""The forge capsule: a thin bus shell around :class:`sage.forge.service.Forge`.

Requests (request/reply; the caller's principal is ``envelope.principal``,
the broker-verified one, never a payload field):

- ``forge.v1.request.list`` ``{session_id}`` → ``{tools: [{name, description,
  inputSchema}]}``: the four meta-tools and the session's visible forged
  tools (session > project > user), names without the ``mcp__forge__`` prefix.
- ``forge.v1.request.call`` ``{session_id, tool_name, arguments,
  tool_use_id?}`` → the MCP result ``{content, structuredContent, isError}``.
  Every failure is an ``isError`` result with ``{ok: false, error: CODE,
  message}`` (the bus's one reply shape, :mod:`sage.replies`).
- ``forge.v1.request.admin.<op>`` (``list``, ``show``, ``run``, ``promote``,
  ``rm``, ``runs``): only for an envelope without a principal (an operator
  or a trusted capsule); others get ``{ok: false, error: "acl_denied", message}``.
- ``forge.v1.request.runs.list`` ``{principal_id?, name?, limit?}`` →
  ``{ok, runs, total_bytes, principals, max_bytes, max_bytes_per_principal}``
  and ``forge.v1.request.runs.prune`` ``{principal_id?, older_than?,
  keep_bytes?, dry_run?}`` → ``{ok, dry_run, removed: [{run_id,
  principal_id, session_id, bytes}], count, bytes}``: an envelope without a
  principal may name any principal (or none: all); one with a principal
  only itself (else ``acl_denied``).

- ``sage.v1.request.forge.list`` ``{session_id?}`` and
  ``sage.v1.request.forge.call`` ``{session_id?, tool_name, arguments}``: the
  same as ``list`` and ``call``, for a user's connection acting for its
  principal (``astrid mcp serve --server forge`` in a REPL session). The
  caller must act for a principal, and a ``session_id`` must name one of that
  principal's sessions (the runner's or a REPL's), else ``unknown_session``.

Audit events go out on ``forge.v1.audit.<event>`` (the supervisor appends
them to the one hash-chained log); after a forge / promote / rm,
``sage.v1.tools.changed {session_id, names, server: "forge"}``, and for a
session-scoped change ``sage.v1.event.<sid>.tools_changed {session_id, names,
server: "forge"}`` to the session's principal only (what ``astrid mcp serve``
turns into ``notifications/tools/list_changed``).
Requests are served concurrently (one task each); at most
:data:`CONCURRENT_CALLS` tool calls run at once.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import msgspec

from bus import BusError, Envelope, Subscription
from sage import replies
from sage.capsule.context import CapsuleContext
from sage.capsule.sessions import foreign_session, session_owner
from sage.errors import ForgeError, SageError
from sage.forge.service import Caller, Forge, mcp_result
from sage.usage.admission import REPL_FORGE_CALL, admit

__all__ = ("ForgeCapsule", "run")

PREFIX = "forge.v1.request."
USER_PREFIX = "sage.v1.request.forge."
"""Requests from users' connections, in the request space users may publish to."""
CONCURRENT_CALLS = 8
"""Tool calls run at once; more wait their turn (lists and forges do not wait)."""


class ForgeCapsule:
    def __init__(self, ctx: CapsuleContext) -> None:
        self.ctx = ctx
        self.log = ctx.log
        self._store: Any = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.calls = anyio.CapacityLimiter(CONCURRENT_CALLS)
        self.forge = Forge(
            ctx.config,
            self._audit,
            changed=self._changed,
            secrets=self._secret,
            config_of=lambda: ctx.config,
        )

    def _audit(self, event: str, payload: dict[str, Any]) -> None:
        try:
            self.ctx.publish(f"forge.v1.audit.{event}", payload)
        except BusError as exc:
            self.log.error("forge.audit_failed", audit_event=event, error=str(exc))

    def _changed(self, session_id: str | None, names: list[str]) -> None:
        payload = {"session_id": session_id, "names": names, "server": "forge"}
        try:
            self.ctx.publish("sage.v1.tools.changed", payload)
        except BusError as exc:
            self.log.error("forge.changed_failed", error=str(exc))
        if session_id is not None and self._tg is not None:
            self._tg.start_soon(self._tell_session, session_id, payload)

    async def _tell_session(self, session_id: str, payload: dict[str, Any]) -> None:
        """``sage.v1.event.<sid>.tools_changed`` to the session's principal (REPL serve)."""
        try:
            owner = await session_owner(self.ctx.state, session_id)
            if owner is not None:
                self.ctx.publish(
                    f"sage.v1.event.{session_id}.tools_changed", payload, on_behalf_of=owner
                )
        except (BusError, SageError) as exc:
            self.log.warning("forge.session_event_failed", error=str(exc))

    def _secret(self, name: str) -> str | None:
        from sage.security.secrets import SecretStore

        if self._store is None:
            self._store = SecretStore.open(self.ctx.config)
        value: str | None = self._store.get("forge", name)
        return value

    async def run(self) -> None:
        requests = self.ctx.subscribe(PREFIX + ">")
        from_users = self.ctx.subscribe(USER_PREFIX + "*")
        self.ctx.ready()
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._serve_all, from_users)
                await self._serve_all(requests)
        finally:
            self._tg = None
            with anyio.CancelScope(shield=True):
                await self.forge.aclose()

    async def _serve_all(self, requests: Subscription) -> None:
        assert self._tg is not None
        async for envelope in requests:
            self._tg.start_soon(self.serve, envelope)

    async def serve(self, envelope: Envelope) -> None:
        try:
            answer = await self.handle(envelope)
        except Exception as exc:  # one bad request never stops the capsule
            self.log.error("forge.handler_failed", topic=envelope.topic, error=type(exc).__name__)
            answer = mcp_result(
                replies.error("internal_error", "the forge capsule failed on this request")
            )
        if envelope.reply_to is not None:
            try:
                self.ctx.reply(envelope, answer)
            except BusError as exc:
                self.log.error("forge.reply_failed", error=str(exc))

    async def handle(self, envelope: Envelope) -> dict[str, Any]:
        if envelope.topic.startswith(USER_PREFIX):
            return await self.handle_user(envelope)
        op = envelope.topic.removeprefix(PREFIX)
        data = _object(envelope.payload)
        if data is None:
            return mcp_result(replies.error("bad_request", "the payload must be a JSON object"))
        sid = data.get("session_id")
        sid = sid if isinstance(sid, str) else None
        if op in ("list", "call"):
            return await self.list_or_call(op, Caller(envelope.principal, sid), data)
        if op in ("runs.list", "runs.prune"):
            try:
                return self.runs(op.removeprefix("runs."), envelope.principal, data)
            except ForgeError as exc:
                return replies.from_error(exc)
        if op.startswith("admin."):
            if envelope.principal is not None:
                return replies.error("acl_denied", "forge admin requests are for operators")
            try:
                return await self.admin(op.removeprefix("admin."), data)
            except ForgeError as exc:
                return replies.from_error(exc)
        return replies.error("bad_request", f"unknown forge request {op!r}")

    async def handle_user(self, envelope: Envelope) -> dict[str, Any]:
        """``sage.v1.request.forge.{list,call}``: a user's list or call, for its own
        principal and one of that principal's sessions (or none)."""
        op = envelope.topic.removeprefix(USER_PREFIX)
        if op not in ("list", "call"):
            return mcp_result(replies.error("bad_request", f"unknown forge request {op!r}"))
        if envelope.principal is None:
            return mcp_result(
                replies.error("bad_request", "act for a principal (astrid mcp serve --principal)")
            )
        data = _object(envelope.payload)
        if data is None:
            return mcp_result(replies.error("bad_request", "the payload must be a JSON object"))
        sid = data.get("session_id")
        if sid is not None and not isinstance(sid, str):
            return mcp_result(replies.error("bad_request", "session_id must be a string"))
        try:
            refusal = await foreign_session(self.ctx.state, sid, envelope.principal)
        except SageError as exc:
            refusal = f"unknown_session: session {sid!r} could not be checked: {exc}"
        if refusal is not None:
            self._audit(
                "session_refused",
                {"principal": envelope.principal, "session_id": None, "request": op},
            )
            return mcp_result(
                replies.error("unknown_session", refusal.removeprefix("unknown_session: "))
            )
        if op == "call":  # over a budget, no tool runs: a REPL's model calls never pass
            try:  # through sage, its tool calls do (sage/usage/admission.py)
                await admit(self.ctx, envelope.principal, REPL_FORGE_CALL, sid)
            except SageError as exc:
                return mcp_result(replies.from_error(exc))
        return await self.list_or_call(op, Caller(envelope.principal, sid), data)

    async def list_or_call(self, op: str, caller: Caller, data: dict[str, Any]) -> dict[str, Any]:
        """The session's tools (``list``), or one tool call (``call``) as an MCP result."""
        if op == "list":
            return {"tools": self.forge.descriptors(caller)}
        name = data.get("tool_name")
        if not isinstance(name, str):
            return mcp_result(replies.error("bad_request", "tool_name must be a string"))
        async with self.calls:
            answer = await self.forge.dispatch(caller, name, data.get("arguments", {}))
        return mcp_result(answer)

    def runs(self, op: str, principal: str | None, data: dict[str, Any]) -> dict[str, Any]:
        caller = Caller(principal, None)
        target = data.get("principal_id")
        if target is not None and not isinstance(target, str):
            raise ForgeError("bad_request", "principal_id must be a string")
        if op == "list":
            name = data.get("name")
            if name is not None and not isinstance(name, str):
                raise ForgeError("bad_request", "name must be a string")
            limit = data.get("limit", 20)
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ForgeError("bad_request", "limit must be a positive integer")
            return {"ok": True, **self.forge.list_runs(caller, target, name, limit)}
        older_than = data.get("older_than")
        if older_than is not None and (
            not isinstance(older_than, int | float) or isinstance(older_than, bool)
        ):
            raise ForgeError("bad_request", "older_than must be a number of seconds")
        keep_bytes = data.get("keep_bytes")
        if keep_bytes is not None and (
            not isinstance(keep_bytes, int) or isinstance(keep_bytes, bool)
        ):
            raise ForgeError("bad_request", "keep_bytes must be an integer")
        dry_run = data.get("dry_run") is True
        removed = self.forge.prune_runs(
            caller, target, older_than=older_than, keep_bytes=keep_bytes, dry_run=dry_run
        )
        return {
            "ok": True,
            "dry_run": dry_run,
            "removed": [r.row() for r in removed],
            "count": len(removed),
            "bytes": sum(r.bytes for r in removed),
        }

    async def admin(self, op: str, data: dict[str, Any]) -> dict[str, Any]:
        principal = data.get("principal_id")
        principal = principal if isinstance(principal, str) else None
        caller = Caller(
            principal, data.get("session_id") if isinstance(data.get("session_id"), str) else None
        )
        name = data.get("name")
        if op == "list":
            return {"ok": True, "tools": self.forge.all_tools()}
        if op == "runs":
            limit = data.get("limit")
            limit = limit if isinstance(limit, int) and limit > 0 else 20
            return {
                "ok": True,
                "runs": self.forge.runs.recent(name if isinstance(name, str) else None, limit),
            }
        if not isinstance(name, str):
            raise ForgeError("bad_request", "name must be a string")
        if op == "show":
            scope = data.get("scope")
            if isinstance(scope, str):
                found = self.forge.registry.get(scope, name, caller.principal, caller.session_id)  # type: ignore[arg-type]
            else:
                found = self.forge.registry.lookup(name, caller.principal, caller.session_id)
            if found is None:
                raise ForgeError("unknown_tool", f"no tool named {name!r}")
            return {"ok": True, "tool": msgspec.to_builtins(found.record), "path": str(found.path)}
        if op == "run":
            async with self.calls:
                envelope = await self.forge.dispatch(caller, name, data.get("arguments", {}))
            return mcp_result(envelope)
        if op == "promote":
            promoted = await self.forge.promote(caller, name, force=data.get("force") is True)
            return {"ok": True, "name": name, "version": promoted.version}
        if op == "rm":
            await self.forge.remove(caller, str(data.get("scope")), name)
            return {"ok": True, "name": name}
        raise ForgeError("bad_request", f"unknown admin request {op!r}")


def _object(payload: bytes) -> dict[str, Any] | None:
    """The payload as a JSON object (none: ``{}``); None when it is anything else."""
    try:
        data = msgspec.json.decode(payload) if payload else {}
    except msgspec.DecodeError:
        return None
    return data if isinstance(data, dict) else None


async def run(ctx: CapsuleContext) -> None:
    """The capsule's entry point (``capsules.forge.capsule:run``)."""
    await ForgeCapsule(ctx).run()
