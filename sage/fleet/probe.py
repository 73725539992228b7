"""What ``astrid doctor`` asks the NATS servers of a ``[fleet]``: each one alone.

The async shell of the doctor's fleet checks (sage/cli/doctor_fleet.py turns what it
finds into rows).  Each server of ``[fleet] url`` is connected to on its own, with the
node's own credentials (:func:`sage.fleet.member.sign_in_options`, the supervisor's
own reading of them) and a short timeout, no reconnects: a server that does not
answer, refuses the credentials or is older than the fleet allows is named.  On the
first server that signs the node in, the info of every stream of the fleet is read
(``$JS.API.STREAM.INFO.<stream>``, which the node's permissions allow) and checked with
the supervisor's own check (:func:`sage.fleet.streams.unsafe`); the server's time in
those answers (``ts``) against the local clock around the request is the clock skew
(sage/fleet/clock.py).  Nothing is created or written: a stream not made yet is said so.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from sage.config import FleetConfig
from sage.errors import FleetError, FleetUnavailable
from sage.fleet.clock import Skew, measure, parse_server_time
from sage.fleet.member import (
    MIN_SERVER,
    is_auth_refusal,
    new_client,
    refused_who,
    sign_in_options,
)
from sage.fleet.nats_errors import describe, nats_errors
from sage.fleet.streams import STREAMS, Unsafe, describe_unsafe, unsafe

if TYPE_CHECKING:
    from nats.aio.client import Client as Nats

__all__ = ("FleetProbe", "ServerProbe", "StreamProbe", "probe_fleet")

RETRY_WAIT: Any = 0.1
"""Seconds before the one retry (nats-py types it ``int`` but sleeps a float)."""

SERVER_TIMEOUT = 2.0
"""Seconds one server has to answer and sign the node in."""


@dataclass(frozen=True)
class ServerProbe:
    """One server of ``[fleet] url``, asked alone."""

    url: str
    error: str = ""
    """Why the node could not use it; empty: it answered and signed the node in."""
    refused: bool = False
    """The server answered and refused the node's credentials."""
    tls_failed: bool = False
    """TLS could not be set up (a certificate, a CA, a server without TLS)."""
    version: str = ""


@dataclass(frozen=True)
class StreamProbe:
    """One stream of the fleet (sage/fleet/streams.py), as a server describes it."""

    name: str
    found: bool
    weak: list[Unsafe] = field(default_factory=list)
    """Each setting weaker than the fleet needs; empty: safe (or not made yet)."""
    error: str = ""
    """Why its info could not be read; empty: it was."""

    @property
    def problem(self) -> str:
        """One line: what is wrong with it and the fix; empty: nothing."""
        if self.error:
            return f"stream {self.name}: {self.error}"
        if self.weak:
            spec = next(spec for spec in STREAMS if spec.name == self.name)
            return describe_unsafe(spec, self.weak)
        return ""


@dataclass(frozen=True)
class FleetProbe:
    """What the servers said: each server, and (from the first that signed the node in)
    the streams and the clock skew."""

    servers: list[ServerProbe]
    streams: list[StreamProbe] = field(default_factory=list)
    """Empty: no server signed the node in."""
    asked: str = ""
    """The URL the streams and the clock were read from."""
    skew: Skew | None = None
    """None: no answer carried the server's time (no stream made yet)."""


async def probe_fleet(
    config: FleetConfig, path_of: Callable[[str], Path], *, wait: float = SERVER_TIMEOUT
) -> FleetProbe:
    """Ask every server of ``config`` alone.  The credentials' files must be usable
    (:func:`sign_in_options` raises its FleetError otherwise)."""
    sign_in = sign_in_options(config, path_of)
    servers: list[ServerProbe] = []
    found = FleetProbe(servers=servers)
    for url in config.urls:
        nc, server = await _sign_in(config, sign_in, url, wait)
        servers.append(server)
        if nc is None:
            continue
        try:
            if not found.streams:
                streams, skew = await _streams(nc, config, wait)
                found = FleetProbe(servers=servers, streams=streams, asked=url, skew=skew)
        finally:
            with anyio.move_on_after(1.0, shield=True):
                await nc.close()
    return found


