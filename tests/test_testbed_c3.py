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

Measured (the 1000-image testbed at held-out 0.1, as this fixture builds it; training seeds 0, 1, 2,
2026-11-26, by the same commands run by hand with this manifest's settings, the control on seeds
0, 1, 2 (below); this test itself was not run: the shared machine was at load 20-34; docs/jobs/c3.md), seed 0's
held-out AUC value [95% bootstrap interval], n, frozen global-cosine baseline:

==============  ======================  =====  ========
type            trained                 n      frozen
==============  ======================  =====  ========
type1           0.581 [0.569, 0.593]    1923   0.561
type2_random    0.593 [0.580, 0.606]    1933   0.641
type2_hard      0.583 [0.569, 0.596]    1822   0.615
type2_binding   0.636 [0.609, 0.662]    548    0.605
==============  ======================  =====  ========

The control (``control=shuffled``, same seed): 0.500 [0.499, 0.501] / 0.499 [0.498, 0.500] /
0.503 [0.502, 0.504] / 0.505 [0.502, 0.508]: its scores hardly vary, so its intervals are +-0.001-0.003
wide and two lower bounds sit 0.002 above 0.5; SLACK (0.01) allows that, no more.
Control seeds 1 / 2 (2026-11-26, the same fixture's Testbed, after the c3 defaults moved to ITM + MCP
with the testbed pinning ``itm: false, epoch_unit: concept_rows``): type1 0.501 [0.499, 0.502] /
0.498 [0.497, 0.500], type2_random 0.499 [0.498, 0.501] / 0.500 [0.498, 0.501], type2_hard 0.500
[0.499, 0.501] / 0.498 [0.497, 0.500], type2_binding 0.502 [0.499, 0.505] / 0.504 [0.501, 0.507]:
the largest lower bound above 0.5 is 0.0007 (seed 2, binding), inside SLACK; trained type 1 minus the
control's is at least 0.056 (seed 2) against the asserted 0.04.

Seed 1: 0.565 [0.554, 0.577], 0.578 [0.566, 0.590], 0.581 [0.569, 0.595], 0.617 [0.590, 0.645].
Seed 2: 0.556 [0.547, 0.565], 0.560 [0.550, 0.570], 0.560 [0.549, 0.570], 0.581 [0.556, 0.603].
The margins (ci_low - 0.5 > 0.03) leave 0.017 of the thinnest lower bound (type 1, seed 2: 0.547)
unused. Wall time: 800 steps took ~13 min under that load (about
4 min at the 3.5 steps/s of a quieter moment), longer than the 2-3 min a slow test should take.
"""

from __future__ import annotations

import pytest

from tests.testbed_run import rows, testbed  # noqa: F401  (the session fixture)

LEARNED = {"type1": 0.03, "type2_random": 0.03, "type2_hard": 0.03, "type2_binding": 0.03}  # ci_low - 0.5 required
SLACK = 0.01  # the control's ci_low may exceed 0.5 by at most this (seed 0: 0.002; intervals +-0.001-0.003)
NO_BENCH = "eval.benchmarks=[]"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_c3_learns_mcp_on_the_testbed_and_its_control_does_not(testbed):  # noqa: F811
    testbed.stages("ingest", "extract-clip-tokens", "mine-concepts", "encode-concepts")
    _, results = testbed.train("c3", NO_BENCH)
    r = rows(results)
    for t, margin in LEARNED.items():
        x = r[("c3_mcp", t, "auc")]
        assert x["n"] >= 300 and x["ci_low"] - 0.5 > margin, (t, x)
    _, ctl_results = testbed.train("c3", NO_BENCH, "train.c3.control=shuffled")
    c = rows(ctl_results)
    for t in ("type1", "type2_random", "type2_hard", "type2_binding"):
        x = c[("c3_mcp", t, "auc")]
        if x["n"]:
            assert x["ci_low"] <= 0.5 + SLACK, (t, x)
    assert r[("c3_mcp", "type1", "auc")]["value"] >= c[("c3_mcp", "type1", "auc")]["value"] + 0.04
