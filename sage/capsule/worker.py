"""The worker side of an out-of-process capsule: ``python -m sage.capsule.worker MODULE[:ATTR]``.

The supervisor (:mod:`sage.daemon.workers`) starts this in the capsule's folder
with the bus socket inherited as ``ASTRID_BUS_FD``, the capsule's name in
``ASTRID_CAPSULE``, a ready pipe in ``ASTRID_READY_FD`` and the log level in
``ASTRID_LOG_LEVEL``.  It attaches a :class:`bus.client.BusClient` to the
socket (the identity is the one the supervisor fixed for that socket, not
anything said here), loads the capsule's main and runs it with a
:class:`RemoteContext`, the same interface an in-process capsule gets
(``publish``, ``await open``, ``reply``, ``request``, ``ready``, ``log``,
``manifest``).

``MODULE:ATTR`` names an async function taking the context (or an object
with such a ``run``); ``MODULE`` alone runs ``sage.capsule.sdk.Capsule.from_module``.
Exit codes: 0 when the main returned, or on SIGTERM, SIGINT or end of input
(the supervisor's first stop step), after what was published is flushed;
1 when the main raised (its traceback goes to stderr); 2 when the worker
cannot start (no bus descriptor, an entry that does not load).
"""

from __future__ import annotations

import importlib
import inspect
import os
import signal
import stat
import sys
import traceback
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from bus import BusClient, BusError, Envelope, PayloadTooLarge, RemoteSubscription, split_topic
from sage.capsule.manifest import CapsuleManifest, load_manifest
from sage.errors import ConfigError, SageError
from sage.logs import configure_logging

__all__ = ("RemoteContext", "WorkerMain", "load_main", "main", "serve")

log = structlog.get_logger("sage.capsule.worker")

_encode = msgspec.json.Encoder().encode
_LEVELS = frozenset({"debug", "info", "warning", "error"})
FLUSH_DEADLINE = 2.0
"""Seconds a stopping worker waits for the supervisor to take what it published."""


class RemoteContext:
    """A capsule's context over the socket: what :class:`sage.capsule.context.CapsuleContext`
    offers, for code that runs in either place.

    Errors the bus can tell at once (a bad topic, a payload over the limit,
    a value that is not JSON) raise here as in-process.  A refusal by the
    supervisor (``AclDenied``) arrives later: it is logged as it comes
    (``worker.bus_error``) and raised by the next :meth:`flush`.
    """

    def __init__(
        self,
        client: BusClient,
        manifest: CapsuleManifest,
        *,
        ready_fd: int | None = None,
    ) -> None:
        self.client = client
        self.manifest = manifest
        self.log = log.bind(capsule=manifest.name)
        self._ready_fd = ready_fd
        welcome = client.welcome
        self.source = welcome.source if welcome is not None else ""
        """The bus source the supervisor gave this worker (``capsule:<name>``)."""
        self._max_payload = welcome.max_payload if welcome is not None else None
        client.on_error = self._on_error

    def _on_error(self, error: BusError) -> None:
        self.log.warning("worker.bus_error", code=error.code, error=str(error))

    def _encoded(self, payload: Any) -> bytes:
        data = _encode(payload)
        if self._max_payload is not None and len(data) > self._max_payload:
            raise PayloadTooLarge(
                f"payload of {len(data)} bytes is over the limit of {self._max_payload}"
            )
        return data

    def publish(self, topic: str, payload: Any, *, on_behalf_of: str | None = None) -> None:
        """Publish as the capsule (queued; a refusal comes back on :meth:`flush`).

        ``on_behalf_of`` scopes the envelope to that principal, as in-process.
        """
        split_topic(topic)
        self.client.publish_raw(topic, self._encoded(payload), on_behalf_of=on_behalf_of)

    async def open(self, pattern: str) -> RemoteSubscription:
        """Subscribe; the subscription is active when this returns (``async for`` it)."""
        return await self.client.subscribe(pattern)

    def reply(self, request: Envelope, payload: Any) -> bool:
        """Answer a request; False if the envelope is not one."""
        if request.reply_to is None:
            return False
        self.client.reply_raw(request.reply_to, self._encoded(payload))
        return True

    async def request(self, topic: str, payload: Any, *, deadline: float | None = None) -> Envelope:
        split_topic(topic)
        return await self.client.request_raw(topic, self._encoded(payload), deadline=deadline)

    async def flush(self) -> None:
        """Wait until the supervisor handled everything sent; raise its first refusal."""
        await self.client.flush()

    def ready(self) -> None:
        """Say the capsule serves its topics (the supervisor's READY waits for it)."""
        fd, self._ready_fd = self._ready_fd, None
        if fd is None:
            return
        try:
            os.write(fd, b"READY=1\n")
        except OSError as exc:
            self.log.warning("worker.ready_not_sent", error=exc.strerror)
        finally:
            os.close(fd)


