"""astrid doctor's fleet rows from what the servers said: the clock against max_clock_skew
(a skewed server clock cannot be had from a real server here), and the rows' order."""

from __future__ import annotations

from sage.cli.doctor_fleet import _clock_row, _server_rows, _streams_row
from sage.config import FleetConfig
from sage.fleet.clock import Skew
from sage.fleet.probe import FleetProbe, ServerProbe, StreamProbe

URL = "nats://127.0.0.1:4222"
CONFIG = FleetConfig(
    url=URL, node="a", password_file="/p", heartbeat=2.0, lost_after=6.0, max_clock_skew=1.5
)


def probe(offset: float | None) -> FleetProbe:
    return FleetProbe(
        servers=[ServerProbe(url=URL, version="2.15.1")],
        streams=[StreamProbe("KV_sage_nodes", found=True)],
        asked=URL,
        skew=None if offset is None else Skew(offset=offset, uncertainty=0.001),
    )


def test_a_clock_off_by_more_than_half_of_max_clock_skew_fails() -> None:
    row = _clock_row(CONFIG, probe(0.8))  # budget 1.5 / 2 = 0.75 s
    assert row.status == "fail"
    assert row.detail.startswith("this host's clock is 0.800 s behind NATS"), row.detail
    assert "half of [fleet] max_clock_skew" in row.detail
    assert "sync the clock" in row.detail
    assert row.facts["budget_s"] == 0.75
    ahead = _clock_row(CONFIG, probe(-0.8))
    assert ahead.status == "fail"
    assert "0.800 s ahead of NATS" in ahead.detail


def test_a_clock_within_the_budget_is_ok_and_says_how_it_was_measured() -> None:
    row = _clock_row(CONFIG, probe(-0.5))
    assert row.status == "ok"
    assert row.detail == (
        f"0.500 s ahead of NATS (the server's time in a JetStream stream info answer from"
        f" {URL}, ±0.001 s); allowed 0.75 s"
    )


def test_no_server_time_is_a_warning_not_a_pass() -> None:
    row = _clock_row(CONFIG, probe(None))
    assert row.status == "warn"
    assert "no stream made yet" in row.detail
    nobody = _clock_row(CONFIG, FleetProbe(servers=[ServerProbe(url=URL, error="x")]))
    assert (nobody.status, nobody.detail) == ("warn", "not measured: no server signed the node in")


def test_one_server_row_per_url_in_order() -> None:
    found = FleetProbe(
        servers=[
            ServerProbe(url="nats://h1:4222", error="refused user 'a'", refused=True),
            ServerProbe(url="nats://h2:4222", error="TLS failed: x", tls_failed=True),
            ServerProbe(url="nats://h3:4222", error="unreachable: refused"),
            ServerProbe(url="nats://h4:4222", version="2.15.1"),
        ]
    )
    rows = _server_rows(found)
    assert [(r.facts["url"], r.status) for r in rows] == [
        ("nats://h1:4222", "fail"),
        ("nats://h2:4222", "fail"),
        ("nats://h3:4222", "fail"),
        ("nats://h4:4222", "ok"),
    ]
    assert rows[0].detail.endswith("fix the credentials or the server's user entry")
    assert rows[1].detail.endswith("check [fleet] ca, cert and key against the server's tls block")
    assert rows[2].detail.endswith("is it running, and reachable from here?")


def test_streams_not_made_yet_are_fine_and_unreadable_ones_fail() -> None:
    none_yet = FleetProbe(
        servers=[], streams=[StreamProbe("KV_sage_nodes", found=False)], asked=URL
    )
    assert _streams_row(none_yet).status == "ok"
    denied = FleetProbe(
        servers=[],
        streams=[StreamProbe("KV_sage_nodes", found=False, error="refused: permissions")],
        asked=URL,
    )
    row = _streams_row(denied)
    assert row.status == "fail"
    assert row.detail == "stream KV_sage_nodes: refused: permissions"