async def _sign_in(
    config: FleetConfig, sign_in: dict[str, Any], url: str, wait: float
) -> tuple[Nats | None, ServerProbe]:
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = new_client(config)
    failure: FleetError | None = None
    try:
        with nats_errors(f"a sign-in at {url}"), anyio.fail_after(wait + 1.0):
            await nc.connect(
                **sign_in,
                servers=[url],
                error_cb=on_error,
                allow_reconnect=False,
                max_reconnect_attempts=1,  # 0 would be: for ever (the check is `> 0`)
                reconnect_time_wait=RETRY_WAIT,
                connect_timeout=max(1, round(wait)),
            )
    except FleetError as exc:  # nats-py's own, the socket's and ssl's, a deadline: mapped
        failure = exc
    if failure is None and nc.is_connected:
        version = nc.connected_server_version
        said = f"{version.major}.{version.minor}.{version.patch}"
        if (version.major, version.minor) < MIN_SERVER:
            await nc.close()
            return None, ServerProbe(
                url=url,
                version=said,
                error=f"version {said}: the fleet needs {MIN_SERVER[0]}.{MIN_SERVER[1]}"
                " or newer on every server",
            )
        return nc, ServerProbe(url=url, version=said)
    with anyio.move_on_after(1.0, shield=True):
        await nc.close()
    causes = [*errors, *([failure.__cause__ or failure] if failure is not None else [])]
    timed_out = isinstance(failure, FleetUnavailable) and failure.timed_out
    refusal = next((exc for exc in causes if is_auth_refusal(exc)), None)
    if refusal is not None:
        return None, ServerProbe(
            url=url, refused=True, error=f"refused {refused_who(config)} ({describe(refusal)})"
        )
    tls = next((exc for exc in causes if isinstance(exc, ssl.SSLError)), None)
    if tls is not None:
        return None, ServerProbe(url=url, tls_failed=True, error=f"TLS failed: {describe(tls)}")
    if timed_out or not causes:
        return None, ServerProbe(url=url, error=f"no answer within {wait:g} s")
    return None, ServerProbe(url=url, error=f"unreachable: {describe(causes[0])}")


async def _streams(
    nc: Nats, config: FleetConfig, wait: float
) -> tuple[list[StreamProbe], Skew | None]:
    """Every stream's info (asked raw, for the server's ``ts`` in the answer), checked."""
    from nats.js.api import StreamInfo

    out: list[StreamProbe] = []
    skew: Skew | None = None
    for spec in STREAMS:
        sent = time.time()
        try:
            with nats_errors(f"the {spec.name} stream's info"):
                answer = await nc.request(f"$JS.API.STREAM.INFO.{spec.name}", b"", timeout=wait)
            received = time.time()
            data = json.loads(answer.data)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except (FleetError, ValueError) as exc:  # no answer, no responders, bad JSON
            why = describe(exc)
            out.append(StreamProbe(spec.name, found=False, error=f"no info: {why}"))
            continue
        if skew is None and isinstance(data.get("ts"), str):
            with contextlib.suppress(ValueError):
                skew = measure(sent, received, parse_server_time(data["ts"]))
        error = data.get("error")
        if isinstance(error, dict):
            if error.get("code") == 404:
                out.append(StreamProbe(spec.name, found=False))
            else:
                why = str(error.get("description") or error)
                out.append(StreamProbe(spec.name, found=False, error=f"refused: {why}"))
            continue
        try:
            info = StreamInfo.from_response(data)
        except (KeyError, TypeError, ValueError) as exc:
            out.append(StreamProbe(spec.name, found=True, error=f"odd info: {exc!r}"))
            continue
        out.append(
            StreamProbe(spec.name, found=True, weak=unsafe(spec, info.config, config.replicas))
        )
    return out, skew


def sign_in_problem(config: FleetConfig, path_of: Callable[[str], Path]) -> str:
    """Why the node's credentials cannot be used as its files stand (empty: they can)."""
    try:
        sign_in_options(config, path_of)
    except FleetError as exc:
        return str(exc)
    return ""
