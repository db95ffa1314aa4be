"""Is a result distinguishable from what no learning gets? The 95 % interval decides, not ``value > chance``.

An evaluation row carries ``value``, ``n`` (items scored), ``chance`` and, where the harness
computed it, ``ci_low`` / ``ci_high`` (its 95 % interval, :mod:`train.eval.intervals`). A row without
them gets a Wilson score interval when its value is a percentage accuracy over ``n`` items
(``unit == "%"``); any other metric without an interval gets no verdict.

A job may report no-learning baselines beside a result: a frozen score, a prior without the image, one
group, a random assignment, the untrained model. Such a row names the result it is the baseline of in
``baseline_for`` (``"<subset>/<metric>"`` in the same benchmark; older results: a metric spelled
``<metric>[<baseline>]``). The verdicts (:func:`verdicts`):

* ``baseline``: the row is a no-learning baseline, not a result;
* ``too few items``: fewer than ``MIN_ITEMS`` (10) items: no verdict at all;
* ``above``: the whole interval lies above chance *and* above the strongest baseline reported for it;
* ``not above <baseline>``: above chance, but the interval does not clear that baseline's value;
* ``below``: the whole interval lies below chance;
* ``not significant``: chance lies inside the interval (AUC 0.515 on 45 items, 26 % on 52 items
  against 25 %).
"""

from __future__ import annotations

import math
import re

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


MIN_ITEMS = 10  # below this many scored items a row gets "too few items", not a verdict
# the no-learning baselines a metric spelled ``<metric>[<name>]`` can name (older results without baseline_for)
NO_LEARNING = ("random", "one-group", "chunks", "untrained", "prior", "frozen", "global_cosine")


def baseline_target(row: dict) -> str | None:
    """``"<subset>/<metric>"`` of the result this row is a no-learning baseline of, else None."""
    b = row.get("baseline_for")
    if b:
        return str(b)
    m = str(row.get("metric") or "")
    if m.endswith("]") and "[" in m:
        base, name = m[:-1].rsplit("[", 1)
        if name in NO_LEARNING:
            return f"{row.get('subset') or ''}/{base}"
    return None


def baselines_of(rows: list[dict]) -> dict[tuple, list[tuple[str, float]]]:
    """(benchmark, "<subset>/<metric>") -> [(baseline label, value)] over ``rows`` (one evaluation)."""
    out: dict[tuple, list[tuple[str, float]]] = {}
    for r in rows:
        t, v = baseline_target(r), _num(r.get("value"))
        if t and v is not None:
            same_subset = (r.get("subset") or "") == t.split("/", 1)[0]
            label = str(r.get("metric")) if same_subset else f"{r.get('subset')}/{r.get('metric')}"
            out.setdefault((r.get("benchmark"), t), []).append((label, v))
    return out


def verdict(row: dict, baselines: list[tuple[str, float]] = ()) -> str | None:
    """The row's verdict (module doc), or None when it has no chance level or no interval.
    ``baselines``: [(label, value)] of the no-learning baselines reported for it."""
    if baseline_target(row):
        return "baseline"
    n = _num(row.get("n"))
    chance, ci = _num(row.get("chance")), interval(row)
    if n is not None and n < MIN_ITEMS and (chance is not None or ci is not None):
        return "too few items"
    if chance is None or ci is None:
        return None
    if ci[1] < chance:
        return "below"
    if ci[0] <= chance:
        return "not significant"
    strongest = max(baselines, key=lambda b: b[1], default=None)
    if strongest is not None and ci[0] <= strongest[1]:
        return f"not above {strongest[0]} ({strongest[1]:.4g})"
    return "above"


def judged(rows: list[dict]) -> list[tuple[str | None, tuple[str, float] | None]]:
    """(:func:`verdict`, the strongest baseline reported for it or None) of every row of one evaluation."""
    base = baselines_of(rows)
    out = []
    for r in rows:
        bl = base.get((r.get("benchmark"), f"{r.get('subset') or ''}/{r.get('metric')}"), [])
        out.append((verdict(r, bl), max(bl, key=lambda b: b[1], default=None)))
    return out


def verdicts(rows: list[dict]) -> list[str | None]:
    """:func:`verdict` of every row of one evaluation, each against the baselines reported beside it."""
    return [v for v, _ in judged(rows)]


_TIED = re.compile(r"(\d[\d,]*) of (\d[\d,]*) items tied")


def with_reason(v: str | None, row: dict) -> str | None:
    """The verdict with the reason of a degenerate row beside it: ``below: 462 of 462 items tied`` where a
    row is below chance and its note counts ties (a strict scorer scores a tie wrong: a model blind to what
    the negatives change ties everywhere and lands under chance, down to 0 %). Other verdicts unchanged."""
    m = _TIED.search(str(row.get("note") or "")) if v == "below" else None
    return f"below: {m[1]} of {m[2]} items tied" if m and m[1] != "0" else v
