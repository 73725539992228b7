"""The forge sandbox escape suite: each test tries one way out, with real bwrap, and asserts it failed.

Tests marked ``both`` run twice: in a fresh sandbox and in a spare one
(sage.forge.spares, started ahead of the call); the spare run asserts the
call really took the spare.
"""

from __future__ import annotations

import base64
import json
import os
import pty
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from sage.errors import SandboxError
from sage.forge import mounts
from sage.forge import sandbox as sb
from sage.forge.mounts import Bind
from sage.forge.sandbox import Limits, SandboxResult, SandboxSpec, run_sandboxed
from sage.forge.spares import SparePool, kind_of, spare_forge_bytes
from sage.redaction import redact_json, redact_text
from tests.support.sandbox_rig import LIMITS, PY, in_spare

pytestmark = pytest.mark.anyio


_POOL: SparePool | None = None


@pytest.fixture(params=["fresh", "spare"])
async def sandbox(request: pytest.FixtureRequest) -> Any:
    """``fresh``: every call starts its own sandbox; ``spare``: calls take a primed spare."""
    global _POOL
    pool = SparePool(2) if request.param == "spare" else None
    _POOL = pool
    try:
        yield request.param
    finally:
        _POOL = None
        if pool is not None:
            await pool.aclose()


both = pytest.mark.usefixtures("sandbox")


