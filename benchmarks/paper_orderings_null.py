"""How often a paper-ordering rule calls a difference "resolved" when the two rows are the same.

``python benchmarks/paper_orderings_null.py [--grids N] [--seed K]`` simulates null grids: two rows
of ``seeds`` runs each, every run scored on the same ``images`` images (``items`` 0/1 items each),
the two rows with the same population accuracy. Two noises, as in a real grid:

- evaluation noise all seeds share: each row (configuration) gets an image-by-row effect a_{r,i}
  ~ N(0, tau) on the logit (which images a configuration gets right), the same for its seeds, so on a
  finite set of images the two rows differ even though their population accuracies are equal;
- seed noise: each run a logit shift b_{r,s} ~ N(0, sigma), and its own Bernoulli draws.

It prints the share of grids each rule resolves (a false resolution: the truth is no difference):

- the old rule (issue 26): |difference of the means| > the larger of the two rows' std over seeds;
- the rule of ``train compare --paper`` (:func:`train.eval.intervals.seeds_difference`): the 95%
  interval combining the paired evaluation bootstrap and the variance between seeds excludes 0.

``tests/test_paper_orderings.py`` runs it (fewer grids) and checks the new rule's rate is within
Monte Carlo error of at most 5% and the old rule's far above it; docs/evaluation.md quotes its output.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.eval.intervals import proportion, seeds_difference  # noqa: E402

IMAGES, ITEMS, SEEDS, TAU, SIGMA, MU = 150, 2, 3, 1.0, 0.15, 0.8


def null_grid(rng: np.random.Generator, images: int = IMAGES, items: int = ITEMS, seeds: int = SEEDS,
              tau: float = TAU, sigma: float = SIGMA, mu: float = MU):
    """Two rows' runs ([seeds] proportion estimates each) on the same images, no true difference."""
    img = np.repeat(np.arange(images), items)
    rows = []
    for _ in range(2):
        a = rng.normal(0.0, tau, images)[img]
        runs = []
        for _ in range(seeds):
            p = 1.0 / (1.0 + np.exp(-(mu + a + rng.normal(0.0, sigma))))
            runs.append(proportion(rng.random(img.size) < p, img))
        rows.append(runs)
    return rows


def old_rule(row: list, ref: list) -> bool:
    a, b = np.array([100 * e.value for e in row]), np.array([100 * e.value for e in ref])
    return bool(abs(a.mean() - b.mean()) > max(a.std(ddof=1), b.std(ddof=1)))


def new_rule(row: list, ref: list, resamples: int = 400) -> bool:
    s = list(range(len(row)))
    return seeds_difference(row, ref, 100.0, result_seeds=s, ref_seeds=s, resamples=resamples).excludes_zero


def null_rates(grids: int = 400, seed: int = 0, resamples: int = 400) -> dict[str, float]:
    """{"old": share resolved by the old rule, "new": by seeds_difference, "grids": grids}."""
    rng = np.random.default_rng(seed)
    old = new = 0
    for _ in range(grids):
        row, ref = null_grid(rng)
        old += old_rule(row, ref)
        new += new_rule(row, ref, resamples)
    return {"old": old / grids, "new": new / grids, "grids": grids}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grids", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    r = null_rates(a.grids, a.seed)
    mc = 1.96 * np.sqrt(0.05 * 0.95 / a.grids)
    print(f"null grids: {a.grids} ({IMAGES} images x {ITEMS} items, {SEEDS} seeds a row, image-by-row logit sd {TAU}, "
          f"seed logit sd {SIGMA}); resolved under no true difference: old rule (|diff| > larger seed std) "
          f"{100 * r['old']:.1f}%, train compare --paper (seeds + evaluation interval excludes 0) {100 * r['new']:.1f}% "
          f"(Monte Carlo +- {100 * mc:.1f} points at 5%)")


if __name__ == "__main__":
    main()
