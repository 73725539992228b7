"""bus's public names load their module when first used: each resolves to its module's
object, and a client alone never loads the broker, the server or their logging."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import bus


@pytest.mark.parametrize("name", bus.__all__)
def test_every_public_name_is_its_modules_object(name: str) -> None:
    """``from bus import X`` is the X of the module the table names for it."""
    value = getattr(bus, name)
    module = importlib.import_module(bus._EXPORTS[name])
    assert getattr(module, name) is value
    assert set(bus._EXPORTS) == set(bus.__all__)


def test_an_unknown_name_is_an_attribute_error() -> None:
    """A typo still fails as one."""
    with pytest.raises(AttributeError, match="no attribute 'BusCleint'"):
        bus.BusCleint  # noqa: B018


def test_the_blocking_client_loads_no_event_loop_nor_broker() -> None:
    """What ``astrid status`` loads of bus: the wire and the blocking client only."""
    code = "import sys\nfrom bus import BlockingClient\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    assert "bus.blocking" in loaded
    assert not {"bus.broker", "bus.server", "bus.client", "structlog", "anyio"} & loaded
