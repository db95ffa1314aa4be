"""concept-ot learns through the real commands on the testbed (tests/testbed_run.py: the testbed
manifest, 1000 images, `pipeline run ingest` + `extract-clip-tokens` with ``models.clip:
scene-oracle``, then `train run concept-ot --json` with the manifest's ``train.concept_ot`` and its
control ``control=shuffled``), and its control does not.

Every benchmark scores held-out images only (the manifest's ``image_splits: [val, test]``: 100
images; retrieval and COCO-order: the 50 test images), so the test is the full testbed's seed 0.
What the trained local score must add (the frozen global score g alone is at chance there):
SugarCrepe swap_att above the control's, ARO VG-Attribution with ci_low above chance, the two-stage
retrieval above the frozen global one; word order (ARO VG-Relation, COCO-order) stays within its
interval of chance. The control (the same job, each training caption paired with another training
image once before training) keeps swap_att and VG-Attribution not above chance (ci_low <= 50),
swap_att at the frozen global score's and the rerank at the frozen global retrieval.

Measured (seed 0, held-out, 2026-11-25; `benchmarks/testbed.py` runs the same): trained swap_att 62.9
[51.1, 73.2] (n 70), VG-Attribution macro 71.0 [66.2, 76.2] (n 169), harness rerank R@1 i2t 72 [60,
84] / t2i 37.6 [31.6, 44.0] (chance 2), in-job rerank avg R@1 38.6 vs global 26.4, in-job swap_att
64.1 vs the global score's 47.7; VG-Relation 47.9 [40.6, 55.0], COCO-order 27.5 [22.3, 33.4] (chance
22.9). Control: swap_att 41.4 [30.6, 53.1], VG-Attribution 53.0 [47.4, 58.8], in-job swap_att 46.8,
rerank minus global +1.1. Seeds 1 and 2, measured before the benchmarks were restricted to held-out
images (all-image items, 400 images): swap_att 68.1 / 66.3, VG-Attribution 72.0 / 68.4, rerank over
global +11.8 / +11.3, control swap_att 47.5 / 47.1 (docs/jobs/concept-ot.md). Bounds (about half the
measured margins): swap_att >= 58 and >= the control's + 10 (n 70: its interval alone is too wide
to bound below at 50 with room), VG-Attribution >= 60 with ci_low > 50, in-job swap_att >= the
global score's + 12, rerank >= global + 6; control within 6 / 5 of the global score. Winoground is
not asserted: 12 held-out items.
"""

from __future__ import annotations

import pytest

from tests.testbed_run import rows, testbed  # noqa: F401  (the session fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # over 10 min at load 15-30 on 2 cores

# the margins were calibrated with the job's default rerank (global top-128: every one of the 100 held-out
# images); manifests/testbed.yaml reranks the top 32 of its 480 to keep the 1200-image run in budget
CALIBRATED = ["train.concept_ot.rerank_top_k=128"]


def _in(r) -> bool:
    return r["ci_low"] <= r["chance"] <= r["ci_high"]


def test_concept_ot_learns_on_the_testbed_and_its_control_does_not(testbed):  # noqa: F811
    testbed.stages("ingest", "extract-clip-tokens")
    res, results = testbed.train("concept-ot", *CALIBRATED)
    r = rows(results)
    swap, attr = r[("sugarcrepe", "swap_att", "accuracy")], r[("vg-attribution", "all", "macro_accuracy")]
    assert swap["value"] >= 58, swap
    assert attr["ci_low"] > 50 and attr["value"] >= 60, attr
    assert res["sugarcrepe/swap_att"] >= res["sugarcrepe_global/swap_att"] + 12
    assert res["rerank/avg_R@1"] >= res["global/avg_R@1"] + 6
    for d in ("i2t_R@1", "t2i_R@1"):
        assert r[("retrieval", "rerank", d)]["ci_low"] > r[("retrieval", "rerank", d)]["chance"]
    # word order is in no feature
    assert _in(r[("vg-relation", "all", "macro_accuracy")]) and _in(r[("coco-order", "all", "accuracy")])

    ctl, ctl_results = testbed.train("concept-ot", *CALIBRATED, "train.concept_ot.control=shuffled")
    c = rows(ctl_results)
    assert swap["value"] >= c[("sugarcrepe", "swap_att", "accuracy")]["value"] + 10
    # what training added is gone: not above chance, back at the frozen global score
    for k in (("sugarcrepe", "swap_att", "accuracy"), ("vg-attribution", "all", "macro_accuracy")):
        assert c[k]["ci_low"] <= c[k]["chance"], c[k]
    assert abs(ctl["sugarcrepe/swap_att"] - ctl["sugarcrepe_global/swap_att"]) <= 6
    assert abs(ctl["rerank/avg_R@1"] - ctl["global/avg_R@1"]) <= 5
    assert _in(c[("vg-relation", "all", "macro_accuracy")])
