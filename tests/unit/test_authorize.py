"""Who a connecting peer is: uid -> principals, admins, roles and their ACLs."""

from __future__ import annotations

import os

import pytest

from bus import FrameError, NotAuthorized, PeerCred
from bus.wire import Hello
from sage.config import decode_config
from sage.daemon.supervisor import Supervisor

ME = os.getuid()
ALICE = ME + 1001
BOTH = ME + 1002
ADMIN = ME + 1003
NOBODY = ME + 1004


@pytest.fixture
def supervisor() -> Supervisor:
    config = decode_config(
        f"[supervisor]\nadmins = [{ADMIN}]\ncapsules = []\n"
        f'[[principals]]\nname = "alice"\nuids = [{ALICE}, {BOTH}]\n'
        f'[[principals]]\nname = "bob"\nuids = [{BOTH}]\n'
    )
    return Supervisor(config)


def _peer(uid: int) -> PeerCred:
    return PeerCred(pid=1, uid=uid, gid=uid)


def test_single_principal_uid_acts_for_it(supervisor: Supervisor) -> None:
    """A uid mapped to one principal acts for it, with the user ACL."""
    identity = supervisor.authorize(_peer(ALICE), Hello(role="cli"))
    assert identity.principal == "alice"
    assert identity.source == f"cli:{ALICE}"
    assert identity.acl is not None
    assert identity.acl.may_publish("sage.v1.request.spawn")
    assert not identity.acl.may_publish("sage.v1.audit.spawn")
    assert not identity.acl.may_subscribe(">")


def test_claimed_principal_is_checked(supervisor: Supervisor) -> None:
    """A hello may name a principal only if the peer's uid may act for it."""
    assert supervisor.authorize(_peer(BOTH), Hello(role="cli", principal="bob")).principal == "bob"
    with pytest.raises(
        NotAuthorized, match=r"may not act for principal 'bob' \(it may for: alice\)"
    ):
        supervisor.authorize(_peer(ALICE), Hello(role="cli", principal="bob"))


def test_a_misspelt_principal_is_named_unknown_to_an_admin_only(supervisor: Supervisor) -> None:
    """An admin learns the name is not configured; a user gets the answer it gets for a
    real principal not its own, so it cannot probe for others' names."""
    with pytest.raises(
        NotAuthorized, match=r"unknown principal 'alcie' \(configured: alice, bob\)"
    ):
        supervisor.authorize(_peer(ADMIN), Hello(role="cli", principal="alcie"))
    with pytest.raises(NotAuthorized) as real:
        supervisor.authorize(_peer(ALICE), Hello(role="cli", principal="bob"))
    with pytest.raises(NotAuthorized) as typo:
        supervisor.authorize(_peer(ALICE), Hello(role="cli", principal="bobb"))
    assert str(real.value).replace("'bob'", "X") == str(typo.value).replace("'bobb'", "X")


def test_uid_of_several_principals_must_name_one(supervisor: Supervisor) -> None:
    """A non-admin uid mapped to several principals must say which; it never acts as none."""
    with pytest.raises(NotAuthorized, match="name one of: alice, bob"):
        supervisor.authorize(_peer(BOTH), Hello(role="cli"))


def test_unmapped_uid_is_refused(supervisor: Supervisor) -> None:
    """A uid that is neither admin nor mapped to a principal may not connect."""
    with pytest.raises(NotAuthorized, match="may not act for any principal"):
        supervisor.authorize(_peer(NOBODY), Hello(role="cli"))


def test_admins_and_own_uid_are_unrestricted(supervisor: Supervisor) -> None:
    """Configured admins and the supervisor's own uid get no ACL and may act for anyone."""
    for uid in (ADMIN, ME):
        identity = supervisor.authorize(_peer(uid), Hello(role="cli", principal="bob"))
        assert identity.acl is None
        assert identity.principal == "bob"


def test_emit_role_may_only_publish_hooks(supervisor: Supervisor) -> None:
    """astrid-emit connections may publish sage.v1.hook.> and nothing else."""
    identity = supervisor.authorize(_peer(ADMIN), Hello(role="emit"))
    assert identity.acl is not None
    assert identity.acl.may_publish("sage.v1.hook.PreToolUse")
    assert not identity.acl.may_publish("demo.x")
    assert not identity.acl.may_subscribe("sage.v1.hook.>")


def test_unknown_role_and_socket_capsule_refused(supervisor: Supervisor) -> None:
    """An unknown role is a bad hello; a capsule over the socket needs an admin uid."""
    with pytest.raises(FrameError, match="unknown role"):
        supervisor.authorize(_peer(ALICE), Hello(role="root"))
    with pytest.raises(NotAuthorized, match="only an admin"):
        supervisor.authorize(_peer(ALICE), Hello(role="capsule"))


def test_denial_audits_are_rate_limited_per_source() -> None:
    """Past the burst, refusals are counted, and the next audited one reports how many."""
    from sage.security.denials import DenialLimiter

    limiter = DenialLimiter(burst=2, window=10.0)
    assert limiter.admit("cli:1", 0.0) == 0
    assert limiter.admit("cli:1", 1.0) == 0
    assert limiter.admit("cli:1", 2.0) is None
    assert limiter.admit("cli:1", 3.0) is None
    assert limiter.admit("cli:2", 3.0) == 0  # other sources are not affected
    assert limiter.admit("cli:1", 10.5) == 2  # a new window: the suppressed count is reported
    assert limiter.admit("cli:1", 11.0) == 0


def test_audit_limiter_is_a_token_bucket_per_publisher_with_limited_reports() -> None:
    """Past its bucket a publisher's entries are dropped and counted; the counts come out as
    reports, at most one per publisher a second and a few a second over all of them."""
    from sage.daemon.supervisor import AuditLimiter

    limiter = AuditLimiter(rate=2.0, burst=3, report_every=1.0, report_rate=1.0, report_burst=2)
    bob = ("cli:1000", "bob")
    assert [limiter.admit(bob, 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert limiter.admit(("cli:1001", "carol"), 0.0)  # another publisher has its own bucket
    assert limiter.reports(0.0) == [(bob, 2)]
    assert not limiter.admit(bob, 0.1)
    assert limiter.reports(0.5) == []  # reported less than a second ago: kept for later
    assert limiter.pending() == 1
    assert limiter.admit(bob, 1.0)  # refilled: two tokens a second
    assert limiter.reports(1.2) == [(bob, 1)]
    assert limiter.pending() == 0
    # reports are limited over all publishers too: the rest wait, counted
    for n in range(5):
        key = (f"capsule:c{n}", "")
        for _ in range(4):
            limiter.admit(key, 2.0)
    assert len(limiter.reports(5.0)) == 2  # the report bucket is full again (2)
    assert limiter.pending() == 3
    assert len(limiter.reports(6.0)) == 1  # one more refilled
    assert limiter.pending() == 2
