"""The suite's own layout: pytest imports tests/unit and tests/integration modules by
basename (neither is a package), so two modules of one name there stop the whole run at
collection; tests/e2e is a package and may repeat a name."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_rootless_test_modules_share_a_basename() -> None:
    rootless = [d for d in ("unit", "integration") if not (TESTS / d / "__init__.py").exists()]
    names = Counter(p.name for d in rootless for p in (TESTS / d).glob("test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
    assert len(names) > 100  # the glob sees the suite
