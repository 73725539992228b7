"""One sandbox uid per principal, from a range of sage's own.

When the supervisor is root, a forged tool runs as an unprivileged uid
(docs/forge-sandbox.md, Identity).  That uid must be nobody else's: a fresh
sandbox carries its secrets in ``/proc/<pid>/environ``, which every process
of the same uid may read, and RLIMIT_NPROC counts per uid.  So neither
``nobody`` (65534, shared with host daemons) nor one uid for every principal:
each principal's tools get a uid of their own from ``[forge]
sandbox_uid_base`` .. ``+ sandbox_uid_count - 1`` (90000-90999 by default:
above the 16-bit ids, systemd's DynamicUser and homed ranges, below the
``/etc/subuid`` ranges that start at 100000).

The mapping is persisted in ``<forge_dir>/sandbox_uids.json`` (0600), so it
never changes once made, and a uid once given is never given to another
principal, even one removed from the config (its files in ``rw`` binds stay
its own).  The first uid of the range is for calls without a principal
(operators, capsules); the configured principals follow in config order, the
first time the forge starts with them; a principal added later gets the
next free uid at its first call.  A uid the host's user database knows
(``getpwuid``) is skipped when allocating and refused when used
(``SandboxError("sandbox_uid_taken")``): it would not be sage's own.
Allocation takes an ``flock`` on ``sandbox_uids.lock``, so two processes on
one forge folder agree.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import threading
from collections.abc import Iterable
from pathlib import Path

import msgspec

from sage.errors import SandboxError
from sage.files import private_dir, write_replace

__all__ = ("DEFAULT_UID_BASE", "DEFAULT_UID_COUNT", "NO_PRINCIPAL", "SandboxUids", "known_uid")

DEFAULT_UID_BASE = 90000
DEFAULT_UID_COUNT = 1000
NO_PRINCIPAL = ""
"""The key of calls made without a principal (no principal name is empty)."""


class _Table(msgspec.Struct, forbid_unknown_fields=False):
    uids: dict[str, int] = {}


def known_uid(uid: int) -> bool:
    """Does the host's user database (``/etc/passwd``, NSS) know ``uid``?"""
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


class SandboxUids:
    """``principal -> uid`` for the sandbox, persisted under ``forge_dir``; see the module doc."""

    def __init__(
        self,
        forge_dir: Path,
        base: int,
        count: int,
        *,
        name: str = "sandbox_uids",
        setting: str = "[forge] sandbox_uid",
        what: str = "sandbox",
    ) -> None:
        # ``name``: the table's file name (``.json``, ``.lock``); ``setting`` and ``what``
        # name it in messages. Session uids (sage/security/runas.py) and installed capsules'
        # workers (keyed by capsule name) use the same class with the same rules.
        self.path = forge_dir / f"{name}.json"
        self.lock_path = forge_dir / f"{name}.lock"
        self.base = base
        self.count = count
        self.setting = setting
        self.what = what
        self._mutex = threading.Lock()
        self._cache: dict[str, int] = {}

    def in_range(self, uid: int) -> bool:
        """Is ``uid`` one of the range's?"""
        return self._in_range(uid)

    def _in_range(self, uid: int) -> bool:
        return self.base <= uid < self.base + self.count

    def _read(self) -> dict[str, int]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise SandboxError(
                "sandbox_uid_unavailable", f"{self.path}: cannot read: {exc.strerror}"
            ) from None
        try:
            return dict(msgspec.json.decode(raw, type=_Table).uids)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # never guess: a lost table could hand one principal's uid to another
            raise SandboxError(
                "sandbox_uid_unavailable",
                f"{self.path}: not a uid table ({exc}); fix or restore it",
            ) from None

    def allocate(self, principals: Iterable[str]) -> dict[str, int]:
        """Give every one of ``principals`` that has none a uid (in order); the whole table."""
        wanted = list(principals)
        with self._mutex:
            private_dir(self.path.parent)
            fd = os.open(
                self.lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                table = self._read()
                taken = set(table.values())
                added = False
                for name in wanted:
                    if name in table and self._in_range(table[name]):
                        continue
                    table[name] = self._free(taken)
                    taken.add(table[name])
                    added = True
                if added:
                    data = msgspec.json.format(msgspec.json.encode(_Table(uids=table)))
                    write_replace(self.path, data + b"\n")
            finally:
                os.close(fd)
            self._cache = {k: v for k, v in table.items() if self._in_range(v)}
            return dict(self._cache)

    def _free(self, taken: set[int]) -> int:
        for uid in range(self.base, self.base + self.count):
            if uid not in taken and not known_uid(uid):
                return uid
        raise SandboxError(
            "sandbox_uid_exhausted",
            f"no free {self.what} uid left in {self.base}..{self.base + self.count - 1}"
            f" (raise {self.setting}_count)",
        )

    def uid_for(self, principal: str | None) -> int:
        """The uid ``principal``'s tools run as (``None``: calls without a principal)."""
        name = NO_PRINCIPAL if principal is None else principal
        uid = self._cache.get(name)
        if uid is None:
            uid = self.allocate([name])[name]
        if known_uid(uid):
            raise SandboxError(
                "sandbox_uid_taken",
                f"{self.what} uid {uid} ({name or 'no principal'}) now belongs to a user of this"
                " host; sage will not share it (remove that user or move"
                f" {self.setting}_base)",
            )
        return uid
