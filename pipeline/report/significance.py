"""Is a result distinguishable from chance? The 95 % interval decides, not ``value > chance``.

An evaluation row carries ``value``, ``n`` (items scored), ``chance`` and, where the harness
computed it, ``ci_low`` / ``ci_high`` (its 95 % interval). A row without them gets a Wilson score
interval when its value is a percentage accuracy over ``n`` items (``unit == "%"``); any other
metric (an AUC, a mean IoU, a recall over a ranking) gets no interval and no verdict.

The verdict: ``above`` when the whole interval lies above chance, ``below`` when it lies below,
else ``not significant`` (AUC 0.515 on 45 items, 26 % on 52 items against 25 %).
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054

# strict scoring: a tie between the right and the wrong option counts as wrong, so a scorer that
# cannot tell the options apart (random or untrained features, identical texts) lands under chance
BELOW_CHANCE_NOTE = ("significantly below chance: ties count as wrong (a scorer that gives the options equal "
                     "scores fails the item), so an uninformative model can score under chance, down to 0 %")


def wilson_interval(value_pct: float, n: int) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion given in percent over ``n`` items, in percent."""
    p = min(1.0, max(0.0, float(value_pct) / 100.0))
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return 100.0 * max(0.0, centre - half), 100.0 * min(1.0, centre + half)


def _num(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def interval(row: dict) -> tuple[float, float] | None:
    """The row's 95 % interval: its ``ci_low`` / ``ci_high``, else Wilson for a percentage over
    ``n`` items, else None."""
    lo, hi = _num(row.get("ci_low")), _num(row.get("ci_high"))
    if lo is not None and hi is not None:
        return lo, hi
    value, n = _num(row.get("value")), _num(row.get("n"))
    if row.get("unit") == "%" and value is not None and n and n > 0:
        return wilson_interval(value, int(n))
    return None


def verdict(row: dict) -> str | None:
    """``above`` / ``below`` / ``not significant`` (against ``chance``), or None when the row has
    no chance level or no interval."""
    chance, ci = _num(row.get("chance")), interval(row)
    if chance is None or ci is None:
        return None
    if ci[0] > chance:
        return "above"
    if ci[1] < chance:
        return "below"
    return "not significant"
