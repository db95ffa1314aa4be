"""visual-tokens learns on a reduced testbed through the real path, and its control stays at chance.

Reduced testbed: the testbed manifest (``TESTBED`` in tests/testbed_reduced.py) at 400 generated
images (360 train, 40 held out), the scene-oracle instrument for CLIP, SAM and the predicate
encoder; ingest -> extract-clip-tokens -> extract-visual-tokens (``run_stage``, what ``pipeline
run`` calls), then ``train run visual-tokens`` (the testbed's ``train.visual_tokens`` settings,
``epochs`` 60 here: 300 steps) with benchmarks SugarCrepe and ARO VG-Relation, and the same command
with ``control=shuffled``. Asserted from each run's ``eval/final/results.parquet``:

* learned: held-out image->text R@1 (chance 2.5%), SugarCrepe replace-att and replace-obj (chance 50%)
  have ci_low above chance by a margin;
* word order stays at chance (the oracle's text tokens carry no order, the text head has no
  positions): VG-Relation accuracy and SugarCrepe swap-obj have chance inside their interval;
* the control (pairings shuffled once): each of these metrics has chance inside its interval.

Calibration over training seeds 0, 1, 2 (numbers as value [ci_low, ci_high]):
CALIBRATION
"""

from __future__ import annotations

import pytest

from tests.testbed_reduced import reduced_testbed, run_stages, train_run

LEARNED = [("eval-split-retrieval", "all", "i2t_R@1"), ("sugarcrepe", "replace_att", "accuracy"),
           ("sugarcrepe", "replace_obj", "accuracy")]
ORDER = [("vg-relation", "all", "accuracy"), ("sugarcrepe", "swap_obj", "accuracy")]
MARGIN = {"i2t_R@1": 20.0, "accuracy": 10.0}  # ci_low - chance, points (calibrated minimum minus a safety gap)


def inside(row) -> bool:
    return row["ci_low"] <= row["chance"] <= row["ci_high"]


@pytest.mark.slow
def test_visual_tokens_learns_on_the_testbed_and_control_stays_at_chance(tmp_path, ray_session):
    man = reduced_testbed(tmp_path, 400, ["sugarcrepe", "vg-relation"])
    run_stages(man, ["ingest", "extract-clip-tokens", "extract-visual-tokens"])
    got, _ = train_run(man, "visual-tokens", tmp_path / "vt", "epochs=60")
    for key in LEARNED:
        r = got[key]
        assert r["ci_low"] - r["chance"] > MARGIN[key[2]], (key, r)
    for key in ORDER:
        assert inside(got[key]), (key, got[key])
    ctl, _ = train_run(man, "visual-tokens", tmp_path / "vt-control", "epochs=60", "control=shuffled")
    for key in LEARNED + ORDER:
        assert inside(ctl[key]), (key, ctl[key])
