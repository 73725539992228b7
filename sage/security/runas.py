"""Whom a principal's ``claude`` children run as, when the supervisor is root.

A root supervisor never runs ``claude`` as root.  Each principal's children
run as one uid of that principal's own (docs/security.md, Sessions):

- the principal's ``run_as`` (a user name or a uid), when set;
- else a uid of sage's own from ``[sessions] uid_base + 1`` ..
  ``uid_base + uid_count - 1`` (91001-91999 by default: above the forge's
  sandbox range 90000-90999, below the ``/etc/subuid`` ranges), given once
  and persisted in ``<state_dir>/session_uids.json`` with the forge's rules
  (:class:`sage.security.uids.SandboxUids`: never reassigned, a uid the host's
  user database knows is skipped, and refused if it becomes a host user's).

Their gid is the uid's number for sage's own uids, the user's primary group
for a ``run_as`` user.  Their only supplementary group is the **access
group**, the gid ``[sessions] uid_base`` (91000, no host group may have it),
never ``socket.group``: that group is the people's who may use the socket
(:func:`socket_group`), and an agent gets nothing of theirs.  The supervisor
gives the state folder to the access group (0750), and the socket and its
folder to ``socket.group`` when set, with an ACL entry for the access group
(``bus.unix.grant_group``), else to the access group, so a child can pass
through the state folder to its home and identity file and connect to the
socket, and read nothing else there (every file is 0600, every other folder
0700 or 0711).  On the socket a child's uid is allowed only as ``astrid-emit``
(role ``emit``) of its own principal: :meth:`SessionUids.principal_of`.

A supervisor that is not root runs its children as itself, as before:
:func:`enabled` is false and :meth:`SessionUids.run_as` answers None.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import site
import sys
from dataclasses import dataclass
from pathlib import Path

from sage.claude.homes import can_run
from sage.config import GROUP_ADVICE, Config, PrincipalConfig
from sage.errors import ConfigError, SageError, SandboxError
from sage.security.uids import SandboxUids, known_uid

__all__ = (
    "RunAs",
    "SessionUids",
    "access_group",
    "emit_launcher",
    "enabled",
    "setpriv_prefix",
    "socket_group",
)

TABLE = "session_uids"


@dataclass(frozen=True)
class RunAs:
    """The credentials of one principal's children."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    """Supplementary groups: the access group, or none."""


def enabled() -> bool:
    """Do children run as their principals' uids? Only under a root supervisor."""
    return os.geteuid() == 0


def socket_group(config: Config) -> int | None:
    """The gid of ``socket.group`` (the people who may use the socket), None when unset;
    a privileged one (gid 0 whatever its name) is refused."""
    name = config.socket.group
    if not name:
        return None
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(f"socket.group: no group named {name!r}") from None
    if gid == 0:
        raise ConfigError(f"socket.group: {name!r} has gid 0 (root's group); {GROUP_ADVICE}")
    return gid


def access_group(config: Config) -> int | None:
    """The ``claude`` children's access group (root only): the gid ``[sessions]
    uid_base``, a group of sage's own, never ``socket.group``."""
    if not enabled():
        return None
    gid = config.sessions.uid_base
    try:
        name = grp.getgrgid(gid).gr_name
    except KeyError:
        return gid
    raise ConfigError(
        f"sessions.uid_base: gid {gid} is the host's group {name!r}; sage uses that gid for"
        " its sessions' access to the socket (move [sessions] uid_base)"
    )


