"""nats-py's exceptions, mapped to sage's fleet errors at one boundary.

As httpcore's ``map_exceptions``: every call into nats-py that may fail is made
inside :func:`nats_errors`, which lets a :class:`~sage.errors.SageError` pass and
turns what nats-py (or the socket, or a deadline around the call) raised into one of
the fleet's errors (sage/errors.py), each with its code:

- a key written since the revision a write named (``KeyWrongLastSequenceError``, or a
  publish's "wrong last sequence"):
  :class:`~sage.errors.FleetRaceLost` (``fleet_race_lost``): another node won the race;
- a key, bucket or object that is not there (``NotFoundError`` and its kin):
  :class:`~sage.errors.FleetNotFound` (``fleet_not_found``), with the revision of a
  deleted key's delete marker when nats-py says it;
- no responders, no answer in time, a connection closed or reconnecting, a server's
  refusal, an OS error on the socket: :class:`~sage.errors.FleetUnavailable`
  (``fleet_unavailable``).

Anything else (a bug) leaves as it came.  So the rest of sage/fleet catches sage's
errors by family, and imports nothing of nats-py's errors; a handler that must catch
everything (a task that outlives any error) logs :func:`code_of` the exception.

nats-py is imported only when a translation is needed: a single host never loads it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from sage.errors import FleetError, FleetNotFound, FleetRaceLost, FleetUnavailable, SageError

__all__ = ("code_of", "describe", "nats_errors", "translate")

INTERNAL = "internal_error"
"""The code a handler logs for an exception that is no sage error: a bug."""


def describe(exc: BaseException) -> str:
    """One line for an error (nats-py's and the socket's never carry a password)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]


def code_of(exc: BaseException) -> str:
    """The code to log for ``exc``: a sage error's own, ``internal_error`` for anything
    else (it was not expected: a bug)."""
    return exc.code if isinstance(exc, SageError) else INTERNAL


WRONG_LAST_SEQUENCE = 10071
"""JetStream's "wrong last sequence: N": a publish that named the revision it read (of a
key, or of a subject filter: sage/fleet/claims.py) found another stored since."""
WRONG_LAST_SEQUENCE_CONSTANT = 10164
"""The same refusal as nats-server 2.12 and later words it for a subject-filter CAS
(``Nats-Expected-Last-Subject-Sequence-Subject``): "wrong last sequence", no number."""
RACE_LOST_CODES = frozenset({WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_CONSTANT})
NO_PEERS_YET = 10005
"""JetStream's "no suitable peers for placement": a cluster whose servers are still
meeting (a bucket with replicas 3 while one is not yet known)."""


def translate(exc: BaseException, what: str) -> FleetError | None:
    """The fleet error ``exc`` (raised by nats-py, the socket or a deadline while doing
    ``what``) stands for, its message nats-py's own line; None when it is none of theirs.
    The error keeps ``what`` (``.what``) for logs."""
    from nats.errors import Error as NatsError
    from nats.errors import NoRespondersError
    from nats.js.errors import (
        BadRequestError,
        KeyWrongLastSequenceError,
        NotFoundError,
        ServiceUnavailableError,
    )

    mapped: FleetError
    if isinstance(exc, FleetError):
        return exc
    if isinstance(exc, KeyWrongLastSequenceError) or (
        isinstance(exc, BadRequestError) and exc.err_code in RACE_LOST_CODES
    ):
        mapped = FleetRaceLost(describe(exc))
    elif isinstance(exc, NotFoundError):
        marker = getattr(getattr(exc, "entry", None), "revision", None)
        mapped = FleetNotFound(describe(exc), revision=marker if isinstance(marker, int) else 0)
    elif isinstance(exc, (NatsError, OSError, TimeoutError)):  # a deadline's too
        unavailable = FleetUnavailable(describe(exc))
        unavailable.no_responders = isinstance(exc, NoRespondersError)
        unavailable.timed_out = isinstance(exc, TimeoutError)
        unavailable.not_ready = isinstance(exc, (NoRespondersError, ServiceUnavailableError)) or (
            isinstance(exc, BadRequestError) and exc.err_code == NO_PEERS_YET
        )
        mapped = unavailable
    else:
        return None
    mapped.what = what
    return mapped


@contextlib.contextmanager
def nats_errors(what: str) -> Iterator[None]:
    """Inside: what nats-py raises leaves as a fleet error (see the module docstring);
    a sage error, a cancellation or a bug leaves unchanged.  ``what``: what was being
    done, for the message (``"the sage_claims bucket"``)."""
    try:
        yield
    except SageError:
        raise
    except Exception as exc:  # the boundary: mapped, or re-raised as it came
        mapped = translate(exc, what)
        if mapped is None:
            raise
        raise mapped from exc
