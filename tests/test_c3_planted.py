"""Planted signal for the c3 trainer (tests/c3_planted.py: objects are colour-shape pairs; an
object's patches carry E_v[colour] + E_v[shape], so which colour goes with which shape is visible
only at the patch level; pooled embeddings carry a weak bag of words; captions "a red circle and
a blue square"; concepts mined by the real miner with coverage off and N = 3; 400 images, 320 for
training).

Trained with MCP + MCC (800 steps of 16 triplets, each with a type-1 and a type-2 negative; the
loop's defaults otherwise, gradient clipping at 1.0 included), evaluated on held-out (test-split)
triplets whose partners and negatives come from the test split only. The control trains the same
model on the same rows with every training sample reading another training image's features
(`control: shuffled`): it can learn which concepts tend to be positives, nothing about images.
Type-2 negatives of the evaluation are concept-matched (another positive's image pair with this
positive's concept), so what the control can learn is worth exactly nothing on every type.

Calibration (data seed = training seed, one thread, measured 2026-11-24; seeds 0 / 1 / 2 / 3):

* type-1 AUC 0.889 / 0.915 / 0.903 / 0.857 (frozen global-cosine baseline 0.636 / 0.660 / 0.636 /
  0.631);
* attribute-binding type-2 AUC 0.786 / 0.838 / 0.816 / 0.733 (baseline 0.589 / 0.613 / 0.605 /
  0.609); random type-2 0.903 / 0.928 / 0.919 / 0.852, hard type-2 0.892 / 0.907 / 0.883 / 0.848
  (baselines 0.69-0.77);
* the control's AUCs, type-1 / random / hard / binding: 0.518 0.507 0.524 0.506 /
  0.504 0.499 0.497 0.486 / 0.492 0.499 0.490 0.501 / 0.491 0.499 0.486 0.492 (largest distance
  from 0.5: 0.024);
* MCC precision@5 over the rare concepts (in <= 10% of the held-out images) 22.6% against a
  base rate of 4.6% (x4.9) / 20.1% vs 5.0% (x4.0) / 17.9% vs 5.0% (x3.6) / 18.5% vs 5.0% (x3.7);
  the unconditioned frozen-embedding ranking 14.5% / 12.6% / 10.6% / 13.1% (5.4-8.1 points
  below). Over all two-word concepts it is x3.1 / x2.7 / x2.6 / x2.6: two in five of their
  queries are of "a <colour>", in a third of the images, where 3x the base rate would be 100%
  precision (theirs is 84-91%); colour-shape bigrams alone reach x4.0 / x4.1 (seeds 1 / 2).

Asserted on seed 0; every bound also holds on the worst of the four seeds, with the thinnest
margins there on binding over its baseline (0.124 against 0.1, seed 3) and rare precision over
the frozen ranking (5.4 points against 5, seed 3):

* MCP AUC >= 0.8 against type-1 negatives and >= 0.7 against attribute-binding type-2 negatives
  (the issue: 0.8 and 0.65), each >= 0.1 above the frozen global-cosine baseline of the same
  triplets; random and hard type-2 AUC >= 0.05 above theirs;
* the control's AUC within 0.5 +- 0.06 on every negative type (about three standard errors of an
  AUC at chance with ~500-1000 triplets a side);
* MCC concept-conditioned precision@5 of the rare concepts >= 3x its base rate and >= 5 points
  above the unconditioned frozen-embedding ranking.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from c3_planted import write_c3_planted  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

ARGS = ["train.c3.batch_size=16", "train.c3.d_model=64", "train.c3.layers=1", "train.c3.dropout=0",
        "train.c3.lr=1e-3", "train.c3.threads=1", "train.c3.eval_splits=[test]", "train.c3.amp=off"]
STEPS = 800
TYPES = ("type1", "type2_random", "type2_hard", "type2_binding")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("c3_planted")
    write_c3_planted(out, n_images=400, seed=0, global_signal=0.35, P=64)
    return out


def _run(out: Path, steps: int, extra=(), name="c3") -> dict:
    from pipeline.config import load_manifest
    from train.config import TrainerConfig
    from train.jobs.c3 import make_job
    from train.loop import train

    no_h = ["train.c3.benchmarks_at_end=false"] if "benchmarks_at_end" in TrainerConfig.model_fields else []
    m = load_manifest(None, [f"output={out}", *ARGS, f"train.c3.max_steps={steps}", *no_h, *extra])
    job = make_job(m.train.c3, m, out / "train" / name, torch.device("cpu"))
    return train(job, resume=False, progress=False)


@pytest.mark.timeout(1800)
def test_planted_mcp_mcc_and_control(data):
    res = _run(data, STEPS)
    print({k: round(v, 3) for k, v in res.items() if isinstance(v, float) and not k.startswith("data")}, flush=True)
    ctl = _run(data, STEPS, ["train.c3.control=shuffled"], "control")
    print({k: round(v, 3) for k, v in ctl.items() if isinstance(v, float) and not k.startswith("data")}, flush=True)
    auc = {t: res[f"c3_mcp/{t}/auc"] for t in TYPES}
    glob = {t: res[f"c3_mcp/{t}/auc_global_cosine"] for t in TYPES}
    assert all(res[f"chance/c3_mcp/{t}/auc"] == 0.5 for t in TYPES)
    assert auc["type1"] >= 0.8 and auc["type1"] >= glob["type1"] + 0.1, (auc, glob)
    assert auc["type2_binding"] >= 0.7 and auc["type2_binding"] >= glob["type2_binding"] + 0.1, (auc, glob)
    assert auc["type2_random"] >= glob["type2_random"] + 0.05 and auc["type2_hard"] >= glob["type2_hard"] + 0.05
    # the control: at chance on every negative type (concept-matched negatives)
    for t in TYPES:
        assert abs(ctl[f"c3_mcp/{t}/auc"] - 0.5) <= 0.06, (t, ctl[f"c3_mcp/{t}/auc"])
    p5, base = res["c3_retrieval/rare/precision@5"], res["chance/c3_retrieval/rare/precision@5"]
    assert p5 >= 3 * base and p5 >= res["c3_retrieval/rare/precision@5_global_cosine"] + 5, (p5, base)
