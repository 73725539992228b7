"""The table every benchmark writes its figures into."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Row:
    section: str
    name: str
    value: float
    unit: str
    reference: float | None = None
    reference_name: str = ""
    goal: str = ""
    higher_is_better: bool = True

    @property
    def ratio(self) -> float | None:
        if self.reference is None or self.reference == 0:
            return None
        return self.value / self.reference


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)

    def add(self, section: str, name: str, value: float, unit: str, **kw: object) -> Row:
        row = Row(section, name, value, unit, **kw)  # type: ignore[arg-type]
        self.rows.append(row)
        print(f"  {section}: {name} = {_fmt(value)} {unit}", flush=True)
        return row

    def render(self) -> str:
        lines = [
            f"{'section':<10} {'measure':<44} {'ours':>12} {'reference':>12} {'ratio':>7}  {'unit':<12} goal",
        ]
        for r in self.rows:
            ref = _fmt(r.reference) if r.reference is not None else "-"
            ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
            lines.append(
                f"{r.section:<10} {r.name:<44} {_fmt(r.value):>12} {ref:>12} {ratio:>7}  {r.unit:<12} {r.goal}"
            )
        return "\n".join(lines)


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 1:
        return f"{v:.2f}"
    return f"{v:.4f}"


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank, no interpolation)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
