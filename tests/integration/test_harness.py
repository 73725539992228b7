"""The test harness itself: a hung test ends inside its loop and stops what it started."""

from __future__ import annotations

import time

import anyio
import pytest

from tests.support import FAKE_CLAUDE
from tests.support.daemon import descendants
from tests.support.deadline import TEARDOWN_MARGIN, bounded
from tests.support.procs import alive
from tests.support.sage_harness import running_sage, sage_config

pytestmark = pytest.mark.anyio

FAKE = str(FAKE_CLAUDE)


async def test_a_hung_body_becomes_a_timeout_error() -> None:
    async def hang() -> None:
        await anyio.sleep(3600)

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=f"less {TEARDOWN_MARGIN:g} s for teardown"):
        await bounded(hang, 0.2)()
    assert time.monotonic() - t0 < 2


async def test_a_cancelled_body_still_stops_its_supervisor_and_sessions() -> None:
    """The cancel that ends a hung test must not skip the supervisor's stop."""
    config = sage_config(FAKE, {})
    with anyio.move_on_after(20) as scope:
        async with running_sage(config, env={"ANTHROPIC_API_KEY": "sk-double"}) as sage:
            assert sage.daemon.proc is not None
            daemon = sage.daemon.proc.pid
            await sage.ready("hung")
            below = descendants(daemon)
            assert below  # the session's claude double
            scope.deadline = anyio.current_time()  # the test's deadline passes here
            await anyio.sleep(3600)
    assert scope.cancelled_caught
    assert not alive(daemon)
    assert not [pid for pid in below if alive(pid)]
