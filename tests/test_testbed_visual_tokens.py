"""visual-tokens learns on a reduced testbed through the real path, and its control stays at chance.

Reduced testbed: the testbed manifest (``TESTBED`` in tests/testbed_reduced.py) at 400 generated
images (360 train, 40 held out), the scene-oracle instrument for CLIP, SAM and the predicate
encoder; ingest -> extract-clip-tokens -> extract-visual-tokens (``run_stage``, what ``pipeline
run`` calls), then ``train run visual-tokens`` (the testbed's ``train.visual_tokens`` settings,
``epochs`` 60 here: 300 steps) with benchmarks SugarCrepe and ARO VG-Relation, and the same command
with ``control=shuffled``. Asserted from each run's ``eval/final/results.parquet``:

* learned: held-out image->text R@1 (chance 2.5%), SugarCrepe replace-att and replace-obj (chance 50%)
  have ci_low above chance by a margin;
* word order is not learned (the oracle's text tokens carry no order, the text head has no
  positions): VG-Relation accuracy and SugarCrepe swap-obj are not above chance;
* the control (pairings shuffled once): none of these metrics is above chance.

"Not above chance" is ci_low <= chance + SLACK (2 points). One-sided: a run that learns nothing
can land a little *below* chance with an interval that excludes it (seed 1's control: R@1 0 of 40
images, bootstrap interval [0, 0]; VG-Relation 46.7 [43.7, 49.7]); the slack: the seven no-learning
checks are each a 95% interval, and over the three calibration seeds two control intervals excluded
chance from above by less than half a point (seed 2: SugarCrepe replace-att 55.2 [50.4, 60.0],
swap-obj 56.0 [50.3, 61.5]), as multiplicity predicts; a control that learns the binding would sit
far higher (the trained runs: ci_low >= 79).

Calibration over training seeds 0, 1, 2 (numbers as value [ci_low, ci_high]):
=================  ==========================  ==========================  ==========================
seed               0                           1                           2
=================  ==========================  ==========================  ==========================
i2t R@1 (ch 2.5)   65.0 [50.0, 80.0]           62.5 [47.5, 77.5]           62.5 [47.5, 77.5]
replace-att (50)   84.2 [80.4, 87.5]           83.0 [79.0, 86.4]           84.8 [80.9, 87.9]
replace-obj (50)   84.8 [80.9, 87.9]           88.8 [85.3, 91.5]           88.0 [84.4, 90.8]
VG-Relation (50)   50.6 [47.6, 53.6]           49.6 [46.6, 52.6]           48.6 [45.6, 51.6]
swap-obj (50)      49.0 [43.4, 54.6]           52.3 [46.7, 57.9]           50.7 [45.0, 56.3]
control: R@1       2.5 [0.0, 7.5]              0.0 [0.0, 0.0]              5.0 [0.0, 12.5]
control: rep-att   49.0 [44.1, 53.9]           50.2 [45.4, 55.1]           55.2 [50.4, 60.0]
control: rep-obj   48.8 [43.9, 53.6]           50.5 [45.6, 55.4]           49.5 [44.6, 54.4]
control: VG-Rel    50.5 [47.5, 53.5]           46.7 [43.7, 49.7]           52.3 [49.3, 55.3]
control: swap-obj  46.7 [41.1, 52.3]           51.0 [45.4, 56.6]           56.0 [50.3, 61.5]
=================  ==========================  ==========================  ==========================

So the smallest learned margins (ci_low - chance) are 45.0 (R@1), 29.0 (replace-att) and 30.9
(replace-obj); the test asks for 20 and 10. Wall time per `train run` (300 steps + the two
benchmarks): 104-228 s on the shared reference machine under load from four other sessions.
"""

from __future__ import annotations

import pytest

from tests.testbed_reduced import reduced_testbed_from, run_stages, train_runs_side_by_side

LEARNED = [("eval-split-retrieval", "all", "i2t_R@1"), ("sugarcrepe", "replace_att", "accuracy"),
           ("sugarcrepe", "replace_obj", "accuracy")]
ORDER = [("vg-relation", "all", "accuracy"), ("sugarcrepe", "swap_obj", "accuracy")]
MARGIN = {"i2t_R@1": 20.0, "accuracy": 10.0}  # ci_low - chance, points (calibrated minimum minus a safety gap)


SLACK = 2.0  # points: the no-learning checks' allowance for 7 simultaneous 95% intervals (see above)


def not_above(row) -> bool:
    return row["ci_low"] <= row["chance"] + SLACK


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 6-7 min on the shared 2-core machine under load from four other sessions
def test_visual_tokens_learns_on_the_testbed_and_control_stays_at_chance(tmp_path, oracle_testbed_400):
    man = reduced_testbed_from(oracle_testbed_400, tmp_path, 400, ["sugarcrepe", "vg-relation"])  # stages: copied
    run_stages(man, ["ingest", "extract-clip-tokens", "extract-visual-tokens"])
    # the run and its control side by side (threads: 1, the testbed's: their numbers do not depend on it)
    got, ctl = train_runs_side_by_side(man, "visual-tokens", (tmp_path / "vt", "epochs=60"),
                                       (tmp_path / "vt-control", "epochs=60", "control=shuffled"))
    for key in LEARNED:
        r = got[key]
        assert r["ci_low"] - r["chance"] > MARGIN[key[2]], (key, r)
    for key in ORDER:
        assert not_above(got[key]), (key, got[key])
    for key in LEARNED + ORDER:
        assert not_above(ctl[key]), (key, ctl[key])
