"""concept-ot learns through the real commands on a reduced testbed (tests/testbed_run.py: the
testbed manifest at 400 images, `pipeline run ingest` + `extract-clip-tokens` with
``models.clip: scene-oracle``, then `train run concept-ot --json` with the manifest's
``train.concept_ot`` and its control ``control=shuffled``), and its control does not.

What the trained local score must add (the frozen global score g alone is at chance there:
``sugarcrepe_global/swap_att``, ARO VG-Attribution of the `global-only` variant): SugarCrepe
swap_att and ARO VG-Attribution with ci_low above chance, the two-stage retrieval above the frozen
global one; word order (ARO VG-Relation, COCO-order) stays within its interval of chance, and
Winoground's text score is not above chance. The control (the same job, each training caption
paired with another training image once before training) keeps swap_att and VG-Attribution within
their interval of chance and the rerank at the frozen global retrieval.

Calibration (seeds 0, 1, 2 of the job; 400 images, the manifest's 200 steps; docs/jobs/concept-ot.md, Testbed):
MARGINS_MEASURED below.
"""

from __future__ import annotations

import pytest

from tests.testbed_run import rows, testbed  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.slow

def _in(r) -> bool:
    return r["ci_low"] <= r["chance"] <= r["ci_high"]


def test_concept_ot_learns_on_the_testbed_and_its_control_does_not(testbed):  # noqa: F811
    testbed.stages("ingest", "extract-clip-tokens")
    res, results = testbed.train("concept-ot")
    r = rows(results)
    swap, attr = r[("sugarcrepe", "swap_att", "accuracy")], r[("vg-attribution", "all", "macro_accuracy")]
    assert swap["ci_low"] > 50 and swap["value"] >= 58, swap
    assert attr["ci_low"] > 50 and attr["value"] >= 58, attr
    assert res["sugarcrepe/swap_att"] >= res["sugarcrepe_global/swap_att"] + 8
    assert res["rerank/avg_R@1"] >= res["global/avg_R@1"] + 4
    for d in ("i2t_R@1", "t2i_R@1"):
        assert r[("retrieval", "rerank", d)]["ci_low"] > r[("retrieval", "rerank", d)]["chance"]
    # word order is in no feature
    assert _in(r[("vg-relation", "all", "macro_accuracy")]) and _in(r[("coco-order", "all", "accuracy")])
    wino = r[("winoground", "all", "text_score")]
    assert wino["ci_low"] <= wino["chance"]

    ctl, ctl_results = testbed.train("concept-ot", "train.concept_ot.control=shuffled")
    c = rows(ctl_results)
    assert _in(c[("sugarcrepe", "swap_att", "accuracy")]) and _in(c[("vg-attribution", "all", "macro_accuracy")])
    assert _in(c[("vg-relation", "all", "macro_accuracy")])
    assert abs(ctl["rerank/avg_R@1"] - ctl["global/avg_R@1"]) <= 4
