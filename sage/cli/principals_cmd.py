"""``astrid sage install|principals``: provision principals and see their state.

``install`` asks the runner (``sage.v1.request.install``), which validates
the settings, has the installer capsule write the principal's home, stores
the API key encrypted and then keeps the settings.  The key is read with
hidden input (or from ``--api-key-stdin``), travels only inside that one
request, on a topic the bus never delivers off the supervisor, and is never
printed.  ``principals`` lists modes, install state and whether a key is
stored, never the key.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import sys
from pathlib import Path
from typing import Any

import msgspec

from bus import BusError
from sage.cli._common import call_runner
from sage.cli._connect import connect, print_json
from sage.errors import SageError

__all__ = ("register",)

INSTALL_TIMEOUT = 45.0


def register(commands: Any, common: Any) -> None:
    install = commands.add_parser(
        "install",
        help="provision a principal's home (settings, .mcp.json, CLAUDE.md) and its API key",
        description=(
            "Provision PRINCIPAL (declared under [[principals]] in supervisor.toml): the"
            " installer writes <home>/.claude/settings.local.json, .mcp.json and CLAUDE.md"
            " for the chosen modes, and the supervisor keeps the settings. In api_key mode"
            " the API key is asked for with hidden input (or read from --api-key-stdin) and"
            " stored encrypted; an empty answer stores nothing. subscription mode never asks."
            " Re-running changes only what differs; --force rewrites every file."
        ),
        epilog=(
            "examples:\n"
            "  astrid sage install alice --interaction-mode headless --auth-mode api_key\n"
            '  printf %s "$KEY" | astrid sage install alice --api-key-stdin\n'
            "  astrid sage install bob --interaction-mode repl --auth-mode subscription"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    install.add_argument("principal_id", metavar="PRINCIPAL")
    install.add_argument("--interaction-mode", choices=("headless", "repl"))
    install.add_argument("--auth-mode", choices=("api_key", "subscription"))
    install.add_argument("--model", help="--model for new sessions ('' for the CLI's default)")
    install.add_argument("--max-turns", type=int, help="--max-turns (0: none)")
    install.add_argument("--force", action="store_true", help="rewrite every file")
    key = install.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key-stdin", action="store_true", help="read the API key from stdin (no prompt)"
    )
    key.add_argument(
        "--no-api-key", action="store_true", help="do not ask for a key (keep any stored one)"
    )
    common(install)
    install.set_defaults(handler=_install)

    listing = commands.add_parser(
        "principals",
        help="list principals: modes, install state, whether a key is stored",
        description=(
            "List the principals you may act for (all of them for an admin) with their"
            " interaction and auth modes, whether their home is installed and whether an"
            " API key is stored for them (never the key)."
        ),
    )
    common(listing)
    listing.set_defaults(handler=_principals)

    repl = commands.add_parser(
        "repl",
        help="start claude interactively in a principal's home, its hooks validated",
        description=(
            "Run `claude` (no -p) in PRINCIPAL's home with HOME set, a hook token minted for"
            " this run (so the installed command hooks are validated like a headless"
            " session's), the supervisor's socket, and in api_key mode the principal's key."
            " The principal's tools come from its .mcp.json (astrid mcp serve). The token is"
            " scrubbed when claude exits. Arguments after -- go to claude."
        ),
    )
    repl.add_argument("principal_id", metavar="PRINCIPAL")
    repl.add_argument(
        "--dry-run", action="store_true", help="print the command and environment (secrets masked)"
    )
    repl.add_argument("claude_args", nargs="*", help="arguments for claude, after --")
    common(repl)
    repl.set_defaults(handler=_repl)


def _read_key(args: argparse.Namespace, current: dict[str, Any] | None) -> str | None:
    """The key to store, if one should be asked for; None when not."""
    if args.api_key_stdin:
        return sys.stdin.read().strip()
    if args.no_api_key:
        return None
    mode = args.auth_mode or (current or {}).get("auth_mode", "api_key")
    if mode != "api_key":
        return None  # subscription mode never asks
    if current and current.get("key_stored") and not args.force:
        return None  # a key is stored: keep it unless rewriting
    if not sys.stdin.isatty():
        print(
            "astrid: no terminal to ask for the API key; pass --api-key-stdin"
            " (sessions fail with api_key_missing until a key is stored)",
            file=sys.stderr,
        )
        return None
    return getpass.getpass(f"Anthropic API key for {args.principal_id} (empty: none): ").strip()


async def _install(args: argparse.Namespace) -> int:
    import anyio  # `astrid sage send` registers this group too: no loop imported for it

    payload: dict[str, Any] = {"principal_id": args.principal_id}
    for field in ("interaction_mode", "auth_mode", "model", "max_turns"):
        value = getattr(args, field)
        if value is not None:
            payload[field] = value
    if args.force:
        payload["force"] = True
    async with connect(args) as client:
        # the principal first: nobody types a secret for one that does not exist
        listing = await call_runner(client, "sage.v1.request.principals", {}, 10.0)
        current = next(
            (p for p in listing["principals"] if p["principal_id"] == args.principal_id),
            None,
        )
        if current is None:
            known = ", ".join(p["principal_id"] for p in listing["principals"]) or "none"
            raise SageError(
                f"unknown_principal: no principal {args.principal_id!r} you may install"
                f" (yours: {known}); declare it under [[principals]] in the supervisor's"
                " config and reload it (SIGHUP)"
            )
        key = await anyio.to_thread.run_sync(_read_key, args, current)
        if key:
            payload["api_key"] = key
        steps = None
        with contextlib.suppress(BusError):  # progress is a nicety: the reply says what happened
            steps = await client.subscribe("sage.v1.event.install.status")
        async with anyio.create_task_group() as tg:
            if steps is not None and not args.json:
                tg.start_soon(_progress, steps, args.principal_id)
            data = await call_runner(client, "sage.v1.request.install", payload, INSTALL_TIMEOUT)
            tg.cancel_scope.cancel()
    if args.json:
        print_json(data)
        return 0
    changed = data.get("changed") or []
    print(f"installed {data['principal_id']} in {data.get('home_path')}")
    for key_name, value in data["config"].items():
        print(f"  {key_name:<17} {value}")
    print(f"  {'api key':<17} {'stored' if data.get('key_stored') else 'none'}")
    print(f"  {'files rewritten':<17} {', '.join(changed) if changed else 'none (up to date)'}")
    return 0


async def _progress(steps: Any, principal: str) -> None:
    async for envelope in steps:
        data = msgspec.json.decode(envelope.payload)
        if data.get("principal_id") == principal:
            print(f"  ... {data.get('step')}", file=sys.stderr)


async def _principals(args: argparse.Namespace) -> int:
    async with connect(args) as client:
        data = await call_runner(client, "sage.v1.request.principals", {}, 10.0)
    rows = data["principals"]
    if args.json:
        print_json(rows)
        return 0
    if not rows:
        print("no principals (declare them under [[principals]] in supervisor.toml)")
        return 0
    print(f"{'PRINCIPAL':<16} {'MODE':<9} {'AUTH':<13} {'INSTALLED':<9} {'KEY':<7} SESSIONS")
    for row in rows:
        stored = row.get("key_stored")
        key = "stored" if stored else "?" if stored is None else "none"
        if not stored and row.get("operator_key") and row.get("auth_mode") == "api_key":
            key = "operator"  # runs on the operator's key (operator_key = true)
        installed = "yes" if row.get("installed") else "no"
        print(
            f"{row['principal_id']:<16} {row['interaction_mode']:<9} {row['auth_mode']:<13}"
            f" {installed:<9} {key:<7} {row.get('sessions', 0)}"
        )
        if row.get("settings_error"):
            print(f"  ! {row['settings_error']}")
    return 0


async def _repl(args: argparse.Namespace) -> int:
    import os
    import signal
    import subprocess

    import anyio

    from sage.claude.binary import resolve_claude_binary
    from sage.cli._connect import config_of
    from sage.security.secrets import API_KEY, SecretError, SecretStore, principal_namespace

    config = config_of(args)
    name = args.principal_id
    async with connect(args) as client:
        listing = await call_runner(client, "sage.v1.request.principals", {}, 10.0)
        row = next((p for p in listing["principals"] if p["principal_id"] == name), None)
        if row is None:
            raise SageError(f"unknown_principal: no principal {name!r} you may act for")
        opened = await call_runner(
            client, "sage.v1.request.repl.open", {"principal_id": name}, 10.0
        )
    sid, token, home = opened["session_id"], opened["token"], opened["home"]
    try:  # from here on the token is closed however this ends
        env = {
            "HOME": home,
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "ASTRID_PRINCIPAL_ID": name,
            "ASTRID_SESSION_ID": sid,
            "ASTRID_HOOK_TOKEN": token,
            "ASTRID_SOCKET": str(config.socket_path),
        }
        for var in ("TERM", "LANG", "LC_ALL", "LC_CTYPE", "COLORTERM"):
            if os.environ.get(var):
                env[var] = os.environ[var]
        if row.get("auth_mode") == "api_key":
            key = None
            # not the supervisor's user: the store does not open; the operator's key, if any
            with contextlib.suppress(SecretError, OSError):
                key = SecretStore.open(config).get(principal_namespace(name), API_KEY)
            key = key or os.environ.get("ANTHROPIC_API_KEY")
            if key:
                env["ANTHROPIC_API_KEY"] = key
        env.update(config.claude.env)
        # the home is the project: git must not find a repository above it (the checkout
        # of a state folder inside one), whose root would get the CLI's project files
        env["GIT_CEILING_DIRECTORIES"] = str(Path(home).parent)
        extra = [a for a in args.claude_args if a != "--"] if args.claude_args else []
        # the CLI's default mode was auto (its own classifier decides) in 2.1.296-2.1.301:
        # ask for default unless the user chose a mode on this command line
        if not any(a == "--permission-mode" or a.startswith("--permission-mode=") for a in extra):
            extra = ["--permission-mode", "default", *extra]
        argv = [str(resolve_claude_binary(config)), *extra]
        _repl_home(name, Path(home))
        if args.dry_run:
            masked = {
                k: (
                    "<token>"
                    if k == "ASTRID_HOOK_TOKEN"
                    else "<key>"
                    if k == "ANTHROPIC_API_KEY"
                    else v
                )
                for k, v in env.items()
            }
            print_json({"argv": argv, "cwd": home, "env": masked, "session_id": sid})
            return 0
        _answer_key(Path(home), env.get("ANTHROPIC_API_KEY"))
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # claude owns the terminal
        try:
            done = await anyio.to_thread.run_sync(
                lambda: subprocess.run(argv, env=env, cwd=home, check=False)
            )
        except OSError as exc:  # no home (not installed), claude not runnable
            raise SageError(f"cannot start {argv[0]} in {home}: {exc.strerror}") from None
        finally:
            signal.signal(signal.SIGINT, previous)
        return done.returncode
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(BusError, SageError, OSError):
            async with connect(args) as client:
                await call_runner(client, "sage.v1.request.repl.close", {"session_id": sid}, 10.0)


def _repl_home(name: str, home: Path) -> None:
    """The REPL runs ``claude`` as the caller: only in a home that is the caller's own.

    A home the installer gave to another uid (the uid a root supervisor runs the
    principal's sessions as) would get the caller's files (root's, say) and an
    onboarding that never sticks: refused, with the fix named."""
    import os
    import pwd

    try:
        owner = home.stat().st_uid
    except OSError:
        raise SageError(
            f"not_installed: {home} does not exist; install the principal first"
            f" (astrid sage install {name} --interaction-mode repl)"
        ) from None
    me = os.geteuid()
    if owner == me:
        return
    try:
        user = pwd.getpwuid(me).pw_name
    except KeyError:
        user = str(me)
    as_user = "USER" if me == 0 else user  # root never runs a principal's claude
    raise SageError(
        f"repl_not_yours: {name}'s home {home} belongs to uid {owner} (the uid its sessions"
        f" run as), not to you (uid {me}): a repl runs claude as you, and would leave your"
        f" files there. Give {name} a user of its own: in the supervisor's config set"
        f' run_as = "{as_user}" and add that uid to uids under [[principals]] name ='
        f' "{name}", reload it, run astrid sage install {name} --force, then run astrid'
        f" sage repl {name} as that user (a member of the socket's group)"
    )


def _answer_key(home: Path, key: str | None) -> None:
    """Accept ``key`` in the home's Claude Code config, as the CLI itself records a yes to
    its "use this API key?" (whose default is no), so Enter cannot drop the stored key; the
    installer answered the onboarding and the folder's trust already."""
    from sage.claude.homes import USER_CONFIG, answered_config
    from sage.files import write_replace

    path = home / USER_CONFIG
    try:
        current: bytes | None = path.read_bytes() if not path.is_symlink() else None
    except OSError:
        current = None
    answered = answered_config(current, home, key)
    if answered != current:
        write_replace(path, answered)
