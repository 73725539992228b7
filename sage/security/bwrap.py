"""Whether bubblewrap can sandbox anything on this host.

Forged tools run inside ``bwrap``; a host where it is missing, or where the
kernel or a container refuses the namespaces it needs, cannot run them.
:func:`probe_bwrap` finds ``bwrap`` on PATH, reads ``bwrap --version`` and
then really starts the smallest sandbox sage would use (every namespace
unshared, no capabilities, an empty environment, ``/usr`` read-only) around
``/bin/true``: only an exit 0 of that counts (as the sandbox uid when
``uid`` is given and the caller is root, since that is how forge runs it).  :func:`sandbox_argv` builds
that command from the host's root layout, so a merged-``/usr`` system
(``/bin``, ``/lib`` ... symlinks into ``/usr``, as on Debian 12) and an
older split one both work.  The result is a :class:`BwrapProbe` saying why
when it is not ok; the probe never raises for a broken host.

Forge starts bwrap through :func:`launcher`: ``setpriv`` (the death signal,
and the sandbox uid when the caller is root) then ``prlimit`` (the rlimits),
both from util-linux.  Doing those in small programs instead of between
fork and exec of the supervisor lets Python spawn with ``vfork``: a fork
copies the supervisor's page tables (10 ms with a 200 MB heap, with the
event loop stopped) where ``vfork`` costs a fraction of a millisecond.  The
probe runs its sandbox through the same launcher, so a host without them
fails the probe too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec

__all__ = ("BwrapProbe", "launcher", "probe_bwrap", "sandbox_argv")

_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_VERSION = re.compile(r"\d+(?:\.\d+)+")
_TAIL = 200


class BwrapProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What :func:`probe_bwrap` found."""

    ok: bool
    """True only when a minimal sandbox ran and exited 0."""
    path: str = ""
    """The ``bwrap`` found on PATH; empty when there is none."""
    version: str = ""
    """Its version (``0.8.0``), or its first output line if that has no number."""
    reason: str = ""
    """Why it is not ok, one line; empty when ok."""
    setpriv: str = ""
    """util-linux ``setpriv`` (death signal, uid); empty when missing."""
    prlimit: str = ""
    """util-linux ``prlimit`` (rlimits); empty when missing."""


def launcher(
    probe: BwrapProbe, *, uid: int | None = None, rlimits: Sequence[tuple[str, int, int]] = ()
) -> list[str]:
    """The command that goes before ``bwrap``: death signal, ``uid`` (root only), ``rlimits``.

    ``rlimits`` are ``(name, soft, hard)`` with prlimit's names (``cpu``,
    ``as``, ``fsize``, ``nofile``, ``core``, ``nproc``).  ``setpriv`` sets
    ``PR_SET_PDEATHSIG`` after it changes the uid (a uid change clears it),
    and the signal survives the two ``execve`` that follow.
    """
    argv = [probe.setpriv, "--pdeathsig", "KILL"]
    if uid is not None:
        argv += ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"]
    argv.append("--")
    if rlimits:
        argv.append(probe.prlimit)
        argv += [f"--{name}={soft}:{hard}" for name, soft, hard in rlimits]
        argv.append("--")
    return argv


def sandbox_argv(bwrap: str, root: Path = Path("/")) -> list[str]:
    """The minimal sandbox command around ``/bin/true``, for the layout under ``root``."""
    argv = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--clearenv",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for name in _TOP_LEVEL:
        host = root / name
        if host.is_symlink():
            argv += ["--symlink", os.readlink(host), f"/{name}"]
        elif host.is_dir():
            argv += ["--ro-bind", f"/{name}", f"/{name}"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--", "/bin/true"]
    return argv


async def probe_bwrap(
    *,
    timeout: float = 10.0,  # noqa: ASYNC109 - a hung bwrap is a finding
    uid: int | None = None,
) -> BwrapProbe:
    """Find ``bwrap``, read its version and run a minimal sandbox; never raises for a bad host.

    With ``uid`` (the sandbox uid) and a root caller, the sandbox is started as
    that uid, as forge starts it: this is what needs unprivileged user
    namespaces, which root itself does not.
    """
    found = shutil.which("bwrap")
    if found is None:
        return BwrapProbe(
            ok=False,
            reason="bwrap not found on PATH (install bubblewrap: `apt-get install bubblewrap`)",
        )
    env = {"PATH": os.environ.get("PATH", os.defpath)}
    setpriv, prlimit = shutil.which("setpriv"), shutil.which("prlimit")
    if setpriv is None or prlimit is None:
        missing = " and ".join(n for n, p in (("setpriv", setpriv), ("prlimit", prlimit)) if not p)
        return BwrapProbe(
            ok=False,
            path=found,
            reason=f"{missing} not found on PATH (they come with util-linux), and forge"
            " starts bwrap through them",
        )
    tools = BwrapProbe(ok=False, path=found, setpriv=setpriv, prlimit=prlimit)
    as_uid = uid if uid is not None and os.geteuid() == 0 and uid != 0 else None
    version = ""
    try:
        with anyio.fail_after(timeout):
            result = await _run([found, "--version"], env)
            if result.returncode != 0:
                return BwrapProbe(
                    ok=False, path=found, reason=f"bwrap --version {_failure(result)}"
                )
            version = _version_of(result.stdout.decode(errors="replace"))
            argv = launcher(tools, uid=as_uid, rlimits=(("core", 0, 0),)) + sandbox_argv(found)
            result = await _run(argv, env)
    except TimeoutError:
        return BwrapProbe(
            ok=False,
            path=found,
            version=version,
            reason=f"bwrap did not finish within {timeout:g} s",
        )
    except OSError as exc:
        return BwrapProbe(
            ok=False, path=found, version=version, reason=f"cannot run bwrap: {exc.strerror or exc}"
        )
    if result.returncode != 0:
        return BwrapProbe(
            ok=False,
            path=found,
            version=version,
            reason=f"a minimal sandbox {_failure(result)}",
        )
    return BwrapProbe(ok=True, path=found, version=version, setpriv=setpriv, prlimit=prlimit)


async def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return await anyio.run_process(argv, stdin=subprocess.DEVNULL, env=env, cwd="/", check=False)


def _version_of(output: str) -> str:
    match = _VERSION.search(output)
    if match:
        return match.group(0)
    lines = output.strip().splitlines()
    return lines[0] if lines else ""


def _failure(result: subprocess.CompletedProcess[bytes]) -> str:
    code = result.returncode
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    said = " ".join(result.stderr.decode(errors="replace").split())
    if len(said) > _TAIL:
        said = "..." + said[-_TAIL:]
    return f"{how}: {said}" if said else how
