"""``astrid doctor``: is this host ready to run the supervisor, and is it running?

Each check is one :class:`Check` row, ``ok``, ``warn`` or ``fail`` with a
one-line detail: the config's source, the ``claude`` binary and its version,
a real bubblewrap sandbox, the permissions of the state folder, its keys and
the control socket, and, when the socket exists, whether the supervisor
answers a status request; with a ``[fleet]``, its credentials, TLS, each NATS
server, the fleet's streams and the clock (sage/cli/doctor_fleet.py).  The file checks only look (``lstat``), they never
create or chmod anything.  Nothing from ``[claude] env`` is printed: its
values may be credentials.  The exit status is 1 when any check fails.
"""

from __future__ import annotations

import argparse
import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import anyio
import msgspec

from bus import BusClient, BusError
from bus.wire import frame_limit
from sage.audit.keys import KEY_FILENAME, PUBLIC_KEY_FILENAME
from sage.claude.binary import (
    Support,
    read_claude_version,
    resolve_claude_binary,
    support,
)
from sage.claude.hooks import hooks_known_by
from sage.cli._commands import summary
from sage.cli._common import add_common
from sage.cli._connect import print_json
from sage.cli.doctor_checks import Check, Status, owner_and_mode
from sage.config import Config, load_config
from sage.errors import ConfigError, ProcessError
from sage.security.bwrap import probe_bwrap
from sage.security.runas import access_group

_STATUS_TOPIC = "sage.v1.request.status"
_ASK_TIMEOUT = 3.0

_EPILOG = """\
checks:
  config      where the config came from (--config FILE, $ASTRID_CONFIG or the
              embedded defaults) and how many principals it declares; fail: it
              does not load (fix what the line names)
  claude      the claude binary sessions will run (claude.binary, else the one
              `make setup` installs in .tools/, else PATH) and its version against
              the supported range built into sage; warn: newer than any tested
              release; fail: none found, it does not run, older than the floor or
              a known-bad release (the runner refuses to spawn on it)
  api         the Messages API sessions use (ANTHROPIC_BASE_URL in [claude] env,
              else api.anthropic.com) answers HTTP within 3 s; warn: it does not
              (sessions would retry for minutes)
  bwrap       bubblewrap really runs a minimal sandbox (as forge.sandbox_uid_base
              when run as root); fail: forge refuses to run any forged tool (fail
              closed) - install bubblewrap, allow unprivileged user namespaces
  state       state_dir is yours, mode 0700 (0750 with socket.group, or as root
              with the claude children's access group [sessions] uid_base); warn: not
              created yet (the supervisor does on first start); fail: owned by
              another uid or open to others (chmod/chown it)
  homes       installed principals' .claude/settings.local.json name only hook
              events this claude knows; fail: reinstall (`astrid sage install
              NAME --force`)
  keys        state_dir/keys is 0700, the audit key 0600 (its .pub 0644 at most)
  socket      the control socket is 0600 (0660 with socket.group or the access
              group) in a 0700 (0750) folder; warn: absent, the supervisor is not running
  supervisor  (when the socket exists) the supervisor answers a status request;
              warn: it does not (a stale socket left by a killed supervisor?)

with a [fleet] table (docs/fleet.md):
  fleet-auth  the node's password_file, nkey_seed or creds exists, is yours, 0600,
              and holds what it must; fail: none named, or insecure_no_auth = true
              (any client of the servers may act as any node)
  fleet-tls   fail: a server URL off loopback without TLS (set ca, or tls:// URLs)
  fleet-server  one row per URL: that server alone answers within 2 s and signs the
              node in (fail: unreachable, or it refused the credentials)
  fleet-streams  every stream of the fleet there is as safe as the supervisor's
              start-up check wants (fail: fleet_stream_unsafe's settings and fix)
  fleet-clock the server's time (a JetStream answer's) against this host's clock,
              within half of [fleet] max_clock_skew; warn: no stream yet to ask

exit status: 0 when no check fails (warnings allowed), 1 otherwise.
"""