WorkerMain = Callable[[RemoteContext], Awaitable[None]]


def load_main(target: str) -> WorkerMain:
    """``module:attr`` -> that async function (or its ``run``); ``module`` -> an SDK capsule."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
        if not attr:
            from sage.capsule.sdk import Capsule

            sdk_main: WorkerMain = Capsule.from_module(module).run
            return sdk_main
        found: Any = getattr(module, attr)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise ConfigError(f"cannot load {target}: {exc}") from exc
    if not inspect.iscoroutinefunction(found) and inspect.iscoroutinefunction(
        getattr(found, "run", None)
    ):
        found = found.run
    if not inspect.iscoroutinefunction(found):
        raise ConfigError(f"cannot load {target}: not an async function")
    entry: WorkerMain = found
    return entry


def _manifest(name: str) -> CapsuleManifest:
    """The capsule's manifest from the working folder, else one carrying only the name."""
    try:
        manifest = load_manifest(Path.cwd())
    except ConfigError:
        manifest = None
    if manifest is not None and (not name or manifest.name == name):
        return manifest
    return msgspec.convert({"package": {"name": name or "worker"}}, CapsuleManifest)


async def _until_stopped(scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` on SIGTERM, SIGINT or end of input (when stdin is a pipe)."""

    async def end_of_input() -> None:
        try:
            if not stat.S_ISFIFO(os.fstat(0).st_mode):
                return
            os.set_blocking(0, False)
        except OSError:
            return
        while True:
            try:
                if not os.read(0, 4096):
                    break
            except BlockingIOError:
                await anyio.wait_readable(0)
            except OSError:
                break
        log.info("worker.stopping", reason="end of input")
        scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(end_of_input)
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("worker.stopping", reason=signal.Signals(signum).name)
                scope.cancel()
                return


async def serve(target: str, environ: Mapping[str, str] = os.environ) -> int:
    """Run the capsule main named by ``target`` on the inherited bus; the exit code."""
    name = environ.get("ASTRID_CAPSULE", "")
    try:
        fd = int(environ["ASTRID_BUS_FD"])
    except (KeyError, ValueError):
        print(
            "sage.capsule.worker: ASTRID_BUS_FD is not set (the supervisor starts workers)",
            file=sys.stderr,
        )
        return 2
    ready_text = environ.get("ASTRID_READY_FD", "")
    ready_fd = int(ready_text) if ready_text.isdigit() else None
    try:
        entry = load_main(target)
    except SageError as exc:
        print(f"sage.capsule.worker: {exc}", file=sys.stderr)
        return 2
    manifest = _manifest(name)
    failed = False
    async with BusClient.attach_fd(fd, role="capsule", name=manifest.name) as client:
        ctx = RemoteContext(client, manifest, ready_fd=ready_fd)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_until_stopped, tg.cancel_scope)
            try:
                await entry(ctx)
            except Exception:
                failed = True
                traceback.print_exc(limit=8, file=sys.stderr)
            tg.cancel_scope.cancel()
        with anyio.move_on_after(FLUSH_DEADLINE):
            try:
                await client.flush()
            except BusError as exc:
                ctx.log.info("worker.unflushed", error=str(exc))
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sage.capsule.worker MODULE[:ATTR]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m sage.capsule.worker MODULE[:ATTR]", file=sys.stderr)
        return 2
    level = os.environ.get("ASTRID_LOG_LEVEL", "info")
    configure_logging(level if level in _LEVELS else "info")
    try:
        return anyio.run(serve, args[0])
    except BusError as exc:  # the bus went away underneath the capsule
        print(f"sage.capsule.worker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # run the importable module's main, so capsule code sees one sage.capsule.worker
    from sage.capsule.worker import main as _main

    sys.exit(_main())
