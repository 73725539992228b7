"""The test tiers stand alone: each imports from tests/support and the code, never
from another tier nor from tests/conftest.py (tests/support/__init__.py), so a tier
can move or change alone."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIERS = ("unit", "integration", "e2e", "bench", "soak")


def imported_modules(source: str) -> list[str]:
    """Every module an ``import`` or ``from ... import`` names, at any depth, as
    dotted names (relative imports are left out: they stay in their package)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def foreign_tiers(tier: str, source: str) -> set[str]:
    """What of tests/ other than support and ``tier`` itself ``source`` (a module of
    ``tier``) imports: another tier, tests.conftest, or the bare ``tests`` package."""
    foreign = set()
    for name in imported_modules(source):
        parts = name.split(".")
        if parts[0] == "tests" and (len(parts) == 1 or parts[1] not in ("support", tier)):
            foreign.add(".".join(parts[:2]))
    return foreign


def test_no_tier_imports_another() -> None:
    crossings = []
    for tier in TIERS:
        for path in sorted((TESTS / tier).rglob("*.py")):
            for other in sorted(foreign_tiers(tier, path.read_text())):
                crossings.append(f"{path.relative_to(TESTS.parent)} imports {other}")
    assert crossings == []


def test_support_imports_no_tier() -> None:
    crossings = []
    for path in sorted((TESTS / "support").rglob("*.py")):
        for other in sorted(foreign_tiers("support", path.read_text())):
            crossings.append(f"{path.relative_to(TESTS.parent)} imports {other}")
    assert crossings == []


def test_the_rule_sees_every_form_of_import() -> None:
    """The check can fail: a crossing at the top, inside a function, or as a bare
    ``from tests import e2e`` is found; support, the code and the own tier are not."""
    crossing = (
        "from tests.e2e.host import Host\n",
        "def f():\n    from tests.integration.test_approvals import Terminal\n",
        "import tests.bench.report\n",
        "from tests import soak\n",
        "from tests.conftest import TEARDOWN_MARGIN\n",
    )
    for source in crossing:
        assert foreign_tiers("unit", source), source
    fine = (
        "from tests.support.host import Host\n",
        "from tests.unit.test_protocol import golden\n",
        "import sage.claude.protocol\n",
        "from . import sibling\n",
        "from tests import support\n",
    )
    for source in fine:
        assert not foreign_tiers("unit", source), source
