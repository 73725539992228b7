"""``astrid audit verify|tail|pubkey``: read the audit log straight from its SQLite file.

This module owns the ``audit`` command group.  The commands need no running
supervisor: they open ``<state_dir>/audit.db`` read-only and the key from
``<state_dir>/keys``.  ``verify`` exits 0 when the chain and its signed
checkpoints hold and 2 with the first broken entry (seq, kind, why);
``tail`` prints entries as lines (or one JSON object per line) and can
follow; ``pubkey`` prints the checkpoint verifying key for safekeeping
elsewhere, which is what makes a wholesale rewrite of the log detectable.
``verify --fleet`` is the one that asks the local supervisor: it holds the
node's NATS credentials, reads every node's streamed audit from JetStream and
asks each live node to compare its own log with it (sage/fleet/audit_stream.py);
it exits 0 when every node is intact, 2 with each broken node's first failure,
and 1 when the stream cannot be read or a live node did not answer.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from sage import replies
from sage.audit import (
    Entry,
    VerifyReport,
    last_seq,
    load_public_key,
    max_unsigned_for,
    parse_public_key,
    public_key_pem,
    public_key_raw_b64,
    tail,
    verify_audit,
)
from sage.cli._commands import summary
from sage.cli._common import add_common, printable
from sage.cli._connect import config_of, connect, print_json
from sage.errors import AuditError

__all__ = ("register",)

EXIT_BROKEN = 2
EXIT_UNREADABLE = 1
VERIFY_FLEET_TOPIC = "sage.v1.request.audit.verify_fleet"  # answered by the supervisor
FLEET_DEADLINE = 90.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``audit verify``, ``audit tail`` and ``audit pubkey`` to ``sub``."""
    group = sub.add_parser(
        "audit",
        help=summary("audit"),
        description=(
            "Read the tamper-evident audit log (<state_dir>/audit.db) directly;"
            " no running supervisor is needed."
        ),
    )
    actions = group.add_subparsers(dest="audit_action", metavar="ACTION", required=True)

    verify = actions.add_parser(
        "verify",
        help="check the hash chain and the signed checkpoints",
        description=(
            "Recompute every entry's hash, check the links between entries and the"
            " Ed25519 signatures of the checkpoints. Exit 0 when the log is intact,"
            " 2 with the first broken entry (seq, kind and why: tampered, broken_chain,"
            " missing or bad_checkpoint), 1 when the log cannot be read."
        ),
    )
    add_common(verify)
    verify.add_argument(
        "--pubkey",
        metavar="FILE",
        default=None,
        help=(
            "verify against this public key (PEM or base64, as `astrid audit pubkey` prints);"
            " default: the key in <state_dir>/keys"
        ),
    )
    verify.add_argument(
        "--fleet",
        action="store_true",
        help=(
            "verify every node of the fleet from the sage_audit stream, and have each live"
            " node compare its own log with it (asks the local supervisor; admins)"
        ),
    )
    verify.set_defaults(handler=cmd_verify)

    follow = actions.add_parser(
        "tail",
        help="print the last entries, optionally following new ones",
        description="Print the last N audit entries, one per line; with -f keep printing new ones.",
    )
    add_common(follow)
    follow.add_argument(
        "-f", "--follow", action="store_true", help="keep running and print entries as they land"
    )
    follow.add_argument(
        "-n",
        "--lines",
        metavar="N",
        type=_non_negative,
        default=10,
        help="how many of the latest entries to print first (default: 10; 0: none)",
    )
    follow.set_defaults(handler=cmd_tail)

    pubkey = actions.add_parser(
        "pubkey",
        help="print the checkpoint verifying key",
        description=(
            "Print the Ed25519 public key that verifies audit checkpoints (PEM, or raw"
            " base64 with --raw). Keep a copy away from this machine; then"
            " `astrid audit verify --pubkey FILE` catches even a rewrite of the whole log."
        ),
    )
    add_common(pubkey)
    pubkey.add_argument("--raw", action="store_true", help="print the 32 raw key bytes, base64")
    pubkey.set_defaults(handler=cmd_pubkey)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def _require_log(path: Path) -> None:
    if not path.exists():
        raise AuditError(f"{path}: no audit log there (the supervisor creates it on first start)")


# --- verify ------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    if args.fleet:
        if args.pubkey:
            raise AuditError(
                "--pubkey and --fleet: the fleet's keys are the ones each node streamed"
            )
        code: int = anyio.run(cmd_verify_fleet, args)
        return code
    config = config_of(args)
    path = config.audit_path
    _require_log(path)
    if args.pubkey:
        try:
            data = Path(args.pubkey).read_bytes()
        except OSError as exc:
            raise AuditError(f"{args.pubkey}: cannot read: {exc.strerror}") from exc
        key = parse_public_key(data, source=args.pubkey)
    else:
        key = load_public_key(config.keys_dir)
    report = verify_audit(path, key, max_unsigned=max_unsigned_for(config.audit))
    if args.json:
        print_json(_report_json(path, report))
    else:
        print(_report_text(path, report))
    return 0 if report.ok else EXIT_BROKEN


