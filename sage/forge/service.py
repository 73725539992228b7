"""The forge call path, without the bus: forge, list, call, promote, remove.

:class:`Forge` is driven by the capsule (``capsules/forge``) with a
:class:`Caller` (the verified principal and the session) and reports every
audit event through the injected ``emit(event, payload)`` callable (the
capsule publishes it on ``forge.v1.audit.<event>``) and every change of a
session's tool list through ``changed(session_id_or_None, names)``.  The
sandbox sits behind :class:`Executor` so unit tests can swap it; everything
else is real files.

Failures are :class:`sage.errors.ForgeError` inside; :meth:`Forge.dispatch`
turns them into the envelope ``{ok: false, error: {kind, message}}``.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import fastjsonschema
import msgspec

from sage import replies
from sage.config import Config
from sage.errors import ForgeError, SandboxError
from sage.forge.breakers import BreakerBoard, State
from sage.forge.cache import ResultCache, cache_key
from sage.forge.mounts import Bind, forbidden_for
from sage.forge.policy import Policy, PolicyFile
from sage.forge.registry import (
    NAME_RE,
    RESERVED,
    Registry,
    ToolRecord,
    fingerprint,
    tighten,
)
from sage.forge.runs import (
    PAGE_DEFAULT,
    PAGE_MAX,
    RUN_ID_RE,
    RunInfo,
    RunStore,
    mask_input,
    new_run_id,
)
from sage.forge.sandbox import Limits, SandboxResult, SandboxSpec
from sage.forge.static_check import check_impl
from sage.forge.stats import SAVE_EVERY, StatsFile
from sage.redaction import redact_json, redact_text
from sage.security.uids import NO_PRINCIPAL, SandboxUids

__all__ = ("Caller", "Executor", "Forge", "SandboxExecutor", "mcp_result")

SECRET_NAME_RE = re.compile(r"^[A-Z_][A-Z0-9_]{0,63}\Z")
RUNTIMES = {"python": "python", "python3": "python", "python3.11": "python", "bash": "bash"}
STDERR_TAIL = 2000

Emit = Callable[[str, dict[str, Any]], None]
Changed = Callable[[str | None, list[str]], None]
SecretLookup = Callable[[str], str | None]


@dataclass(frozen=True)
class Caller:
    principal: str | None
    session_id: str | None


class Executor(Protocol):
    async def ensure(self) -> None: ...

    async def run(self, spec: SandboxSpec) -> SandboxResult: ...

    async def aclose(self) -> None: ...


class SandboxExecutor:
    """The real bubblewrap sandbox, with up to ``spares`` started ahead (sage.forge.spares)."""

    def __init__(self, uid: int, spares: int = 0) -> None:
        from sage.forge.spares import SparePool

        self.uid = uid
        self.spares = SparePool(spares)

    async def ensure(self) -> None:
        from sage.forge.sandbox import ensure_sandbox

        await ensure_sandbox(uid=self.uid)

    async def run(self, spec: SandboxSpec) -> SandboxResult:
        from sage.forge.sandbox import run_sandboxed

        return await run_sandboxed(spec, self.spares)

    async def aclose(self) -> None:
        await self.spares.aclose()


def mcp_result(envelope: dict[str, Any]) -> dict[str, Any]:
    """The MCP ``tools/call`` result carrying ``envelope``."""
    return {
        "content": [{"type": "text", "text": msgspec.json.encode(envelope).decode()}],
        "structuredContent": envelope,
        "isError": not envelope.get("ok", False),
    }


def _err(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """A failure envelope: the bus's one reply shape, ``extra`` fields kept."""
    return replies.error(code, message, **extra)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


