"""Run every benchmark (or those named on the command line) and print the table."""

from __future__ import annotations

import compileall
import importlib
import pkgutil
import sys
from pathlib import Path

from tests.bench.report import Report

ROOT = Path(__file__).resolve().parents[2]


def _byte_compile() -> None:
    """Compile the tree's sources as pip compiles an installed package: the commands a
    bench starts (astrid, astrid-emit) then pay no compile, even under
    PYTHONDONTWRITEBYTECODE, which stops them writing the bytecode themselves."""
    for folder in ("sage", "bus", "capsules", "tests"):
        compileall.compile_dir(ROOT / folder, quiet=1)


def main(argv: list[str]) -> int:
    import tests.bench as pkg

    _byte_compile()
    names = sorted(
        m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name.startswith("bench_")
    )
    if argv:
        names = [n for n in names if any(a in n for a in argv)]
    report = Report()
    for name in names:
        print(f"== {name}", flush=True)
        module = importlib.import_module(f"tests.bench.{name}")
        module.run(report)
    print()
    print(report.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
