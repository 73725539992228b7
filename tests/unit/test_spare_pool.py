"""The warm-spare pool's decisions, without a process: which spare a spawn may
take, when one is stale or too old, that each is used once, and the bounds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import cast

import pytest

from capsules.runner.claude_process import ClaudeProcess
from capsules.runner.command import Launch
from capsules.runner.errors import SessionError
from capsules.runner.mcp import McpServer
from capsules.runner.spare_keeper import SpareHost
from capsules.runner.spares import (
    DEFAULT_KIND,
    RETRY_MAX,
    Kind,
    Spare,
    SpareInputs,
    SparePool,
    SpareState,
    binary_identity,
    env_digest,
    inputs_of,
)
from sage.claude.protocol import CanUseToolRequest, HookCallbackRequest
from sage.errors import IllegalTransition

INPUTS = SpareInputs(
    flags_hash="sha256:f", identity="sha256:i", env="sha256:e", binary=("/c", 1, 2, 3, 4)
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _default(*names: str) -> dict[str, list[Kind]]:
    """Targets: each principal with the default kind only."""
    return {name: [DEFAULT_KIND] for name in names}


def _each(*names: str) -> list[tuple[str, Kind]]:
    return [(name, DEFAULT_KIND) for name in names]


def _pool(per_principal: int = 1, max_age: float = 60.0) -> tuple[SparePool[str], Clock]:
    clock = Clock()
    return SparePool(per_principal, max_age, clock), clock


def _spare(
    pool: SparePool[str], sid: str = "s1", principal: str = "alice", **kw: str
) -> Spare[str]:
    spare = Spare(
        session_id=sid,
        claude_session=f"uuid-{sid}",
        principal_id=principal,
        cwd=kw.get("cwd", ""),
        model=kw.get("model", ""),
        born=pool.clock(),
        handle=f"proc-{sid}",
    )
    pool.add(spare)
    return spare


def test_only_a_ready_spare_is_claimed() -> None:
    """A spare still starting (``initialize`` not answered) is not handed out."""
    pool, _ = _pool()
    spare = _spare(pool)
    assert pool.claim("alice", "", "") is None
    assert pool.ready(spare, INPUTS)
    assert pool.claim("alice", "", "") is spare
    assert spare.state is SpareState.CLAIMED


def test_a_spare_is_used_once() -> None:
    """Claimed, a spare leaves the pool: a second spawn finds none, and the pool wants
    a new one."""
    pool, _ = _pool()
    spare = _spare(pool)
    pool.ready(spare, INPUTS)
    assert pool.claim("alice", "", "") is spare
    assert pool.claim("alice", "", "") is None
    assert len(pool) == 0
    assert pool.wanted(_default("alice")) == _each("alice")
    assert not pool.discard(spare, "late")  # it is the session's now
    assert spare.state is SpareState.CLAIMED


@pytest.mark.parametrize(
    ("principal", "cwd", "model"),
    [("bob", "/home/alice", ""), ("alice", "/srv/work", ""), ("alice", "/home/alice", "opus")],
)
def test_another_principal_folder_or_model_finds_no_spare(
    principal: str, cwd: str, model: str
) -> None:
    """A spare serves only its principal, working folder and model."""
    pool, _ = _pool()
    spare = _spare(pool)
    pool.ready(spare, INPUTS)
    assert pool.claim(principal, cwd, model) is None
    assert spare.state is SpareState.READY


def test_the_inputs_must_match_exactly() -> None:
    """flags_hash, identity, environment, binary and uid prefix: any difference is stale."""
    pool, _ = _pool()
    spare = _spare(pool)
    pool.ready(spare, INPUTS)
    assert pool.matches(spare, INPUTS)
    for changed in (
        replace(INPUTS, flags_hash="sha256:g"),
        replace(INPUTS, identity="sha256:j"),
        replace(INPUTS, env="sha256:x"),
        replace(INPUTS, binary=("/c", 1, 9, 3, 4)),
        replace(INPUTS, prefix=("setpriv",)),
    ):
        assert not pool.matches(spare, changed)


def test_a_spare_without_inputs_never_matches() -> None:
    """One that never answered ``initialize`` has no inputs to compare."""
    pool, _ = _pool()
    spare = _spare(pool)
    assert not pool.matches(spare, INPUTS)


def test_a_spare_past_max_age_is_not_claimed_and_expires() -> None:
    """Older than ``max_age``: never handed out, discarded by ``expired``."""
    pool, clock = _pool(max_age=60.0)
    spare = _spare(pool)
    pool.ready(spare, INPUTS)
    assert pool.next_look() == 1060.0
    clock.now += 60.5
    assert pool.claim("alice", "", "") is None
    assert pool.expired() == [spare]
    assert spare.state is SpareState.DISCARDED
    assert spare.reason == "too_old"
    assert pool.expired() == []
    assert pool.next_look() is None


def test_a_young_spare_does_not_expire() -> None:
    pool, clock = _pool(max_age=60.0)
    spare = _spare(pool)
    clock.now += 59.0
    assert pool.expired() == []
    assert spare.state is SpareState.STARTING


def test_the_oldest_ready_spare_is_claimed_first() -> None:
    pool, clock = _pool(per_principal=2)
    first = _spare(pool, "s1")
    clock.now += 1
    second = _spare(pool, "s2")
    pool.ready(second, INPUTS)
    pool.ready(first, INPUTS)
    assert pool.claim("alice", "", "") is first


def test_wanted_bounds_spares_per_principal() -> None:
    """Starting and ready spares both count; each principal gets ``per_principal``."""
    pool, _ = _pool(per_principal=2)
    assert pool.wanted(_default("alice", "bob")) == _each("alice", "alice", "bob", "bob")
    _spare(pool, "s1")
    ready = _spare(pool, "s2", "bob")
    pool.ready(ready, INPUTS)
    assert pool.wanted(_default("alice", "bob")) == _each("alice", "bob")
    _spare(pool, "s3")
    _spare(pool, "s4", "bob")
    assert pool.wanted(_default("alice", "bob")) == []
    pool.per_principal = 0
    assert pool.wanted(_default("alice", "bob")) == []


def test_stale_discards_a_principals_spares_only() -> None:
    """An identity change: that principal's spares go, others stay."""
    pool, _ = _pool(per_principal=2)
    a1, a2, b1 = _spare(pool, "a1"), _spare(pool, "a2"), _spare(pool, "b1", "bob")
    pool.ready(a1, INPUTS)
    assert set(pool.stale("alice")) == {a1, a2}
    assert {a1.state, a2.state} == {SpareState.DISCARDED}
    assert pool.spares() == [b1]


