"""Every tier: an async test that overruns ends inside its own event loop.

pytest-timeout's signal method raises in whatever frame the main thread is
in; inside a running asyncio loop that leaves the test, its async fixtures
and the supervisors it started waiting on a loop that never turns again, and
one stuck test stalls the whole run.  So each async test body runs under an
anyio deadline a little shorter than its pytest timeout: a hang becomes a
``TimeoutError`` in the test, the ``async with`` blocks unwind (shielded
teardowns stop what they started), and pytest-timeout stays the backstop.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.deadline import body_deadline, bounded


@pytest.fixture
def anyio_backend() -> str:
    """The event loop every @pytest.mark.anyio test runs on, in every tier."""
    return "asyncio"


@pytest.fixture
def tmp_path(tmp_path: Path) -> Path:
    """pytest's ``tmp_path``, passable (0711, never listable) by other uids when run as root.

    A root supervisor runs each principal's ``claude`` children as the principal's
    uid (sage/security/runas.py); a test's CLI double or wrapper in ``tmp_path`` must be
    reachable by that uid, as ``/usr/bin`` is for the real CLI."""
    if os.geteuid() == 0:
        top = Path(tempfile.gettempdir())
        for folder in (tmp_path, *tmp_path.parents):
            if folder == top or not folder.is_relative_to(top):
                break
            folder.chmod(folder.stat().st_mode & 0o7777 | 0o011)
    return tmp_path


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Iterator[None]:
    func = pyfuncitem.obj
    deadline = body_deadline(pyfuncitem)
    if deadline is None or not inspect.iscoroutinefunction(func):
        yield
        return
    pyfuncitem.obj = bounded(func, deadline)
    try:
        yield
    finally:
        pyfuncitem.obj = func
