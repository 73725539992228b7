"""nats-py's exceptions become sage's fleet errors at one boundary (sage/fleet/nats_errors.py),
and the rest of sage/fleet neither imports them nor catches everything without a reason
and a code."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    ServiceUnavailableError,
)

from sage.errors import (
    FleetError,
    FleetNotFound,
    FleetRaceLost,
    FleetUnavailable,
    NotVouched,
)
from sage.fleet.nats_errors import NO_PEERS_YET, RACE_LOST_CODES, code_of, nats_errors, translate

FLEET = Path(__file__).resolve().parents[2] / "sage" / "fleet"


def test_each_nats_error_becomes_the_fleet_error_another_part_acts_on() -> None:
    """A lost revision race, a missing key, no responders, a timeout, a closed
    connection, an OS error: each maps to its family member and code."""
    race = translate(KeyWrongLastSequenceError(description="wrong last sequence: 7"), "claims")
    assert isinstance(race, FleetRaceLost)
    assert (race.code, race.what) == ("fleet_race_lost", "claims")
    for code in RACE_LOST_CODES:  # "wrong last sequence: 7", and 2.12's for a filter CAS
        lost = translate(BadRequestError(err_code=code, description="wrong last sequence"), "c")
        assert isinstance(lost, FleetRaceLost), code
    missing = KeyNotFoundError(entry=SimpleNamespace(revision=12))
    gone = translate(missing, "claims")
    assert isinstance(gone, FleetNotFound)
    assert (gone.code, gone.revision) == ("fleet_not_found", 12)
    silent = translate(NoRespondersError(), "a request")
    assert isinstance(silent, FleetUnavailable)
    assert (silent.no_responders, silent.timed_out, silent.not_ready) == (True, False, True)
    late = translate(NatsTimeout(), "a request")
    assert isinstance(late, FleetUnavailable)
    assert (late.timed_out, late.not_ready) == (True, False)
    assert isinstance(translate(TimeoutError(), "a deadline"), FleetUnavailable)
    closed = translate(ConnectionClosedError(), "a publish")
    assert isinstance(closed, FleetUnavailable)
    assert closed.code == "fleet_unavailable"
    assert isinstance(translate(OSError("broken pipe"), "a socket"), FleetUnavailable)


def test_jetstream_not_ready_is_told_from_a_refusal() -> None:
    """Unavailable or no peers yet: ask again; any other bad request: a refusal."""
    unready = translate(ServiceUnavailableError(), "the bucket")
    assert isinstance(unready, FleetUnavailable)
    assert unready.not_ready
    peers = translate(BadRequestError(err_code=NO_PEERS_YET), "the bucket")
    assert isinstance(peers, FleetUnavailable)
    assert peers.not_ready
    refused = translate(BadRequestError(err_code=10058), "the bucket")
    assert isinstance(refused, FleetUnavailable)
    assert not refused.not_ready


def test_the_boundary_lets_sage_errors_and_bugs_through() -> None:
    """A sage error keeps its class and code; a bug stays a bug; a mapped error keeps
    nats-py's as its cause."""
    with pytest.raises(NotVouched), nats_errors("a check"):
        raise NotVouched("no")
    with pytest.raises(KeyError), nats_errors("a bug"):
        raise KeyError("x")
    with pytest.raises(FleetRaceLost) as caught, nats_errors("claims"):
        raise KeyWrongLastSequenceError(description="wrong last sequence")
    assert isinstance(caught.value.__cause__, KeyWrongLastSequenceError)
    assert code_of(KeyError("x")) == "internal_error"
    assert code_of(FleetError("x")) == "fleet_failed"


def _modules() -> list[Path]:
    return sorted(FLEET.glob("*.py"))


def test_only_the_boundary_imports_nats_errors() -> None:
    importing = [
        path.name
        for path in _modules()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module in ("nats.errors", "nats.js.errors")
        and path.name != "nats_errors.py"
    ]
    assert importing == []


def _broad(handler: ast.ExceptHandler) -> bool:
    return isinstance(handler.type, ast.Name) and handler.type.id in ("Exception", "BaseException")


def _logs_a_code_or_reraises(handler: ast.ExceptHandler) -> bool:
    for node in ast.walk(handler):
        if isinstance(node, ast.Raise):
            return True
        if isinstance(node, ast.Call) and any(k.arg == "code" for k in node.keywords):
            return True
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "code" for t in node.targets
        ):
            return True  # the code is kept, and logged on the failure path
    return False


def test_every_broad_handler_in_the_fleet_says_why_and_logs_the_code() -> None:
    """``except Exception`` only where a task must outlive any error (the comment on its
    line says so), and it logs the code (or re-raises: a translation, not a handler)."""
    found = []
    for path in _modules():
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ExceptHandler) and _broad(node):
                line = lines[node.lineno - 1]
                if "#" not in line or not _logs_a_code_or_reraises(node):
                    found.append(f"{path.name}:{node.lineno}: {line.strip()}")
    assert found == []
    # the check sees a silent one
    silent = ast.parse("try:\n    f()\nexcept Exception:\n    pass\n")
    handler = next(n for n in ast.walk(silent) if isinstance(n, ast.ExceptHandler))
    assert _broad(handler)
    assert not _logs_a_code_or_reraises(handler)


def test_no_fleet_module_suppresses_everything() -> None:
    """``contextlib.suppress(Exception)`` hides a bug as well as NATS going away: the
    fleet suppresses FleetError only."""
    found = [
        f"{path.name}:{n}"
        for path in _modules()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "suppress(Exception)" in line or "suppress(BaseException)" in line
    ]
    assert found == []