class SessionUids:
    """``principal -> uid`` of the children; see the module doc."""

    def __init__(self, config: Config) -> None:
        self.config = config
        sessions = config.sessions
        self.table = SandboxUids(
            config.state_dir,
            sessions.uid_base + 1,
            sessions.uid_count - 1,
            name=TABLE,
            setting="[sessions] uid",
            what="session",
        )
        self._uids: dict[str, int] = {}

    def allocate(self) -> None:
        """Give each configured principal without ``run_as`` its uid (root only)."""
        if not enabled():
            return
        names = [p.name for p in self.config.principals if not p.run_as]
        self._uids = self.table.allocate(names)

    def run_as(self, principal: PrincipalConfig) -> RunAs | None:
        """The credentials of ``principal``'s children; None when they run as the supervisor.

        Raises SageError when no uid can be given (the range is full, or the uid is
        now a host user's)."""
        if not enabled():
            return None
        group = access_group(self.config)
        groups = () if group is None else (group,)
        if principal.run_as:
            uid = principal.run_as_uid
            if uid is None:
                raise SageError(f"run_as: no user named {principal.run_as!r} any more")
            try:
                gid = pwd.getpwuid(uid).pw_gid
            except KeyError:
                gid = uid
            return RunAs(uid, gid, groups)
        try:
            uid = self.table.uid_for(principal.name)
        except SandboxError as exc:
            raise SageError(str(exc)) from None
        self._uids[principal.name] = uid
        return RunAs(uid, uid, groups)

    def principal_of(self, uid: int) -> str | None:
        """The principal whose children run as ``uid``, if any (for the socket's ``emit``)."""
        if not enabled() or uid == 0:
            return None
        for principal in self.config.principals:
            if principal.run_as and principal.run_as_uid == uid:
                return principal.name
        if uid not in self._uids.values() and self.table.in_range(uid):
            # given since we last looked (by the runner, to a principal added on reload)
            with contextlib.suppress(SageError):
                self._uids = self.table.allocate([])
        for name, mapped in self._uids.items():
            owner = self.config.principal(name)
            if mapped == uid and owner is not None and not owner.run_as:
                return None if known_uid(uid) else name
        return None


def emit_launcher(run_as: RunAs) -> bytes | None:
    """A script that runs ``astrid-emit`` as ``run_as`` when sage's own interpreter is
    out of that uid's reach (a virtualenv made from a Python under ``/root``), else None.

    It runs a Python of the same minor version that the uid may execute
    (``/usr/bin``, ``/usr/local/bin``: extension modules are built per minor
    version), isolated and without ``site`` (``-IS``: astrid-emit needs the
    standard library only, and ``site`` would cost every hook milliseconds), with
    the folder holding the ``sage`` package first on its path and sage's
    site-packages after it (for the config file, read only without
    ``ASTRID_SOCKET``); None too when there is no such Python (the hooks cannot
    run: docs/security.md)."""
    groups = {run_as.gid, *run_as.groups}
    if can_run(Path(sys.executable), run_as.uid, groups):
        return None
    name = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for folder in ("/usr/bin", "/usr/local/bin"):
        python = Path(folder) / name
        if python.exists() and can_run(python, run_as.uid, groups):
            import sage

            root = os.path.dirname(os.path.dirname(os.path.abspath(sage.__file__)))
            sites = [p for p in site.getsitepackages() if os.path.isdir(p) and p != root]
            return (
                f"#!{python} -IS\n"
                "# astrid-emit for a claude child whose uid cannot run sage's own Python\n"
                "# (written by sage's installer; sage/security/runas.py emit_launcher)\n"
                "import sys\n\n"
                f"sys.path[:0] = {[root]!r}\n"
                f"sys.path += {sites!r}\n"
                "from sage.claude.emit import main\n\n"
                "sys.exit(main())\n"
            ).encode()
    return None


def setpriv_prefix(run_as: RunAs, death_signal: str = "KILL") -> list[str]:
    """What goes before the child's argv: ``setpriv`` becomes ``run_as`` and execs it.

    The uid change clears ``PR_SET_PDEATHSIG``, so setpriv sets it again after it;
    ``--no-new-privs``: nothing the child runs gains privileges (setuid binaries)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        raise SageError("setpriv (util-linux) is missing: a root supervisor needs it")
    argv = [setpriv, "--reuid", str(run_as.uid), "--regid", str(run_as.gid)]
    if run_as.groups:
        argv += ["--groups", ",".join(str(g) for g in run_as.groups)]
    else:
        argv.append("--clear-groups")
    return [*argv, "--no-new-privs", "--pdeathsig", death_signal, "--"]
