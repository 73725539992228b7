"""Shared fixtures: run anyio tests on asyncio only."""

from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    """The event loop every @pytest.mark.anyio test runs on."""
    return "asyncio"
