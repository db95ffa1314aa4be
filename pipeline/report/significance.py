"""Is a result distinguishable from what no learning gets? 95 % intervals decide, not ``value > chance``.

An evaluation row carries ``value``, ``n`` (items scored), ``chance`` and, where the harness computed
it, ``ci_low`` / ``ci_high`` (its 95 % interval, ``train.eval.intervals``). A row without them gets
no verdict: no interval, no verdict (a macro row the harness could not give an interval is not
judged by an interval it never computed).

A job may report no-learning baselines beside a result: a frozen score, a prior without the image, one
group, a random assignment, the untrained model. Such a row names the result it is the baseline of in
``baseline_for`` (``"<subset>/<metric>"`` in the same benchmark; older results: a metric spelled
``<metric>[<baseline>]``). The harness pairs every result row with its strongest baseline over the
same resampled images (``train.eval.paired``): ``diff_vs`` (that baseline), ``diff`` (result -
baseline) and ``diff_low`` / ``diff_high`` (its 95 % interval). The verdicts (:func:`verdicts`):

* ``baseline``: the row is a no-learning baseline, not a result;
* ``too few items``: fewer than ``MIN_ITEMS`` (10) items: no verdict at all;
* a row with a baseline: ``above`` when the paired difference's interval lies above 0 *and* the row's
  own interval above chance; ``below`` when the difference's interval lies below 0; ``not resolved``
  otherwise; no verdict (None) when the paired difference has no interval (a baseline is never
  compared as a constant);
* a row without a baseline, against chance by its own interval: ``above`` (the whole interval above),
  ``below`` (the whole interval below), ``not resolved`` (chance inside: AUC 0.515 on 45 items, 26 %
  on 52 items against 25 %).

:func:`diff_text` writes the difference and its interval that every table prints beside the verdict.
"""

from __future__ import annotations

import math
import re

# strict scoring: a tie between the right and the wrong option counts as wrong, so a scorer that
# cannot tell the options apart (random or untrained features, identical texts) lands under chance
BELOW_CHANCE_NOTE = ("significantly below chance: ties count as wrong (a scorer that gives the options equal "
                     "scores fails the item), so an uninformative model can score under chance, down to 0 %")


def _num(v) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def interval(row: dict) -> tuple[float, float] | None:
    """The row's 95 % interval (``ci_low``, ``ci_high``), or None when it has none."""
    lo, hi = _num(row.get("ci_low")), _num(row.get("ci_high"))
    return (lo, hi) if lo is not None and hi is not None else None


def diff_interval(row: dict) -> tuple[float, float] | None:
    """The 95 % interval of the row's paired difference from its strongest baseline, or None."""
    lo, hi = _num(row.get("diff_low")), _num(row.get("diff_high"))
    return (lo, hi) if lo is not None and hi is not None else None


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
    """The row's verdict (module doc), or None when it has no chance level, no interval, or a baseline
    but no paired interval. ``baselines``: [(label, value)] of the no-learning baselines reported for it
    (a row whose own ``diff_vs`` is set has one, whether or not they are in ``baselines``)."""
    if baseline_target(row):
        return "baseline"
    n = _num(row.get("n"))
    chance, ci = _num(row.get("chance")), interval(row)
    if n is not None and n < MIN_ITEMS and (chance is not None or ci is not None):
        return "too few items"
    if chance is None or ci is None:
        return None
    if baselines or row.get("diff_vs"):
        d = diff_interval(row)
        if d is None:
            return None
        if d[0] > 0 and ci[0] > chance:
            return "above"
        return "below" if d[1] < 0 else "not resolved"
    if ci[1] < chance:
        return "below"
    return "above" if ci[0] > chance else "not resolved"


def diff_text(row: dict, fmt=lambda v: f"{v:+.4g}") -> str:
    """``+1.2 [0.3, 2.1] vs <baseline>``: the row's paired difference, its 95 % interval and what it
    is against; ``vs <baseline>: no paired interval`` without one; "" for a row without a baseline."""
    vs = row.get("diff_vs")
    if not vs:
        return ""
    d, ci = _num(row.get("diff")), diff_interval(row)
    if d is None or ci is None:
        return f"vs {vs}: no paired interval"
    return f"{fmt(d)} [{fmt(ci[0])}, {fmt(ci[1])}] vs {vs}"


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