def test_a_replacement_waits_until_the_spare_it_replaces_is_gone() -> None:
    """A stale spare still stopping holds its place: never two spares where one is
    wanted (found by the lifecycle model test, after an identity change)."""
    pool, _ = _pool()
    old = _spare(pool, "a1")
    pool.ready(old, INPUTS)
    assert pool.stale("alice") == [old]
    assert pool.wanted(_default("alice")) == []  # its process still stops
    pool.left(old)
    pool.left(old)  # once only
    assert pool.wanted(_default("alice")) == _each("alice")
    claimed = _spare(pool, "a2")
    pool.ready(claimed, INPUTS)
    assert pool.claim("alice", "", "") is claimed
    pool.left(claimed)  # a spawn took it: it never held a leaving place
    assert pool.wanted(_default("alice")) == _each("alice")


def test_a_discarded_spare_is_never_handed_out() -> None:
    """A spare that died is gone; its late ``ready`` is refused."""
    pool, _ = _pool()
    spare = _spare(pool)
    assert pool.discard(spare, "died")
    assert not pool.discard(spare, "died")
    assert not pool.ready(spare, INPUTS)
    assert pool.claim("alice", "", "") is None


def test_close_discards_everything() -> None:
    pool, _ = _pool(per_principal=3)
    spares = [_spare(pool, f"s{i}") for i in range(3)]
    pool.ready(spares[0], INPUTS)
    assert pool.close() == spares
    assert len(pool) == 0
    assert all(s.state is SpareState.DISCARDED and s.reason == "closing" for s in spares)


def test_the_state_table_refuses_a_second_life() -> None:
    """A claimed or discarded spare never becomes ready again; one id joins once."""
    pool, _ = _pool()
    spare = _spare(pool)
    pool.ready(spare, INPUTS)
    pool.claim("alice", "", "")
    with pytest.raises(IllegalTransition):
        spare.move(SpareState.READY)
    again = Spare("s2", "u", "alice", "/", "", 0.0, "p")
    pool.add(again)
    with pytest.raises(IllegalTransition):
        pool.add(again)


def test_the_env_digest_ignores_the_hook_token_only() -> None:
    """The token is minted per child; every other variable (the API key) counts."""
    env = {"HOME": "/h", "ASTRID_HOOK_TOKEN": "a", "ANTHROPIC_API_KEY": "k1"}
    assert env_digest(env) == env_digest({**env, "ASTRID_HOOK_TOKEN": "b"})
    assert env_digest(env) != env_digest({**env, "ANTHROPIC_API_KEY": "k2"})


def test_a_replaced_binary_has_another_identity(tmp_path: Path) -> None:
    """Replaced by a new file (a new inode) or rewritten in place, it differs."""
    binary = tmp_path / "claude"
    binary.write_bytes(b"one")
    before = binary_identity(binary)
    fresh = tmp_path / "claude.new"
    fresh.write_bytes(b"one")
    fresh.replace(binary)
    assert binary_identity(binary) != before
    assert binary_identity(tmp_path / "missing")[1:] == (-1, -1, -1, -1)


