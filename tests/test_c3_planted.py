"""Planted signal for the c3 trainer (tests/c3_planted.py: objects are colour-shape pairs; an
object's patches carry E_v[colour] + E_v[shape], so which colour goes with which shape is visible
only at the patch level; pooled embeddings carry a weak bag of words; concepts mined by the real
miner with coverage off and N = 3; 400 images, 320 for training).

Trained with MCP + MCC (400 steps of 32 triplets), evaluated on held-out (test-split) triplets whose
partners and negatives come from the test split only. Calibration (seed 0, one thread, measured
2026-11-23): type-1 AUC 0.777 (frozen global-cosine baseline 0.633), attribute-binding type-2
AUC 0.772 (baseline 0.532; the control 0.694), MCC precision@5 of two-word concepts 29.9% against a
base rate of 9.95% (x3.0; unconditioned frozen ranking 19.3%); the control (training images'
features permuted, `control: shuffled`) type-1 AUC 0.518. Asserted with margins below those:

* MCP AUC >= 0.72 against type-1 negatives (the issue's 0.8 is not reached in this budget) and
  >= 0.65 against attribute-binding type-2 negatives (a concept made of words of the anchor's
  captions, e.g. "blue circle" for "red circle and blue square", that neither image contains),
  each >= 0.05 above the frozen global-cosine baseline of the same triplets;
* the control's type-1 AUC within 0.5 +- 0.1 (exact chance 0.5: positives and type-1 negatives
  share the concept, and nothing about images was learnt). Its type-2 AUCs are NOT at 0.5
  (binding 0.69, hard 0.81): a model that sees no image still learns which concepts tend to be
  positives (negative concepts are longer and rarer), so type-2 AUC must be read against the
  control: the trained model's binding AUC must beat the control's by >= 0.04;
* MCC concept-conditioned precision@5 for two-word concepts >= 2.5x its base rate and >= 5
  points above the unconditioned frozen-embedding ranking.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from c3_planted import write_c3_planted  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]

ARGS = ["train.c3.batch_size=32", "train.c3.d_model=64", "train.c3.layers=1", "train.c3.dropout=0",
        "train.c3.lr=1e-3", "train.c3.threads=1", "train.c3.eval_splits=[test]", "train.c3.amp=off"]


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
    t1, bind = "c3_mcp/type1", "c3_mcp/type2_binding"
    assert res[f"chance/{t1}/auc"] == 0.5
    assert res[f"{t1}/auc"] >= 0.72 and res[f"{t1}/auc"] >= res[f"{t1}/auc_global_cosine"] + 0.05
    assert res[f"{bind}/auc"] >= 0.65 and res[f"{bind}/auc"] >= res[f"{bind}/auc_global_cosine"] + 0.05
    assert res[f"{bind}/auc"] >= ctl[f"{bind}/auc"] + 0.04
    p5, base = res["c3_retrieval/n=2/precision@5"], res["chance/c3_retrieval/n=2/precision@5"]
    assert p5 >= MCC_RATIO * base and p5 >= res["c3_retrieval/n=2/precision@5_global_cosine"] + 5, (p5, base)
    assert abs(ctl[f"{t1}/auc"] - 0.5) <= 0.1


MCC_RATIO = 2.5
STEPS = 400