def _report_json(path: Path, report: VerifyReport) -> dict[str, Any]:
    failure = report.failure
    return {
        "path": str(path),
        "ok": report.ok,
        "entries_checked": report.entries_checked,
        "checkpoints_checked": report.checkpoints_checked,
        "unsigned_tail": report.unsigned_tail,
        "failure": None
        if failure is None
        else {
            "kind": str(failure.kind),
            "seq": failure.seq,
            "entry_kind": failure.entry_kind,
            "reason": failure.reason,
        },
    }


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _report_text(path: Path, report: VerifyReport) -> str:
    counts = (
        f"{_count(report.entries_checked, 'entry', 'entries')} and"
        f" {_count(report.checkpoints_checked, 'checkpoint', 'checkpoints')} checked"
    )
    failure = report.failure
    if failure is None:
        line = f"audit log intact: {counts}"
        if report.unsigned_tail:
            line += f"; the last {report.unsigned_tail} entries are not signed yet"
        return line
    what = f" ({failure.entry_kind})" if failure.entry_kind else ""
    return (
        f"audit log BROKEN at seq {failure.seq}{what}: {failure.kind}: {failure.reason}"
        f" [{counts} before it; {path}]"
    )


# --- tail --------------------------------------------------------------------------------


async def cmd_tail(args: argparse.Namespace) -> int:
    config = config_of(args)
    path = config.audit_path
    _require_log(path)
    after = max(0, last_seq(path) - args.lines)
    async for entry in tail(path, after, args.follow):
        if args.json:
            print_json(entry_json(entry))
        else:
            sys.stdout.write(entry_line(entry) + "\n")
            sys.stdout.flush()
    return 0


def _iso(ts_ns: int) -> str:
    moment = datetime.datetime.fromtimestamp(ts_ns / 1e9, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def entry_json(entry: Entry) -> dict[str, Any]:
    """An entry as a JSON-ready dict (payload decoded, hashes hex)."""
    try:
        payload: Any = msgspec.json.decode(entry.payload)
    except msgspec.DecodeError:
        payload = entry.payload.decode(errors="replace")
    return {
        "seq": entry.seq,
        "ts": entry.ts,
        "time": _iso(entry.ts),
        "kind": entry.kind,
        "principal": entry.principal,
        "session": entry.session,
        "payload": payload,
        "prev_hash": entry.prev_hash.hex(),
        "hash": entry.hash.hex(),
    }


def entry_line(entry: Entry) -> str:
    """An entry as one human line."""
    payload = entry.payload.decode(errors="replace")
    session = entry.session or "-"
    principal = entry.principal or "-"
    return f"{entry.seq:>7}  {_iso(entry.ts)}  {entry.kind}  {principal}  {session}  {payload}"


# --- pubkey ------------------------------------------------------------------------------


def cmd_pubkey(args: argparse.Namespace) -> int:
    config = config_of(args)
    key = load_public_key(config.keys_dir)
    if args.json:
        print_json({"pem": public_key_pem(key), "raw": public_key_raw_b64(key)})
    elif args.raw:
        print(public_key_raw_b64(key))
    else:
        sys.stdout.write(public_key_pem(key))
    return 0


# --- verify --fleet ----------------------------------------------------------------------


async def cmd_verify_fleet(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        reply = await client.request(VERIFY_FLEET_TOPIC, {}, deadline=FLEET_DEADLINE)
    data = replies.parse(reply.payload)  # not_in_fleet, fleet_unavailable: exit 1
    if args.json:
        print_json(data)
    else:
        print(fleet_report_text(data))
    if not data.get("intact"):
        return EXIT_BROKEN
    return 0 if data.get("complete") else EXIT_UNREADABLE


def fleet_report_text(data: dict[str, Any]) -> str:
    """The reply of ``verify_fleet`` as lines: one per node, its first failure if any."""
    nodes = data.get("nodes") or []
    intact = "intact" if data.get("intact") else "BROKEN"
    lines = [
        f"fleet audit {intact}: {_count(len(nodes), 'node', 'nodes')},"
        f" {_count(int(data.get('messages') or 0), 'message', 'messages')} in the stream"
        f" (asked by node {printable(str(data.get('node')))})"
    ]
    for node in nodes:
        stream = node.get("stream") or {}
        counts = (
            f"{_count(stream.get('entries', 0), 'entry', 'entries')} and"
            f" {_count(stream.get('checkpoints', 0), 'checkpoint', 'checkpoints')} streamed"
        )
        local = node.get("local")
        if local is not None:
            where = f"local log matches ({local['compared']} compared"
            where += f", {local['unstreamed']} not streamed yet)" if local["unstreamed"] else ")"
        elif node.get("local_error"):
            where = f"local log NOT compared: {printable(str(node['local_error']))}"
        else:
            where = "local log not compared (node not live)"
        failure = node.get("failure")
        name = printable(str(node.get("node")))
        if failure is None:
            lines.append(f"  {name:<20} ok      {counts}; {where}")
            continue
        what = f" ({printable(failure['entry_kind'])})" if failure.get("entry_kind") else ""
        at = f"at seq {failure['seq']}{what}: " if failure["seq"] else ""  # 0: the whole history
        lines.append(
            f"  {name:<20} BROKEN  {at}{printable(failure['kind'])}"
            f" in the {failure.get('where', 'stream')} log: {printable(failure['reason'])}"
            f" [{counts}]"
        )
    for stray in data.get("strays") or []:
        lines.append(f"  stray message {printable(str(stray))}: on no node's audit subject")
    return "\n".join(lines)