def test_inputs_of_a_launch(tmp_path: Path) -> None:
    """What a launch is compared by: its flags_hash, identity digest, env and prefix."""
    binary = tmp_path / "claude"
    binary.write_bytes(b"x")
    launch = Launch(
        argv=["claude"],
        env={"HOME": "/h", "ASTRID_HOOK_TOKEN": "t"},
        cwd=tmp_path,
        identity_file=tmp_path / "identity.md",
        claude_session="u",
        flags_hash="sha256:f",
        identity_fallback=False,
        prefix=("setpriv",),
        identity_digest="sha256:i",
    )
    inputs = inputs_of(launch, binary)
    assert inputs == SpareInputs(
        "sha256:f", "sha256:i", env_digest({"HOME": "/h"}), binary_identity(binary), ("setpriv",)
    )


def test_a_failed_start_pauses_that_principal_only() -> None:
    """After a failure the principal's next spare waits 1 s, doubling per failure in a
    row up to a minute; other principals are not held up; a ready spare ends it."""
    pool, clock = _pool()
    assert pool.failed("alice") == 1.0
    assert pool.wanted(_default("alice", "bob")) == _each("bob")
    assert pool.next_look() == 1001.0
    clock.now += 1.0
    assert pool.wanted(_default("alice")) == _each("alice")
    assert [pool.failed("alice") for _ in range(8)] == [2, 4, 8, 16, 32, 60, 60, 60]
    assert RETRY_MAX == 60
    clock.now += 60.0
    spare = _spare(pool)
    assert pool.ready(spare, INPUTS)
    assert pool.failed("alice") == 1.0  # counted afresh after a spare came up


def test_surplus_drops_spares_nobody_should_have() -> None:
    """A principal no longer eligible loses its spares; a lower ``per_principal`` drops
    the newest first."""
    pool, clock = _pool(per_principal=3)
    old = _spare(pool, "a1")
    clock.now += 1
    newer = [_spare(pool, "a2"), _spare(pool, "a3")]
    bob = _spare(pool, "b1", "bob")
    assert pool.surplus(_default("alice", "bob")) == []
    pool.per_principal = 1
    assert set(pool.surplus(_default("alice"))) == {*newer, bob}
    assert pool.spares() == [old]
    assert bob.reason == "not_wanted"


class _Proc:
    session_id = "s1"


@pytest.mark.anyio
async def test_an_untaken_spare_tells_nobody_and_may_do_nothing() -> None:
    """Its host keeps ``init`` for the spawn (and reports it ready), drops every other
    event, denies every tool call and refuses in-band hooks (``not_taken``)."""
    ready: list[bool] = []
    host = SpareHost(cast(McpServer, None), lambda: ready.append(True))
    proc = cast(ClaudeProcess, _Proc())
    host.event(proc, "error", {"reason": "init_timeout"})
    assert (host.init, ready) == (None, [])
    host.event(proc, "init", {"pid": 7})
    assert (host.init, ready) == ({"pid": 7}, [True])
    allowed, message, _ = await host.can_use_tool(proc, CanUseToolRequest(tool_name="t"))
    assert not allowed
    assert "not been taken" in message
    with pytest.raises(SessionError) as caught:
        await host.hook_callback(proc, HookCallbackRequest(callback_id="hook_PreToolUse"))
    assert caught.value.code == "not_taken"


def test_each_kind_has_its_own_spares() -> None:
    """A principal's spare kinds (folder, model) are bounded one by one, a spawn takes
    only a spare of its kind, and a kind no longer wanted loses its spares."""
    pool, _ = _pool(per_principal=1)
    work: Kind = ("/srv/work", "")
    opus: Kind = ("", "claude-opus")
    targets = {"alice": [DEFAULT_KIND, work, opus, work]}  # a kind named twice counts once
    assert pool.wanted(targets) == [("alice", DEFAULT_KIND), ("alice", work), ("alice", opus)]
    default = _spare(pool, "s1")
    at_work = _spare(pool, "s2", cwd="/srv/work")
    for spare in (default, at_work):
        pool.ready(spare, INPUTS)
    assert pool.wanted(targets) == [("alice", opus)]
    assert pool.claim("alice", "", "claude-opus") is None  # none of that kind yet
    assert pool.claim("alice", "/srv/work", "") is at_work
    assert pool.claim("alice", "/srv/work", "") is None
    _spare(pool, "s3", cwd="/srv/work")
    gone = pool.surplus({"alice": [DEFAULT_KIND]})  # the work kind left the config
    assert [s.session_id for s in gone] == ["s3"]
    assert pool.spares() == [default]


def test_a_failing_kind_pauses_only_itself() -> None:
    """A kind whose spares fail (a folder made unsafe) does not hold up the default one."""
    pool, _ = _pool(per_principal=1)
    broken: Kind = ("/srv/unsafe", "")
    targets = {"alice": [DEFAULT_KIND, broken]}
    assert pool.failed("alice", broken) == 1.0
    assert pool.wanted(targets) == [("alice", DEFAULT_KIND)]
    assert pool.failed("alice", broken) == 2.0
