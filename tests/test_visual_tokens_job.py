"""The `visual-tokens` job on hand-made artifacts (tests/vt_artifacts.py): bad samples counted and
skipped, the joined batches, exact resume through the loop, the variants' data transforms, the
scoring interface; and the demo end to end through the CLI (slow)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vt_artifacts import BAD, write_vt_artifacts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["layers=1", "heads=2", "width=16", "ff_dim=32", "embed_dim=8", "image_mlp_hidden=16", "text_layers=1",
         "batch_size=8", "context_length=12", "eval_splits=[test]", "swap_dirs=[]", "threads=1", "log_every=1",
         "benchmarks_at_end=false", "dropout=0.1"]


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    out = tmp_path_factory.mktemp("vt_job")
    write_vt_artifacts(out)
    return out


def _job(out, run_dir, *sets):
    from pipeline.config import load_manifest
    from train.jobs.visual_tokens import make_job

    m = load_manifest(None, [f"output={out}", *[f"train.visual_tokens.{s}" for s in (*SMALL, *sets)]])
    return make_job(m.train.visual_tokens, m, run_dir, torch.device("cpu"))


def test_bad_samples_are_counted_and_skipped(arts, tmp_path):
    job = _job(arts, tmp_path / "r")
    assert job.skipped == {reason: 1 for reason in BAD.values()}
    assert job.n_samples == 40 and len(job.split) == 40 - len(BAD)
    assert not set(BAD) & set(job.split)
    assert 8 in job.usable and 3 not in job.usable  # no captions: still scorable (image side is fine)
    ids = [int(s) for b in job.batches(0, 0) for s in b["sample_id"]]
    assert set(ids) <= job.train_ids and len(ids) == job.batches_per_epoch() * 8
    assert all(job.split_of(i) == "train" for i in ids)
    with pytest.raises(KeyError, match="sample 3 is not scorable"):
        job.score_pairs(job.build_model().eval(), [3], ["x"])


def test_batches_join_the_right_captions_and_tokens(arts, tmp_path):
    from pipeline.loaders.clip_tokens import read_shard

    job = _job(arts, tmp_path / "r")
    caps = {s["sample_id"]: np.array(s["caption_ids"]) for p in job.ct_shards for s in read_shard(p, fields=("caption_ids",))}
    b = next(iter(job.batches(1, 0)))
    for sid, cid in zip(b["sample_id"].tolist(), b["caption_id"].tolist()):
        assert cid in caps[sid].tolist()  # one of the image's own captions
    for i, sid in enumerate(b["sample_id"].tolist()):
        s = job.vt_index.read(sid, ("tangible", "ranks"))
        V = np.asarray(s["tangible"]).shape[0]
        np.testing.assert_array_equal(b["tokens"][i, 1:1 + V].numpy(), np.asarray(s["tangible"]))
        T = np.asarray(s["ranks"]).shape[0]
        np.testing.assert_array_equal(b["ranks"][i, :T, :T].numpy(), np.asarray(s["ranks"]))
    assert b["tokens"].shape[1] <= 12  # pad_to: batch


def test_shuffled_control_pairs_each_image_with_other_captions(arts, tmp_path):
    """control: shuffled: a fixed derangement of the training images; the batches carry the partner's
    captions, evaluation reads the true ones."""
    from pipeline.loaders.clip_tokens import read_shard

    job = _job(arts, tmp_path / "r", "control=shuffled")
    pair = job.pairing
    assert set(pair) == job.train_ids == set(pair.values()) and all(a != b for a, b in pair.items())
    assert pair == _job(arts, tmp_path / "r2", "control=shuffled").pairing  # fixed by the seed
    caps = {s["sample_id"]: np.array(s["caption_ids"]) for p in job.ct_shards for s in read_shard(p, fields=("caption_ids",))}
    n = 0
    for b in job.batches(0, 0):
        for sid, cid in zip(b["sample_id"].tolist(), b["caption_id"].tolist()):
            assert cid in caps[pair[sid]].tolist() and cid not in caps[sid].tolist()
            n += 1
    assert n > 0
    ev = job._load(job.eval_ids()[:2], captions=True)
    assert all(np.array_equal(np.asarray(s["caption_ids"]), caps[s["sample_id"]]) for s in ev)


def test_variant_transforms(arts, tmp_path):
    from train.jobs.visual_tokens.batches import shuffle_ranks

    base = next(iter(_job(arts, tmp_path / "a").batches(0, 0)))
    tang = next(iter(_job(arts, tmp_path / "b", "variant=tangible-only").batches(0, 0)))
    assert base["sample_id"].tolist() == tang["sample_id"].tolist()
    assert (tang["type_ids"] != 2).all()  # no intangible tokens
    for i in range(len(base["sample_id"])):
        V = int((tang["type_ids"][i] == 1).sum())
        np.testing.assert_array_equal(tang["ranks"][i, :1 + V, :1 + V], base["ranks"][i, :1 + V, :1 + V])
    shuf = next(iter(_job(arts, tmp_path / "c", "variant=shuffled-ranks").batches(0, 0)))
    assert not torch.equal(shuf["ranks"], base["ranks"])
    assert torch.equal(shuf["ranks"].sum((1, 2)), base["ranks"].sum((1, 2)))  # same values, permuted
    assert torch.equal(shuf["ranks"][:, 0], base["ranks"][:, 0])  # image slot kept
    r = np.arange(25, dtype=np.uint8).reshape(5, 5)
    np.testing.assert_array_equal(shuffle_ranks(r, 5, 0, 7), shuffle_ranks(r, 5, 0, 7))  # fixed per sample
    vit = next(iter(_job(arts, tmp_path / "d", "variant=vit").batches(0, 0)))
    assert vit["patch_tokens"].shape[1:] == (4, 10) and "tokens" not in vit


@pytest.mark.parametrize("variant", ["additive", "vit"])
def test_exact_resume_and_evaluation(arts, tmp_path, variant):
    from train.loop import train

    full = _job(arts, tmp_path / "full", f"variant={variant}", "max_steps=6", "eval_every=3")
    res = train(full, progress=False)
    part = _job(arts, tmp_path / "part", f"variant={variant}", "max_steps=6", "eval_every=3")
    assert train(part, progress=False, stop_after=4) == {"interrupted_at": 4}
    res2 = train(_job(arts, tmp_path / "part", f"variant={variant}", "max_steps=6", "eval_every=3"), progress=False)

    def losses(d):
        return [r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]

    assert losses(tmp_path / "full") == losses(tmp_path / "part") and len(losses(tmp_path / "full")) == 6
    a = torch.load(tmp_path / "full" / "checkpoints" / "final.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "part" / "checkpoints" / "final.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    bad = {i for i, why in BAD.items() if variant != "vit" or why in ("no_captions", "not_in_clip_tokens")}
    n_test = len([i for i in range(1, 41) if i % 5 == 0 and i not in bad])
    assert res["eval_images"] == n_test and res == res2
    for k in ("i2t_R@1", "t2i_R@1", "i2t_R@5", "t2i_R@10"):
        assert 0 <= res[f"retrieval/{k}"] <= 100 and 0 < res[f"chance/{k}"] <= 100
    assert res["chance/t2i_R@1"] == pytest.approx(100 / n_test)
    assert -1 <= res["similarity/mean_cos_offdiag"] <= 1
    from train.loop import load_model_for_eval

    model, _ = load_model_for_eval(full, tmp_path / "full" / "checkpoints" / "final.pt")
    with torch.no_grad():  # as the harness calls it
        table = [r.as_dict() for r in full.job_metrics(model, tmp_path / "jm")]
    for r in table:  # every figure has its interval, or says why not (the rank weights: learned parameters)
        if r["benchmark"] == "rank_weights":
            assert r["ci_low"] != r["ci_low"] and "no interval: a learned weight" in r["note"], r
        else:
            assert r["ci_low"] <= r["value"] <= r["ci_high"], r
    assert {r["benchmark"] for r in table} >= {"eval-split-retrieval", "similarity"}
    assert res["data/skipped_no_captions"] == 1
    if variant == "additive":
        w = json.loads((tmp_path / "full" / "eval" / "final" / "rank_weights.json").read_text())
        assert np.all(np.diff(np.asarray(w)[0, 0]) > 0) and w[0][0][0] == 0  # monotone, w_0 = 0
        assert "rank_weights/w_7" in res
    assert (tmp_path / "full" / "eval" / "final" / "similarity_and_rank_weights.png").is_file() and "figure_error" not in res


def test_score_pairs_and_retrieval_scores_agree(arts, tmp_path, monkeypatch):
    """score_pairs over arbitrary texts (the frozen text tower is replaced by a stub that returns
    the stored tokens of known captions) equals the cosine of the job's own encoders."""
    job = _job(arts, tmp_path / "r")
    model = job.build_model().eval()
    stored = {}
    for sid in (10, 15):
        s = job.join.index.read(sid, ("text_tokens", "text_mask", "text_embed"))
        for j in range(2):
            n = int(np.asarray(s["text_mask"])[j].sum())
            stored[f"caption {sid}/{j}"] = (torch.from_numpy(np.asarray(s["text_tokens"])[j].astype(np.float32)), n,
                                            torch.from_numpy(np.asarray(s["text_embed"])[j].astype(np.float32)))

    def fake(spec, man, texts, chunk=128):
        M = max(stored[t][1] for t in texts)
        tok = torch.stack([stored[t][0][:M] for t in texts])
        mask = torch.stack([torch.arange(M) < stored[t][1] for t in texts])
        return {"tokens": tok, "mask": mask, "embed": torch.stack([stored[t][2] for t in texts])}

    import pipeline.models.clip

    monkeypatch.setattr(pipeline.models.clip, "encode_texts_like_artifact", fake)
    texts = list(stored)
    with torch.no_grad():
        s = job.score_pairs(model, [10, 10, 15, 15], texts)
        S = job.retrieval_scores(model, [10, 15], None, texts)["score"]
        img = job.encode_images(model, [10, 15])
        b = next(iter([__import__("train.jobs.visual_tokens.batches", fromlist=["collate_batch"]).collate_batch(
            job._load([10, 15], captions=True), None, opts=job._opts(), captions="all")]))
        txt = job._encode_text_batch(model, b)
    assert s.dtype == np.float64 and s.shape == (4,)
    np.testing.assert_allclose(s, [S[0, 0], S[0, 1], S[1, 2], S[1, 3]], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(S, (img @ txt.t()).numpy(), rtol=1e-4, atol=1e-5)


def test_text_pooled_and_rank_weight_options(arts, tmp_path):
    from train.loop import train

    res = train(_job(arts, tmp_path / "p", "text=pooled", "rank_weights=per-layer-head", "variant=fixed-w",
                     "max_steps=2"), progress=False)
    w = json.loads((tmp_path / "p" / "eval" / "final" / "rank_weights.json").read_text())
    assert np.asarray(w).shape == (1, 2, 8) and np.asarray(w)[0, 0].tolist() == list(range(8))  # fixed-w: not learned
    assert "retrieval/i2t_R@1" in res


def _hashed_tower(dim: int = 16, pooled: int = 8):
    """A stand-in for the frozen CLIP text tower: each text a fixed random vector of its own (seeded by its bytes)."""
    def fake(spec, man, texts, chunk=128):
        g = [np.random.default_rng(list(t.encode())) for t in texts]
        return {"tokens": torch.tensor(np.stack([x.normal(size=(3, dim)) for x in g]), dtype=torch.float32),
                "mask": torch.ones(len(texts), 3, dtype=torch.bool),
                "embed": torch.tensor(np.stack([np.random.default_rng(list(t.encode()) + [1]).normal(size=pooled)
                                                for t in texts]), dtype=torch.float32)}
    return fake


def _unit(x):
    x = np.asarray(x, np.float64)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_frozen_clip_retrieval_baseline_is_the_artifacts_cosine(arts, tmp_path):
    """The frozen-CLIP retrieval rows: the same images and captions as the job's rows (same n, same
    image clusters), each naming its result row, with R@K recomputed by brute force from the
    clip_tokens artifact's stored image_embed and text_embed."""
    job = _job(arts, tmp_path / "f")
    model = job.build_model().eval()
    with torch.no_grad():
        rows = job.job_metrics(model, tmp_path / "jm")
    res = {(r.subset, r.metric): r for r in rows if r.benchmark == "eval-split-retrieval"}
    ids = job.eval_ids()
    img, txt, owner = [], [], []
    for i, sid in enumerate(ids):
        s = job.join.index.read(sid, ("image_embed", "text_embed"))
        img.append(np.asarray(s["image_embed"], np.float64))
        for t in np.asarray(s["text_embed"], np.float64):
            txt.append(t)
            owner.append(i)
    S = _unit(img) @ _unit(txt).T
    owner = np.array(owner)
    for k in (1, 5, 10):
        i2t = np.mean([owner[np.argsort(-S[i], kind="stable")[:k]].tolist().count(i) > 0 for i in range(len(ids))])
        t2i = np.mean([i in np.argsort(-S[:, j], kind="stable")[:k] for j, i in enumerate(owner)])
        for d, want in (("i2t", i2t), ("t2i", t2i)):
            b, r = res[("frozen_clip", f"{d}_R@{k}")], res[("all", f"{d}_R@{k}")]
            assert b.baseline_for == f"all/{d}_R@{k}" and "frozen CLIP" in b.note
            assert b.value == pytest.approx(100 * want)
            assert b.est.n == r.est.n == r.n and np.array_equal(b.est.cluster, r.est.cluster)
            assert b.ci_low <= b.value <= b.ci_high


def test_frozen_and_text_only_swap_baselines(arts, tmp_path, monkeypatch):
    """The harness's pairwise baselines on a SugarCrepe folder: `[frozen]` = the artifact's CLIP
    cosine (brute force), `[text-only]` = the job's text head against the mean eval-image embedding;
    both on the result row's items (same n, same images); text-only on VL-CheckList / VALSE formats
    too, never on others (ARO)."""
    import pipeline.models.clip
    from train.eval.in_job import score_folders

    monkeypatch.setattr(pipeline.models.clip, "encode_texts_like_artifact", _hashed_tower())
    job = _job(arts, tmp_path / "s")
    model = job.build_model().eval()
    d = tmp_path / "sc"
    d.mkdir()
    sids = [1, 2, 4, 6, 7, 10, 12, 15, 20]
    items = {str(k): {"filename": f"{s:012d}.jpg", "caption": f"a red cube {k}", "negative_caption": f"a blue ball {k}"}
             for k, s in enumerate(sids + sids)}
    (d / "replace_att.json").write_text(json.dumps(items))
    with torch.no_grad():
        got = score_folders(job, model, "swaps", [d], arts / "samples", baselines=True)
        tu = sorted({t for v in items.values() for t in (v["caption"], v["negative_caption"])})
        head = job._text_embeddings(model, tu).double().numpy()
        const = job.encode_images(model, job.eval_ids()).mean(0).double().numpy()
    rows = {r.metric: r for r in got.rows if r.subset == "replace_att"}
    res, fz, to = rows["accuracy"], rows["accuracy[frozen]"], rows["accuracy[text-only]"]
    emb = {t: _unit(job._text_cache[t]["embed"].numpy()) for t in tu}
    h = dict(zip(tu, head))
    want_f, want_t = [], []
    for v in items.values():
        e = _unit(np.asarray(job.join.index.read(int(v["filename"][:12]), ("image_embed",))["image_embed"], np.float64))
        want_f.append(e @ emb[v["caption"]] > e @ emb[v["negative_caption"]])
        want_t.append(const @ h[v["caption"]] > const @ h[v["negative_caption"]])
    assert fz.value == pytest.approx(100 * np.mean(want_f)) and to.value == pytest.approx(100 * np.mean(want_t))
    for b in (fz, to):
        assert b.baseline_for == "replace_att/accuracy" and b.n == res.n == len(items)
        assert np.array_equal(b.est.cluster, res.est.cluster) and b.est.n == res.est.n
    assert got.matched == len(items)  # the baselines are not counted as more items
    # the harness adds the text-only bar on the text-shortcut formats only
    from pipeline.config import BenchmarkSpec
    from train.eval.harness import evaluate_benchmark
    from train.eval.in_job import read_folders

    data, _ = read_folders("swaps", [d])
    for fmt, has in (("vl_checklist", True), ("valse", True), ("aro", False)):
        with torch.no_grad():
            rs = evaluate_benchmark(job, model, BenchmarkSpec(name="swaps", format=fmt, path=str(d)), arts / "samples",
                                    set(job.usable), 2048, log=lambda m: None, data=data)
        assert any(r.metric.endswith("[text-only]") for r in rs) == has, fmt
        assert any(r.metric.endswith("[frozen]") for r in rs)
    # the job's in-job swap rows carry the same baselines, named after their result row, estimates kept
    job2 = _job(arts, tmp_path / "s2", f"swap_dirs=[{d}]", "samples_artifact=samples")
    with torch.no_grad():
        sw = {r.metric: r for r in job2._swap_rows(model)}
    assert sw["pairwise_acc[frozen]"].value == fz.value and sw["pairwise_acc[text-only]"].value == to.value
    assert sw["pairwise_acc[frozen]"].baseline_for == "replace_att/pairwise_acc"
    assert np.array_equal(sw["pairwise_acc[frozen]"].est.cluster, sw["pairwise_acc"].est.cluster)


# ---------------------------------------------------------------------------- demo end to end
@pytest.mark.slow
def test_demo_end_to_end_cli(tmp_path, ray_session):
    """`train run visual-tokens --manifest manifests/demo.yaml` (and variant=vit) on a copy of the
    generated dataset's artifacts: trains, checkpoints, resumes, evaluates (swap files through
    score_pairs with the frozen tiny CLIP text tower)."""
    from typer.testing import CliRunner

    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest
    from train.cli import app

    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=24", "stages.extract_visual_tokens.shard_size=8",
                                 "stages.extract_clip_tokens.shard_size=16"])
    for st in ("ingest", "extract-visual-tokens", "extract-clip-tokens"):
        run_stage(st, RunContext(m))
    sets = ["--set", f"output={m.output}", "--set", "train.visual_tokens.max_steps=2", "--set", "train.visual_tokens.threads=1",
            "--set", "train.visual_tokens.layers=2", "--set", "train.visual_tokens.benchmarks_at_end=false",
            "--set", "train.visual_tokens.eval_splits=[val,test]"]  # the demo has 1 test image; the paper: test only
    for extra in ([], ["--set", "train.visual_tokens.variant=vit"]):
        r = CliRunner().invoke(app, ["run", "visual-tokens", "--manifest", str(REPO / "manifests" / "tiny.yaml"),
                                     "--no-progress", "--json", *sets, *extra])
        assert r.exit_code == 0, r.output
        res = json.loads([ln for ln in r.output.splitlines() if ln.startswith("{")][-1])  # stderr is mixed in
        assert res["eval_images"] >= 1 and "retrieval/i2t_R@1" in res
        assert 0 <= res["generated_swaps/swap_obj/pairwise_acc"] <= 100
        run = Path(res["run_dir"])
        assert (run / "checkpoints" / "final.pt").is_file() and run.name.startswith(res.get("variant", extra and "vit" or "additive"))
    shutil.rmtree(m.output, ignore_errors=True)
