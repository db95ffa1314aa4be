"""c3's defaults are the paper's main model (issue 26), on the small oracle testbed (tests/conftest.py:
100 generated images through the real stages; mine-concepts and encode-concepts run on this module's
copy with the testbed's mining settings):

* defaults: ITM + MCP (Table 3 row 4 without MLM), both negative types, triplets, and an epoch that is
  a pass over the training images (each anchor image once, one of its concepts drawn), not over the
  (image, concept) rows (``epoch_unit: concept_rows``, the former meaning);
* ``control: images_zeroed`` reaches the model (every image feature zero in training batches, in the
  held-out scoring and in score_pairs), so a model's score depends on the concept only; a short
  ``train run`` with it completes and reports the ``type2_as_trained`` row beside the concept-matched
  ones;
* ``type2_as_trained``: C' drawn as training draws it (in neither image, not C); the concept-matched
  rows stay at 0.5 exactly for a scorer of the concept alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.testbed_reduced import copy_testbed, run_stages

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["train.c3.batch_size=8", "train.c3.d_model=16", "train.c3.layers=1", "train.c3.heads=2",
         "train.c3.mcc_rank=4", "train.c3.mcc_hidden=16", "train.c3.adapter_rank=4", "train.c3.threads=1",
         "train.c3.eval_max_triplets=64", "train.c3.eval_max_concepts=10", "train.c3.amp=off",
         "train.c3.benchmarks_at_end=false"]


@pytest.fixture(scope="module")
def oracle(small_testbed, tmp_path_factory) -> tuple[Path, Path]:
    """(output folder, manifest) of this module's copy of the small testbed, with concepts and their
    encodings made by the real stages."""
    out, man = copy_testbed(small_testbed, tmp_path_factory.mktemp("c3_paper"))
    run_stages(man, ["mine-concepts", "encode-concepts"])
    return out, man


def _job(oracle, *extra: str, run: str = "x"):
    from pipeline.config import load_manifest
    from train.jobs.c3 import make_job

    out, man = oracle
    m = load_manifest(man, [*SMALL, *extra])
    return make_job(m.train.c3, m, out / "train" / run, torch.device("cpu"))


def test_defaults_are_the_papers_main_model():
    from train.jobs.c3 import Config

    c = Config()
    assert (c.objectives, c.itm, c.negatives, c.formulation, c.epoch_unit) == ("mcp", True, "both", "triplet", "images")
    assert c.epochs == 1.0  # the paper's continual "1 epoch"


def test_an_epoch_is_a_pass_over_the_training_images(oracle):
    job = _job(oracle)
    d = job.data
    anchors = np.unique(d.r_anchor)
    assert len(anchors) < len(d.r_cid)  # several concepts per image: the two units differ
    assert job.batches_per_epoch() == len(anchors) // 8
    rows = d.epoch_rows(0)
    assert len(rows) == len(anchors) and sorted(d.r_anchor[rows].tolist()) == anchors.tolist()  # each anchor once
    assert not np.array_equal(rows, d.epoch_rows(1))
    assert job.is_train[d.r_anchor[rows]].all()
    b = next(iter(job.batches(0, 0)))  # the default batch: MCP with both negative types, and ITM; no MCC
    assert set(b["mcp_type"].tolist()) == {0, 1, 2} and "itm_pair" in b and "mcc_i" not in b
    loss, logs = job.loss(job.build_model(), b)
    assert torch.isfinite(loss) and {"loss_mcp", "loss_itm"} <= set(logs) and "loss_mcc" not in logs
    old = _job(oracle, "train.c3.epoch_unit=concept_rows")
    assert old.batches_per_epoch() == len(old.data.r_cid) // 8
    assert sorted(old.data.epoch_rows(0).tolist()) == list(range(len(old.data.r_cid)))


def test_images_zeroed_reaches_the_model(oracle):
    job = _job(oracle, "train.c3.control=images_zeroed")
    b = next(iter(job.batches(0, 0)))
    assert b["patches"].abs().sum() == 0 and b["embed"].abs().sum() == 0 and len(b["img_rows"]) > 1
    model = job.build_model().eval()
    E = job.heldout.eval_set()
    ai, aj, c = E["ai"], E["aj"], E["c"]
    t1 = E["negs"]["type1"]
    v = t1 >= 0
    assert v.sum() >= 5
    with torch.no_grad():
        sp, _ = job.heldout.triplet_scores(model, ai[v], aj[v], c[v])
        sn, _ = job.heldout.triplet_scores(model, ai[v], t1[v], c[v])
    np.testing.assert_allclose(sp, sn, atol=1e-5)  # another image, the same concept: the same score
    k = np.nonzero(v)[0][:4]  # score_pairs (the harness's interface): the same texts on other images
    enc = {"pooled": job.ct.gather(job.ct.rows(c[k]))["pooled"]}
    s1 = job.score_pairs(model, job.store.sids[ai[k]], ["t"] * len(k), encoded=enc)
    s2 = job.score_pairs(model, job.store.sids[t1[k]], ["t"] * len(k), encoded=enc)
    np.testing.assert_allclose(s1, s2, atol=1e-5)
    # the trained model, unzeroed: images change the score (so the equality above is the control's doing)
    plain = _job(oracle, run="y")
    with torch.no_grad():
        pp, _ = plain.heldout.triplet_scores(model, ai[v], aj[v], c[v])
        pn, _ = plain.heldout.triplet_scores(model, ai[v], t1[v], c[v])
    assert np.abs(pp - pn).max() > 1e-4


def test_type2_as_trained_row(oracle, tmp_path):
    job = _job(oracle)
    E = job.heldout.eval_set()
    c, neg = E["c"], E["negs"]["type2_as_trained"]
    v = neg >= 0
    assert v.mean() > 0.9
    si, sj = job.store.sids[E["ai"][v]], job.store.sids[E["aj"][v]]
    assert (neg[v] != c[v]).all() and job.ct.rows(neg[v]).min() >= 0
    assert not job.member.contains(neg[v], si).any() and not job.member.contains(neg[v], sj).any()
    # a scorer of the concept alone: the concept-matched rows at 0.5 exactly, the as-trained row not bound to it
    job.heldout.triplet_scores = lambda model, a, j, cc: (np.sin(1.7 * cc.astype(np.float64)), np.zeros(len(cc)))
    rows = {r.subset: r for r in job.job_metrics(job.build_model(), tmp_path) if r.benchmark == "c3_mcp" and r.metric == "auc"}
    assert set(rows) == {"type1", "type2_random", "type2_hard", "type2_binding", "type2_as_trained"}
    matched = {k: r.value for k, r in rows.items() if k != "type2_as_trained" and r.n}  # (10 held-out images: not every kind)
    assert "type1" in matched and "type2_random" in matched
    assert all(v == pytest.approx(0.5, abs=1e-9) for v in matched.values()), matched
    r = rows["type2_as_trained"]
    assert r.chance == 0.5 and r.n == int(v.sum()) and r.ci_low <= r.value <= r.ci_high and r.ci_high > r.ci_low


def test_images_zeroed_run_completes(oracle, tmp_path):
    """``train run c3 --set train.c3.control=images_zeroed``: the real command, a few steps."""
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from train.cli import app

    out, man = oracle
    run_dir = tmp_path / "zeroed"
    args = ["run", "c3", "--manifest", str(man), "--no-progress", "--max-steps", "3", "--set",
            f"train.c3.run_dir={run_dir}", "--set", "train.c3.control=images_zeroed"]
    for s in [*SMALL, "train.c3.benchmarks_at_end=true", "eval.benchmarks=[]"]:  # results.parquet: the job's own rows
        args += ["--set", s]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert (run_dir / "eval" / "final" / "results.parquet").is_file(), r.output
    rows = {(x["subset"], x["metric"]): x for x in pq.read_table(run_dir / "eval" / "final" / "results.parquet").to_pylist()
            if x["benchmark"] == "c3_mcp"}
    for t in ("type1", "type2_random", "type2_as_trained"):
        x = rows[(t, "auc")]
        assert x["n"] > 0 and x["chance"] == 0.5 and x["ci_low"] <= x["value"] <= x["ci_high"], (t, x)
    # every image is the same zero vector: a type-1 negative scores as its positive
    assert rows[("type1", "auc")]["value"] == pytest.approx(0.5, abs=0.02)
