"""``astrid doctor``'s rows for a ``[fleet]``: credentials, TLS, servers, streams, clock.

Run only when the config has a ``[fleet]`` table (nats-py is imported only then).  Each
row is a :class:`~sage.cli.doctor.Check`, ok, warn or fail with the fix in its detail:

- ``fleet-auth``: the node names credentials, their files are there, its own and
  0600, and hold what they must (the supervisor's own reading of them,
  sage/fleet/member.py); ``insecure_no_auth = true`` fails (any client of the servers
  may act as any node), and so does a ``[fleet]`` with neither;
- ``fleet-tls``: every server off loopback is reached with TLS; a password or a JWT
  would cross the network in clear otherwise;
- ``fleet-server``, one row per URL: the server answers alone within 2 s and signs the
  node in with its credentials (a refusal says which), at a supported version;
- ``fleet-streams``: every stream of the fleet there is as safe as the supervisor's
  start-up check wants (``fleet_stream_unsafe``); one not made yet is fine;
- ``fleet-clock``: this host's clock against the server's (the ``ts`` of a JetStream
  stream info answer, against the local time around the request) within half of
  ``[fleet] max_clock_skew`` (sage/fleet/clock.py).

Nothing is created or written, on disk or on the servers.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from sage.cli.doctor_checks import Check, owner_and_mode
from sage.config import Config, FleetConfig
from sage.errors import FleetError, FleetNoAuth
from sage.fleet.auth import AuthMethod, auth_method, plaintext_urls, tls_on
from sage.fleet.clock import skew_budget
from sage.fleet.probe import FleetProbe, probe_fleet, sign_in_problem

__all__ = ("fleet_checks",)

_DOCS = "docs/fleet.md#authentication-is-required"


async def fleet_checks(config: Config) -> list[Check]:
    """The fleet's rows, in report order (none without ``[fleet]``)."""
    fleet = config.fleet
    if fleet is None:
        return []
    auth, usable = _check_auth(config, fleet)
    checks = [auth, _check_tls(fleet)]
    if not usable:
        checks.append(
            Check(
                name="fleet-server",
                status="warn",
                detail="not asked: the node's credentials cannot be used (see fleet-auth)",
            )
        )
        return checks
    try:
        found = await probe_fleet(fleet, config.path_of)
    except FleetError as exc:  # the files changed since they were read: said, not raised
        return [*checks, Check(name="fleet-server", status="fail", detail=str(exc))]
    checks += _server_rows(found)
    checks.append(_streams_row(found))
    checks.append(_clock_row(fleet, found))
    return checks


def _check_auth(config: Config, fleet: FleetConfig) -> tuple[Check, bool]:
    """The credentials row, and whether a sign-in may be tried with them."""
    try:
        method = auth_method(fleet)
    except FleetNoAuth as exc:
        return Check(name="fleet-auth", status="fail", detail=str(exc)), False
    facts: dict[str, Any] = {"method": method.value}
    if method is AuthMethod.NONE:
        return (
            Check(
                name="fleet-auth",
                status="fail",
                detail=f"insecure_no_auth = true: node {fleet.node!r} signs in to NATS with"
                " no credentials, so any client of the servers may act as any node; give"
                " it its own NATS user (password_file, nkey_seed or creds; `astrid fleet"
                f" permissions --node {fleet.node}`) and remove insecure_no_auth ({_DOCS})",
                facts=facts,
            ),
            True,
        )
    path = config.path_of(getattr(fleet, method.value))
    facts["path"] = str(path)
    problems = _file_problems(path)
    if not problems:
        problem = sign_in_problem(fleet, config.path_of)
        if problem:
            problems.append(problem)
    if problems:
        detail = "; ".join(problems)
        return Check(name="fleet-auth", status="fail", detail=detail, facts=facts), False
    mode = stat.S_IMODE(path.stat().st_mode)
    return (
        Check(
            name="fleet-auth",
            status="ok",
            detail=f"{method.value} {path} {mode:04o}, yours, readable as the node's"
            f" {_WHAT[method]}",
            facts=facts,
        ),
        True,
    )


_WHAT = {
    AuthMethod.PASSWORD: "password",
    AuthMethod.NKEY: "NKey seed",
    AuthMethod.CREDS: "user JWT and seed",
    AuthMethod.NONE: "nothing",
}


