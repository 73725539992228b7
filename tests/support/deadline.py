"""The anyio deadline of a test body (tests/conftest.py applies it to every async test).

pytest-timeout's signal method raises in whatever frame the main thread is
in; inside a running asyncio loop that leaves the test stuck, so each async
test body runs under an anyio deadline a little shorter than its pytest timeout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import pytest

#: Seconds kept back from the pytest timeout for the test's teardown.
TEARDOWN_MARGIN = 10.0


def body_deadline(item: pytest.Item) -> float | None:
    """The anyio deadline of a test body: its pytest timeout less the margin."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        timeout = float(marker.args[0])
    elif marker is not None and "timeout" in marker.kwargs:
        timeout = float(marker.kwargs["timeout"])
    else:
        timeout = float(item.config.getini("timeout") or 0)
    if timeout <= 0:
        return None
    return max(timeout - TEARDOWN_MARGIN, timeout * 0.5)


def bounded(
    func: Callable[..., Coroutine[Any, Any, Any]], deadline: float
) -> Callable[..., Coroutine[Any, Any, Any]]:
    @functools.wraps(func)
    async def run(*args: Any, **kwargs: Any) -> Any:
        try:
            with anyio.fail_after(deadline):
                return await func(*args, **kwargs)
        except TimeoutError as exc:
            raise TimeoutError(
                f"test body passed its {deadline:g} s deadline (pytest timeout less"
                f" {TEARDOWN_MARGIN:g} s for teardown)"
            ) from exc

    return run
