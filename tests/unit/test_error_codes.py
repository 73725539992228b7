"""Every error code sage and its capsules use is one of the contract's, and documented.

The codes are read from the source with ``ast`` (nothing imported): a class's
``code = "x"``, a ``code="x"`` keyword, the first argument of the calls that take a
code first (``replies.error``, ``SessionError``, ``ForgeError``, ``SandboxError``,
``IllegalTransition``'s kin do not: they name a machine), the third of the runner's
``_reject``, the second of the completion provider's ``Error``, and a reply written as a dict literal (``{"ok": False, "error": "x"}``).
Each must be a value of :class:`sage.contract.codes.ErrorCode`, and each of those is
named in backticks in docs/topics.md.  A code written as ``ErrorCode.X`` is one by
construction.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from sage.contract.codes import ErrorCode

ROOT = Path(__file__).resolve().parents[2]
TOPICS = ROOT / "docs" / "topics.md"
CODE_FIRST = frozenset({"error", "_err", "SessionError", "ForgeError", "SandboxError"})
"""Calls whose first argument is the code (``error``: ``replies.error``, never a logger's)."""


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        owner = func.value
        if func.attr == "error" and not (isinstance(owner, ast.Name) and owner.id == "replies"):
            return ""  # log.error(...), parser.error(...): an event or a message
        return func.attr
    return ""


def _literal(node: ast.expr | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def codes_in(source: str) -> Iterator[tuple[int, str]]:
    """``(line, code)`` of every code ``source`` spells as a string literal."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets: list[ast.expr] = []
                value: ast.expr | None = None
                if isinstance(statement, ast.Assign):
                    targets, value = statement.targets, statement.value
                elif isinstance(statement, ast.AnnAssign):
                    targets, value = [statement.target], statement.value
                named = any(isinstance(t, ast.Name) and t.id == "code" for t in targets)
                if named and (code := _literal(value)) is not None:
                    yield statement.lineno, code
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg == "code" and (code := _literal(keyword.value)) is not None:
                    yield node.lineno, code
            name = _name(node.func)
            if name in CODE_FIRST and node.args and (code := _literal(node.args[0])):
                yield node.lineno, code
            if name == "_reject" and len(node.args) > 2 and (code := _literal(node.args[2])):
                yield node.lineno, code
            if name == "Error" and len(node.args) > 1 and (code := _literal(node.args[1])):
                yield node.lineno, code  # the completion provider's Error(message, code)
        elif isinstance(node, ast.Dict):
            keys = [_literal(k) if k is not None else None for k in node.keys]
            reply = "ok" in keys and "error" in keys
            if reply and (code := _literal(node.values[keys.index("error")])) is not None:
                yield node.lineno, code


def used_codes() -> dict[str, list[str]]:
    """Each code spelled in sage/ or capsules/, with where (``path:line``)."""
    found: dict[str, list[str]] = {}
    for package in ("sage", "capsules"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, code in codes_in(path.read_text()):
                found.setdefault(code, []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_the_scanner_sees_every_way_a_code_is_spelled() -> None:
    """A class default, a keyword, a code-first call, the runner's reject and a dict
    reply are each found; a message or an unrelated keyword is not."""
    source = (
        "class E(SageError):\n    code = 'one'\n"
        "raise SageError('text', code='two')\n"
        "replies.error('three', 'a message')\n"
        "raise SessionError('four', 'why')\n"
        "raise self._reject(request, principal, 'five', 'why')\n"
        "reply = {'ok': False, 'error': 'six', 'message': 'm'}\n"
        "return Error('a message', 'seven')\n"
        "log.error('not_a_code', code=exc.code)\n"
        "log.error('not.a.code', error='x')\n"
        "print('eight')\n"
    )
    assert sorted(code for _, code in codes_in(source)) == [
        "five",
        "four",
        "one",
        "seven",
        "six",
        "three",
        "two",
    ]


def test_every_code_used_is_the_contracts() -> None:
    known = {code.value for code in ErrorCode}
    missing = {code: where for code, where in used_codes().items() if code not in known}
    assert not missing, f"codes not in sage/contract/codes.py: {missing}"


def test_every_contract_code_is_documented() -> None:
    text = TOPICS.read_text()
    missing = sorted(code.value for code in ErrorCode if f"`{code.value}`" not in text)
    assert not missing, f"codes not in docs/topics.md: {missing}"


def test_no_two_names_for_one_failure() -> None:
    """The codes that drifted apart stay unified: one for a bug, one for the state store."""
    values = {code.value for code in ErrorCode}
    assert {"internal", "state_error", "state_unreadable"}.isdisjoint(values)
    assert {"internal_error", "state_failed"} <= values
    assert not {"internal", "state_error", "state_unreadable"} & used_codes().keys()
