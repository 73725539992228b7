"""``astrid sage spawn|send|sessions|watch|interrupt|stop``: Claude sessions from a terminal.

Each command is a request to the session runner over the supervisor's
socket.  ``send`` subscribes to the session's events before it sends, so
no text is missed, prints the reply as it streams and exits when the turn
ends: 0 for a good turn, 1 for an error or a session that ended.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from typing import Any

import msgspec

from bus import BusError, NoResponders
from sage import replies
from sage.cli._commands import summary
from sage.cli._common import add_common, call_runner, printable
from sage.cli._connect import connect, print_json
from sage.cli.turn import (
    ARGS_SHOWN,
    EXIT_SESSION_ENDED,
    EXIT_TURN_FAILED,
    WAKE_TIMEOUT,
    age,
    ask,
    event_line,
)
from sage.cli.turn import send as _send
from sage.contract.usage import BUDGET_TOPIC, REPORT_TOPIC
from sage.errors import SageError
from sage.routing import NoFleet as _NoFleet
from sage.routing import call_session
from sage.routing import in_fleet as _in_fleet

__all__ = ("call_session", "register")

SPAWN_TIMEOUT = 30.0
PLACE_TIMEOUT = 120.0  # a placed spawn may ask several nodes in turn


def register(sub: Any) -> None:
    group = sub.add_parser(
        "sage",
        help=summary("sage"),
        description="Drive Claude Code sessions run by the supervisor's session runner.",
    )
    commands = group.add_subparsers(dest="action", metavar="ACTION", required=True)

    spawn = commands.add_parser(
        "spawn",
        help="start a session for a principal and print its id",
        description="Start a headless Claude session for PRINCIPAL; print the session id.",
    )
    spawn.add_argument("principal_id", metavar="PRINCIPAL", help="a principal from the config")
    spawn.add_argument("--session", metavar="ID", help="choose the id ([A-Za-z0-9_-]{1,64})")
    spawn.add_argument("--message", metavar="TEXT", help="a first user turn, sent once ready")
    spawn.add_argument(
        "--cwd",
        metavar="DIR",
        help="the session's working folder: inside the principal's home or one of its"
        " [[principals]] work_roots (default: the home)",
    )
    spawn.add_argument(
        "--node",
        metavar="NAME",
        help="start it on this node of the fleet; 'any': on the least loaded live node that"
        " serves PRINCIPAL and has room (the next one if it refuses; --json names the node)."
        " Default: as [fleet] placement says, the node asked unless it is 'least_loaded'",
    )
    spawn.add_argument(
        "--model",
        metavar="NAME",
        help="the model: the principal's model or one of its [[principals]] models"
        " (default: its model)",
    )
    _common(spawn, add_common)
    spawn.set_defaults(handler=_spawn)

    send = commands.add_parser(
        "send",
        help="send a user turn and print the reply as it streams",
        description=(
            "Send TEXT ('-' reads it from stdin) to session SID, print Claude's reply as it"
            " streams, exit when the turn ends. A failed turn says why on stderr"
            " (auth_failed, overloaded, rate_limited, api_error, max_turns, ...)."
        ),
        epilog=(
            "exit codes: 0 the turn completed; 1 refused before the turn ran (the message"
            " names the code: unknown_session, payload_too_large, host_full, ...);"
            f" {EXIT_TURN_FAILED} the turn ran and failed; {EXIT_SESSION_ENDED} the session"
            " ended during the turn; 124 --timeout passed; 130 interrupted (Ctrl-C) or"
            " detached"
        ),
    )
    send.add_argument("session", metavar="SID")
    send.add_argument("text", metavar="TEXT")
    send.add_argument(
        "--approve",
        choices=("prompt", "deny", "ask"),
        default=None,
        help="a tool call that needs approval: prompt (the default on a terminal: yes,"
        " always, no), deny (the default otherwise, said on stderr) or ask (leave it to"
        " `astrid sage approvals`, until it times out)",
    )
    send.add_argument(
        "--timeout", type=float, default=0.0, help="give up after this many seconds (0: never)"
    )
    _common(send, add_common)
    send.set_defaults(handler=_send)

    sessions = commands.add_parser(
        "sessions",
        help="list sessions",
        description="List sessions: principal, pid, state, age, turns, cost. --all adds the"
        " ended ones the supervisor keeps ([sessions] history per principal): how they"
        " ended (reason, exit code or signal), start and end.",
    )
    sessions.add_argument("--all", action="store_true", help="ended sessions too")
    _common(sessions, add_common)
    sessions.set_defaults(handler=_sessions)

    watch = commands.add_parser(
        "watch",
        help="print a session's events as JSON lines",
        description="Print every event of session SID as one JSON line until it exits. An"
        " id that never existed is an error at once; an ended session prints its end. A"
        " hibernated session stays asleep (its next send wakes it) unless --wake.",
    )
    watch.add_argument("session", metavar="SID")
    watch.add_argument("-n", "--count", type=int, default=0, help="exit after N events")
    watch.add_argument(
        "--replay",
        type=int,
        default=0,
        metavar="N",
        help="print the session's last N events (at most 256) first",
    )
    watch.add_argument(
        "--wake",
        action="store_true",
        help="wake the session if it is hibernated (resume its conversation now)",
    )
    _common(watch, add_common, json_output=False)
    watch.set_defaults(handler=_watch)

    settings = commands.add_parser(
        "settings",
        help="change a principal's session settings (applies to new sessions)",
        description=(
            "Patch PRINCIPAL's settings (absent fields are kept). The installer rewrites the"
            " principal's files for the new modes, the supervisor keeps the settings across"
            " restarts, and sessions started afterwards use them. Prints the settings now in"
            " force."
        ),
    )
    settings.add_argument("principal_id", metavar="PRINCIPAL")
    settings.add_argument("--model", help="--model for new sessions ('' for the CLI's default)")
    settings.add_argument("--max-turns", type=int, help="--max-turns (0: none)")
    settings.add_argument("--auth-mode", choices=("api_key", "subscription"))
    settings.add_argument("--interaction-mode", choices=("headless", "repl"))
    settings.add_argument(
        "--allow",
        action="append",
        metavar="PATTERN",
        help="allow tool calls matching PATTERN (mcp__sage__*) without asking; repeatable",
    )
    settings.add_argument(
        "--disallow", action="append", metavar="PATTERN", help="drop an allow rule; repeatable"
    )
    settings.add_argument(
        "--identity",
        metavar="FILE",
        help="the principal's identity (appended to the system prompt) from FILE ('-': stdin;"
        " an empty file: the config's again); its live sessions respawn to take it up",
    )
    for kind, unit in (
        ("tokens-per-day", "tokens a UTC day"),
        ("usd-per-day", "US dollars a UTC day"),
        ("usd-per-month", "US dollars a UTC month"),
    ):
        settings.add_argument(
            f"--budget-{kind}",
            metavar="N",
            help=f"admins: the budget of {unit} (every node together); 'none': no such budget",
        )
    settings.add_argument(
        "--budget-reset", action="store_true", help="admins: the config's budgets again"
    )
    _common(settings, add_common)
    settings.set_defaults(handler=_settings)

    usage = commands.add_parser(
        "usage",
        help="tokens and US dollars spent, and the budgets in force",
        description=(
            "What the usage ledger recorded (every model call of a session and every llm"
            " generation): tokens and USD by day, session, model or principal, and each"
            " budget with its spend and reset time. A principal sees only its own."
        ),
    )
    usage.add_argument(
        "--since",
        metavar="DATE",
        help="from this UTC day on (YYYY-MM-DD; default: the first of the month)",
    )
    usage.add_argument("--by", choices=("day", "session", "model", "principal"), default="day")
    usage.add_argument(
        "--fleet",
        action="store_true",
        help="every live node's ledger: each node's rows, then their sums (a node that"
        " cannot or will not answer is named in a warning)",
    )
    _common(usage, add_common)
    usage.set_defaults(handler=_usage)

    approvals = commands.add_parser(
        "approvals",
        help="list the tool calls waiting for your approval",
        description="List pending approvals you may answer (your principal's; an admin: all),"
        " with their age and the time left. --watch asks about each as it comes.",
    )
    approvals.add_argument(
        "--watch", action="store_true", help="ask at the terminal about each new one"
    )
    _common(approvals, add_common)
    approvals.set_defaults(handler=_approvals)
    approve = commands.add_parser(
        "approve", help="allow a pending tool call", description="Allow pending approval ID."
    )
    approve.add_argument("approval_id", metavar="ID")
    approve.add_argument(
        "--always",
        action="store_true",
        help="and allow this tool from now on for the principal (an allow rule)",
    )
    approve.add_argument("--rule", metavar="PATTERN", help="with --always: this pattern instead")
    _common(approve, add_common)
    approve.set_defaults(handler=_decide, allowed=True)
    deny = commands.add_parser(
        "deny", help="deny a pending tool call", description="Deny pending approval ID."
    )
    deny.add_argument("approval_id", metavar="ID")
    deny.add_argument("--reason", help="what Claude is told")
    _common(deny, add_common)
    deny.set_defaults(handler=_decide, allowed=False)

    from sage.cli import principals_cmd

    principals_cmd.register(commands, lambda parser: _common(parser, add_common))

    for name, text in (
        ("interrupt", "interrupt the running turn of a session"),
        ("stop", "stop a session (interrupt, end input, then signals)"),
    ):
        cmd = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        cmd.add_argument("session", metavar="SID")
        _common(cmd, add_common)
        cmd.set_defaults(handler=_simple, verb=name)


def _common(parser: argparse.ArgumentParser, add_common: Any, *, json_output: bool = True) -> None:
    parser.add_argument("--principal", default=None, help="act for this principal")
    add_common(parser, json_output=json_output)


async def _spawn(args: argparse.Namespace) -> int:
    payload: dict[str, Any] = {"principal_id": args.principal_id}
    if args.session:
        payload["session_id"] = args.session
    if args.message:
        payload["initial_message"] = args.message
    if args.cwd is not None:
        payload["cwd"] = str(await _absolute(args.cwd))  # from where astrid runs
    if args.model is not None:
        payload["model"] = args.model
    async with connect(args) as client:
        if args.node == "any":  # the fleet places it: the least loaded node that takes it
            data = await _in_fleet(client, "spawn", {**payload, "node": "any"}, PLACE_TIMEOUT)
        elif args.node:  # the fleet's router forwards it to that node (sage/fleet/router.py)
            data = await _in_fleet(client, "spawn", {**payload, "node": args.node}, SPAWN_TIMEOUT)
        else:
            try:  # in a fleet, its router places it as [fleet] placement says
                data = await _in_fleet(client, "spawn", payload, PLACE_TIMEOUT)
            except _NoFleet:  # a single host
                data = await call_runner(client, "sage.v1.request.spawn", payload, SPAWN_TIMEOUT)
    if data.get("warning"):  # another node's words, maybe: never the terminal's orders
        print(f"astrid: {printable(data['warning'])}", file=sys.stderr)
    if args.json:
        print_json(data)
        return 0
    if data.get("placed"):  # stdout stays the id alone, for scripts
        print(f"astrid: placed on node {printable(str(data.get('node')))}", file=sys.stderr)
    print(data["session_id"])
    return 0


async def _ask_at_terminal(
    request: dict[str, Any], *, where: bool = False
) -> dict[str, Any] | None:
    """:func:`~sage.cli.turn.ask` in a daemon thread: a question left open when the
    watch ends must not keep astrid waiting for a line at exit."""
    import anyio

    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    box: list[dict[str, Any] | None] = []

    def run() -> None:
        try:
            box.append(ask(request, where=where))
        finally:
            with contextlib.suppress(Exception):  # the loop may be gone: nobody waits
                anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=run, name="astrid-approval", daemon=True).start()
    await done.wait()
    return box[0] if box else None


async def _sessions(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    async with connect(args) as client:
        try:  # in a fleet: every node's sessions (sage/fleet/router.py)
            data = await _in_fleet(client, "sessions", {"all": args.all}, 8.0)
            rows = data["sessions"]
        except _NoFleet:
            data = {}
            offset: int | None = 0
            while offset is not None:  # page by page: a host may hold thousands
                page = await call_runner(
                    client, "sage.v1.request.sessions", {"all": args.all, "offset": offset}, 10.0
                )
                rows += page["sessions"]
                offset = page.get("next_offset")
    if data.get("warning"):  # other nodes' words: never the terminal's orders
        print(f"astrid: {printable(data['warning'])}", file=sys.stderr)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no sessions")
        return 0
    fleet = any("node" in row for row in rows)
    print(
        (f"{'NODE':<10} " if fleet else "")
        + f"{'SESSION':<20} {'PRINCIPAL':<12} {'PID':>8} {'STATE':<11} {'AGE':>8} {'TURNS':>5} COST"
    )
    for row in rows:
        print(  # rows of other nodes too: their text is shown, never obeyed
            (f"{printable(row.get('node', '')):<10} " if fleet else "")
            + f"{printable(row['session_id']):<20} {printable(row.get('principal_id', '')):<12} "
            f"{printable(row.get('pid') or '-'):>8} {printable(row['state']):<11}"
            f" {age(_rowage(row)):>8} "
            f"{printable(row.get('turns', 0)):>5} ${row.get('cost_usd', 0.0):.4f}"
            + (f"  {_how(row)}" if row["state"] == "ended" else "")
        )
    return 0


def _rowage(row: dict[str, Any]) -> float:
    """AGE has one meaning: since the session was spawned (across hibernation, respawns and
    a failover; an ended session's too, its end shown beside it)."""
    started = row.get("started_at") or 0.0
    if started:
        return max(0.0, time.time() - float(started))
    return float(row.get("age_s") or 0.0)


def _how(row: dict[str, Any]) -> str:
    """How an ended session ended, for the listing."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.get("ended_at") or 0.0))
    code = row.get("exit_code")
    sig = row.get("signal")
    how = f"signal {sig}" if sig is not None else f"exit {code}" if code is not None else ""
    return printable(f"ended {when}: {row.get('reason', '')}{' (' + how + ')' if how else ''}")


async def _watch(args: argparse.Namespace) -> int:
    seen = 0
    async with connect(args) as client:
        events = await client.subscribe(f"sage.v1.event.{args.session}.>")
        # after subscribing: nothing between the replay and the live events is lost
        found = await call_session(
            client, "session", args.session, {"replay": max(0, min(args.replay, 256))}, 10.0
        )
        last_id = 0
        for old in found.get("events", []):
            last_id = max(last_id, int(old.get("id", 0)))
            print_json(event_line(old["event"], old.get("ts"), old.get("data")))
            seen += 1
        row = found["session"]
        if row.get("state") == "ended":
            print(f"astrid: session {args.session} {_how(row)}", file=sys.stderr)
            return 0
        if args.count and seen >= args.count:
            return 0
        if args.wake and row.get("state") in ("hibernated", "hibernating"):
            await call_session(client, "wake", args.session, {}, WAKE_TIMEOUT)
        try:
            async for envelope in events:
                if envelope.id <= last_id:
                    continue  # the replay showed it already
                name = envelope.topic.rsplit(".", 1)[1]
                print_json(event_line(name, envelope.ts, msgspec.json.decode(envelope.payload)))
                seen += 1
                if name == "exited" or (args.count and seen >= args.count):
                    return 0
        except BusError as exc:
            raise SageError(f"watch ended: {exc}") from exc
    return 0


async def _approvals(args: argparse.Namespace) -> int:
    if args.watch and not sys.stdin.isatty():
        # It would stand as the approver (calls wait for it instead of being denied at
        # once), read end of input at the first question and leave it to time out.
        raise SageError(
            "approvals --watch asks at a terminal and stdin is not one; off a terminal,"
            " answer with `astrid sage approve ID` / `astrid sage deny ID`",
            code="no_terminal",
        )
    async with connect(args) as client:
        if args.watch:
            return await _watch_approvals(client)
        try:  # in a fleet: every node's (sage/fleet/router.py)
            data = await _in_fleet(client, "approvals", {}, 10.0)
        except _NoFleet:
            data = await call_runner(client, "sage.v1.request.approvals", {}, 10.0)
    rows = data["approvals"]
    if data.get("warning"):  # other nodes' words: never the terminal's orders
        print(f"astrid: {printable(data['warning'])}", file=sys.stderr)
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no pending approvals")
        return 0
    fleet = any("node" in row for row in rows)
    print(
        (f"{'NODE':<10} " if fleet else "")
        + f"{'ID':<32}  {'SESSION':<14} {'PRINCIPAL':<12} {'AGE':>5} {'LEFT':>5}  TOOL"
    )
    for row in rows:
        print(
            (f"{printable(row.get('node', '')):<10} " if fleet else "")
            + f"{printable(row['approval_id']):<32}  {printable(row['session_id']):<14}"
            f" {printable(row['principal_id']):<12}"
            f" {row['age_s']:>4.0f}s {row['expires_in_s']:>4.0f}s  {printable(row['tool_name'])}"
            f" {_short(row.get('arguments', {}))}"
        )
    return 0


async def _watch_approvals(client: Any) -> int:
    """Ask about each approval of the caller's sessions as it comes, one at a time."""
    requests = await client.subscribe("sage.v1.event.*.approval_request")
    await client.subscribe("sage.v1.approver.*")  # present: calls wait for an answer
    print("waiting for approvals (Ctrl-C to stop)", file=sys.stderr, flush=True)
    async for envelope in requests:
        request = msgspec.json.decode(envelope.payload)
        answer = await _ask_at_terminal(request, where=True)
        if answer is None:
            return 0
        try:
            done = await call_runner(
                client, f"sage.v1.request.approve.{request.get('approval_id')}", answer, 10.0
            )
        except SageError as exc:
            print(f"astrid: {exc}", file=sys.stderr, flush=True)
            continue
        print(_decided(done), file=sys.stderr, flush=True)
    return 0


def _decided(data: dict[str, Any]) -> str:
    """What an answer did: ``allowed: TOOL in session SID`` (and a rule it added)."""
    verb = "allowed" if data.get("allowed") else "denied"
    rule = f"; from now on allowed: {data['rule_added']}" if data.get("rule_added") else ""
    return printable(f"{verb}: {data.get('tool_name')} in session {data.get('session_id')}{rule}")


async def _decide(args: argparse.Namespace) -> int:
    answer: dict[str, Any] = {"allowed": args.allowed}
    if not args.allowed and args.reason:
        answer["reason"] = args.reason
    if args.allowed and args.always:
        answer["always"] = True
        if args.rule:
            answer["rule"] = args.rule
    async with connect(args) as client:
        data = await call_session(client, "approve", args.approval_id, answer, 10.0)
    if args.json:
        print_json(data)
    else:
        print(_decided(data))
    return 0


def _short(arguments: Any) -> str:
    text = msgspec.json.encode(arguments).decode()
    return text if len(text) <= ARGS_SHOWN else text[: ARGS_SHOWN - 3] + "..."


def _budget_change(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--budget-*`` as a ``sage.v1.request.usage.budget`` payload (None: none given)."""
    change: dict[str, Any] = {"principal_id": args.principal_id}
    for kind in ("tokens_per_day", "usd_per_day", "usd_per_month"):
        value = getattr(args, f"budget_{kind}")
        if value is None:
            continue
        if value.lower() == "none":
            change[kind] = None
            continue
        try:
            number = int(value) if kind == "tokens_per_day" else float(value)
        except ValueError:
            raise SageError(
                f"--budget-{kind.replace('_', '-')}: {value!r} is not a number or 'none'"
            ) from None
        if number < 0:
            raise SageError(f"--budget-{kind.replace('_', '-')}: a budget is 0 or more")
        change[kind] = number
    if args.budget_reset:
        change["reset"] = True
    return change if len(change) > 1 else None


async def _set_budget(args: argparse.Namespace, change: dict[str, Any]) -> int:
    async with connect(args) as client:
        data = await call_usage(client, BUDGET_TOPIC, change)
    if args.json:
        print_json(data)
    else:
        print(f"budgets of {printable(args.principal_id)}:")
        for kind, value in data["after"].items():
            print(f"  {kind:<15} {value}  (was {data['before'].get(kind)})")
        if not data["after"]:
            print("  (none)")
    return 0


async def call_usage(client: Any, topic: str, payload: Any) -> dict[str, Any]:
    """Ask the supervisor's usage ledger; its ``ok`` reply, or a SageError."""
    try:
        reply = await client.request(topic, payload, deadline=30.0)
    except NoResponders:
        raise SageError("the usage ledger is off ([usage] ledger = false)") from None
    return replies.parse(reply.payload)


async def _usage(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"by": args.by, "fleet": args.fleet}
    if args.principal is not None:
        request["principal_id"] = args.principal
    if args.since is not None:
        request["since"] = args.since
    async with connect(args) as client:
        data = await call_usage(client, REPORT_TOPIC, request)
    if args.json:
        print_json(data)
        return 0
    for line in usage_table(data):
        print(line)
    return 0


def usage_table(data: dict[str, Any]) -> list[str]:
    """``astrid sage usage``'s table: the ledger's rows, then the budgets.  A fleet's
    report (``--fleet``) has a NODE column: each node's rows, then the fleet's totals
    (the rows added up across the nodes, NODE ``(fleet)``)."""
    key = str(data.get("by", "day")).upper()
    rows = data.get("rows") or []
    totals = data.get("totals") or []
    fleet = bool(totals) or any(row.get("node") for row in rows)
    node = f"{'NODE':<10} " if fleet else ""
    lines = [
        f"{key:<24} {'PRINCIPAL':<12} {node}{'CALLS':>6} {'INPUT':>10} {'OUTPUT':>9}"
        f" {'CACHE_R':>9} {'CACHE_W':>9} {'TOKENS':>10} {'USD':>10} {'CLI_USD':>10}"
    ]
    shown = [(row, printable(row.get("node") or "")) for row in rows]
    if fleet:
        shown += [(row, "(fleet)") for row in totals]
    for row, where in shown:  # other nodes' rows too: their text is shown, never obeyed
        lines.append(
            f"{printable(row['key']):<24} {printable(row['principal']):<12}"
            + (f" {where:<10}" if fleet else "")
            + f" {row['calls']:>6} {row['input_tokens']:>10} {row['output_tokens']:>9}"
            f" {row['cache_read_tokens']:>9} {row['cache_write_tokens']:>9} {row['tokens']:>10}"
            f" {row['usd']:>10.4f} {row['cli_usd']:>10.4f}"
        )
    if not rows:
        lines.append(f"(nothing recorded since {printable(data.get('since', ''))})")
    for budget in data.get("budgets") or []:
        for kind, limit in (budget.get("limits") or {}).items():
            spent = (budget.get("spend") or {}).get(_SPEND_OF.get(kind, ""), 0)
            resets = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime(budget["resets_at"].get(kind, 0)))
            lines.append(
                f"budget {printable(budget['principal_id'])} {kind}: spent {spent:g} of"
                f" {limit:g}, {budget['remaining'].get(kind, 0):g} left, resets {resets}"
            )
    if data.get("warning"):
        lines.append(f"warning: {printable(data['warning'])}")
    return lines


_SPEND_OF = {"tokens_per_day": "tokens_day", "usd_per_day": "usd_day", "usd_per_month": "usd_month"}


async def _settings(args: argparse.Namespace) -> int:
    change = _budget_change(args)
    if change is not None:
        if any(
            getattr(args, f) is not None
            for f in ("model", "max_turns", "auth_mode", "interaction_mode", "identity")
        ) or (args.allow or args.disallow):
            raise SageError("--budget-* are changed on their own: give no other setting")
        return await _set_budget(args, change)
    patch: dict[str, Any] = {"principal_id": args.principal_id}
    for field in ("model", "max_turns", "auth_mode", "interaction_mode"):
        value = getattr(args, field)
        if value is not None:
            patch[field] = value
    if args.allow:
        patch["allow_add"] = args.allow
    if args.disallow:
        patch["allow_remove"] = args.disallow
    if args.identity is not None:
        try:
            patch["identity"] = (
                sys.stdin.read() if args.identity == "-" else await _read_text(args.identity)
            )
        except (OSError, UnicodeDecodeError) as exc:
            raise SageError(f"--identity {args.identity}: cannot read it: {exc}") from None
    async with connect(args) as client:
        if len(patch) == 1:  # no change asked: show the settings in force
            listing = await call_runner(client, "sage.v1.request.principals", {}, 10.0)
            row = next(
                (r for r in listing["principals"] if r["principal_id"] == args.principal_id),
                None,
            )
            if row is None:
                raise SageError(f"unknown_principal: no principal {args.principal_id!r}")
            shown = {k: row.get(k) for k in ("interaction_mode", "auth_mode", "model", "max_turns")}
            data: dict[str, Any] = {
                "ok": True,
                "principal_id": args.principal_id,
                "config": shown,
                "allow_rules": row.get("allow_rules", []),
            }
        else:
            data = await call_runner(client, "sage.v1.request.settings.set", patch, 10.0)
    if args.json:
        print_json(data)
    else:
        for key, value in data["config"].items():
            print(f"{key:<17} {value}")
        rules = data.get("allow_rules") or []
        print(printable(f"{'allow_rules':<17} {', '.join(rules) if rules else '(none)'}"))
    return 0


async def _simple(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        data = await call_session(client, args.verb, args.session, {}, 30.0)
    if args.json:
        print_json(data)
    elif args.verb == "interrupt" and data.get("interrupted") is False:
        print(f"interrupt: {args.session}: no turn was running; nothing was interrupted")
    else:
        print(f"{args.verb}: {args.session}")
    return 0


async def _read_text(path: str) -> str:
    import anyio  # the commands that run a loop import it (anyio.run), not the module

    return await anyio.Path(path).read_text(encoding="utf-8")


async def _absolute(path: str) -> str:
    import anyio

    return str(await anyio.Path(path).absolute())