def _file_problems(path: Path) -> list[str]:
    try:
        info = path.lstat()
    except FileNotFoundError:
        return [f"{path} does not exist; create it (0600, the supervisor's user's)"]
    except OSError as exc:
        return [f"cannot look at {path}: {exc.strerror}"]
    if not stat.S_ISREG(info.st_mode):
        return [f"{path} is not a regular file"]
    return owner_and_mode(path, info, 0o600, need=0o400)


def _check_tls(fleet: FleetConfig) -> Check:
    plain = plaintext_urls(fleet)
    facts: dict[str, Any] = {"tls": tls_on(fleet), "plaintext": plain}
    if plain:
        return Check(
            name="fleet-tls",
            status="fail",
            detail=f"{', '.join(plain)} not on loopback and TLS is off: the node's"
            " credentials and every message cross the network in clear; set [fleet] ca"
            " (and cert and key if the servers verify clients), or use tls:// URLs",
            facts=facts,
        )
    detail = "TLS on" if tls_on(fleet) else "TLS off, every server on loopback"
    return Check(name="fleet-tls", status="ok", detail=detail, facts=facts)


def _server_rows(found: FleetProbe) -> list[Check]:
    rows = []
    for server in found.servers:
        facts: dict[str, Any] = {"url": server.url, "version": server.version}
        if server.error:
            if server.refused:
                hint = "fix the credentials or the server's user entry"
            elif server.tls_failed:
                hint = "check [fleet] ca, cert and key against the server's tls block"
            else:
                hint = "is it running, and reachable from here?"
            rows.append(
                Check(
                    name="fleet-server",
                    status="fail",
                    detail=f"{server.url}: {server.error}; {hint}",
                    facts={**facts, "refused": server.refused, "tls_failed": server.tls_failed},
                )
            )
        else:
            rows.append(
                Check(
                    name="fleet-server",
                    status="ok",
                    detail=f"{server.url}: answers, signs the node in (nats-server"
                    f" {server.version})",
                    facts=facts,
                )
            )
    return rows


def _streams_row(found: FleetProbe) -> Check:
    if not found.asked:
        return Check(
            name="fleet-streams",
            status="warn",
            detail="not checked: no server signed the node in",
        )
    problems = [stream.problem for stream in found.streams if stream.problem]
    there = [stream.name for stream in found.streams if stream.found]
    facts: dict[str, Any] = {"server": found.asked, "found": there}
    if problems:
        return Check(name="fleet-streams", status="fail", detail="; ".join(problems), facts=facts)
    if not there:
        detail = "none made yet (the first node that starts makes them, safe)"
    else:
        missing = len(found.streams) - len(there)
        detail = f"{len(there)} safe" + (f", {missing} not made yet" if missing else "")
    return Check(name="fleet-streams", status="ok", detail=detail, facts=facts)


def _clock_row(fleet: FleetConfig, found: FleetProbe) -> Check:
    budget = skew_budget(fleet.max_clock_skew)
    skew = found.skew
    if skew is None:
        why = (
            "no server signed the node in"
            if not found.asked
            else "no answer carried the server's time (no stream made yet: start a node)"
        )
        return Check(name="fleet-clock", status="warn", detail=f"not measured: {why}")
    facts: dict[str, Any] = {
        "server": found.asked,
        "offset_s": round(skew.offset, 6),
        "uncertainty_s": round(skew.uncertainty, 6),
        "budget_s": budget,
    }
    how = (
        f"the server's time in a JetStream stream info answer from {found.asked},"
        f" ±{skew.uncertainty:.3f} s"
    )
    way = "behind" if skew.offset > 0 else "ahead of"
    if abs(skew.offset) > budget:
        return Check(
            name="fleet-clock",
            status="fail",
            detail=f"this host's clock is {abs(skew.offset):.3f} s {way} NATS ({how}); more"
            f" than {budget:g} s (half of [fleet] max_clock_skew) lets nodes judge a live"
            " node lost or a dead one live, and two run one conversation - sync the clock"
            " (chrony, systemd-timesyncd)",
            facts=facts,
        )
    return Check(
        name="fleet-clock",
        status="ok",
        detail=f"{abs(skew.offset):.3f} s {way} NATS ({how}); allowed {budget:g} s",
        facts=facts,
    )