META_TOOLS: list[dict[str, Any]] = [
    {
        "name": "forge_tool",
        "description": (
            "Register a new tool at runtime. It runs in a sandbox (no network, only the paths"
            " its schema binds with x-bind) and becomes callable as mcp__forge__<name> on your"
            " next request. The impl reads one JSON object (the arguments) on stdin and prints"
            ' one JSON object: {"ok": true, "data": ..., "meta": ...} or {"ok": false,'
            ' "error": {"kind", "message"}}. Call forge_list first to avoid duplicates.'
        ),
        "inputSchema": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "description": {"type": "string"},
                "input_schema": {"type": "object"},
                "impl": {"type": "string", "description": "source of the tool"},
                "runtime": {"type": "string", "enum": ["python", "python3", "python3.11", "bash"]},
                "meta": {
                    "type": "object",
                    "description": "deterministic: bool (cache results); secrets: [names]",
                },
                "scope": {"type": "string", "enum": ["session", "project"]},
            },
            "required": ["name", "description", "input_schema", "impl", "runtime"],
        },
    },
    {
        "name": "forge_list",
        "description": "List the forged tools visible to this session (name, description,"
        " scope, call_count); optionally narrowed to one scope.",
        "inputSchema": {
            "type": "object",
            "properties": {"scope": {"type": "string", "enum": ["session", "project", "user"]}},
        },
    },
    {
        "name": "forge_promote",
        "description": "Copy a forged tool into the user scope so every session can call it.",
        "inputSchema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "force": {"type": "boolean"}},
            "required": ["name"],
        },
    },
    {
        "name": "read_artifact",
        "description": (
            "Read back, page by page, the full stdout of one of your forged-tool calls that"
            " printed more than the output cap (its result was output_truncated and named a"
            " run_id). Returns {text, encoding (utf-8, or base64 for bytes that are not"
            " UTF-8), offset, next_offset, eof, total_bytes}; call again with offset ="
            f" next_offset until eof. limit: bytes per page, at most {PAGE_MAX}."
        ),
        "inputSchema": {
            "type": "object",
            "properties": {
                "run_id": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                "offset": {"type": "integer", "minimum": 0},
                "limit": {"type": "integer", "minimum": 1, "maximum": PAGE_MAX},
            },
            "required": ["run_id"],
        },
    },
]


@dataclass
class _Args:
    raw: Mapping[str, Any]

    def str(self, key: str, *, required: bool = True) -> str | None:
        value = self.raw.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str):
            raise ForgeError("bad_arguments", f"{key} must be a string")
        return value


