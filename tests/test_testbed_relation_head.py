"""relation-head learns the scene graphs on a reduced testbed through the real path, and its control
stays at chance.

Reduced testbed: the testbed manifest (``TESTBED`` in tests/testbed_reduced.py) at 400 generated
images (360 train, 40 held out, those with 2-4 objects have ground-truth relations), tangible tokens
from the scene-oracle instrument (``models.sam: scene-oracle``, ground-truth masks, relations from
the annotations); ingest -> extract-visual-tokens (``run_stage``, what ``pipeline run`` calls), then
``train run relation-head`` with the testbed's ``train.relation_head`` settings (recall@1/3/5;
``epochs`` 75 here, 900 steps: at the testbed's 30 epochs the 360 images give too few steps) and the
same command with ``control=shuffled`` (the graphs permuted once among training images with the
same instance count, their instances relabelled). Chance is the image-blind ranking (predicates by
training frequency, overall or at the image's instance count, whichever scores higher; pairs tied),
which a head that learns only the graphs' statistics reaches. (The calibration below is from before
2026-11-29, with the overall order and the unrelabelled control; the global order still scores
higher here, so chance is the same: 10.6 / 33.3 / 51.1 at seed 0, and the seed-0 run passed with
recall@3 68.3 [56.5, 80.7], recall@5 80.6 [71.1, 89.4], control 12.8 / 40.0 / 50.0.) Asserted from each run's
``eval/final/results.parquet``: recall@3 and recall@5 have ci_low above chance by a margin; the
control's recall@1/3/5 are not above chance (ci_low <= chance + SLACK, 2 points: one-sided, as in
tests/test_testbed_visual_tokens.py; a control can land below chance with an interval that excludes
it, seed 1: recall@1 2.8 [0.0, 6.1] against 10.6).

Calibration over training seeds 0, 1, 2 (numbers as value [ci_low, ci_high], chance):
==============  ==================  ==================  ==================
seed            0                   1                   2
==============  ==================  ==================  ==================
recall@1 (10.6) 37.8 [25.6, 51.1]   35.6 [23.9, 48.3]   31.1 [20.6, 43.9]
recall@3 (33.3) 67.2 [56.7, 77.8]   67.8 [56.7, 79.4]   59.4 [47.2, 72.8]
recall@5 (51.1) 80.0 [72.8, 87.8]   83.9 [75.0, 91.7]   75.0 [64.4, 85.6]
control @1      12.2 [3.3, 24.4]    2.8 [0.0, 6.1]      19.4 [8.9, 31.7]
control @3      39.4 [26.1, 55.0]   23.9 [12.2, 36.7]   33.9 [21.1, 48.9]
control @5      48.3 [34.4, 62.8]   43.9 [30.0, 58.3]   46.7 [33.3, 61.1]
==============  ==================  ==================  ==================

(n = 30 held-out images with relations.) Smallest learned margins (ci_low - chance): 13.9
(recall@3), 13.3 (recall@5); the test asks for 8. Wall time per `train run` (900 steps): 83-275 s
on the shared reference machine under load from four other sessions (~30 s of CPU).
"""

from __future__ import annotations

import pytest

from tests.testbed_reduced import reduced_testbed_from, run_stages, train_runs_side_by_side

MARGIN = {"recall@3": 8.0, "recall@5": 8.0}  # ci_low - chance, points (calibrated minimum 13.3, minus a safety gap)
SLACK = 2.0  # points: the control's allowance for three simultaneous 95% intervals


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 6-7 min on the shared 2-core machine under load from four other sessions
def test_relation_head_learns_on_the_testbed_and_control_stays_at_chance(tmp_path, oracle_testbed_400):
    man = reduced_testbed_from(oracle_testbed_400, tmp_path, 400, [])  # its stages' output copied: complete
    run_stages(man, ["ingest", "extract-visual-tokens"])
    # the run and its control side by side (threads: 1, the job's default: their numbers do not depend on it)
    got, ctl = train_runs_side_by_side(man, "relation-head", (tmp_path / "rh", "epochs=75"),
                                       (tmp_path / "rh-control", "epochs=75", "control=shuffled"))
    for metric, margin in MARGIN.items():
        r = got[("relation-head", "held_out", metric)]
        assert r["n"] >= 25 and r["ci_low"] - r["chance"] > margin, (metric, r)
    for k in (1, 3, 5):
        r = ctl[("relation-head", "held_out", f"recall@{k}")]
        assert r["ci_low"] <= r["chance"] + SLACK, (k, r)
