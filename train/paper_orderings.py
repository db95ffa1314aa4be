"""A paper's orderings on the testbed, as paired differences with their noise (``train compare --paper``).

For each column of a paper's table (:mod:`train.paper_tables`) and each runnable row, the testbed's
difference (row - reference row) is judged as the paper's is:

- **the difference and its interval**: :func:`train.eval.intervals.seeds_difference` on the two rows'
  runs (every run's per-item estimate from its ``items.parquet``, the same items in every run): the
  mean over the row's seeds minus the mean over the reference's; its variance the between-seed
  variance of the per-seed differences / S (seeds paired by their seed) plus the evaluation
  bootstrap's variance of that mean difference, each draw resampling the same images for every run
  of both rows (the images all seeds share: no number of seeds averages their sampling away); the
  95% interval D +- t_nu sqrt(V), nu Satterthwaite's (S - 1 when the seeds dominate, C - 1 when
  the evaluation does).
- **the verdict**: ``agrees`` / ``disagrees`` (the testbed's sign against the paper's) only when that
  interval excludes 0; ``not testable`` when both rows are at chance (each row's own interval, the
  same combination of seeds and evaluation around its mean, contains chance: neither learnt
  anything the column can order); ``not resolved`` otherwise, saying which way it leans; a tie in
  the paper, fewer than two seeds in a row (no between-seed variance) or runs without per-item
  estimates are ``not resolved`` too, saying why.
- **the order**: Kendall's tau-b between the testbed's means and the published numbers over the rows
  with both, and its exact one-sided permutation p-value P(tau >= observed) over every ordering of the
  testbed's values (n! of them; 3 rows cannot go below p = 1/6).
- **the tally** of a page: per row and in all, the comparisons (row, column) with a published number on
  both sides by verdict; the page's prose quotes it from here (:mod:`train.paper_pages`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from train.paper_tables import Cell, Collected, Column, PaperTable, Row

VERDICTS = ("agrees", "disagrees", "not resolved", "not testable")
PERMUTATION_LIMIT = 8  # rows enumerated exactly (8! = 40,320); more: 20,000 seeded random orderings


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def ranks(values: dict[str, float]) -> dict[str, int]:
    """1 = highest; ties share the better rank."""
    return {k: 1 + sum(1 for w in values.values() if w > v) for k, v in values.items()}


# ------------------------------------------------------------------------------ intervals per cell


def _seeds(cell: Cell) -> list[int] | None:
    return None if any(s is None for s in cell.seeds) else list(cell.seeds)


def row_interval(got: Collected, row: str, col: str):
    """The row's mean over its seeds with its 95% interval (seeds and evaluation combined), cached; None
    without per-item estimates."""
    from train.eval.intervals import seeds_difference

    key = ("row", row, col)
    if key not in got.cache:
        c = got.cells.get((row, col))
        got.cache[key] = None
        if c is not None and c.has_items:
            try:
                got.cache[key] = seeds_difference(c.ests, scale=c.est_scale)
            except ValueError:  # its seeds were scored on other items (the difference says why)
                pass
    return got.cache[key]


def at_chance(got: Collected, row: str, col: str) -> bool | None:
    """The row's interval contains chance (None: no chance level or no interval)."""
    c, ri = got.cells.get((row, col)), row_interval(got, row, col)
    ch = None if c is None else c.chance_level
    if ri is None or ch is None or not (math.isfinite(ri.low) and math.isfinite(ri.high)):
        return None
    return ri.low <= ch <= ri.high


def difference(got: Collected, row: str, ref: str, col: str):
    """:func:`seeds_difference` of (row - reference) in one column, cached; None without estimates."""
    from train.eval.intervals import seeds_difference

    key = ("diff", row, ref, col)
    if key not in got.cache:
        c, cr = got.cells.get((row, col)), got.cells.get((ref, col))
        got.cache[key] = None
        if c is not None and cr is not None and c.has_items and cr.has_items:
            try:
                got.cache[key] = seeds_difference(c.ests, cr.ests, c.est_scale, result_seeds=_seeds(c),
                                                  ref_seeds=_seeds(cr))
            except ValueError as e:  # the runs were not scored on the same items: no paired difference
                got.cache[("why", row, ref, col)] = str(e).removeprefix("paired_difference: ")
    return got.cache[key]


# ------------------------------------------------------------------------------------ verdicts


@dataclass
class Verdict:
    kind: str        # agrees | disagrees | not resolved | not testable | reference | no job option | not run | ...
    why: str = ""    # the reason of a "not resolved" / "not testable" (shown after a colon)

    @property
    def counted(self) -> bool:
        return self.kind in VERDICTS

    def __str__(self) -> str:
        return f"{self.kind}: {self.why}" if self.why else self.kind


