"""bus's public surface: one screen in bus/__init__.py, and nothing in it that drifts."""

from __future__ import annotations

import importlib

import pytest

import bus


def test_all_is_sorted_and_every_name_resolves() -> None:
    """__all__ is a sorted tuple of names that exist in the package."""
    assert isinstance(bus.__all__, tuple)
    assert list(bus.__all__) == sorted(bus.__all__)
    missing = [name for name in bus.__all__ if not hasattr(bus, name)]
    assert missing == []


@pytest.mark.parametrize("name", ["BusClient", "BusServer", "RemoteSubscription", "PeerCred"])
def test_client_and_server_are_public(name: str) -> None:
    """The client and the server are imported from bus, not from their modules."""
    assert name in bus.__all__


@pytest.mark.parametrize(
    "module", ["acl", "broker", "client", "connection", "errors", "server", "unix"]
)
def test_each_public_name_of_a_module_is_its_own(module: str) -> None:
    """Every name a module lists in __all__ is defined or bound in it."""
    mod = importlib.import_module(f"bus.{module}")
    assert all(hasattr(mod, name) for name in mod.__all__)
