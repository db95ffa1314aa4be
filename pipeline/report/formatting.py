"""Numbers, values, durations and sizes as the report and the CLI show them to people."""

from __future__ import annotations

import math

import numpy as np


def fmt_num(v, digits: int = 3) -> str:
    """A number for people: integers with thousands separators, floats to ``digits`` significant
    digits (at most 2 decimals above 1), no ``40.00000059604645``."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, (int, np.integer)):
        return f"{int(v):,}"
    try:
        x = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(x):
        return "—"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    ax = abs(x)
    if ax >= 1000:
        return f"{x:,.0f}"
    if ax >= 1:
        text = f"{x:.{max(0, min(2, digits - 1 - int(math.floor(math.log10(ax)))))}f}"
        return text.rstrip("0").rstrip(".") if "." in text else text
    if ax >= 1e-3:
        return f"{x:.{digits}g}"
    return f"{x:.2e}"


def fmt_value(v, unit: str = "") -> str:
    """A metric with its unit: percentages to one decimal with ``%``, fractions to three decimals."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if unit == "%":
        return f"{float(v):.1f}%"
    if unit == "fraction":
        return f"{float(v):.3f}"
    return fmt_num(v)


def fmt_seconds(s) -> str:
    from pipeline.stage import format_seconds

    return "—" if s is None else format_seconds(float(s))


def fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"
