"""The one error tree: every exception sage and its capsules define is a SageError with a code."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re

import pytest

from sage.errors import ForgeError, IllegalTransition, RequestError, SageError, SandboxError
from sage.replies import ReplyError

_CODE = re.compile(r"^[a-z][a-z0-9_]*$")


def _modules() -> list[str]:
    names = []
    for root in ("sage", "capsules"):
        package = importlib.import_module(root)
        for info in pkgutil.walk_packages(package.__path__, f"{root}."):
            if not info.name.endswith("__main__"):
                names.append(info.name)
    return names


def _defined_exceptions() -> list[type[BaseException]]:
    found = []
    for name in _modules():
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == name and issubclass(cls, BaseException):
                found.append(cls)
    return found


def test_every_defined_exception_is_a_sage_error_with_a_code() -> None:
    found = _defined_exceptions()
    names = {cls.__name__ for cls in found}
    # the ones this tree was made for are all found, so the walk is not empty by mistake
    assert {"HookRejected", "InstallFailed", "IncompleteStream", "UnknownModel"} <= names
    assert {"PolicyError", "SchemaError", "SecretError", "ForgeError", "IllegalTransition"} <= names
    for cls in found:
        assert issubclass(cls, SageError), f"{cls.__module__}.{cls.__qualname__}"
        assert _CODE.match(cls.code), f"{cls.__qualname__}.code = {cls.code!r}"
        assert "kind" not in vars(cls), cls


def test_families_name_their_own_codes() -> None:
    # the root's "error" is a default; a ReplyError's code is the reply's, always given
    for cls in _defined_exceptions():
        if issubclass(cls, SageError) and cls not in (SageError, ReplyError):
            assert cls.code != "error", f"{cls.__qualname__} says nothing of what failed"


def test_forge_error_code_is_the_instance_reason() -> None:
    refused = ForgeError("name_taken", "a tool named 'x' already exists")
    assert (refused.code, str(refused)) == ("name_taken", "a tool named 'x' already exists")
    assert not hasattr(refused, "kind")
    assert ForgeError.code == "forge_failed"
    assert SandboxError("mount_refused", "no").code == "mount_refused"


@pytest.mark.parametrize(
    ("module", "name", "base"),
    [
        ("capsules.hooks.validate", "HookRejected", RequestError),
        ("capsules.llm.mapping", "UnknownModel", RequestError),
        ("capsules.tools.catalogue", "SchemaError", RequestError),
    ],
)
def test_refusals_are_request_errors_not_value_errors(module: str, name: str, base: type) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, base)
    assert not issubclass(cls, ValueError)


def test_hook_rejection_code_is_its_reason() -> None:
    from capsules.hooks.validate import HookRejected

    rejected = HookRejected("bad_token", "alice", "s1", "PreToolUse", "t" * 40)
    assert (rejected.code, str(rejected)) == ("bad_token", "bad_token")
    assert not hasattr(rejected, "reason")


def test_one_illegal_transition_for_every_table() -> None:
    """No module defines an error of its own for a state change its table refuses: the
    audit log's table raises sage.errors.IllegalTransition, as the others do."""
    from sage.audit.store import AuditLog, LogState

    assert [cls for cls in _defined_exceptions() if "Transition" in cls.__name__] == [
        IllegalTransition
    ]
    log = AuditLog.__new__(AuditLog)  # the table alone: no file is opened
    log._state = LogState.CLOSED
    with pytest.raises(IllegalTransition) as caught:
        log._transition(LogState.OPEN)
    assert caught.value.code == "illegal_transition"
    assert (caught.value.machine, caught.value.old, caught.value.new) == (
        "audit log",
        "closed",
        "open",
    )
