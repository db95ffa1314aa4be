"""c3 learns MCP through the real commands on the testbed (tests/testbed_run.py: the 1000-image
testbed, scene-oracle CLIP), and its control stays at chance.

Real path: ``pipeline run ingest / extract-clip-tokens / mine-concepts / encode-concepts``, then
``train run c3`` with the testbed's ``train.c3`` settings (manifests/testbed.yaml: MCP only, 800
steps of 16 triplets, one co-attention layer of 64) and the same command with
``train.c3.control=shuffled``. ``eval.benchmarks=[]``: only the job's own held-out rows
(``c3_mcp``: held-out triplets of the val + test images, partners and negatives from those images
only; the type-2 negatives are concept-matched, so the concept alone scores 0.5 exactly).

Mining on the testbed (``stages.mine_concepts``): ``skip_stopword_edge: true, n_max: 2,
coverage: none`` (docs/jobs/c3.md, Testbed): short content phrases ("pink shape", "red circle").
Held-out type-1 AUC with the other minings: the paper's (N 5, coverage; 150 steps of 64) 0.514,
N 3 without coverage (800 steps of 16, MCP + MCC) 0.511, the stopword-edge filter at N 5 (800 steps,
MCP only) 0.632, whose MCP loss left the prior only after step 550.

Calibrated 2026-11-27 (issue 37: the intervals now resample the triplets' anchor images) on this
fixture (the 1000-image testbed at held-out 0.1) with ``.venv/bin/python
benchmarks/calibrate_testbed_tests.py --jobs c3 --seeds 0 1 2`` (the same commands; trained and
control on seeds 0, 1, 2; load 20-50), held-out AUC [95% interval], frozen global cosine after the bar:

==============  ======================  ======================  ======================  ======
type            seed 0                  seed 1                  seed 2                  frozen
==============  ======================  ======================  ======================  ======
type1           0.575 [0.561, 0.590]    0.572 [0.558, 0.584]    0.562 [0.550, 0.574]    0.561-0.564
type2_random    0.578 [0.564, 0.593]    0.587 [0.574, 0.601]    0.566 [0.555, 0.578]    0.625-0.641
type2_hard      0.572 [0.557, 0.587]    0.593 [0.577, 0.609]    0.565 [0.553, 0.578]    0.601-0.632
type2_binding   0.612 [0.588, 0.636]    0.637 [0.607, 0.665]    0.594 [0.569, 0.620]    0.602-0.623
control type1   0.500 [0.499, 0.501]    0.501 [0.499, 0.502]    0.498 [0.497, 0.500]
control random  0.499 [0.497, 0.501]    0.499 [0.497, 0.501]    0.500 [0.497, 0.502]
control hard    0.503 [0.501, 0.505]    0.500 [0.498, 0.502]    0.498 [0.496, 0.500]
control binding 0.504 [0.501, 0.508]    0.501 [0.497, 0.505]    0.504 [0.500, 0.507]
==============  ======================  ======================  ======================  ======

n: 1922-1933 (types 1 and 2 random / hard), 543-552 (binding). The thinnest trained lower bound is
0.550 (type 1, seed 2): the asserted ci_low - 0.5 > 0.03 leaves 0.020 unused. The control's largest
lower bound above 0.5 is 0.0012 (binding, seed 0), inside SLACK (0.01). Trained type 1 minus the
control's: at least 0.064 (seed 2) against the asserted 0.04. Under the verdict rule (docs/evaluation.md)
none of these clears the frozen global cosine: type 1 ties it (lower bounds 0.550-0.561 against
0.561-0.564), the type-2 rows stay below it (docs/jobs/c3.md, "Testbed verdicts"). What this test
asserts is learning above chance with a control at chance, which holds on every seed. Wall time per run:
167-336 s at load 20-50.
"""

from __future__ import annotations

import pytest

from tests.testbed_run import rows  # the session fixture `testbed`: tests/conftest.py

LEARNED = {"type1": 0.03, "type2_random": 0.03, "type2_hard": 0.03, "type2_binding": 0.03}  # ci_low - 0.5 required
SLACK = 0.01  # the control's ci_low may exceed 0.5 by at most this (largest over seeds 0-2: 0.0012)
NO_BENCH = "eval.benchmarks=[]"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_c3_learns_mcp_on_the_testbed_and_its_control_does_not(testbed):
    testbed.stages("ingest", "extract-clip-tokens", "mine-concepts", "encode-concepts")
    # the run and its control side by side (threads: 1 each, as calibrated; their numbers do not depend on it)
    (_, results), (_, ctl_results) = testbed.train_side_by_side(("c3", NO_BENCH),
                                                                ("c3", NO_BENCH, "train.c3.control=shuffled"))
    r = rows(results)
    for t, margin in LEARNED.items():
        x = r[("c3_mcp", t, "auc")]
        assert x["n"] >= 300 and x["ci_low"] - 0.5 > margin, (t, x)
    c = rows(ctl_results)
    for t in ("type1", "type2_random", "type2_hard", "type2_binding"):
        x = c[("c3_mcp", t, "auc")]
        if x["n"]:
            assert x["ci_low"] <= 0.5 + SLACK, (t, x)
    assert r[("c3_mcp", "type1", "auc")]["value"] >= c[("c3_mcp", "type1", "auc")]["value"] + 0.04