def verdict(table: PaperTable, got: Collected, row: Row, col: Column) -> Verdict:
    """The row's ordering against the reference row in one column (module doc)."""
    if row.options is None:
        return Verdict("no job option")
    if row.id == table.reference:
        return Verdict("reference")
    ref = table.row(table.reference)
    c, cr = got.cells.get((row.id, col.id)), got.cells.get((ref.id, col.id))
    p, pr = row.published.get(col.id), ref.published.get(col.id)
    if c is None or cr is None:
        return Verdict("not run" if row.id not in got.runs or ref.id not in got.runs else "no result")
    if p is None or pr is None:
        return Verdict("no published number")
    if not (c.has_items and cr.has_items):
        missing = (c.no_items + cr.no_items)[:1]
        return Verdict("not resolved", "no per-item estimates (" + "; ".join(missing) + ")")
    if at_chance(got, row.id, col.id) and at_chance(got, ref.id, col.id):
        return Verdict("not testable", "both rows at chance")
    dp = p - pr
    if _sign(dp) == 0:
        return Verdict("not resolved", "the paper's rows tie")
    d = difference(got, row.id, ref.id, col.id)
    if d is None:
        return Verdict("not resolved", "the runs were not scored on the same items ("
                       + got.cache.get(("why", row.id, ref.id, col.id), "") + ")")
    if not (math.isfinite(d.low) and math.isfinite(d.high)):
        return Verdict("not resolved", f"{min(d.seeds)} seed(s) in a row: the variance between seeds is not measured")
    if d.excludes_zero:
        return Verdict("agrees" if _sign(d.diff) == _sign(dp) else "disagrees")
    lean = "tie" if _sign(d.diff) == 0 else "leans " + ("agree" if _sign(d.diff) == _sign(dp) else "disagree")
    return Verdict("not resolved", f"interval contains 0, {lean}")


# ---------------------------------------------------------------------------------- Kendall tau


def kendall_tau_b(x, y) -> float:
    """Kendall's tau-b of two sequences (ties corrected; NaN when either is constant)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    i, j = np.triu_indices(x.size, 1)
    sx, sy = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    n0 = i.size
    nx, ny = n0 - int(np.sum(sx == 0)), n0 - int(np.sum(sy == 0))
    if nx == 0 or ny == 0:
        return float("nan")
    return float(np.sum(sx * sy)) / math.sqrt(nx * ny)


@dataclass
class Kendall:
    tau: float
    p: float          # one-sided: P(tau >= observed) over orderings of the testbed's values
    n: int            # rows with both numbers
    orderings: int    # orderings counted
    exact: bool


def kendall_exact(testbed, paper, seed: int = 0) -> Kendall:
    """Kendall's tau-b between the testbed's values and the paper's, and its permutation p-value: the
    share of orderings of the testbed's values (all n! of them up to :data:`PERMUTATION_LIMIT` rows,
    else 20,000 seeded random ones) whose tau is at least the observed one."""
    x, y = list(map(float, testbed)), list(map(float, paper))
    n = len(x)
    tau = kendall_tau_b(x, y) if n >= 2 else float("nan")
    if not math.isfinite(tau):
        return Kendall(tau, float("nan"), n, 0, True)
    if n <= PERMUTATION_LIMIT:
        perms, exact = itertools.permutations(x), True
    else:
        rng = np.random.default_rng(seed)
        perms, exact = (rng.permutation(x) for _ in range(20000)), False
    taus = np.array([kendall_tau_b(list(p), y) for p in perms])
    return Kendall(tau, float(np.mean(taus >= tau - 1e-12)), n, int(taus.size), exact)


def column_kendall(table: PaperTable, got: Collected, col: Column) -> Kendall:
    both = [r for r in table.rows if (r.id, col.id) in got.cells and r.published.get(col.id) is not None]
    return kendall_exact([got.cells[(r.id, col.id)].mean for r in both], [r.published[col.id] for r in both])


# ------------------------------------------------------------------------------------- the tally


@dataclass
class Tally:
    """Comparisons (row, column) by verdict, per row and over the page; Kendall per column."""

    rows: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # row -> verdict -> columns
    kendall: dict[str, Kendall] = field(default_factory=dict)

    def count(self, kind: str, row: str | None = None) -> int:
        rows = [row] if row else list(self.rows)
        return sum(len(self.rows[r].get(kind, [])) for r in rows)

    @property
    def compared(self) -> int:
        return sum(self.count(k) for k in VERDICTS)

    def sentence(self) -> str:
        """The page's tally in words: what the prose quotes."""
        k = self.kendall.values()
        pos = sum(1 for x in k if math.isfinite(x.tau) and x.tau > 0)
        sig = sum(1 for x in k if math.isfinite(x.p) and x.p < 0.05)
        tested = sum(1 for x in k if math.isfinite(x.tau))
        return (f"{self.compared} comparisons with the reference row: {self.count('agrees')} agree, "
                f"{self.count('disagrees')} disagree, {self.count('not resolved')} not resolved, "
                f"{self.count('not testable')} not testable; Kendall's tau against the paper's order positive in "
                f"{pos} of {tested} columns, p < 0.05 in {sig}")


def tally(table: PaperTable, got: Collected) -> Tally:
    t = Tally()
    for r in table.rows:
        if r.options is None or r.id == table.reference:
            continue
        per: dict[str, list[str]] = {}
        for c in table.columns:
            v = verdict(table, got, r, c)
            if v.counted:
                per.setdefault(v.kind, []).append(c.id)
        t.rows[r.id] = per
    for c in table.columns:
        t.kendall[c.id] = column_kendall(table, got, c)
    return t
