"""The bus's error tree: one root, one machine-readable ``code`` per error."""

from __future__ import annotations

import inspect

import pytest

import bus
import bus.errors
from bus.errors import BusError, FrameError, error_for_code

_DEFINED = [
    cls
    for _, cls in inspect.getmembers(bus.errors, inspect.isclass)
    if cls.__module__ == "bus.errors"
]
_CLASSES = [cls for cls in _DEFINED if issubclass(cls, BusError)]


def test_every_bus_error_derives_from_bus_error() -> None:
    """No exception class of bus.errors has another root than BusError."""
    assert len(_DEFINED) > 5
    assert _CLASSES == _DEFINED


def test_codes_are_distinct_strings() -> None:
    """Each class carries its own code, so the code alone names the class."""
    codes = [cls.code for cls in _CLASSES]
    assert all(isinstance(code, str) and code for code in codes)
    assert len(set(codes)) == len(codes)


@pytest.mark.parametrize("cls", [c for c in _CLASSES if c is not BusError])
def test_a_code_on_the_wire_is_raised_again_as_its_class(cls: type[BusError]) -> None:
    """error_for_code gives back the class whose code travelled, with the message."""
    err = error_for_code(cls.code, "why")
    assert (type(err), str(err)) == (cls, "why")


def test_an_unknown_code_is_a_plain_bus_error() -> None:
    """A code this client does not know is still a BusError, never a crash."""
    assert type(error_for_code("never_heard_of_it", "x")) is BusError


def test_code_can_be_set_per_instance() -> None:
    """code= overrides the class default for one error and leaves the class alone."""
    err = FrameError("bad bytes", code="bad_payload")
    assert (err.code, str(err), FrameError.code) == ("bad_payload", "bad bytes", "bad_frame")


def test_errors_are_exported_from_the_package() -> None:
    """Every error class is part of bus's public surface."""
    assert {cls.__name__ for cls in _CLASSES} <= set(bus.__all__)