def register(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor",
        help=summary("doctor"),
        description="Check the config, the claude binary, bubblewrap, the state folder,\n"
        "its keys and the control socket; print one row per check: ok, warn or fail.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(doctor)
    doctor.set_defaults(handler=_doctor)


async def _doctor(args: argparse.Namespace) -> int:
    checks = await run_checks(args.config)
    ok = all(check.status != "fail" for check in checks)
    if args.json:
        rows = [{"name": c.name, "status": c.status, "detail": c.detail, **c.facts} for c in checks]
        print_json({"checks": rows, "ok": ok})
    else:
        width = max(9, *(len(check.name) + 1 for check in checks))
        for check in checks:
            print(f"{check.status:<6}{check.name:<{width}}{check.detail}")
    return 0 if ok else 1


async def run_checks(config_file: str | None) -> list[Check]:
    """Every check, in report order; a config that does not load skips those that need it."""
    config_check, config = _check_config(config_file)
    checks = [config_check]
    version = None
    if config is not None:
        claude_check, version = await _check_claude(config)
        checks.append(claude_check)
        checks.append(await _check_api(config))
    checks.append(await _check_bwrap(config))
    if config is None:
        return checks
    checks.append(_check_state(config))
    if version is not None:
        checks.append(_check_homes(config, version))
    checks.append(_check_keys(config))
    socket_check, listening = _check_socket(config)
    checks.append(socket_check)
    if listening:
        checks.append(await _check_supervisor(config))
    if config.fleet is not None:
        from sage.cli.doctor_fleet import fleet_checks  # nats-py: only with a [fleet]

        checks += await fleet_checks(config)
    return checks


# -- the checks -------------------------------------------------------------


def _check_config(config_file: str | None) -> tuple[Check, Config | None]:
    if config_file:
        source = config_file
    elif os.environ.get("ASTRID_CONFIG"):
        source = f"{os.environ['ASTRID_CONFIG']} (from $ASTRID_CONFIG)"
    else:
        source = "embedded defaults"
    try:
        config = load_config(config_file)
    except ConfigError as exc:
        return Check(name="config", status="fail", detail=str(exc), facts={"source": source}), None
    count = len(config.principals)
    return (
        Check(
            name="config",
            status="ok",
            detail=f"{source}, {count} principal{'' if count == 1 else 's'}",
            facts={"source": source, "principals": count},
        ),
        config,
    )


_SUPPORT_STATUS: dict[Support, Status] = {
    Support.SUPPORTED: "ok",
    Support.UNTESTED: "warn",
    Support.TOO_OLD: "fail",
    Support.KNOWN_BAD: "fail",
}


async def _check_claude(config: Config) -> tuple[Check, str | None]:
    """The binary and where its version stands in the supported range; its version."""
    try:
        path = resolve_claude_binary(config)
    except ConfigError as exc:
        return Check(name="claude", status="fail", detail=str(exc)), None
    try:
        version = await read_claude_version(path)
        verdict = support(version)
    except (ProcessError, ValueError) as exc:
        return Check(name="claude", status="fail", detail=str(exc), facts={"path": str(path)}), None
    facts: dict[str, Any] = {
        "path": str(path),
        "version": version,
        "support": verdict.support.value,
    }
    detail = f"{path} {verdict.message}"
    status = _SUPPORT_STATUS[verdict.support]
    if status == "fail":
        detail += "; sessions will not start (install a supported release: `make setup`)"
    if config.claude.version:
        facts["ignored_config_version"] = config.claude.version
        detail += "; claude.version in the config is ignored (the range is built in)"
        if status == "ok":
            status = "warn"
    return Check(name="claude", status=status, detail=detail, facts=facts), version


DEFAULT_API = "https://api.anthropic.com"
_API_TIMEOUT = 3.0


async def _check_api(config: Config) -> Check:
    """The Messages API sessions will use (``ANTHROPIC_BASE_URL`` of ``[claude] env``)
    answers HTTP at all: any status will do; no answer means minutes of retries."""
    base = (config.claude.env.get("ANTHROPIC_BASE_URL") or DEFAULT_API).rstrip("/")
    url = f"{base}/v1/models"
    facts: dict[str, Any] = {"url": base}

    def probe() -> int:
        request = urllib.request.Request(url, method="GET", headers={"user-agent": "astrid"})
        try:
            with urllib.request.urlopen(request, timeout=_API_TIMEOUT) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:  # an answer: 401 without a key is fine
            return int(exc.code)

    if not base.startswith(("http://", "https://")):
        return Check(
            name="api",
            status="fail",
            detail=f"ANTHROPIC_BASE_URL {base!r} is not an http(s) URL ([claude] env)",
            facts=facts,
        )
    try:
        status = await anyio.to_thread.run_sync(probe, abandon_on_cancel=True)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        return Check(
            name="api",
            status="warn",
            detail=f"{base} does not answer ({reason}); sessions would retry for minutes"
            " - set ANTHROPIC_BASE_URL in [claude] env, or check the network",
            facts=facts,
        )
    facts["http_status"] = status
    llm = (config.messages_api or DEFAULT_API).rstrip("/")
    facts["llm_url"] = llm
    if llm != base:  # astrid llm generate would go elsewhere than the sessions
        return Check(
            name="api",
            status="warn",
            detail=f"{base} answers (HTTP {status}), but [llm] base_url sends astrid llm"
            f" generate to {llm}; leave [llm] base_url empty to use the sessions' gateway",
            facts=facts,
        )
    return Check(
        name="api",
        status="ok",
        detail=f"{base} answers (HTTP {status}); sessions and astrid llm generate use it",
        facts=facts,
    )


def _check_homes(config: Config, version: str) -> Check:
    """Installed principals' settings name only hook events this claude knows."""
    known = hooks_known_by(version)
    problems: list[str] = []
    checked = 0
    for principal in config.principals:
        settings = config.home_of(principal) / ".claude" / "settings.local.json"
        try:
            data = msgspec.json.decode(settings.read_bytes())
        except FileNotFoundError:
            continue  # not installed
        except (OSError, msgspec.DecodeError) as exc:
            problems.append(f"{principal.name}: {settings} unreadable ({exc})")
            continue
        checked += 1
        hooks = data.get("hooks") if isinstance(data, dict) else None
        unknown = sorted(set(hooks or {}) - known)
        if unknown:
            problems.append(
                f"{principal.name}: hook events claude {version} does not know:"
                f" {', '.join(unknown)} (it may drop the whole file, deny rules included)"
                f" - run `astrid sage install {principal.name} --force`"
            )
    facts: dict[str, Any] = {"checked": checked, "problems": problems}
    if problems:
        return Check(name="homes", status="fail", detail="; ".join(problems), facts=facts)
    return Check(
        name="homes",
        status="ok",
        detail=f"{checked} installed home{'' if checked == 1 else 's'} match claude {version}",
        facts=facts,
    )


async def _check_bwrap(config: Config | None) -> Check:
    # as root, forge runs bwrap as the sandbox uid (unprivileged user namespaces): probe that
    # (the first of the range: every one of its uids is as unprivileged as the others)
    uid = config.forge.sandbox_uid_base if config is not None and os.geteuid() == 0 else None
    probe = await probe_bwrap(uid=uid)
    facts: dict[str, Any] = {"path": probe.path, "version": probe.version}
    as_uid = f" as uid {uid}" if uid is not None else ""
    if uid is not None:
        facts["uid"] = uid
    if probe.ok:
        return Check(
            name="bwrap",
            status="ok",
            detail=f"{probe.path} {probe.version}, sandbox runs{as_uid}",
            facts=facts,
        )
    return Check(
        name="bwrap",
        status="fail",
        detail=f"{probe.reason}{as_uid}; forged tools cannot run: forge refuses to run"
        " any tool until a sandbox works (fail closed)",
        facts=facts,
    )


def _grouped(config: Config, info: os.stat_result) -> bool:
    """May this folder or socket be the group's: ``socket.group``, or (root) the access
    group of the claude children (sage/security/runas.py) when it has that group."""
    if config.socket.group:
        return True
    try:
        gid = access_group(config)
    except ConfigError:
        return False
    return gid is not None and info.st_gid == gid


def _check_state(config: Config) -> Check:
    path = config.state_dir
    info, problem = _lstat(path)
    if info is None:
        if problem:
            return Check(name="state", status="fail", detail=problem)
        return Check(
            name="state",
            status="warn",
            detail=f"{path} does not exist yet (the supervisor creates it 0700 on first start)",
            facts={"path": str(path)},
        )
    problems = _dir_problems(path, info, 0o750 if _grouped(config, info) else 0o700)
    return _verdict("state", path, info, problems)


def _check_keys(config: Config) -> Check:
    path = config.keys_dir
    info, problem = _lstat(path)
    if info is None:
        if problem:
            return Check(name="keys", status="fail", detail=problem)
        return Check(
            name="keys",
            status="warn",
            detail=f"{path} does not exist yet (the supervisor creates it and the audit key"
            " on first start)",
            facts={"path": str(path)},
        )
    problems = _dir_problems(path, info, 0o700)
    files: list[str] = []
    if not problems:
        try:
            names = sorted(os.listdir(path))
        except OSError as exc:
            names = []
            problems.append(f"cannot list {path}: {exc.strerror}")
        for name in names:
            file = path / name
            file_info, file_problem = _lstat(file)
            if file_info is None:
                continue  # gone since the listing (a key being written)
            if file_problem:
                problems.append(file_problem)
            elif not stat.S_ISREG(file_info.st_mode):
                problems.append(f"{file} is not a regular file")
            else:
                allowed = 0o644 if name == PUBLIC_KEY_FILENAME else 0o600
                problems += owner_and_mode(file, file_info, allowed, need=0o400)
                files.append(f"{name} {stat.S_IMODE(file_info.st_mode):04o}")
    check = _verdict("keys", path, info, problems, extra=", ".join(files))
    if check.status == "ok" and not (path / KEY_FILENAME).exists():
        return msgspec.structs.replace(
            check,
            status="warn",
            detail=f"{check.detail}; no {KEY_FILENAME} yet (created on first start)",
        )
    return check


def _check_socket(config: Config) -> tuple[Check, bool]:
    """The socket row, and whether a socket file is there to talk to."""
    path = config.socket_path
    problems: list[str] = []
    folder_info, problem = _lstat(path.parent)
    if problem:
        problems.append(problem)
    elif folder_info is not None:
        grouped = _grouped(config, folder_info)
        problems += _dir_problems(path.parent, folder_info, 0o750 if grouped else 0o700)
    info, problem = _lstat(path)
    facts: dict[str, Any] = {"path": str(path)}
    if problem:
        problems.append(problem)
    if info is None:
        if problems:
            return Check(
                name="socket", status="fail", detail="; ".join(problems), facts=facts
            ), False
        return (
            Check(
                name="socket",
                status="warn",
                detail=f"{path} absent (the supervisor is not running)",
                facts=facts,
            ),
            False,
        )
    if not stat.S_ISSOCK(info.st_mode):
        problems.append(f"{path} is not a socket (the supervisor refuses to replace it)")
        return Check(name="socket", status="fail", detail="; ".join(problems), facts=facts), False
    grouped = _grouped(config, info)
    problems += owner_and_mode(path, info, 0o660 if grouped else 0o600, need=0o600)
    return _verdict("socket", path, info, problems), True


async def _check_supervisor(config: Config) -> Check:
    try:
        with anyio.fail_after(_ASK_TIMEOUT):
            async with BusClient.connect(
                config.socket_path,
                role="cli",
                name="astrid-doctor",
                max_frame=frame_limit(config.bus.max_payload),
                hello_deadline=_ASK_TIMEOUT,
            ) as client:
                reply = await client.request(_STATUS_TOPIC, {}, deadline=_ASK_TIMEOUT)
        data = reply.data()
        pid, version = int(data["pid"]), str(data["version"])
        uptime = float(data.get("uptime_s", 0.0))
    except TimeoutError:
        reason = f"no status answer within {_ASK_TIMEOUT:g} s"
    except (BusError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
    except (KeyError, TypeError, ValueError, msgspec.DecodeError) as exc:
        reason = f"odd status answer: {exc!r}"
    else:
        return Check(
            name="supervisor",
            status="ok",
            detail=f"pid {pid}, sage {version}, up {round(uptime)} s",
            facts={"pid": pid, "version": version, "uptime_s": uptime},
        )
    return Check(
        name="supervisor",
        status="warn",
        detail=f"{reason} (a stale socket left by a killed supervisor?)",
    )


# -- file permissions -------------------------------------------------------


def _lstat(path: Path) -> tuple[os.stat_result | None, str]:
    """``(info, "")``, ``(None, "")`` when absent, or ``(None, problem)``."""
    try:
        return path.lstat(), ""
    except FileNotFoundError:
        return None, ""
    except OSError as exc:
        return None, f"cannot look at {path}: {exc.strerror}"


def _dir_problems(path: Path, info: os.stat_result, allowed: int) -> list[str]:
    if stat.S_ISLNK(info.st_mode):
        return [f"{path} is a symlink; the supervisor wants a real directory"]
    if not stat.S_ISDIR(info.st_mode):
        return [f"{path} is not a directory"]
    return owner_and_mode(path, info, allowed, need=0o700)


def _verdict(
    name: str, path: Path, info: os.stat_result, problems: list[str], *, extra: str = ""
) -> Check:
    mode = stat.S_IMODE(info.st_mode)
    facts = {"path": str(path), "mode": f"{mode:04o}", "uid": info.st_uid}
    if problems:
        return Check(name=name, status="fail", detail="; ".join(problems), facts=facts)
    detail = f"{path} {mode:04o}" + (f", {extra}" if extra else "")
    return Check(name=name, status="ok", detail=detail, facts=facts)
