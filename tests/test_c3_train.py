"""The c3 trainer on data made by the real stages on the small oracle testbed (tests/conftest.py
``small_testbed``: ingest, extract-clip-tokens on 100 generated images, scene-oracle CLIP; here in
addition ``mine-concepts`` with the testbed's settings, ``skip_stopword_edge: true, n_max: 2,
coverage: none``, and ``encode-concepts``): batches are valid triplets (partners and negatives from
the training split; type-1 images without C; type-2 concepts in neither image; MCC false negatives
masked) and a pure function of (seed, epoch, batch); exact resume; every variant trains a step;
score_pairs through the real text path (models.clip = scene-oracle); bad input (partner-less
concepts counted, missing or partial encodings, empty database). The learning test is
tests/test_testbed_c3.py (the testbed, through the real commands)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.testbed_reduced import copy_testbed, run_stages

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["train.c3.batch_size=16", "train.c3.d_model=32", "train.c3.layers=1", "train.c3.heads=2",
         "train.c3.mcc_rank=8", "train.c3.mcc_hidden=32", "train.c3.adapter_rank=4", "train.c3.threads=1",
         "train.c3.eval_splits=[val,test]", "train.c3.eval_max_triplets=64", "train.c3.eval_max_concepts=20",
         "train.c3.amp=off", "train.c3.log_every=1"]
C3_STAGES = ["mine-concepts", "encode-concepts"]


def _no_harness() -> list[str]:
    from train.config import TrainerConfig

    return ["train.c3.benchmarks_at_end=false"] if "benchmarks_at_end" in TrainerConfig.model_fields else []


@pytest.fixture(scope="module")
def data(small_testbed, tmp_path_factory):
    """(output folder, manifest) of a copy of the small testbed with concepts and their encodings."""
    out, mp = copy_testbed(small_testbed, tmp_path_factory.mktemp("c3_small"))
    run_stages(mp, C3_STAGES)
    return out, mp


def _variant(data, dest: Path, stages: list[str], *sets: str) -> tuple[Path, Path]:
    """A copy of ``data`` on which ``stages`` are rerun with the stage options ``sets``."""
    out, mp = copy_testbed(data[1], dest)
    run_stages(mp, stages, list(sets))
    return out, mp


def _job(data, extra=(), run="c3", out: Path | None = None):
    from pipeline.config import load_manifest
    from train.jobs.c3 import make_job

    out = Path(out or data[0])
    m = load_manifest(data[1], [f"output={out}", *SMALL, *_no_harness(), *extra])
    return make_job(m.train.c3, m, out / "train" / run, torch.device("cpu"))


def test_batches_are_valid_and_deterministic(data):
    out, _ = data
    job = _job(data, ["train.c3.type2_source=hard", "train.c3.objectives=both"])  # MCC's false negatives too
    sids = job.store.sids
    b1 = next(iter(job.batches(1, 2)))
    b2 = list(job.batches(1, 0))[2]
    for k in b1:
        if isinstance(b1[k], torch.Tensor):
            assert torch.equal(b1[k], b2[k]), k
    assert not torch.equal(next(iter(job.batches(0, 2)))["mcp_y"], b1["mcp_y"]) or \
        not torch.equal(next(iter(job.batches(0, 2)))["img_rows"], b1["img_rows"])
    img_sid = sids[b1["img_rows"].numpy()]
    assert job.is_train[b1["img_rows"].numpy()].all()  # every image of a training batch is a training image
    con = b1["con_id"].numpy()
    pi, pt = b1["pair_img"].numpy(), b1["pair_txt"].numpy()
    a, b, y, t = (b1[k].numpy() for k in ("mcp_a", "mcp_b", "mcp_y", "mcp_type"))
    contains = job.member.contains
    # positives: both images contain C; type 1: the second image does not; type 2: neither contains C'
    for ty in (0, 1, 2):
        sel = t == ty
        assert sel.any(), ty
        ca, cb = con[pt[a[sel]]], con[pt[b[sel]]]
        assert (ca == cb).all()
        ia, ib = img_sid[pi[a[sel]]], img_sid[pi[b[sel]]]
        if ty == 0:
            assert contains(ca, ia).all() and contains(ca, ib).all() and (y[sel] == 1).all()
        elif ty == 1:
            assert contains(ca, ia).all() and not contains(ca, ib).any() and (y[sel] == 0).all()
        else:
            assert not contains(ca, ia).any() and not contains(ca, ib).any() and (y[sel] == 0).all()
    fn = b1["mcc_fn"].numpy()
    ci, cj, cc = (b1[k].numpy() for k in ("mcc_i", "mcc_j", "mcc_c"))
    want = contains(con[cc][None, :], img_sid[ci][:, None]) & contains(con[cc][None, :], img_sid[cj][None, :])
    np.fill_diagonal(want, False)
    assert (fn == want).all()


def test_concept_without_train_partner_is_counted(data):
    out, _ = data
    job = _job(data)
    assert job.skips["no_partner_in_train_split"] > 0  # test-split partners only
    assert job.skips["anchor_not_in_train_split"] > 0
    assert job.data.p_rows.size and job.is_train[job.data.p_rows].all()


def test_exact_resume_and_variants(data, tmp_path):
    from train.loop import train

    out, _ = data
    job = _job(data, ["train.c3.max_steps=6", "train.c3.ckpt_every=3", "train.c3.itm=true", "train.c3.objectives=both"], run="full")
    train(job, resume=False, progress=False)
    job2 = _job(data, ["train.c3.max_steps=6", "train.c3.ckpt_every=3", "train.c3.itm=true", "train.c3.objectives=both"], run="split")
    assert train(job2, resume=False, progress=False, stop_after=3) == {"interrupted_at": 3}
    res = train(_job(data, ["train.c3.max_steps=6", "train.c3.ckpt_every=3", "train.c3.itm=true", "train.c3.objectives=both"], run="split"),
                resume=True, progress=False)
    a = [json.loads(x) for x in (out / "train" / "full" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (out / "train" / "split" / "metrics.jsonl").read_text().splitlines()]
    la = [r["loss"] for r in a if r["kind"] == "train"]
    lb = [r["loss"] for r in b if r["kind"] == "train"]
    assert len(la) == 6 and la == lb
    sa = torch.load(out / "train" / "full" / "checkpoints" / "final.pt", weights_only=False)["model"]
    sb = torch.load(out / "train" / "split" / "checkpoints" / "final.pt", weights_only=False)["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert "loss_itm" in a[0] and "loss_mcc" in a[0] and "loss_mcp" in a[0]
    assert res["c3_mcp/type1/auc"] == res["c3_mcp/type1/auc"]  # evaluated (not NaN)
    assert res["chance/c3_mcp/type1/auc"] == 0.5 and res["chance/c3_mcp/type1/balanced_accuracy"] == 50.0
    assert res["data/train_rows"] > 0
    # every Table 3 variant takes a step and evaluates
    for extra in (["train.c3.objectives=mcp", "train.c3.negatives=type1"],
                  ["train.c3.objectives=mcp", "train.c3.negatives=type2", "train.c3.type2_source=random"],
                  ["train.c3.formulation=pairwise"], ["train.c3.objectives=mcc"], ["train.c3.control=shuffled"]):
        j = _job(data, ["train.c3.max_steps=1", *extra], run="v" + "_".join(e.split("=")[-1] for e in extra))
        r = train(j, resume=False, progress=False)
        assert r["c3_mcp/type1/auc"] == r["c3_mcp/type1/auc"], extra
        if "train.c3.negatives=type1" in extra:
            b = next(iter(j.batches(0, 0)))
            assert set(b["mcp_type"].tolist()) == {0, 1}


def test_eval_negatives_are_concept_matched(data, tmp_path):
    """Held-out triplets and negatives come from the eval split; type-2 negatives are the image
    pair of another positive with this positive's concept (lacking it, near it for hard, its words
    in the caption for binding), so a scorer that sees only the concept is at AUC 0.5 exactly on
    every negative type (the chance control's premise; independent C' gave it 0.69-0.81).
    The small testbed's 10 held-out images give no binding negative (2 captions each), so here the
    splits swap roles (``train_splits: [val]``, ``eval_splits: [train, test]``: 95 held-out images),
    which is what this test checks: triplets and negatives from the eval split only."""
    from train.jobs.c3.metrics import pq_text

    out, _ = data
    job = _job(data, ["train.c3.eval_max_triplets=400", "train.c3.train_splits=[val]", "train.c3.eval_splits=[train,test]"])
    E = job.heldout.eval_set()
    ai, aj, c = E["ai"], E["aj"], E["c"]
    si, sj = job.store.sids[ai], job.store.sids[aj]
    assert job.is_eval[ai].all() and job.is_eval[aj].all() and not job.is_train[ai].any()
    assert job.member.contains(c, si).all() and job.member.contains(c, sj).all() and (si != sj).all()
    t1 = E["negs"]["type1"]
    v = t1 >= 0
    assert v.mean() > 0.9 and job.is_eval[t1[v]].all() and not job.member.contains(c[v], job.store.sids[t1[v]]).any()
    text = pq_text(job.ct)
    words = job.heldout.caption_words(si)
    for kind in ("type2_random", "type2_hard", "type2_binding"):
        d = E["negs"][kind]
        v = np.nonzero(d >= 0)[0]
        assert len(v) >= 10, kind
        dk = d[v]
        assert (dk != v).all()
        assert not job.member.contains(c[v], si[dk]).any() and not job.member.contains(c[v], sj[dk]).any(), kind
        if kind == "type2_hard":
            hard = job.data.hard_of(c[dk])
            assert (hard == c[v][:, None]).any(1).all()
        if kind == "type2_binding":
            for t, k in zip(v, dk):
                ws = text[int(c[t])].split()
                assert len(ws) >= 2 and set(ws) <= words[int(si[k])], (text[int(c[t])], words[int(si[k])])
    # a scorer of the concept alone: every negative type at chance exactly
    job.heldout.triplet_scores = lambda model, a, j, cc: (np.sin(1.7 * cc.astype(np.float64)), np.zeros(len(cc)))
    rows = job.job_metrics(job.build_model(), tmp_path)
    aucs = {r.subset: r.value for r in rows if r.benchmark == "c3_mcp" and r.metric == "auc"}
    assert set(aucs) == {"type1", "type2_random", "type2_hard", "type2_binding", "type2_as_trained"}
    aucs.pop("type2_as_trained")  # C' drawn as in training: where a concept prior shows (tests/test_c3_paper_defaults.py)
    assert all(a == pytest.approx(0.5, abs=1e-9) for a in aucs.values()), aucs
    # every figure has its 95% interval (a bootstrap over triplets / queries) around it
    scored = [r for r in rows if r.value == r.value]
    assert {r.metric for r in scored} >= {"auc", "auc_global_cosine", "balanced_accuracy"}
    assert all(r.ci_low <= r.value <= r.ci_high for r in scored), [(r.metric, r.ci_low, r.value, r.ci_high) for r in scored]
    # positive and negative share their concept's score: every resample holds the same multiset twice, AUC 0.5 with
    # no spread to measure, so (as a proportion's 0 hits) every image counts once: Wilson about 0.5, never [0.5, 0.5]
    for r in scored:
        if r.metric == "auc" and r.subset != "type2_as_trained":
            assert r.ci_low < 0.5 < r.ci_high and r.ci_high - 0.5 == pytest.approx(0.5 - r.ci_low), r


def test_score_pairs(data):
    """Texts through the real text path (``models.clip`` = scene-oracle, as encode-concepts encodes
    concepts); precomputed encodings of the same texts (``encoded``) give the same scores."""
    job = _job(data)
    model = job.build_model().eval()
    sids = job.store.sids[:6]
    texts = ["red circle", "blue square", "red circle", "green star", "a", "orange ring"]
    s = job.score_pairs(model, sids, texts)
    assert s.dtype == np.float64 and s.shape == (6,) and np.isfinite(s).all()
    assert np.array_equal(job.score_pairs(model, sids, texts, encoded=job.scorer.encode_texts(texts)), s)
    assert job.scorable_sample_ids() == set(job.store.sids.tolist())
    with pytest.raises(ValueError, match="sample 999999 has no clip_tokens"):
        job.score_pairs(model, np.array([999999]), ["red circle"])


def test_bad_inputs(data, small_testbed, tmp_path):
    """Missing encodings; a partially encoded vocabulary (encode-concepts' ``min_df: 3`` leaves the
    concepts of df 2 unencoded); an empty concept database (mine-concepts with every caption word a
    stopword mines no concept; encode-concepts then refuses with one clear error, before the trainer's
    own guard, whose "empty vocabulary" message the planted writer's empty artifact used to reach)."""
    import yaml

    from pipeline.concepts import mining as M
    from pipeline.io.artifacts import Artifact
    from pipeline.stage import StageError

    out, _ = data
    # missing concept encodings: a clear error naming the stage to run
    bad = tmp_path / "no_ct"
    shutil.copytree(out, bad, ignore=shutil.ignore_patterns("concept_tokens", "train"))
    with pytest.raises(FileNotFoundError, match="pipeline run encode-concepts"):
        _job(data, out=bad)
    # partially encoded vocabulary (min_df): rows of unencoded concepts are skipped and counted
    part = _variant(data, tmp_path / "part", ["encode-concepts"], "stages.encode_concepts.min_df=3")
    job = _job(part)
    vocab = Artifact(part[0] / "concepts").read("vocab")
    assert 0 < len(job.ct) == int((vocab["df"].to_numpy() >= 3).sum()) < vocab.num_rows
    assert job.skips["concept_not_encoded"] > 0
    assert (job.ct.rows(job.data.r_cid) >= 0).all()
    # an empty concept database: one clear error
    eout, emp = copy_testbed(small_testbed, tmp_path / "empty")
    caps = Artifact(eout / "samples").read("captions")["text"].to_pylist()
    m = yaml.safe_load(emp.read_text())
    words = sorted({w for t in caps for w in M.MiningParams().normalizer.tokens(t)})  # the miner's own tokens
    m["stages"]["mine_concepts"].update(stopwords=words, hard_negatives=False)
    emp.write_text(yaml.safe_dump(m, sort_keys=False))
    run_stages(emp, ["mine-concepts"])
    assert Artifact(eout / "concepts").read("vocab").num_rows == 0
    with pytest.raises(StageError, match="empty concept vocabulary"):
        run_stages(emp, ["encode-concepts"])


def test_encodings_of_another_clip_or_concepts_are_refused(data, tmp_path):
    """concept_tokens must come from the clip_tokens' CLIP (weights hash) and from this concepts
    artifact (input fingerprint): otherwise one clear error naming the stage to rerun."""
    out, _ = data

    def edit(dst, artifact, fn):
        p = dst / artifact / "_manifest.json"
        m = json.loads(p.read_text())
        fn(m)
        p.write_text(json.dumps(m))

    other = tmp_path / "other_concepts"
    shutil.copytree(out, other, ignore=shutil.ignore_patterns("train"))
    edit(other, "concept_tokens", lambda m: m["input_fingerprints"].update(concepts="0" * 32))
    with pytest.raises(ValueError, match="another concepts artifact.*encode-concepts"):
        _job(data, out=other)
    other_clip = tmp_path / "other_clip"
    shutil.copytree(out, other_clip, ignore=shutil.ignore_patterns("train"))
    edit(other_clip, "concept_tokens", lambda m: m["models"].update(clip={"weights_sha256": "a" * 64}))
    edit(other_clip, "clip_tokens", lambda m: m.setdefault("models", {}).update(clip={"weights_sha256": "b" * 64}))
    with pytest.raises(ValueError, match="CLIP weights aaaaaaaaaaaa but clip_tokens from bbbbbbbbbbbb"):
        _job(data, out=other_clip)
    edit(other_clip, "clip_tokens", lambda m: m["models"].update(clip={"weights_sha256": "a" * 64}))
    assert _job(data, out=other_clip).ct.clip_record["weights_sha256"] == "a" * 64  # the same CLIP: accepted


def test_pooled_only(data, tmp_path):
    """``stages.encode_concepts.pooled_only: true``: the trainer fuses one pooled concept token."""
    from train.loop import train

    job = _job(_variant(data, tmp_path, ["encode-concepts"], "stages.encode_concepts.pooled_only=true"),
               ["train.c3.max_steps=2"])
    assert job.ct.pooled_only and job.d_t == 0
    b = next(iter(job.batches(0, 0)))
    assert "txt_tokens" not in b
    r = train(job, resume=False, progress=False)
    assert r["c3_mcp/type1/auc"] == r["c3_mcp/type1/auc"]


def test_image_store_random_access_matches_memory(data):
    out, _ = data
    mem = _job(data, ["train.c3.image_cache=memory"])
    rnd = _job(data, ["train.c3.image_cache=random"])
    assert mem.store.mode == "memory" and rnd.store.mode == "random"
    rows = np.array([5, 0, 17, 5, len(mem.store.sids) - 1])
    want = mem.store.get(rows)
    for lazy in (False, True):  # kept map, pread (artifacts larger than RAM)
        rnd.store.lazy = lazy
        got = rnd.store.get(rows)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    b1, b2 = next(iter(mem.batches(0, 1))), next(iter(rnd.batches(0, 1)))
    assert all(torch.equal(b1[k], b2[k]) for k in b1 if isinstance(b1[k], torch.Tensor))


def test_held_out_rows_are_computed_once_per_state_of_the_weights(data, tmp_path):
    """The final evaluation and the harness both ask for the held-out rows of the same final model:
    computed once; any change to the weights (an optimizer step, a load_state_dict) scores again."""
    import torch

    job = _job(data, ["train.c3.eval_max_triplets=200"])
    calls = []
    rows_of = job.heldout.rows
    job.heldout.rows = lambda model: calls.append(1) or rows_of(model)
    model = job.build_model()
    first = job.job_metrics(model, tmp_path)
    assert job.job_metrics(model, tmp_path) is first and len(calls) == 1
    with torch.no_grad():
        next(p for p in model.parameters() if p.requires_grad).add_(0.5)  # in place, as an optimizer step
    job.job_metrics(model, tmp_path)
    model.load_state_dict(job.build_model().state_dict())
    job.job_metrics(model, tmp_path)
    other = job.build_model()
    job.job_metrics(other, tmp_path)
    assert len(calls) == 4


def test_frozen_baseline_rows_share_the_result_rows_queries(data, tmp_path):
    """c3's frozen global-cosine precision@k rows carry their per-query estimate on the result row's queries
    (same n, same query images in the same order), its value the estimate's; so do the balanced accuracies.
    (The AUC rows' paired bootstrap needs the positive and negative scores: auc_interval, no Estimate.)"""
    job = _job(data, ["train.c3.eval_max_triplets=200"])
    rows = job.job_metrics(job.build_model(), tmp_path)
    by = {(r.benchmark, r.subset, r.metric): r for r in rows}
    base = [r for r in rows if r.benchmark == "c3_retrieval" and r.baseline_for]
    assert base
    for b in base:
        res = by[("c3_retrieval", *b.baseline_for.split("/", 1))]
        assert b.est.n == res.est.n == res.n and np.array_equal(b.est.cluster, res.est.cluster)
        assert 100 * b.est.value == pytest.approx(b.value) and 100 * res.est.value == pytest.approx(res.value)
    acc = [r for r in rows if r.metric == "balanced_accuracy"]
    assert acc and all(r.est is not None and 100 * r.est.value == pytest.approx(r.value) for r in acc)
