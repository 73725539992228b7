"""The runs folder: caps, per-principal quotas, manual prunes, artifacts paged back.

A fake sandbox that spills like the real one (the bytes past the output cap
go to ``artifacts/full_stdout.bin``); everything else is real files.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sage.config import Config, ForgeConfig, PrincipalConfig, SupervisorConfig
from sage.errors import ForgeError
from sage.forge.runs import PAGE_MAX, decode_page
from sage.forge.sandbox import SandboxResult, SandboxSpec
from sage.forge.service import Caller, Forge

pytestmark = pytest.mark.anyio

KIB = 1024
MIB = 1024 * 1024
CAP = 4096  # the output cap these forges run with

ALICE = Caller("alice", "s1")
BOB = Caller("bob", "s9")

PRINT = {
    "name": "say",
    "description": "print what it is told, n times",
    "input_schema": {
        "type": "object",
        "properties": {"text": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["text", "n"],
    },
    "impl": "print(1)",
    "runtime": "python",
}


class SpillingExecutor:
    """Answers with ``text * n`` as stdout and spills it like the sandbox does."""

    def __init__(self) -> None:
        self.specs: list[SandboxSpec] = []
        self.raw: bytes | None = None

    async def ensure(self) -> None:
        pass

    async def run(self, spec: SandboxSpec) -> SandboxResult:
        self.specs.append(spec)
        args = json.loads(spec.stdin)
        out = self.raw if self.raw is not None else (args["text"] * args["n"]).encode()
        cap = spec.limits.output_cap
        if len(out) <= cap:
            return SandboxResult(0, None, out, len(out), False, None, b"", False, 0.01, "bwrap")
        assert spec.artifacts_dir is not None
        path = spec.artifacts_dir / "full_stdout.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(out[: spec.limits.spill_cap])
        return SandboxResult(
            0, None, out[:cap], len(out), True, path, b"", False, 0.01, "bwrap", cap
        )

    async def aclose(self) -> None:
        pass


class Rig:
    def __init__(self, tmp: Path, **forge: Any) -> None:
        self.config = Config(
            supervisor=SupervisorConfig(state_dir=str(tmp / "state")),
            forge=ForgeConfig(output_cap=CAP, **forge),
            principals=[PrincipalConfig(name="alice"), PrincipalConfig(name="bob")],
        )
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.executor = SpillingExecutor()
        self.forge = Forge(
            self.config,
            lambda e, p: self.events.append((e, p)),
            executor=self.executor,
            secrets={"API_TOKEN": "tok-0123456789abcdef"}.get,
        )
        self.forged: set[Caller] = set()
        # floods of truncated (failed) calls: no breaker in the way
        self.policy(breakers={"per_tool_rpm": 0, "failure_threshold": 0})

    def policy(self, **fields: Any) -> None:
        self.forge.policy_file.current()  # the defaults written
        path = self.forge.policy_file.path
        data = json.loads(path.read_text())
        data.update(fields)
        path.write_text(json.dumps(data))

    async def spill(self, caller: Caller, size: int, text: str = "x") -> str:
        """One call of ``caller`` that spills ``size`` bytes; its run id."""
        if caller not in self.forged:
            await self.forge.forge(caller, PRINT)
            self.forged.add(caller)
        out = await self.forge.dispatch(caller, "say", {"text": text, "n": size // len(text)})
        assert out["error"] == "output_truncated", out
        run_id: str = out["meta"]["run_id"]
        return run_id

    def exists(self, run_id: str) -> bool:
        return (self.config.forge_dir / "runs" / run_id).exists()

    def pruned(self, reason: str | None = None) -> list[dict[str, Any]]:
        return [
            p
            for e, p in self.events
            if e == "runs_pruned" and (reason is None or p["reason"] == reason)
        ]

    def held(self, principal: str) -> int:
        usage = self.forge.runs.usage(principal)
        return int(usage["total_bytes"])


async def test_one_principals_flood_prunes_only_its_own_oldest_runs(tmp_path: Path) -> None:
    rig = Rig(tmp_path, runs_max_bytes=8 * MIB, runs_max_bytes_per_principal=1 * MIB)
    mine = await rig.spill(ALICE, 300 * KIB)
    flood = [await rig.spill(BOB, 300 * KIB) for _ in range(12)]
    assert rig.exists(mine)
    page = rig.forge.read_artifact(ALICE, {"run_id": mine})
    assert page["total_bytes"] == 300 * KIB
    # bob keeps his newest runs within his quota; his oldest went first
    kept = [r for r in flood if rig.exists(r)]
    assert kept == flood[-len(kept) :]
    assert 1 <= len(kept) <= 4
    assert rig.held("bob") <= 1 * MIB
    passes = rig.pruned("principal_quota")
    assert passes, rig.events
    assert sum(p["count"] for p in passes) == 12 - len(kept)
    assert all(
        p["principals"] == [{"principal": "bob", "count": p["count"], "bytes": p["bytes"]}]
        for p in passes
    )
    assert all(p["bytes"] >= 300 * KIB * p["count"] for p in passes)
    assert not rig.pruned("total_cap")


async def test_past_the_total_cap_the_heaviest_principal_loses_its_oldest(tmp_path: Path) -> None:
    # the quota allows the whole folder: only the total cap stops bob
    rig = Rig(tmp_path, runs_max_bytes=2 * MIB, runs_max_bytes_per_principal=2 * MIB)
    alice = [await rig.spill(ALICE, 300 * KIB) for _ in range(2)]
    flood = [await rig.spill(BOB, 300 * KIB) for _ in range(10)]
    assert all(rig.exists(r) for r in alice)
    kept = [r for r in flood if rig.exists(r)]
    assert kept == flood[-len(kept) :]
    assert rig.forge.runs.usage()["total_bytes"] <= 2 * MIB
    passes = rig.pruned("total_cap")
    assert passes
    assert all(p["principals"][0]["principal"] == "bob" for p in passes)
    assert all(p["max_bytes"] == 2 * MIB for p in passes)


async def test_a_run_in_use_is_never_pruned(tmp_path: Path) -> None:
    rig = Rig(tmp_path, runs_max_bytes=8 * MIB, runs_max_bytes_per_principal=1 * MIB)
    first = await rig.spill(BOB, 300 * KIB)
    with rig.forge.runs.using(first):  # a reader holds it
        for _ in range(6):
            await rig.spill(BOB, 300 * KIB)
        assert rig.exists(first)
    await rig.spill(BOB, 300 * KIB)
    assert not rig.exists(first)  # let go: the oldest goes first
    # one run's spill never passes its principal's quota (it would evict itself)
    assert rig.executor.specs[-1].limits.spill_cap == 1 * MIB


async def test_runs_written_before_a_restart_count(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    old = [await rig.spill(BOB, 300 * KIB) for _ in range(5)]
    assert all(rig.exists(r) for r in old)  # the defaults (2 GiB, 512 MiB) are far
    again = Rig(tmp_path, runs_max_bytes=4 * MIB, runs_max_bytes_per_principal=1 * MIB)
    await again.forge.forge(BOB, {**PRINT, "name": "say2"})
    out = await again.forge.dispatch(BOB, "say2", {"text": "y", "n": 300 * KIB})
    assert out["error"] == "output_truncated"
    assert [again.exists(r) for r in old] == [False, False, False, True, True]
    assert again.pruned("principal_quota")[0]["count"] == 3


def test_the_quota_defaults_to_a_quarter_and_may_not_pass_the_cap() -> None:
    assert ForgeConfig().runs_quota == 512 * MIB
    assert ForgeConfig(runs_max_bytes=8 * MIB).runs_quota == 2 * MIB
    with pytest.raises(ValueError, match="larger than runs_max_bytes"):
        ForgeConfig(runs_max_bytes=8 * MIB, runs_max_bytes_per_principal=9 * MIB)
    with pytest.raises(msgspec.ValidationError, match="runs_max_bytes_per_principal"):
        msgspec.convert({"runs_max_bytes_per_principal": 5}, ForgeConfig)


# -- manual prunes -------------------------------------------------------------


async def test_manual_prune_older_than_keep_bytes_and_dry_run(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    bob = [await rig.spill(BOB, 100 * KIB) for _ in range(4)]
    alice = [await rig.spill(ALICE, 100 * KIB) for _ in range(2)]
    # bob's first two are a day old
    for run_id in bob[:2]:
        manifest = rig.config.forge_dir / "runs" / run_id / "run_manifest.json"
        os.utime(manifest, (manifest.stat().st_atime, manifest.stat().st_mtime - 86400))
    admin = Caller(None, None)
    would = rig.forge.prune_runs(admin, None, older_than=3600, keep_bytes=None, dry_run=True)
    assert [r.run_id for r in would] == bob[:2]
    assert all(rig.exists(r) for r in bob)
    assert not rig.pruned()
    gone = rig.forge.prune_runs(admin, None, older_than=3600, keep_bytes=None, dry_run=False)
    assert [r.run_id for r in gone] == bob[:2]
    assert not any(rig.exists(r) for r in bob[:2])
    (audit,) = rig.pruned("manual")
    assert (audit["count"], audit["bytes"]) == (2, sum(r.bytes for r in gone))
    assert audit["older_than"] == 3600
    # bob prunes his own down to ~one run; alice's are not his to touch
    gone = rig.forge.prune_runs(BOB, None, older_than=None, keep_bytes=150 * KIB, dry_run=False)
    assert [r.run_id for r in gone] == [bob[2]]
    assert rig.exists(bob[3])
    assert all(rig.exists(r) for r in alice)
    with pytest.raises(ForgeError) as denied:
        rig.forge.prune_runs(BOB, "alice", older_than=0, keep_bytes=None, dry_run=False)
    assert denied.value.code == "acl_denied"
    assert ("acl_denied", {"principal": "bob", "name": "runs", "target": "alice"}) in rig.events
    with pytest.raises(ForgeError, match="older_than, keep_bytes or both"):
        rig.forge.prune_runs(admin, None, older_than=None, keep_bytes=None, dry_run=False)
    listed = rig.forge.list_runs(BOB, None, None, 20)
    assert [r["run_id"] for r in listed["runs"]] == [bob[3]]
    assert listed["runs"][0]["bytes"] > 100 * KIB
    assert listed["principals"] == [
        {"principal": "bob", "count": 1, "bytes": listed["runs"][0]["bytes"]}
    ]
    with pytest.raises(ForgeError):
        rig.forge.list_runs(BOB, "alice", None, 20)


# -- read_artifact -------------------------------------------------------------


async def test_the_truncated_result_names_the_run_and_read_artifact_pages_it(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    text = "héllo wörld ✓ "  # multibyte characters fall on page boundaries
    await rig.forge.forge(ALICE, PRINT)
    out = await rig.forge.dispatch(ALICE, "say", {"text": text, "n": 20000})
    run_id = out["meta"]["run_id"]
    assert run_id in out["message"]
    assert "read_artifact" in out["message"]
    assert "read_artifact" in [t["name"] for t in rig.forge.descriptors(ALICE)]
    whole = (text * 20000).encode()
    got, offset, pages = bytearray(), 0, 0
    while True:
        page = await rig.forge.dispatch(
            ALICE, "read_artifact", {"run_id": run_id, "offset": offset, "limit": 10_000}
        )
        assert page["ok"] is True, page
        data = page["data"]
        assert data["encoding"] == "utf-8"
        assert data["offset"] == offset
        assert 9_996 < data["bytes"] <= 10_000 or data["eof"]
        got += data["text"].encode()
        offset, pages = data["next_offset"], pages + 1
        if data["eof"]:
            break
    assert bytes(got) == whole
    assert offset == len(whole) == data["total_bytes"]
    # a huge limit is clamped to one page's bound
    big = rig.forge.read_artifact(ALICE, {"run_id": run_id, "limit": 10**12})
    assert big["bytes"] <= PAGE_MAX
    assert not big["eof"]
    # past the end: an empty last page
    end = rig.forge.read_artifact(ALICE, {"run_id": run_id, "offset": 10**9})
    assert (end["text"], end["eof"], end["next_offset"]) == ("", True, len(whole))


async def test_read_artifact_is_scoped_to_the_session_and_refuses_path_tricks(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path)
    run_id = await rig.spill(ALICE, 50 * KIB)
    others = [Caller("alice", "s2"), Caller("bob", "s1"), Caller(None, "s1"), Caller("bob", None)]
    for caller in others:
        out = await rig.forge.dispatch(caller, "read_artifact", {"run_id": run_id})
        assert out["error"] == "unknown_run", (caller, out)
    none = await rig.forge.dispatch(ALICE, "read_artifact", {"run_id": "20260101T000000Z_00"})
    assert none["error"] == "unknown_run"
    for bad in ("../" + run_id, f"{run_id}/../{run_id}", "..", ".", "", "/etc", run_id + "\n"):
        out = await rig.forge.dispatch(ALICE, "read_artifact", {"run_id": bad})
        assert out["error"] == "bad_arguments", (bad, out)
    for args in ({"offset": -1}, {"limit": 0}, {"limit": "9"}, {"offset": True}):
        out = await rig.forge.dispatch(ALICE, "read_artifact", {"run_id": run_id, **args})
        assert out["error"] == "bad_arguments", (args, out)
    # a symlink planted as the artifact is not followed
    artifact = rig.config.forge_dir / "runs" / run_id / "artifacts" / "full_stdout.bin"
    artifact.unlink()
    artifact.symlink_to("/etc/passwd")
    out = await rig.forge.dispatch(ALICE, "read_artifact", {"run_id": run_id})
    assert out["error"] == "no_artifact"


async def test_binary_artifacts_come_back_as_base64(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.executor.raw = bytes(range(256)) * 64
    run_id = await rig.spill(ALICE, 1)
    page = rig.forge.read_artifact(ALICE, {"run_id": run_id, "limit": 1000})
    assert page["encoding"] == "base64"
    assert base64.b64decode(page["text"]) == rig.executor.raw[:1000]
    assert page["next_offset"] == 1000
    # a cut character at a page's end waits for the next page; one inside is base64
    assert decode_page("aé".encode()[:2], at_end=False) == ("a", "utf-8", 1)
    assert decode_page(b"\xa9b", at_end=False)[1] == "base64"
    assert decode_page(b"a\x00b", at_end=False)[1] == "base64"  # \u0000 is six characters
    assert decode_page(b"a\tb\r\n", at_end=False) == ("a\tb\r\n", "utf-8", 5)
    assert decode_page("aé".encode()[:2], at_end=True)[1] == "base64"


async def test_a_run_with_secrets_or_without_a_spill_has_nothing_to_page(tmp_path: Path) -> None:
    rig = Rig(tmp_path, runs_max_bytes=8 * MIB)
    rig.policy(persona_secret_allow={"alice": ["API_TOKEN"]})
    await rig.forge.forge(ALICE, {**PRINT, "name": "sec", "meta": {"secrets": ["API_TOKEN"]}})
    out = await rig.forge.dispatch(ALICE, "sec", {"text": "x", "n": 10 * KIB})
    assert out["error"] == "output_truncated"
    assert "read_artifact" not in out["message"]
    page = await rig.forge.dispatch(ALICE, "read_artifact", {"run_id": out["meta"]["run_id"]})
    assert page["error"] == "artifact_withheld"
    small = await rig.forge.dispatch(ALICE, "sec", {"text": "x", "n": 10})
    assert small["ok"] is False  # "xxx…" is not JSON; the run kept no artifact
    run_id = [p for e, p in rig.events if e == "called"][-1]["run_id"]
    await rig.forge.forge(ALICE, PRINT)
    plain = await rig.forge.dispatch(ALICE, "say", {"text": "x", "n": 10})
    assert plain["error"] == "bad_output"
    plain_id = [p for e, p in rig.events if e == "called"][-1]["run_id"]
    assert plain_id != run_id
    page = await rig.forge.dispatch(ALICE, "read_artifact", {"run_id": plain_id})
    assert page["error"] == "no_artifact"


async def test_read_artifact_cannot_be_forged_over(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    with pytest.raises(ForgeError) as exc:
        await rig.forge.forge(ALICE, {**PRINT, "name": "read_artifact"})
    assert exc.value.code == "bad_name"
