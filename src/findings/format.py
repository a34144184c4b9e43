"""How an estimate reads in docs/findings.md: ``mean [low, high]``, percentage points, a verdict, a table.

The estimates are :meth:`src.findings.paired_stats.Estimate.as_dict` dicts (``mean``, ``low``, ``high``, ``n``);
:mod:`src.findings.render` and :mod:`src.findings.summary` write every cell with these.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


def fmt(value: dict[str, Any] | None, digits: int = 2, suffix: str = "", scale: float = 1.0) -> str:
    """``mean [low, high]`` of an estimate dict (``-`` when it has no values; one value: no interval)."""
    if not value or value.get("mean") is None:
        return "-"
    mean, low, high = (None if v is None else v * scale for v in (value["mean"], value["low"], value["high"]))
    if value["n"] == 1 or math.isclose(low, high, rel_tol=0, abs_tol=0.5 * 10**-digits):
        interval = "" if value["n"] == 1 else " (all seeds)"
        return f"{mean:.{digits}f}{suffix}{interval}"
    return f"{mean:.{digits}f}{suffix} [{low:.{digits}f}, {high:.{digits}f}]"


def points(value: dict[str, Any] | None) -> str:
    """An accuracy difference in percentage points."""
    return fmt(value, 2, " pts", 100.0)


def verdict(value: dict[str, Any] | None, target: float, *, above: bool = True) -> str:
    """Whether an estimate meets ``target``: over its whole interval, on its mean only, or not."""
    if not value or value.get("mean") is None:
        return "not measured"
    side = (lambda x: x >= target) if above else (lambda x: x <= target)
    if side(value["low"] if above else value["high"]):
        return "yes"
    return "on the mean, not over the whole interval" if side(value["mean"]) else "no"


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    """A Markdown table: the header, its rule, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]
