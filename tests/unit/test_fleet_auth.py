"""Authentication required for a fleet: the rule (sage/fleet/auth.py), the config's
refusal of credentials together with insecure_no_auth, the start's warning, TLS off
loopback, and the clock arithmetic doctor uses (sage/fleet/clock.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from sage.config import FleetConfig, decode_config
from sage.errors import ConfigError, FleetNoAuth, FleetUnreachable
from sage.fleet import join
from sage.fleet.auth import AuthMethod, auth_method, is_loopback, plaintext_urls, tls_on
from sage.fleet.clock import measure, parse_server_time, skew_budget
from tests.support.nats_cluster import free_port

URL = "nats://127.0.0.1:4222"


def fleet_toml(*lines: str) -> bytes:
    body = "\n".join(lines)
    return f'[fleet]\nurl = "{URL}"\nnode = "a"\n{body}\n'.encode()


def test_a_fleet_without_credentials_is_refused_naming_the_settings_and_the_fix() -> None:
    with pytest.raises(FleetNoAuth) as refused:
        auth_method(FleetConfig(url=URL, node="a"))
    assert refused.value.code == "fleet_no_credentials"
    message = str(refused.value)
    for setting in ("password_file", "nkey_seed", "creds", "insecure_no_auth = true"):
        assert setting in message, message
    assert "astrid fleet permissions --node a" in message


@pytest.mark.parametrize(
    ("field", "method"),
    [
        ("password_file", AuthMethod.PASSWORD),
        ("nkey_seed", AuthMethod.NKEY),
        ("creds", AuthMethod.CREDS),
    ],
)
def test_each_kind_of_credentials_is_accepted(field: str, method: AuthMethod) -> None:
    config = decode_config(fleet_toml(f'{field} = "/etc/sage/secret"')).fleet
    assert config is not None
    assert auth_method(config) is method


def test_insecure_no_auth_is_accepted_as_no_credentials() -> None:
    config = decode_config(fleet_toml("insecure_no_auth = true")).fleet
    assert config is not None
    assert auth_method(config) is AuthMethod.NONE


@pytest.mark.parametrize("field", ["password_file", "nkey_seed", "creds"])
def test_credentials_with_insecure_no_auth_are_refused_as_contradictory(field: str) -> None:
    """A leftover flag would let a later edit dropping the credentials start without any."""
    with pytest.raises(ConfigError) as refused:
        decode_config(fleet_toml(f'{field} = "/etc/sage/x"', "insecure_no_auth = true"))
    message = str(refused.value)
    assert "fleet.insecure_no_auth" in message, message
    assert field in message, message
    assert "remove insecure_no_auth = true" in message


@pytest.mark.anyio
async def test_join_refuses_a_fleet_without_credentials_before_any_connection() -> None:
    """The rule comes first: an unreachable URL would otherwise be what is reported."""
    config = FleetConfig(url=f"nats://127.0.0.1:{free_port()}", node="a", connect_timeout=1)
    with capture_logs() as logs, pytest.raises(FleetNoAuth):
        async with join(config, Path, started_at=0.0):
            pytest.fail("joined without credentials")
    assert not [entry for entry in logs if entry["event"].startswith("fleet.")], logs


@pytest.mark.anyio
async def test_join_with_insecure_no_auth_warns_then_connects() -> None:
    config = FleetConfig(
        url=f"nats://127.0.0.1:{free_port()}", node="a", insecure_no_auth=True, connect_timeout=1
    )
    with capture_logs() as logs, pytest.raises(FleetUnreachable):
        async with join(config, Path, started_at=0.0):
            pytest.fail("joined a server that is not there")
    warnings = [entry for entry in logs if entry["event"] == "fleet.insecure_no_auth"]
    assert len(warnings) == 1, logs
    assert warnings[0]["log_level"] == "warning"
    assert warnings[0]["node"] == "a"
    assert "password_file" in warnings[0]["hint"]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("10.0.0.5", False),
        ("nats.example.org", False),
        ("0.0.0.0", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_plaintext_urls_are_those_off_loopback_without_tls() -> None:
    urls = ["nats://127.0.0.1:4222", "nats://10.0.0.5:4222", "nats://[::1]:4222"]
    plain = FleetConfig(url=urls, node="a", password_file="/p")
    assert not tls_on(plain)
    assert plaintext_urls(plain) == ["nats://10.0.0.5:4222"]
    with_ca = FleetConfig(url=urls, node="a", password_file="/p", ca="/ca.pem")
    assert tls_on(with_ca)
    assert plaintext_urls(with_ca) == []
    tls_url = FleetConfig(url=["tls://10.0.0.5:4222"], node="a", password_file="/p")
    assert tls_on(tls_url)
    assert plaintext_urls(tls_url) == []


def test_server_time_is_read_to_the_nanosecond() -> None:
    assert parse_server_time("2026-12-06T01:15:50.333891285Z") == pytest.approx(
        1796519750.333891285, abs=1e-6
    )
    assert parse_server_time("2026-12-06T01:15:50Z") == 1796519750.0
    assert parse_server_time("2026-12-06T02:15:50.5+01:00") == 1796519750.5
    for bad in ("", "yesterday", "2026-12-06 01:15:50Z", "2026-12-06T01:15:50"):
        with pytest.raises(ValueError, match="not an RFC 3339 time"):
            parse_server_time(bad)


def test_skew_is_the_server_time_against_the_middle_of_the_round_trip() -> None:
    skew = measure(sent=100.0, received=100.2, server=103.1)
    assert skew.offset == pytest.approx(3.0)
    assert skew.uncertainty == pytest.approx(0.1)
    assert measure(sent=100.0, received=100.0, server=99.5).offset == pytest.approx(-0.5)


def test_skew_budget_is_half_what_the_lease_allows_two_nodes() -> None:
    assert skew_budget(1.0) == 0.5
    assert skew_budget(0.05) == 0.025