@dataclass
class Forge:
    config: Config
    emit: Emit
    changed: Changed = lambda sid, names: None
    executor: Executor | None = None
    secrets: SecretLookup | None = None
    clock: Callable[[], float] = time.monotonic
    config_of: Callable[[], Config] | None = None
    """The config as it is now (principals may be added by a reload); default: ``config``."""
    policy_file: PolicyFile = field(init=False)
    registry: Registry = field(init=False)
    breakers: BreakerBoard = field(init=False)
    cache: ResultCache = field(init=False)
    runs: RunStore = field(init=False)
    counts: Counter[tuple[str, str]] = field(init=False, default_factory=Counter)
    stats: StatsFile = field(init=False)
    uids: SandboxUids = field(init=False)
    _saved_at: float = field(init=False)
    _breaker_moved: bool = field(init=False, default=False)
    _validators: dict[str, Callable[[Any], Any]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        root = self.config.forge_dir
        # owner-only, whatever an older version or the umask left (0644 in 0755 folders)
        tighten(root)
        for principal in self.config.principals:
            tighten(self.config.home_of(principal) / ".astrid" / "forge")
        self.policy_file = PolicyFile(root / "policy.json", self.emit)
        self.registry = Registry(root, self._home, self.emit)
        self.breakers = BreakerBoard(self.clock, self._breaker_changed)
        self.cache = ResultCache(root / "cache")
        self.runs = RunStore(root / "runs", self.emit)
        self.stats = StatsFile(root / "stats.json", self.emit)
        self.uids = SandboxUids(
            root, self.config.forge.sandbox_uid_base, self.config.forge.sandbox_uid_count
        )
        try:  # the configured principals in config order: their uids are predictable
            self.uids.allocate([NO_PRINCIPAL, *(p.name for p in self.config.principals)])
        except (SandboxError, OSError) as exc:  # each call tries again, and fails closed
            self.emit("sandbox_uids_failed", {"error": str(exc)})
        self.counts, saved = self.stats.load()
        self.breakers.restore(saved)
        self._saved_at = self.clock()
        if self.executor is None:
            forge = self.config.forge
            # any uid of the range answers "does bwrap work as an unprivileged uid"
            self.executor = SandboxExecutor(forge.sandbox_uid_base, forge.spare_sandboxes)

    async def aclose(self) -> None:
        """Save the counts and breakers; stop what runs ahead of calls (the spare sandboxes)."""
        self._persist(force=True)
        if self.executor is not None:
            await self.executor.aclose()

    def _persist(self, *, force: bool = False) -> None:
        """Save stats.json when a breaker moved, a second of calls passed, or ``force``."""
        now = self.clock()
        if not (force or self._breaker_moved or now - self._saved_at >= SAVE_EVERY):
            return
        self._breaker_moved = False
        self._saved_at = now
        try:
            self.stats.save(self.counts, self.breakers.export())
        except OSError as exc:
            self.emit("stats_save_failed", {"reason": exc.strerror or type(exc).__name__})

    def _current(self) -> Config:
        return self.config if self.config_of is None else self.config_of()

    def _home(self, principal: str) -> Path | None:
        config = self._current()
        found = config.principal(principal)
        return None if found is None else config.home_of(found)

    def _breaker_changed(self, breaker: str, name: str, state: State, reset_at: float) -> None:
        self._breaker_moved = True  # saved by the next _persist (the board's lock is held here)
        if state is State.OPEN:
            wall = time.time() + max(0.0, reset_at - self.clock()) if reset_at else None
            self.emit("breaker_open", {"breaker": breaker, "name": name, "reset_at": wall})
        elif state is State.CLOSED:
            self.emit("breaker_closed", {"breaker": breaker, "name": name})

    def _deny(self, event: str, kind: str, message: str, **payload: Any) -> ForgeError:
        self.emit(event, payload)
        return ForgeError(kind, message)

    # -- the MCP surface -----------------------------------------------------

    def descriptors(self, caller: Caller) -> list[dict[str, Any]]:
        tools = [dict(t) for t in META_TOOLS]
        for located in self.registry.visible(caller.principal, caller.session_id):
            r = located.record
            tools.append(
                {"name": r.name, "description": r.description, "inputSchema": r.input_schema}
            )
        return tools

    async def dispatch(self, caller: Caller, name: str, arguments: Any) -> dict[str, Any]:
        """One ``tools/call``: a meta-tool or a forged tool; always an envelope."""
        try:
            if not isinstance(arguments, dict):
                raise ForgeError("bad_arguments", "arguments must be an object")
            if name == "forge_tool":
                record = await self.forge(caller, arguments)
                return {
                    "ok": True,
                    "data": {
                        "name": record.name,
                        "scope": record.scope,
                        "impl_sha256": record.impl_sha256,
                    },
                }
            if name == "forge_list":
                scope = _Args(arguments).str("scope", required=False)
                return {"ok": True, "data": {"tools": self.list_tools(caller, scope)}}
            if name == "forge_promote":
                force = arguments.get("force") is True
                promoted = await self.promote(caller, str(arguments.get("name")), force=force)
                return {"ok": True, "data": {"name": promoted.name, "version": promoted.version}}
            if name == "read_artifact":
                return {"ok": True, "data": self.read_artifact(caller, arguments)}
            return await self.call(caller, name, arguments)
        except ForgeError as exc:
            return _err(exc.code, str(exc))

    # -- forge -----------------------------------------------------------------

    async def forge(self, caller: Caller, arguments: Mapping[str, Any]) -> ToolRecord:
        args = _Args(arguments)
        name = args.str("name") or ""
        description = args.str("description") or ""
        impl = args.str("impl") or ""
        runtime = RUNTIMES.get(args.str("runtime") or "")
        scope = args.str("scope", required=False) or "session"
        schema = arguments.get("input_schema")
        meta = arguments.get("meta") or {}
        if not NAME_RE.match(name):
            raise ForgeError("bad_name", "name must match ^[A-Za-z0-9_-]{1,64}$")
        if name in RESERVED:
            raise ForgeError("bad_name", f"{name!r} is reserved")
        if runtime is None:
            raise ForgeError("bad_runtime", "runtime must be python (python3, python3.11) or bash")
        if scope not in ("session", "project"):
            raise ForgeError("bad_scope", "scope must be session or project")
        if scope == "session" and caller.session_id is None:
            raise ForgeError("bad_scope", "no session to forge into")
        if scope == "project" and (
            caller.principal is None or self._home(caller.principal) is None
        ):
            raise ForgeError("bad_scope", "project scope needs a known principal")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            raise ForgeError(
                "bad_schema", 'input_schema must be an object schema ("type": "object")'
            )
        if not isinstance(meta, dict):
            raise ForgeError("bad_arguments", "meta must be an object")
        secrets = meta.get("secrets", [])
        if not isinstance(secrets, list) or not all(
            isinstance(s, str) and SECRET_NAME_RE.match(s) for s in secrets
        ):
            raise ForgeError("bad_arguments", "meta.secrets must be names like OPENAI_API_KEY")
        policy = self.policy_file.current()
        who = {"principal": caller.principal, "session_id": caller.session_id, "name": name}
        pattern = policy.forbidden(name)
        if pattern is not None:
            raise self._deny(
                "name_forbidden",
                "name_forbidden",
                f"{name!r} matches forbidden pattern {pattern!r}",
                pattern=pattern,
                phase="forge",
                **who,
            )
        if not policy.namespace_ok(caller.principal, name):
            prefix = policy.persona_namespaces.get(caller.principal or "", "")
            raise self._deny(
                "namespace_denied",
                "namespace_denied",
                f"this principal may only forge names starting with {prefix + '_'!r}",
                **who,
            )
        network, _ = policy.network_for(caller.principal)
        try:
            check_impl(runtime, impl, network=network)
        except ForgeError as exc:
            self.emit("static_check_failed", {**who, "reason": str(exc)[:300]})
            raise
        try:
            fastjsonschema.compile(schema)
        except Exception as exc:  # fastjsonschema raises several types for a bad schema
            raise ForgeError("bad_schema", f"input_schema does not compile: {exc}") from None
        trip = self.breakers.admit_forge(caller.session_id, policy.breakers)
        self._persist()
        if trip is not None:
            raise ForgeError(
                "breaker_open",
                "this session forged its allowance of tools"
                f" ({policy.breakers.per_session_forge_count})",
            )
        record = ToolRecord(
            name=name,
            description=description,
            input_schema=schema,
            impl=impl,
            runtime=runtime,  # type: ignore[arg-type]
            meta=meta,
            scope=scope,  # type: ignore[arg-type]
            principal_id=caller.principal,
            session_id=caller.session_id if scope == "session" else None,
            created_at=_now(),
            impl_sha256=hashlib.sha256(impl.encode()).hexdigest(),
            schema_fingerprint=fingerprint(schema),
        )
        self.registry.create(record)
        self.emit(
            "created",
            {
                **who,
                "scope": scope,
                "runtime": runtime,
                "impl_sha256": record.impl_sha256,
                "schema_fingerprint": record.schema_fingerprint,
            },
        )
        self.changed(caller.session_id if scope == "session" else None, [name])
        return record

    # -- list / promote / remove -------------------------------------------------

    def list_tools(self, caller: Caller, scope: str | None = None) -> list[dict[str, Any]]:
        out = []
        for located in self.registry.visible(caller.principal, caller.session_id):
            r = located.record
            if scope is not None and r.scope != scope:
                continue
            out.append(
                {
                    "name": r.name,
                    "description": r.description,
                    "scope": r.scope,
                    "call_count": self.counts[(r.scope, r.name)],
                }
            )
        return out

    def all_tools(self) -> list[dict[str, Any]]:
        found = self.registry.all_records()
        for principal in self._current().principals:
            found += self.registry.scan("project", principal.name, None)
        return [
            {
                "name": x.record.name,
                "scope": x.record.scope,
                "principal_id": x.record.principal_id,
                "session_id": x.record.session_id,
                "description": x.record.description,
                "version": x.record.version,
                "impl_sha256": x.record.impl_sha256,
                "call_count": self.counts[(x.record.scope, x.record.name)],
            }
            for x in found
        ]

    async def promote(self, caller: Caller, name: str, *, force: bool = False) -> ToolRecord:
        found = self.registry.lookup(name, caller.principal, caller.session_id)
        if found is None:
            raise ForgeError("unknown_tool", f"no tool named {name!r}")
        if found.record.scope == "user":
            raise ForgeError("already_promoted", f"{name!r} is already in the user scope")
        policy = self.policy_file.current()
        pattern = policy.forbidden(name)
        if pattern is not None:
            raise self._deny(
                "name_forbidden",
                "name_forbidden",
                f"{name!r} matches forbidden pattern {pattern!r}",
                pattern=pattern,
                phase="promote",
                name=name,
                principal=caller.principal,
                session_id=caller.session_id,
            )
        promoted = self.registry.promote(found.record, force=force)
        self.emit(
            "promoted",
            {
                "name": name,
                "principal": caller.principal,
                "session_id": caller.session_id,
                "version": promoted.version,
                "from_scope": found.record.scope,
                "impl_sha256": promoted.impl_sha256,
                "forced": force,
            },
        )
        self.changed(None, [name])
        return promoted

    async def remove(self, caller: Caller, scope: str, name: str) -> bool:
        if scope not in ("session", "project", "user"):
            raise ForgeError("bad_scope", "scope must be session, project or user")
        removed = self.registry.remove(scope, name, caller.principal, caller.session_id)  # type: ignore[arg-type]
        if not removed:
            raise ForgeError("unknown_tool", f"no {scope} tool named {name!r}")
        self.counts.pop((scope, name), None)
        self.emit(
            "removed",
            {
                "name": name,
                "scope": scope,
                "principal": caller.principal,
                "session_id": caller.session_id,
            },
        )
        self.changed(caller.session_id if scope == "session" else None, [name])
        return True

    # -- runs ------------------------------------------------------------------

    def read_artifact(self, caller: Caller, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """A page of the stdout artifact of one of the caller's own runs.

        Scoped to the caller's principal and session: another's run (or a
        run id that names none) is ``unknown_run``, the same answer either way.
        A run that had secrets injected is withheld: its raw stdout was never
        redacted (only what came back in the envelope was).
        """
        run_id = arguments.get("run_id")
        offset = arguments.get("offset", 0)
        limit = arguments.get("limit", PAGE_DEFAULT)
        if not isinstance(run_id, str) or not RUN_ID_RE.match(run_id):
            raise ForgeError(
                "bad_arguments", "run_id must be a run id like 20260101T000000Z_0123abcd"
            )
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ForgeError("bad_arguments", "offset must be an integer, 0 or more")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise ForgeError("bad_arguments", "limit must be an integer, 1 or more")
        manifest = self.runs.read(run_id)
        if (
            manifest is None
            or manifest.get("principal_id") != caller.principal
            or manifest.get("session_id") != caller.session_id
        ):
            raise ForgeError("unknown_run", f"no run {run_id!r} of this session")
        if manifest.get("secrets_injected"):
            raise ForgeError(
                "artifact_withheld",
                f"run {run_id!r} had secrets in its environment: its raw stdout is not"
                " paged back (an operator can read it on the host)",
            )
        return self.runs.read_page(run_id, offset, min(limit, PAGE_MAX))

    def _retain(self) -> None:
        """The runs folder back under its caps (the run just written is in use: kept)."""
        forge = self._current().forge
        try:
            self.runs.enforce(forge.runs_max_bytes, forge.runs_quota)
        except OSError as exc:  # the call's result matters more; the next write tries again
            self.emit("runs_prune_failed", {"reason": exc.strerror or type(exc).__name__})

    def list_runs(
        self, caller: Caller, principal: str | None, name: str | None, limit: int
    ) -> dict[str, Any]:
        """Recent runs and the bytes held; a principal sees only its own."""
        principal = self._runs_scope(caller, principal)
        forge = self._current().forge
        return {
            "runs": self.runs.recent(name, limit, principal=principal),
            **self.runs.usage(principal),
            "max_bytes": forge.runs_max_bytes,
            "max_bytes_per_principal": forge.runs_quota,
        }

    def prune_runs(
        self,
        caller: Caller,
        principal: str | None,
        *,
        older_than: float | None,
        keep_bytes: int | None,
        dry_run: bool,
    ) -> list[RunInfo]:
        """``astrid forge runs prune``: an operator's any runs, a principal its own."""
        return self.runs.prune(
            principal=self._runs_scope(caller, principal),
            older_than=older_than,
            keep_bytes=keep_bytes,
            dry_run=dry_run,
            by=caller.principal,
        )

    def _runs_scope(self, caller: Caller, principal: str | None) -> str | None:
        if caller.principal is None:
            return principal
        if principal is not None and principal != caller.principal:
            raise self._deny(
                "acl_denied",
                "acl_denied",
                "a principal may list and prune only its own runs",
                principal=caller.principal,
                name="runs",
                target=principal,
            )
        return caller.principal

    # -- call ------------------------------------------------------------------

    def _validator(self, record: ToolRecord) -> Callable[[Any], Any]:
        found = self._validators.get(record.schema_fingerprint)
        if found is None:
            try:
                found = fastjsonschema.compile(record.input_schema)
            except Exception as exc:  # an edited record whose schema no longer compiles
                raise ForgeError(
                    "bad_schema", f"the tool's input_schema does not compile: {exc}"
                ) from None
            self._validators[record.schema_fingerprint] = found
        return found

    async def call(self, caller: Caller, name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
        policy = self.policy_file.current()  # the snapshot this call keeps to its end
        located = self.registry.lookup(name, caller.principal, caller.session_id)
        if located is None:
            raise ForgeError("unknown_tool", f"no forged tool named {name!r}")
        record = located.record
        who = {"principal": caller.principal, "session_id": caller.session_id, "name": name}
        if not policy.may_call(caller.principal, name):
            raise self._deny(
                "acl_denied", "acl_denied", f"this principal may not call {name!r}", **who
            )
        pattern = policy.forbidden(name)
        if pattern is not None:
            raise self._deny(
                "name_forbidden",
                "name_forbidden",
                f"{name!r} matches forbidden pattern {pattern!r}",
                pattern=pattern,
                phase="call",
                **who,
            )
        trip = self.breakers.admit_call(name, policy.breakers)
        if trip is not None:
            self._persist()
            raise ForgeError(
                "breaker_open",
                f"the {trip.breaker} breaker of {name!r} is open"
                f" (resets in {max(0.0, trip.reset_at - self.clock()):.0f}s)",
            )
        try:
            self._validator(record)(dict(arguments))
        except fastjsonschema.JsonSchemaException as exc:
            self.emit(
                "called",
                {
                    **who,
                    "scope": record.scope,
                    "ok": False,
                    "error": "validation_failed",
                    "run_id": None,
                },
            )
            raise ForgeError("validation_failed", str(exc)) from None
        names = list(record.meta.get("secrets", []))
        values = self._secrets(caller, names, policy)
        masked = redact_json(
            mask_input(record.input_schema, dict(arguments)), list(values.values())
        )
        run_id = new_run_id()
        with self.runs.using(run_id):  # being written: no prune takes it
            return await self._call_run(
                caller, record, arguments, policy, values, names, masked, who, run_id
            )

    async def _call_run(
        self,
        caller: Caller,
        record: ToolRecord,
        arguments: Mapping[str, Any],
        policy: Policy,
        values: dict[str, str],
        names: list[str],
        masked: Any,
        who: dict[str, Any],
        run_id: str,
    ) -> dict[str, Any]:
        name = record.name
        deterministic = record.meta.get("deterministic") is True
        key = (
            cache_key(name, record.impl_sha256, record.schema_fingerprint, dict(arguments))
            if deterministic
            else None
        )
        base = {
            "run_id": run_id,
            "tool": name,
            "scope": record.scope,
            "principal_id": caller.principal,
            "session_id": caller.session_id,
            "impl_sha256": record.impl_sha256,
            "input": masked,
        }
        if key is not None:
            hit = self.cache.get(key)
            if hit is not None:
                envelope = hit["envelope"]
                # not fsynced: a hit's durable record is its audit entry, which
                # names the seed run (whose manifest is durable); the fsyncs were
                # more than half of a hit's time
                self.runs.write(
                    run_id,
                    {
                        **base,
                        "kind": "cache_hit",
                        "seed_run_id": hit["seed_run_id"],
                        "ok": True,
                        "cache": {"key": key, "seed_run_id": hit["seed_run_id"]},
                        "secrets_injected": [],
                    },
                    durable=False,
                )
                self._retain()
                self._finish(
                    record,
                    who,
                    run_id,
                    True,
                    None,
                    cache="hit",
                    policy=policy,
                    seed_run_id=str(hit["seed_run_id"]),
                )
                return dict(envelope)
        envelope, manifest = await self._run(
            record, caller, arguments, policy, values, run_id, names
        )
        ok = envelope.get("ok") is True
        kind = "run"
        if key is not None and ok:
            self.cache.put(key, envelope, run_id)
            kind = "cache_seed"
        self.runs.write(
            run_id,
            {
                **base,
                **manifest,
                "kind": kind,
                "ok": ok,
                "cache": {"key": key} if key else None,
                "secrets_injected": names,
            },
        )
        self._retain()
        error = None if ok else str(envelope.get("error"))
        self._finish(
            record,
            who,
            run_id,
            ok,
            error,
            cache="seed" if kind == "cache_seed" else None,
            policy=policy,
        )
        return envelope

    def _finish(
        self,
        record: ToolRecord,
        who: dict[str, Any],
        run_id: str,
        ok: bool,
        error: str | None,
        *,
        cache: str | None,
        policy: Policy,
        seed_run_id: str | None = None,
    ) -> None:
        self.counts[(record.scope, record.name)] += 1
        if cache != "hit":
            self.breakers.record(record.name, ok, policy.breakers)
        payload = {
            **who,
            "scope": record.scope,
            "ok": ok,
            "error": error,
            "run_id": run_id,
            "cache": cache,
        }
        if seed_run_id is not None:
            payload["seed_run_id"] = seed_run_id
        self.emit("called", payload)
        self._persist()

    def _secrets(self, caller: Caller, names: list[str], policy: Policy) -> dict[str, str]:
        if not names:
            return {}
        denied = policy.secrets_denied(caller.principal, names)
        if denied:
            raise self._deny(
                "secret_denied",
                "secret_denied",
                f"this principal may not use secrets {denied}",
                principal=caller.principal,
                names=denied,
            )
        values: dict[str, str] = {}
        missing = []
        for secret in names:
            try:
                value = None if self.secrets is None else self.secrets(secret)
            except Exception as exc:  # the vault cannot be read: fail closed, never its text
                raise self._deny(
                    "secret_missing",
                    "secret_missing",
                    "the secret vault cannot be read",
                    principal=caller.principal,
                    names=names,
                    reason=type(exc).__name__,
                ) from None
            if value is None:
                missing.append(secret)
            else:
                values[secret] = value
        if missing:
            raise self._deny(
                "secret_missing",
                "secret_missing",
                f"secrets not in the vault: {missing}",
                principal=caller.principal,
                names=missing,
            )
        return values

    def _binds(self, record: ToolRecord, arguments: Mapping[str, Any]) -> tuple[Bind, ...]:
        props = record.input_schema.get("properties") or {}
        binds = []
        for key, spec in props.items():
            mode = spec.get("x-bind") if isinstance(spec, dict) else None
            value = arguments.get(key)
            if mode not in ("ro", "rw") or not isinstance(value, str) or not value:
                continue
            path = Path(value)
            if not path.is_absolute():
                raise ForgeError("validation_failed", f"{key}: an x-bind path must be absolute")
            if mode == "rw" and not path.is_dir():
                path = path.parent
            binds.append(Bind(path, mode))
        return tuple(binds)

    async def _run(
        self,
        record: ToolRecord,
        caller: Caller,
        arguments: Mapping[str, Any],
        policy: Policy,
        secrets: dict[str, str],
        run_id: str,
        names: list[str],
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        assert self.executor is not None
        network, loopback = policy.network_for(caller.principal)
        limits = Limits.from_config(self.config.forge)
        try:
            uid = self.uids.uid_for(caller.principal)
        except (SandboxError, OSError) as exc:
            message = f"no sandbox uid for this principal: {exc}"
            code = exc.code if isinstance(exc, SandboxError) else "sandbox_failed"
            return _err(code, message), {"error": message}
        limits = Limits(
            **{
                **limits.__dict__,
                "output_cap": policy.output_cap_for(limits.output_cap),
                "sandbox_uid": uid,
                # one run's spill always fits its principal's share of the runs folder
                "spill_cap": min(limits.spill_cap, self._current().forge.runs_quota),
            }
        )
        if record.runtime == "python":
            argv, impl_path = [self.config.forge.python, "/forge/tool.py"], "/forge/tool.py"
        else:
            argv, impl_path = [self.config.forge.bash, "/forge/tool.sh"], "/forge/tool.sh"
        binds = self._binds(record, arguments)
        spec = SandboxSpec(
            argv=argv,
            impl=record.impl.encode(),
            impl_path=impl_path,
            stdin=msgspec.json.encode(dict(arguments)),
            limits=limits,
            binds=binds,
            network=network,
            loopback=loopback,
            env=secrets,
            artifacts_dir=self.runs.artifacts(run_id),
            forbidden=forbidden_for(self.config),
        )
        sandbox_info = {
            "binds": [{"path": str(b.path), "mode": b.mode} for b in binds],
            "network": network,
            "loopback": loopback,
            "limits": {k: v for k, v in limits.__dict__.items()},
        }
        values = list(secrets.values())
        try:
            await self.executor.ensure()
            result = await self.executor.run(spec)
        except SandboxError as exc:
            message = redact_text(str(exc), values)
            return _err(exc.code, message), {"sandbox": sandbox_info, "error": message}
        except OSError as exc:  # a host-side failure around the sandbox: fail closed
            message = redact_text(f"{type(exc).__name__}: {exc}", values)
            return _err("sandbox_failed", message), {"sandbox": sandbox_info, "error": message}
        stderr = redact_text(
            result.stderr_tail.decode(errors="replace"),
            values,
        )[-STDERR_TAIL:]
        manifest: dict[str, Any] = {
            "exit_code": result.exit_code,
            "signal": result.signal,
            "timed_out": result.timed_out,
            "duration_ms": round(result.duration * 1000),
            "stderr_tail": stderr,
            "sandbox": {**sandbox_info, "label": result.label},
        }
        envelope = self._envelope(result, values, stderr, run_id, bool(secrets))
        if result.stdout_truncated:
            manifest["stdout"] = {
                "truncated": True,
                "total_bytes": result.stdout_total_bytes,
                "artifact": str(result.stdout_artifact),
            }
        else:
            manifest["stdout"] = envelope
        return envelope, manifest

    def _envelope(
        self,
        result: SandboxResult,
        values: list[str],
        stderr: str,
        run_id: str,
        withheld: bool,
    ) -> dict[str, Any]:
        if result.stdout_truncated:
            where = (
                "it had secrets in its environment, so the full stdout is kept for an operator only"
                if withheld
                else f"the full stdout is kept as run {run_id}: page through it with"
                f' read_artifact {{"run_id": "{run_id}", "offset": 0}}, then offset ='
                " next_offset until eof"
            )
            return _err(
                "output_truncated",
                f"the tool printed {result.stdout_total_bytes} bytes, more than the output"
                f" cap ({result.stdout_truncated_at_bytes}); {where}",
                meta={
                    "run_id": run_id,
                    "stdout_truncated": True,
                    "stdout_truncated_at_bytes": result.stdout_truncated_at_bytes,
                    "stdout_total_bytes": result.stdout_total_bytes,
                    "stdout_full_artifact": str(result.stdout_artifact),
                },
            )
        if result.timed_out:
            return _err("timeout", f"the tool ran past its wall clock; stderr: {stderr[-500:]}")
        try:
            parsed = msgspec.json.decode(result.stdout)
        except msgspec.DecodeError:
            parsed = None
        if not isinstance(parsed, dict) or not isinstance(parsed.get("ok"), bool):
            return _err(
                "bad_output",
                "stdout was not one JSON object with a boolean ok"
                f" (exit {result.exit_code}); stderr: {stderr[-500:]}",
            )
        redacted: dict[str, Any] = redact_json(parsed, values)
        if not redacted["ok"]:
            # a tool prints {"ok": false, "error": {"kind", "message"}}; the reply is flat
            error = redacted.pop("error", None)
            redacted.pop("message", None)
            if isinstance(error, dict):
                kind, message = error.get("kind"), error.get("message")
                code = kind if isinstance(kind, str) and kind else "tool_error"
                return _err(code, message if isinstance(message, str) else "", **redacted)
            return _err("tool_error", str(error), **redacted)
        return redacted