@pytest.fixture
def open_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder the sandbox uid may reach (tmp_path's parents are 0700 for root)."""
    base = Path("/tmp") / f"forge-test-{os.getpid()}-{time.monotonic_ns()}"
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    yield base
    subprocess.run(["rm", "-rf", str(base)], check=False)


async def _run(code: str, *, stdin: Any = None, **kwargs: Any) -> SandboxResult:
    limits = kwargs.pop("limits", LIMITS)
    impl_path = kwargs.pop("impl_path", sb.IMPL_PATH)
    spec = SandboxSpec(
        argv=[PY, impl_path],
        impl_path=impl_path,
        impl=textwrap.dedent(code).encode(),
        stdin=json.dumps(stdin or {}).encode(),
        limits=limits,
        **kwargs,
    )
    pool = _POOL
    if pool is None or kind_of(spec) is None:
        return await run_sandboxed(spec)
    return await in_spare(pool, spec)


def _json(result: SandboxResult) -> Any:
    assert result.exit_code == 0, result.stderr_tail.decode(errors="replace")
    return json.loads(result.stdout)


def _read_or_empty(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _tokens_alive(token: str) -> list[int]:
    alive = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            except OSError:
                continue
            if token.encode() in cmdline:
                alive.append(int(name))
    return alive


@both
async def test_a_plain_tool_runs_as_the_sandbox_uid() -> None:
    """Baseline: stdin in, JSON out, the sandbox uid, a clean environment, label bwrap."""
    result = await _run(
        """
        import json, os, sys
        print(json.dumps({"in": json.load(sys.stdin), "uid": os.getuid(), "env": dict(os.environ)}))
        """,
        stdin={"n": 3},
    )
    data = _json(result)
    assert data["in"] == {"n": 3}
    assert data["uid"] == (LIMITS.sandbox_uid if os.geteuid() == 0 else os.getuid())
    assert data["uid"] != 65534
    assert set(data["env"]) <= {"PATH", "LANG", "HOME", "TMPDIR", "PWD", "LC_CTYPE"}
    assert result.label == "bwrap"
    assert not result.timed_out


async def test_cannot_read_a_path_the_schema_did_not_name(open_dir: Path) -> None:
    """A sibling of the bound folder and the unbound host file are simply not there."""
    named = open_dir / "named"
    named.mkdir(mode=0o755)
    (named / "ok.txt").write_text("visible")
    (open_dir / "secret.txt").write_text("HOST-ONLY-CONTENT")
    (open_dir / "secret.txt").chmod(0o644)
    result = await _run(
        f"""
        import json
        out = {{"named": open({str(named / "ok.txt")!r}).read()}}
        try:
            out["other"] = open({str(open_dir / "secret.txt")!r}).read()
        except OSError as exc:
            out["other"] = type(exc).__name__
        print(json.dumps(out))
        """,
        binds=(Bind(named, "ro"),),
    )
    data = _json(result)
    assert data == {"named": "visible", "other": "FileNotFoundError"}
    assert b"HOST-ONLY-CONTENT" not in result.stdout


async def test_cannot_write_to_an_ro_path(open_dir: Path) -> None:
    """Even a 0777 folder bound ro refuses writes (EROFS); the host file is unchanged."""
    folder = open_dir / "ro"
    folder.mkdir()
    folder.chmod(0o777)
    (folder / "f.txt").write_text("original")
    (folder / "f.txt").chmod(0o666)
    result = await _run(
        f"""
        import json, errno
        out = {{}}
        for name in ("f.txt", "new.txt"):
            try:
                open({str(folder)!r} + "/" + name, "w").write("pwned")
                out[name] = "written"
            except OSError as exc:
                out[name] = errno.errorcode[exc.errno]
        print(json.dumps(out))
        """,
        binds=(Bind(folder, "ro"),),
    )
    assert _json(result) == {"f.txt": "EROFS", "new.txt": "EROFS"}
    assert (folder / "f.txt").read_text() == "original"
    assert not (folder / "new.txt").exists()


@both
async def test_cannot_read_etc_shadow_or_the_vault(open_dir: Path) -> None:
    """/etc/shadow and the state folder's secrets.db are absent inside; binding them is refused."""
    state = open_dir / "state"
    state.mkdir(mode=0o755)
    vault = state / "secrets.db"
    vault.write_text("VAULT-BYTES")
    vault.chmod(0o644)
    result = await _run(
        f"""
        import json
        out = {{}}
        for path in ("/etc/shadow", {str(vault)!r}):
            try:
                out[path] = open(path).read()
            except OSError as exc:
                out[path] = type(exc).__name__
        print(json.dumps(out))
        """
    )
    assert set(_json(result).values()) == {"FileNotFoundError"}
    for bad in (Path("/etc/shadow"), vault, state, open_dir, Path("/")):
        with pytest.raises(SandboxError) as caught:
            await _run("pass", binds=(Bind(bad, "ro"),), forbidden=(state, vault))
        assert caught.value.code == "mount_refused"


@both
async def test_cannot_open_a_tcp_connection_without_network() -> None:
    """No network namespace: a listener on the host's loopback gets nothing, outbound fails."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        result = await _run(
            f"""
            import json, socket
            out = {{}}
            for host in ("127.0.0.1", "1.1.1.1"):
                try:
                    socket.create_connection((host, {port} if host == "127.0.0.1" else 53), timeout=1)
                    out[host] = "connected"
                except OSError as exc:
                    out[host] = type(exc).__name__
            print(json.dumps(out))
            """
        )
        with pytest.raises(TimeoutError):
            listener.accept()
    data = _json(result)
    assert "connected" not in data.values()


@both
async def test_cannot_reach_loopback_with_network_allowed() -> None:
    """With the network shared, the shim refuses 127.0.0.1, localhost, ::ffff:127.0.0.1, IMDS.

    Control: the same tool with loopback allowed does connect, so the listener is reachable.
    """
    tool = """
        import json, socket, sys
        port = json.load(sys.stdin)["port"]
        out = {}
        for host in ("127.0.0.1", "localhost", "127.1.2.3", "0.0.0.0"):
            try:
                socket.create_connection((host, port), timeout=1).close()
                out[host] = "connected"
            except OSError as exc:
                out[host] = type(exc).__name__
        s6 = socket.socket(socket.AF_INET6)
        out["mapped"] = s6.connect_ex(("::ffff:127.0.0.1", port))
        s = socket.socket()
        out["imds"] = s.connect_ex(("169.254.169.254", 80))
        print(json.dumps(out))
    """
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        denied = await _run(tool, stdin={"port": port}, network=True)
        with pytest.raises(TimeoutError):
            listener.accept()
        data = _json(denied)
        assert denied.label == "bwrap+net-noloop"
        assert data["127.0.0.1"] == data["localhost"] == data["127.1.2.3"] == "PermissionError"
        assert data["0.0.0.0"] == "PermissionError"
        assert data["mapped"] == data["imds"] == 13  # EACCES
        allowed = await _run(tool, stdin={"port": port}, network=True, loopback=True)
        assert _json(allowed)["127.0.0.1"] == "connected"
        assert _json(allowed)["imds"] == 13  # metadata stays denied
        assert allowed.label == "bwrap+net"


async def test_fork_bomb_is_contained() -> None:
    """RLIMIT_NPROC stops the bomb, the wall clock ends the call, nothing survives, the host forks."""
    token = f"forkbomb-{os.getpid()}-{time.monotonic_ns()}"
    limits = Limits(**{**LIMITS.__dict__, "wall_clock": 3.0, "max_processes": 12})
    started = time.monotonic()
    result = await _run(
        """
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)
        """,
        limits=limits,
        impl_path=f"/forge/{token}.py",
    )
    assert time.monotonic() - started < limits.wall_clock + 2.5
    assert result.timed_out
    await anyio.sleep(0.1)
    assert _tokens_alive(token) == []
    assert os.waitstatus_to_exitcode(os.system("/bin/true")) == 0  # noqa: ASYNC221 - the host still forks


@both
async def test_memory_balloon_is_contained() -> None:
    """RLIMIT_AS: allocation fails with MemoryError well below the host's memory."""
    limits = Limits(**{**LIMITS.__dict__, "memory_bytes": 256 * 1024 * 1024})
    result = await _run(
        """
        import json
        chunks, got = [], 0
        try:
            while True:
                chunks.append(bytearray(16 * 1024 * 1024))
                got += 16
        except MemoryError:
            pass
        print(json.dumps({"mib": got}))
        """,
        limits=limits,
    )
    assert _json(result)["mib"] < 256


@both
async def test_infinite_loop_is_killed_by_the_cpu_limit_or_wall_clock() -> None:
    """A busy loop is killed by RLIMIT_CPU (SIGXCPU); a sleeping one by the wall clock."""
    limits = Limits(**{**LIMITS.__dict__, "cpu_seconds": 1, "wall_clock": 4.0})
    busy = await _run("while True: pass", limits=limits)
    assert busy.signal in (24, 9)  # SIGXCPU, or SIGKILL at the hard limit
    assert busy.duration < 4.0
    limits = Limits(**{**LIMITS.__dict__, "wall_clock": 1.0})
    idle = await _run("import time\nwhile True: time.sleep(1)", limits=limits)
    assert idle.timed_out
    assert idle.duration < 3.0


@both
async def test_a_daemonized_grandchild_dies_with_the_sandbox() -> None:
    """setsid + double fork inside: gone after the call, whether it ended or timed out."""
    for ending in ("exit", "hang"):
        token = f"daemon-{ending}-{os.getpid()}-{time.monotonic_ns()}"
        limits = Limits(**{**LIMITS.__dict__, "wall_clock": 2.0})
        result = await _run(
            f"""
            import subprocess, time
            subprocess.Popen(["/usr/bin/setsid", "/usr/bin/sleep", "1000"], start_new_session=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={{"T": {token!r}}})
            subprocess.Popen(["/bin/sh", "-c", "sleep 1000 # {token}"], start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.3)
            {"time.sleep(100)" if ending == "hang" else "pass"}
            """,
            limits=limits,
        )
        assert result.timed_out is (ending == "hang")
        await anyio.sleep(0.1)
        assert _tokens_alive(token) == []


def _tiocsti_child(fd_out: int) -> None:  # pragma: no cover - runs in a pty child
    async def go() -> SandboxResult:
        return await _run(
            """
            import fcntl, json, os, termios
            out = {}
            try:
                fd = os.open("/dev/tty", os.O_RDWR)
                fcntl.ioctl(fd, termios.TIOCSTI, b"x")
                out["tty"] = "injected"
            except OSError as exc:
                out["tty"] = type(exc).__name__
            for fd in (0, 1, 2):
                try:
                    fcntl.ioctl(fd, termios.TIOCSTI, b"x")
                    out[str(fd)] = "injected"
                except OSError as exc:
                    out[str(fd)] = type(exc).__name__
            print(json.dumps(out))
            """
        )

    result = anyio.run(go)
    import termios
    import tty

    tty.setraw(0)
    os.set_blocking(0, False)
    try:
        pending = os.read(0, 100)
    except BlockingIOError:
        pending = b""
    termios.tcflush(0, termios.TCIFLUSH)
    report = {"stdout": result.stdout.decode(), "pending": pending.decode(errors="replace")}
    os.write(fd_out, json.dumps(report).encode())


def test_tiocsti_on_the_terminal_fails() -> None:
    """Run from a process that has a controlling terminal: nothing gets pushed into its input."""
    read_end, write_end = os.pipe()
    pid, master = pty.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            _tiocsti_child(write_end)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        raw = reader.read()  # until the child exits (it writes nothing to the pty)
    os.waitpid(pid, 0)
    os.close(master)
    report = json.loads(raw)
    assert report["pending"] == ""
    inside = json.loads(report["stdout"])
    assert "injected" not in inside.values()
    assert inside["tty"] in ("OSError", "FileNotFoundError")  # ENXIO: no controlling terminal


async def test_an_xbind_symlink_to_etc_is_refused(open_dir: Path) -> None:
    """A path that is a symlink to /etc (or into it) is refused before anything starts."""
    (open_dir / "innocent").symlink_to("/etc")
    (open_dir / "hosts").symlink_to("/etc/hostname")
    for path in (open_dir / "innocent", open_dir / "hosts", open_dir / "innocent" / "ssl"):
        with pytest.raises(SandboxError) as caught:
            await _run("pass", binds=(Bind(path, "ro"),))
        assert caught.value.code == "mount_refused"
        assert "/etc" in str(caught.value)


async def test_a_path_swapped_for_a_symlink_after_the_check(
    open_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapped between check and open: refused.  Swapped after open: the checked folder is mounted."""
    data = open_dir / "data"
    data.mkdir(mode=0o755)
    (data / "mine.txt").write_text("checked content")
    (data / "mine.txt").chmod(0o644)
    hostname = _read_or_empty("/etc/hostname")
    real_check = mounts.check_binds

    def check_then_swap(*args: Any, **kwargs: Any) -> Any:
        checked = real_check(*args, **kwargs)
        data.rename(open_dir / "moved")
        data.symlink_to("/etc")
        return checked

    monkeypatch.setattr(mounts, "check_binds", check_then_swap)
    with pytest.raises(SandboxError) as caught:
        await _run("pass", binds=(Bind(data, "ro"),))
    assert caught.value.code == "mount_refused"
    assert "swapped" in str(caught.value)
    monkeypatch.undo()

    data.unlink()
    (open_dir / "moved").rename(data)
    real_open = mounts.open_binds

    def open_then_swap(binds: Any) -> Any:
        fds = real_open(binds)
        data.rename(open_dir / "moved")
        data.symlink_to("/etc")
        return fds

    monkeypatch.setattr(mounts, "open_binds", open_then_swap)
    result = await _run(
        f"""
        import json, os
        print(json.dumps(sorted(os.listdir({str(data)!r}))))
        """,
        binds=(Bind(data, "ro"),),
    )
    assert _json(result) == ["mine.txt"]
    if hostname:
        assert hostname.encode() not in result.stdout


@both
async def test_ten_megabytes_of_stdout_are_capped_and_spilled(tmp_path: Path) -> None:
    """1 MiB cap: the first MiB returned, all 10 MiB in full_stdout.bin (0600), counted."""
    artifacts = tmp_path / "runs" / "r1" / "artifacts"
    result = await _run(
        """
        import sys
        block = bytes(range(256)) * 4096
        for _ in range(10):
            sys.stdout.buffer.write(block)
        """,
        artifacts_dir=artifacts,
    )
    assert result.exit_code == 0
    total = 10 * 1024 * 1024
    expected = (bytes(range(256)) * 4096) * 10
    assert result.stdout_total_bytes == total
    assert result.stdout_truncated
    assert result.stdout_truncated_at_bytes == LIMITS.output_cap
    assert result.stdout == expected[: LIMITS.output_cap]
    assert result.stdout_artifact == artifacts / "full_stdout.bin"
    assert result.stdout_artifact.read_bytes() == expected
    assert result.stdout_artifact.stat().st_mode & 0o777 == 0o600


@both
async def test_a_secret_printed_raw_base64_and_split_is_redacted() -> None:
    """The caller redacts stdout (JSON) and stderr: no form of the secret survives."""
    secret = "sk-test-1234567890abcdefSECRET"
    result = await _run(
        """
        import base64, json, os, sys, binascii
        s = os.environ["API_KEY"]
        b64 = base64.b64encode(s.encode()).decode()
        print(json.dumps({"raw": s, "b64": b64, "split": s[:10] + "\\n" + s[10:],
                          "pieces": [s[:12], s[12:]], "hex": binascii.hexlify(s.encode()).decode(),
                          s: "as a key", "env": dict(os.environ)}))
        sys.stderr.write("leak " + s[:7] + "\\n" + s[7:] + " and " + b64[:20] + "\\n" + b64[20:] + "\\n")
        """,
        env={"API_KEY": secret},
    )
    data = _json(result)
    assert data["raw"] == secret  # the tool really printed it
    clean = json.dumps(redact_json(data, [secret]))
    text = redact_text(result.stderr_tail.decode(), [secret])
    b64 = base64.b64encode(secret.encode()).decode()
    for blob in (clean, text):
        squeezed = "".join(blob.split()).replace("\\n", "")
        assert secret not in squeezed
        assert b64 not in squeezed
        assert b64.rstrip("=") not in squeezed
        assert secret.encode().hex() not in squeezed
        assert secret[:12] not in squeezed
    assert "<redacted>" in text


@both
async def test_the_sandbox_root_is_read_only(open_dir: Path) -> None:
    """bwrap's root tmpfs has no size cap: nothing may be written there (only /tmp, capped)."""
    (open_dir / "f.txt").write_text("x")
    (open_dir / "f.txt").chmod(0o644)
    result = await _run(
        f"""
        import errno, json
        out = {{}}
        for path in ("/x", "/usr-like", "/forge/extra", {str(open_dir / "g.txt")!r}, "/tmp/ok"):
            try:
                open(path, "w").write("x")
                out[path] = "written"
            except OSError as exc:
                out[path] = errno.errorcode[exc.errno]
        print(json.dumps(out))
        """,
    )
    data = _json(result)
    assert data.pop("/tmp/ok") == "written"
    assert data.pop(str(open_dir / "g.txt")) == "ENOENT"  # not bound: not there
    assert set(data.values()) <= {"EROFS", "EACCES"}, data


_MOUNT_WALK = """
import errno, json, os, stat

def unescape(text):
    return text.encode().decode("unicode_escape")

mounts = []
for line in open("/proc/self/mountinfo"):
    left, _, right = line.rstrip("\\n").partition(" - ")
    fields, tail = left.split(), right.split()
    mounts.append({
        "point": unescape(fields[4]),
        "opts": fields[5].split(","),
        "fstype": tail[0],
        "super": tail[2].split(","),
    })
# every place that takes a file: each mount point that is a folder, and /dev/shm
places = sorted({m["point"] for m in mounts if os.path.isdir(m["point"])} | {"/dev/shm"})
chunk = b"x" * (1 << 20)
stop = LIMIT + (8 << 20)  # a little past the whole cap, then give up
written = {}


def fill(place):
    total = 0
    for n in range(stop // (4 << 20) + 1):
        try:
            fd = os.open(f"{place}/.fill{n}", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return total
        try:
            for _ in range(4):  # files of 4 MiB: under RLIMIT_FSIZE
                if total >= stop:
                    return total
                total += os.write(fd, chunk)
        except OSError:
            return total
        finally:
            os.close(fd)
    return total


for place in places:
    total = fill(place)
    if total:
        written[place] = total
kinds = {m["point"]: stat.S_IFMT(os.stat(m["point"]).st_mode) for m in mounts}
print(json.dumps({"mounts": mounts, "written": written, "kinds": kinds}))
"""


def _cap_of(spare: bool) -> int:
    return LIMITS.writable_bytes(spare_forge_bytes() if spare else 0)


@both
async def test_no_writable_filesystem_without_a_cap(sandbox: str) -> None:
    """Every writable mount is a capped tmpfs (or proc, devpts, a device node): no /dev/shm of host RAM."""
    cap = _cap_of(sandbox == "spare")
    data = _json(await _run(_MOUNT_WALK.replace("LIMIT", str(cap))))
    sizes = 0
    for mount in data["mounts"]:
        if "rw" not in mount["opts"]:
            continue
        kind = data["kinds"][mount["point"]]
        if mount["fstype"] in ("proc", "devpts") or kind == stat.S_IFCHR:
            continue
        assert mount["fstype"] == "tmpfs", mount
        size = [o for o in mount["super"] if o.startswith("size=")]
        assert size, f"{mount['point']} is a writable tmpfs with no size cap: {mount}"
        sizes += int(size[0][5:].rstrip("k")) * 1024
    assert 0 < sizes <= cap


@both
async def test_the_bytes_one_call_may_write_are_capped(sandbox: str) -> None:
    """Filling every writable place (/tmp, /dev/shm, /dev, /forge, ...) stops at the call's cap."""
    cap = _cap_of(sandbox == "spare")
    data = _json(await _run(_MOUNT_WALK.replace("LIMIT", str(cap))))
    written = data["written"]
    assert written.get("/tmp", 0) >= 8 << 20, written  # /tmp takes writes, up to its size
    assert "/dev" not in written, written
    assert written.get("/dev/shm", 0) <= LIMITS.shm_bytes, written
    assert sum(written.values()) <= cap, written


@both
async def test_memory_outside_the_file_systems_is_refused(sandbox: str) -> None:
    """memfds (RLIMIT_FSIZE each, not the cap), System V shm and message queues (no
    limit but the namespace's) would hold bytes past the cap and RLIMIT_AS: refused."""
    cap = _cap_of(sandbox == "spare")
    result = await _run(
        f"""
        import ctypes, errno, json, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        out, held, chunk = {{}}, 0, b"x" * (1 << 20)
        try:
            while held < {cap} + (8 << 20):
                fd = os.memfd_create("fill")  # files of 4 MiB: under RLIMIT_FSIZE
                for _ in range(4):
                    held += os.write(fd, chunk)
            out["memfd"] = "held"
        except OSError as exc:
            out["memfd"] = errno.errorcode[exc.errno]
        size, shm = 8 << 20, 0
        while held + shm < {cap} + (8 << 20):
            sid = libc.shmget(0, ctypes.c_size_t(size), 0o1600)
            if sid < 0:
                out["shm"] = errno.errorcode[ctypes.get_errno()]
                break
            addr = libc.shmat(sid, None, 0)
            ctypes.memset(addr, 1, size)
            libc.shmdt(ctypes.c_void_p(addr))  # detached: no longer in RLIMIT_AS
            shm += size
        else:
            out["shm"] = "held"
        queue = libc.msgget(0, 0o1600)
        out["msg"] = "made" if queue >= 0 else errno.errorcode[ctypes.get_errno()]
        out["held"] = held + shm
        print(json.dumps(out))
        """
    )
    data = _json(result)
    assert data["held"] <= cap, data
    assert (data["memfd"], data["shm"], data["msg"]) == ("EPERM", "EPERM", "EPERM"), data


@both
async def test_a_syscall_of_another_abi_kills_the_tool() -> None:
    """``int 0x80`` (the 32-bit ABI, numbers of its own) would pass a filter by number."""
    assert os.uname().machine == "x86_64", "this row is written for x86_64"
    result = await _run(
        """
        import ctypes, mmap
        code = b"\\xb8\\x14\\x00\\x00\\x00\\xcd\\x80\\xc3"  # mov eax, 20 (getpid); int 0x80; ret
        page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        call = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
        print("returned", call(), flush=True)
        """
    )
    assert result.signal == signal.SIGSYS, result
    assert b"returned" not in result.stdout


@both
async def test_proc_shows_only_the_sandbox() -> None:
    """A fresh /proc of its own pid namespace: a handful of pids, and none of the host's."""
    result = await _run(
        """
        import json, os, subprocess
        p = subprocess.Popen(["/usr/bin/sleep", "5"])
        pids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
        cmd = [open(f"/proc/{n}/cmdline", "rb").read().decode(errors="replace") for n in pids]
        p.kill()
        print(json.dumps({"pids": pids, "cmd": cmd}))
        """
    )
    data = _json(result)
    assert len(data["pids"]) <= 4
    assert max(data["pids"]) < 10
    assert not any("pytest" in c for c in data["cmd"])


async def test_setup_failure_raises_and_bwrap_missing_fails_closed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No working bwrap: every call raises sandbox_unavailable (fail closed), nothing runs."""
    probe = sb.SandboxProbe()
    monkeypatch.setattr(sb, "_PROBE", probe)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxError) as caught:
        await _run("print('ran')")
    assert caught.value.code == "sandbox_unavailable"
    assert "forge refuses to run tools" in str(caught.value)
    assert "bwrap not found" in str(caught.value)


if sys.platform != "linux":  # pragma: no cover
    pytest.skip("bwrap is Linux only", allow_module_level=True)
