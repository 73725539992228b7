"""Run every benchmark (or those named on the command line) and print the table."""

from __future__ import annotations

import importlib
import pkgutil
import sys

from tests.bench.report import Report


def main(argv: list[str]) -> int:
    import tests.bench as pkg

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
