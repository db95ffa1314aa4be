"""InfoGround trainer: loss vs a float64 per-word loop reference, masking of padded regions and
words (attention and BatchNorm), the grounding metrics and their exact chance, the PROPN fix of
the negatives stage, bad input (missing / foreign artifacts, zero regions, zero nouns)."""

from __future__ import annotations

import json
import math
import random
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

from train.eval.intervals import wilson, wilson_of

# structural fixtures (ids, empty region sets, widths) from the benchmark's artifact generator;
# learning is shown through the real stages in tests/test_testbed_infoground.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(B=5, U=4, R=6, T=4, K=5, d_r=10, d_w=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rmask = torch.zeros(U, R, dtype=torch.bool)
    for u, n in enumerate([R, 3, 1, R - 1][:U]):
        rmask[u, :n] = True
    wmask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate([T, 2, 0, 1, 3][:B]):  # caption 2 has no word (left out of L_img)
        wmask[b, :n] = True
    lmask = torch.zeros(B, 1 + K, dtype=torch.bool)
    lmask[0] = True
    lmask[1, : 1 + K - 2] = True  # fewer valid negatives
    lmask[3, :3] = True
    # caption 4: no noun (left out of L_lang)
    lmask[2, 0] = True
    lmask[2, 2] = True  # a hole in the middle
    return {
        "region_features": torch.randn(U, R, d_r, generator=g, dtype=dtype) * rmask[..., None],
        "region_mask": rmask,
        "image_of": torch.tensor([0, 1, 2, 3, 0][:B]),
        "words": torch.randn(B, T, d_w, generator=g, dtype=dtype) * wmask[..., None],
        "word_mask": wmask,
        "lang_words": torch.randn(B, 1 + K, d_w, generator=g, dtype=dtype),
        "lang_mask": lmask,
    }


@pytest.mark.parametrize("hidden", [0, 1, 2])
@pytest.mark.parametrize("train_mode", [True, False])
def test_loss_matches_per_word_float64_reference(hidden, train_mode):
    from train.jobs.infoground.losses import infoground_loss, reference_loss
    from train.jobs.infoground.model import InfoGroundModel

    torch.manual_seed(hidden)
    model = InfoGroundModel(10, 8, hidden_layers=hidden).double()
    assert model.d == 4  # d_w / 2
    if not train_mode:
        for m in model.modules():  # non-trivial running statistics
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    model.train(train_mode)
    batch = _batch()
    for use_lang in (True, False):
        fast, logs = infoground_loss(model, batch, use_lang=use_lang)
        ref = reference_loss(model, batch, use_lang=use_lang)
        fast, ref = float(fast.detach()), float(ref.detach())
        assert abs(fast - ref) < 1e-6, (hidden, train_mode, use_lang, fast, ref)
    assert logs["img_words"] == 10


def test_gradients_match_reference():
    from train.jobs.infoground.losses import infoground_loss, reference_loss
    from train.jobs.infoground.model import InfoGroundModel

    torch.manual_seed(0)
    model = InfoGroundModel(10, 8, hidden_layers=1).double()
    batch = _batch(seed=3)
    g1 = torch.autograd.grad(infoground_loss(model, batch)[0], list(model.parameters()))
    g2 = torch.autograd.grad(reference_loss(model, batch), list(model.parameters()))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=1e-9, rtol=1e-7)


def test_padding_changes_nothing():
    """Extra padded regions / word slots (any values) leave the loss, the attention and the BatchNorm
    statistics unchanged: padding is masked out of both."""
    from train.jobs.infoground.losses import infoground_loss
    from train.jobs.infoground.model import InfoGroundModel

    torch.manual_seed(0)
    model = InfoGroundModel(10, 8, hidden_layers=1).double().train()
    b = _batch()
    pad = dict(b)
    pad["region_features"] = torch.cat([b["region_features"], 50 * torch.randn(4, 3, 10, dtype=torch.float64)], 1)
    pad["region_mask"] = torch.cat([b["region_mask"], torch.zeros(4, 3, dtype=torch.bool)], 1)
    garbage = 7 + 9 * torch.randn(b["words"].shape, dtype=torch.float64)
    pad["words"] = torch.where(b["word_mask"][..., None], b["words"], garbage)
    l1 = infoground_loss(model, b)[0]
    rm0 = [m.running_mean.clone() for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    l2 = infoground_loss(model, pad)[0]
    assert abs(float(l1) - float(l2)) < 1e-10
    # the same batch statistics both times: running means moved by the same update twice
    rm1 = [m.running_mean for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)]
    for a, c in zip(rm0, rm1):
        assert torch.isfinite(c).all() and float((c - a).abs().max()) < 50  # no blow-up from the garbage rows


def test_attention_ignores_padded_regions():
    from train.jobs.infoground.model import InfoGroundModel

    model = InfoGroundModel(6, 4, hidden_layers=1).eval()
    k = torch.randn(2, 5, model.d)
    v = torch.randn(2, 5, model.d)
    m = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    q, vw = torch.randn(3, model.d), torch.randn(3, model.d)
    phi, a = model.attention_all(q, vw, k, v, m)
    assert torch.all(a[:, 0, 2:] == 0) and torch.allclose(a.sum(-1), torch.ones(3, 2))
    phi2, _ = model.attention_all(q, vw, k[:1, :2], v[:1, :2], m[:1, :2])
    assert torch.allclose(phi[:, :1], phi2, atol=1e-6)


# ------------------------------------------------------------------------------ grounding metrics
def test_recall_chance_is_exact():
    from train.jobs.infoground.metrics import recall_chance

    for n in range(1, 8):
        for h in range(0, n + 1):
            for k in (1, 3, 5, 10):
                combos = list(combinations(range(n), min(k, n)))
                exact = sum(any(i < h for i in c) for c in combos) / len(combos)
                assert math.isclose(recall_chance(n, h, k), exact), (n, h, k)


def test_phrase_outcome():
    from train.jobs.infoground.metrics import phrase_outcome

    boxes = np.array([[0, 0, 10, 10], [20, 20, 40, 40], [0, 0, 100, 100], [22, 22, 38, 38]], float)
    gt = np.array([[20, 20, 40, 40]], float)
    o = phrase_outcome(np.array([0.1, 0.5, 0.3, 0.1]), boxes, gt, 0.5)
    assert o["r1"] == 1 and o["pointing_accuracy"] == 1
    # good boxes: 1 (IoU 1) and 3 (IoU 0.64); centres inside: 1, 3 (the big box's centre (50, 50) is not)
    assert math.isclose(o["r1_chance"], 0.5) and math.isclose(o["pointing_accuracy_chance"], 0.5)
    o = phrase_outcome(np.array([0.1, 0.2, 0.9, 0.0]), boxes, gt, 0.5)
    assert o["r1"] == 0 and o["pointing_accuracy"] == 0 and o["r5"] == 1 and o["r5_chance"] == 1.0


# ------------------------------------------------------------------------------------ PROPN fix
def test_propn_nouns_get_features_and_negatives():
    from pipeline.models.mlm import load_mlm
    from pipeline.models.spacy_tagger import Word
    from pipeline.negatives.core import MinerOptions, NegativeMiner
    from pipeline.stages.negative_captions import Config, miner_options

    assert Config().include_propn is True and miner_options(Config()).include_propn is True
    assert miner_options(Config(include_propn=False)).include_propn is False
    text = "a cyan hexagon beside a red circle"
    # the packaged tagger's PROPN reading of generated captions, fixed here so the test does not
    # depend on the tagger version
    words = [Word(1, 2, 6, "cyan", "PROPN", "cyan"), Word(2, 7, 14, "hexagon", "PROPN", "hexagon"),
             Word(4, 24, 27, "red", "ADJ", "red"), Word(5, 28, 34, "circle", "NOUN", "circle")]
    mlm = load_mlm("tiny-random")
    miner = NegativeMiner(mlm, None, MinerOptions(negative_feature_k=2))  # one vocabulary build (the slow part)
    on = miner.mine([(0, 0, text)], [words])[0]
    miner.opts.include_propn = False
    off = miner.mine([(0, 0, text)], [words])[0]
    assert {w.text for w in on.words} == {"cyan", "hexagon", "red", "circle"}
    assert {n.word.text for n in on.nouns} == {"cyan", "hexagon", "circle"}
    assert all(len(n.candidates) > 0 and n.neg_features is not None for n in on.nouns)
    assert {w.text for w in off.words} == {"red", "circle"} and {n.word.text for n in off.nouns} == {"circle"}


# ---------------------------------------------------------------------------------- collate
def test_collate_contextual_random_and_masks():
    from train.jobs.infoground.batches import Collate

    class FakeReader:
        def get(self, sid, fields):
            n = {1: 3, 2: 5}[sid]
            return {"sample_id": sid, "boxes": np.zeros((n, 4), np.float32), "features": np.full((n, 6), sid, np.float16)}

    rng = np.random.default_rng(0)

    def item(sid, cid, nouns):
        wf = rng.normal(size=(3, 4)).astype(np.float16)
        it = {"sample_id": sid, "caption_id": cid, "wf": wf, "wi": np.array([1, 2, 4], np.int32),
              "w_word_index": [1, 2, 4], "w_is_noun": [False, True, True], "w_text": ["red", f"n{cid}", f"m{cid}"]}
        if nouns:
            it.update(neg_wi=np.array([2, 4], np.int32), neg_count=np.array([3, 0], np.int32),
                      neg_valid=np.array([[1, 1, 1, 0], [0, 0, 0, 0]], bool), neg_f=rng.normal(size=(2, 4, 4)).astype(np.float16))
        return it

    samples = [item(1, 10, True), item(2, 20, True), item(1, 11, False)]
    c = Collate("unused", "contextual", 4, None, None)
    c._reader = FakeReader()
    b = c(samples, random.Random(0))
    assert b["image_of"].tolist() == [0, 1, 0] and b["region_mask"].sum(1).tolist() == [3, 5]
    assert b["lang_mask"][2].sum() == 0  # no negatives stored for caption 11
    assert b["lang_mask"][0].tolist() == [True, True, True, True, False]  # noun at index 2 (the one with count 3)
    assert torch.allclose(b["lang_words"][0, 0], torch.from_numpy(samples[0]["wf"][1].astype(np.float32)))
    c = Collate("unused", "random", 4, 2, None)
    c._reader = FakeReader()
    b = c(samples, random.Random(0))
    assert b["word_mask"].sum(1).tolist() == [2, 2, 2]  # max_words_per_caption
    # caption 20 (image 2) draws negatives from the 4 nouns of image 1's captions
    assert b["lang_mask"][1].tolist() == [True] * 5
    pool = {tuple(np.round(samples[i]["wf"][r].astype(np.float32), 3)) for i in (0, 2) for r in (1, 2)}
    assert {tuple(np.round(x, 3)) for x in b["lang_words"][1, 1:].numpy()} <= pool


# ------------------------------------------------------------------------------------ bad input
def _manifest(out, *sets):
    from pipeline.config import load_manifest
    from train.config import TrainerConfig

    extra = ["train.infoground.benchmarks_at_end=false"] if "benchmarks_at_end" in TrainerConfig.model_fields else []
    return load_manifest(None, [f"output={out}", "train.infoground.threads=1", "train.infoground.heatmaps=0", *extra, *sets])


def test_bad_inputs(tmp_path, monkeypatch):
    from infoground_artifacts import write_grounding_artifacts
    from train.jobs.infoground import make_job
    from train.loop import train

    a, b = tmp_path / "a", tmp_path / "b"
    write_grounding_artifacts(a, n_images=30, empty_regions={3, 4, 5})  # 4 is a test image, 3 a val image
    write_grounding_artifacts(b, n_images=30, id_offset=1000)  # another dataset's ids
    dev = torch.device("cpu")
    import train.loop as loop_module

    monkeypatch.setattr(loop_module, "plot_metrics", lambda *a, **k: None)  # not under test, slow
    m = _manifest(a, "train.infoground.regions_artifact=nowhere")
    with pytest.raises(FileNotFoundError, match="regions artifact .*nowhere is missing .*extract-regions"):
        make_job(m.train.infoground, m, tmp_path / "r0", dev)
    m = _manifest(a, f"train.infoground.regions_artifact={b / 'regions'}")
    with pytest.raises(ValueError, match="only 0 of the 30 samples .* different datasets"):
        make_job(m.train.infoground, m, tmp_path / "r1", dev)
    m = _manifest(a, f"train.infoground.negatives_artifact={a / 'samples'}")
    with pytest.raises(ValueError, match="holds a 'samples' artifact, expected 'negatives'"):
        make_job(m.train.infoground, m, tmp_path / "r2", dev)
    # zero regions: skipped and counted, training and evaluation run through
    m = _manifest(a, "train.infoground.max_steps=2", "train.infoground.batch_size=8", "train.infoground.lr=1e-3")
    job = make_job(m.train.infoground, m, tmp_path / "r3", dev)
    assert job.skips["zero_regions"] == 3
    res = train(job, resume=False, progress=False)
    # 6 test and 6 val images of 2 captions x 2 phrases; one of each has no region
    assert res["test_skipped"] == 4 and res["val_skipped"] == 4
    assert res["test_phrases"] == 20 and res["val_phrases"] == 20
    g = json.loads((job.run_dir / "eval" / "final" / "grounding.json").read_text())
    assert g["test"]["skip_reasons"] == {"no_regions": 4}


def test_zero_nouns_is_an_error(tmp_path):
    """A negatives artifact whose captions had no noun or adjective (no word rows) is one clear error."""
    from infoground_artifacts import write_grounding_artifacts
    from pipeline.io.artifacts import ArtifactWriter, unit_name
    from pipeline.io.wds import ShardWriter
    from pipeline.stages.negative_captions import NEGATIVES_SCHEMA, WORDS_SCHEMA
    from train.jobs.infoground import make_job

    write_grounding_artifacts(tmp_path, n_images=10)
    import shutil

    shutil.rmtree(tmp_path / "negatives")
    w = ArtifactWriter(tmp_path, "negatives", "negative-captions", {})
    uw = w.unit_writer(unit_name(0), "fp")
    with ShardWriter(uw.shard_path()):  # the stage writes a shard even when no sample has words
        pass
    uw.record_shard(uw.shard_path(), 0)
    uw.write_table("words", WORDS_SCHEMA.empty_table())
    uw.write_table("negatives", NEGATIVES_SCHEMA.empty_table())
    uw.commit()
    w.finalize([unit_name(0)], extra={"feature_dim": 24, "negative_feature_k": 25})
    m = _manifest(tmp_path)
    with pytest.raises(ValueError, match="no words"):
        make_job(m.train.infoground, m, tmp_path / "r", torch.device("cpu"))


def test_exact_resume_and_best(tmp_path, monkeypatch):
    """An interrupted run resumed from last.pt logs the same losses as an uninterrupted one (the
    batches, the per-epoch noun draw and the random variant's negatives are functions of (seed,
    epoch, batch)); best.pt is chosen at the per-epoch evaluations."""
    from infoground_artifacts import write_grounding_artifacts
    from train.jobs.infoground import make_job
    from train.loop import load_checkpoint, train
    import train.loop as loop_module

    monkeypatch.setattr(loop_module, "plot_metrics", lambda *a, **k: None)
    write_grounding_artifacts(tmp_path, n_images=40)
    dev = torch.device("cpu")
    for variant in ("contextual", "random"):
        m = _manifest(tmp_path, f"train.infoground.negatives={variant}", "train.infoground.batch_size=8",
                      "train.infoground.epochs=2", "train.infoground.lr=1e-3", "train.infoground.log_every=1")
        runs = {}
        for name, stop in (("full", None), ("cut", 4)):
            job = make_job(m.train.infoground, m, tmp_path / f"{variant}-{name}", dev)
            if stop:
                train(job, resume=False, progress=False, stop_after=stop)
                job = make_job(m.train.infoground, m, tmp_path / f"{variant}-{name}", dev)
                train(job, resume=True, progress=False)
            else:
                train(job, resume=False, progress=False)
            rows = [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
            runs[name] = [(r["step"], r["loss"]) for r in rows if r["kind"] == "train"]
            evals = [r for r in rows if r["kind"] == "eval"]
        bpe = job.batches_per_epoch()
        assert bpe == 6 and len(runs["full"]) == 12 and runs["full"] == runs["cut"], variant  # 48 captions / 8
        assert [r["step"] for r in evals] == [6, 12]  # per epoch (eval_per_epoch)
        best = max(evals, key=lambda r: r["val_pointing_accuracy"])
        assert load_checkpoint(job.run_dir / "checkpoints" / "best.pt")["step"] == best["step"]


def test_text_words_match_the_stage_features():
    """score_pairs encodes arbitrary texts as the negatives stage does: same words, same features."""
    from pipeline.config import load_manifest
    from pipeline.models.mlm import load_mlm
    from pipeline.models.spacy_tagger import Tagger
    from pipeline.negatives.core import MinerOptions, NegativeMiner
    from train.jobs.infoground.scoring import TextWords

    m = load_manifest(None, ["models.mlm=tiny-random", "models.word_encoder=tiny-random"])
    texts = ["A man is walking on a beach with his skateboard.", "Two dogs chase a red frisbee across the park.",
             "nothing here", "A small cyan hexagon left of a big square."]
    res = NegativeMiner(load_mlm("tiny-random"), None, MinerOptions(negative_features="none")).mine(
        [(i, 0, t) for i, t in enumerate(texts)], Tagger(m.models.spacy).tag(texts))
    tw = TextWords(m, {"feature_pos": ["NOUN", "ADJ"], "noun_pos": ["NOUN"], "include_propn": True})
    enc = tw.encode(texts)
    for r, e in zip(res, enc):
        assert e.shape == r.features.shape, r.text
        assert np.allclose(e, r.features, atol=1e-4), r.text
    assert enc[2].shape[0] == 0 and tw.encode([texts[0]])[0] is enc[0]  # cached


def test_score_word_features_batched_equals_per_pair(tmp_path):
    """The harness score (mean over words of phi), batched per image with per-pair box masks, equals
    a direct per-pair computation; texts without words score NaN."""
    from infoground_artifacts import write_grounding_artifacts
    from train.jobs.infoground import make_job
    from train.jobs.infoground.metrics import centre_in

    write_grounding_artifacts(tmp_path, n_images=20)
    m = _manifest(tmp_path)
    job = make_job(m.train.infoground, m, tmp_path / "r", torch.device("cpu"))
    model = job.build_model().eval()
    es = job.eval_set(["test"])
    rng = np.random.default_rng(0)
    sids, feats, boxes = [], [], []
    for im in es.images:
        for j in range(3):
            sids.append(im["sample_id"])
            feats.append(es.images[rng.integers(len(es.images))]["words"][: rng.integers(0, 5)])
            boxes.append([np.nan] * 4 if j == 0 else list(im["boxes"][j]) if j == 1 else [0, 0, 1, 1])
    with torch.no_grad():
        fast = job.score_word_features(model, np.array(sids), feats, np.array(boxes))
        ref = []
        for s, w, b in zip(sids, feats, boxes):
            if len(w) == 0:
                ref.append(np.nan)
                continue
            r = job.regions.get(s)
            keep = np.ones(len(r["boxes"]), bool)
            if not np.isnan(b).any() and centre_in(r["boxes"].astype(np.float64), np.array(b)[None]).any():
                keep = centre_in(r["boxes"].astype(np.float64), np.array(b)[None])
            k, v = model.regions(torch.from_numpy(r["features"].astype(np.float32))[None],
                                 torch.ones(1, len(keep), dtype=torch.bool))
            q, vw = model.words(torch.from_numpy(w.astype(np.float32)), None)
            phi, _ = model.attention_all(q, vw, k, v, torch.from_numpy(keep)[None])
            ref.append(float(phi[:, 0].double().mean()))
    ref = np.array(ref)
    assert np.array_equal(np.isnan(fast), np.isnan(ref)) and np.isnan(ref).any()
    assert np.nanmax(np.abs(fast - ref)) < 1e-5


def test_eval_on_another_runs_artifacts(tmp_path, monkeypatch):
    """eval_output: train on one run's artifacts, evaluate on another's (its splits, phrases, regions,
    words); widths that differ are one clear error."""
    from infoground_artifacts import write_grounding_artifacts
    from train.jobs.infoground import make_job
    import train.loop as loop_module

    monkeypatch.setattr(loop_module, "plot_metrics", lambda *a, **k: None)
    write_grounding_artifacts(tmp_path / "a", n_images=20)
    write_grounding_artifacts(tmp_path / "b", n_images=40, id_offset=500, seed=1)
    write_grounding_artifacts(tmp_path / "c", n_images=10, id_offset=900, d_r=16)
    m = _manifest(tmp_path / "a", f"train.infoground.eval_output={tmp_path / 'b'}")
    job = make_job(m.train.infoground, m, tmp_path / "r", torch.device("cpu"))
    model = job.build_model()
    res = job.evaluate(model, tmp_path / "ev")
    assert res["test_phrases"] == 8 * 2 * 2 and res["val_phrases"] == 8 * 2 * 2  # b's 8 test and 8 val images
    rows = job.job_metrics(model, tmp_path / "ev2")
    assert rows[0].benchmark == "grounding:b" and rows[0].n == 32
    m = _manifest(tmp_path / "a", f"train.infoground.eval_output={tmp_path / 'c'}")
    job = make_job(m.train.infoground, m, tmp_path / "r2", torch.device("cpu"))
    with pytest.raises(ValueError, match="widths 16/24 differ .* 32/24"):
        job.evaluate(job.build_model(), tmp_path / "ev3")


def test_feature_encoder_is_the_mlm_body_when_shared():
    """pipeline.models.mlm.load_feature_encoder: the word-feature encoder of the negatives stage,
    the masked LM's body when models.word_encoder == models.mlm, else the word encoder."""
    from pipeline.models.mlm import load_feature_encoder, load_mlm, load_word_encoder

    shared = load_feature_encoder("tiny-random", "tiny-random")
    lm = load_mlm("tiny-random")
    assert type(shared.model) is type(lm.encoder) and shared.record["role"] == "mlm"
    apart = load_feature_encoder("random-bert-base", "tiny-random")
    assert apart.record == load_word_encoder("tiny-random").record
    ids = torch.tensor([[101, 2000, 2001, 102]])
    with torch.no_grad():
        a = shared.model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        b = lm.encoder(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
    assert torch.equal(a, b)


def test_grounding_rows_carry_wilson_intervals():
    from scipy.stats import binomtest

    from train.jobs.infoground.metrics import grounding_rows

    g = {"phrases": 40, "nouns": 9, "skipped": 2, "skip_reasons": {"x": 2},
         "noun_vs_negatives": 100 * 4 / 9, "noun_vs_negatives_chance": 25.0}
    for j, k in enumerate(("r1", "r5", "r10", "pointing_accuracy")):
        g[k], g[f"{k}_chance"] = 100 * (10 + 7 * j) / 40, 10.0
    rows = grounding_rows(g, "flickr30k-entities", "test")
    want = [(10 + 7 * j, 40) for j in range(4)] + [(4, 9)]
    assert len(rows) == len(want)
    for r, (k, n) in zip(rows, want):
        ci = binomtest(k, n).proportion_ci(method="wilson")
        assert (r.ci_low, r.ci_high) == pytest.approx((100 * ci.low, 100 * ci.high)), r.metric


# ------------------------------------------------------------- issue 26: IoU convention, prior baseline
def test_iou_plus_one_flips_a_hit_at_the_border():
    """IoU of [0,0,9,4] with the ground truth [0,0,9,9]: 36/81 = 0.44 for continuous boxes, 50/100 =
    0.5 with the reference code's +1-pixel widths: the R@1 hit flips; the default is the reference's."""
    from train.jobs.infoground import Config
    from train.jobs.infoground.metrics import phrase_outcome

    boxes = np.array([[0, 0, 9, 4], [50, 50, 60, 60]], float)
    gt = np.array([[0, 0, 9, 9]], float)
    score = np.array([0.9, 0.1])
    assert phrase_outcome(score, boxes, gt, 0.5, plus_one=True)["r1"] == 1
    assert phrase_outcome(score, boxes, gt, 0.5, plus_one=False)["r1"] == 0
    assert Config.model_fields["iou_plus_one"].default is True


def test_prior_wins_matches_brute_force():
    """The prior-only scorer on a hand-made vocabulary: ranking all words by training count, the true
    noun must come first even when ties are ordered against it."""
    from train.jobs.infoground.metrics import noun_counts, prior_wins

    texts = ["Dog", "dog", "cat", "cat", "man", "red", "dog", "ball"]
    is_noun = [True, True, True, True, True, False, True, True]
    counts = noun_counts(texts, is_noun)
    assert counts == {"dog": 3, "cat": 2, "man": 1, "ball": 1}  # "red" is not a noun
    cases = [("dog", ["cat", "man"], True), ("cat", ["dog"], False), ("man", ["ball"], False),  # a tie is wrong
             ("Cat", ["man", "unseen"], True), ("unseen", ["zebra"], False), ("ball", ["red"], True)]
    for noun, negs, want in cases:
        assert prior_wins(noun, negs, counts) is want, (noun, negs)
    rng = random.Random(0)
    vocab = ["dog", "cat", "man", "ball", "red", "zebra"]
    for _ in range(200):
        noun, negs = rng.choice(vocab), rng.sample(vocab, rng.randint(1, 5))
        negs = [w for w in negs if w != noun] or ["zebra" if noun != "zebra" else "red"]
        ranked = sorted([(counts.get(w, 0), 0, w) for w in negs] + [(counts.get(noun, 0), -1, noun)], reverse=True)
        assert prior_wins(noun, negs, counts) is (ranked[0][2] == noun and ranked[0][1] == -1), (noun, negs)


def test_noun_vs_negatives_reports_the_prior_baseline(tmp_path):
    """The job's prior row: counts from the training captions' nouns only, each held-out noun against
    its valid negatives, recomputed here from the artifact's tables; a Wilson interval as the rest."""
    import polars as pl

    from infoground_artifacts import write_grounding_artifacts
    from pipeline.io.artifacts import Artifact
    from train.jobs.infoground import make_job
    from train.jobs.infoground.metrics import grounding_rows

    write_grounding_artifacts(tmp_path / "a", n_images=20)
    m = _manifest(tmp_path / "a")
    job = make_job(m.train.infoground, m, tmp_path / "r", torch.device("cpu"))
    g = job.ground(job.build_model(), job.eval_set(job.cfg.test_splits))
    neg = Artifact(tmp_path / "a" / "negatives")
    words = neg.scan("words").collect()
    train = words.filter(pl.col("is_noun") & pl.col("sample_id").is_in(sorted(job.train_ids)))
    counts: dict = {}
    for t in train["text"].to_list():
        counts[t.lower()] = counts.get(t.lower(), 0) + 1
    test_ids = {im["sample_id"] for im in job.eval_set(job.cfg.test_splits).images}
    wins = n = 0
    outcomes, images = [], []
    for r in neg.scan("negatives").collect().filter(pl.col("sample_id").is_in(sorted(test_ids))).iter_rows(named=True):
        n += 1
        won = all(counts.get(r["noun"].lower(), 0) > counts.get(c.lower(), 0) for c in r["candidates"])
        wins += won
        outcomes.append(won)
        images.append(r["sample_id"])
    assert g["nouns"] == n > 0 and g["noun_vs_negatives_prior"] == pytest.approx(100 * wins / n)
    row = [r for r in grounding_rows(g, "b", "test") if r.metric == "noun vs its negatives[prior]"]
    assert len(row) == 1 and row[0].n == n and row[0].chance == g["noun_vs_negatives_chance"]
    # nouns of one image are not independent: Wilson on the effective n of nouns clustered by image
    assert (row[0].ci_low, row[0].ci_high) == pytest.approx(wilson_of(np.array(outcomes), clusters=np.array(images)))
    assert row[0].baseline_for == "test/noun vs its negatives"


def test_frozen_clip_grounding_is_the_brute_force_argmax(tmp_path):
    """Zero-shot grounding by a frozen text encoder (here: a fixed random vector per phrase text)
    points each phrase at the region of highest cosine: recomputed phrase by phrase; its rows name
    their result rows and carry estimates on the same phrases and images. Regions that are not
    clip-pool features (these hand-made ones record no CLIP) get no baseline row, and the result rows
    say why."""
    from infoground_artifacts import write_grounding_artifacts
    from train.jobs.infoground import make_job
    from train.jobs.infoground.metrics import centre_in, ground_frozen, grounding_rows

    write_grounding_artifacts(tmp_path / "a", n_images=20)
    m = _manifest(tmp_path / "a")
    job = make_job(m.train.infoground, m, tmp_path / "r", torch.device("cpu"))
    es = job.eval_set(job.cfg.test_splits)
    d = job.d_r

    def embed(texts):
        return np.stack([np.random.default_rng(list(t.encode()) or [0]).normal(size=d) for t in texts])

    fz = ground_frozen(es, embed, job.cfg)
    point, r1, imgs = [], [], []
    for im in es.images:
        R = len(im["boxes"]) if job.cfg.max_regions is None else min(len(im["boxes"]), job.cfg.max_regions)
        f = im["features"][:R].astype(np.float64)
        for cap in im["captions"]:
            for ph in cap["phrases"]:
                t = embed([ph["text"]])[0]
                cos = [float(x @ t / np.linalg.norm(x) / np.linalg.norm(t)) for x in f]
                top = im["boxes"][int(np.argmax(cos))]
                point.append(bool(centre_in(top[None], ph["gt"])[0]))
                ious = []
                for gt in ph["gt"]:  # the reference's +1-pixel IoU, written out
                    iw = min(top[2], gt[2]) - max(top[0], gt[0]) + 1
                    ih = min(top[3], gt[3]) - max(top[1], gt[1]) + 1
                    inter = max(iw, 0) * max(ih, 0)
                    a = (top[2] - top[0] + 1) * (top[3] - top[1] + 1) + (gt[2] - gt[0] + 1) * (gt[3] - gt[1] + 1)
                    ious.append(inter / (a - inter))
                r1.append(max(ious) >= job.cfg.iou_threshold)
                imgs.append(im["sample_id"])
    assert fz["phrases"] == len(point) > 0
    assert fz["pointing_accuracy"] == pytest.approx(100 * np.mean(point)) and fz["r1"] == pytest.approx(100 * np.mean(r1))
    g = job.ground(job.build_model(), es)
    rows = {r.metric: r for r in grounding_rows(g, "b", "test", fz)}
    for name in ("R@1", "R@5", "R@10", "pointing accuracy"):
        b, res = rows[f"{name}[frozen]"], rows[name]
        assert b.baseline_for == f"test/{name}" and b.n == res.n == len(point)
        assert np.array_equal(b.est.cluster, res.est.cluster) and np.array_equal(b.est.cluster, np.array(imgs))
        assert 100 * b.est.value == pytest.approx(b.value)
    why = job.frozen_grounding(es)
    assert isinstance(why, str) and "not from a CLIP's joint space (clip-pool:<CLIP>)" in why
    rows = job.job_metrics(job.build_model(), tmp_path / "jm")
    assert not any(r.metric.endswith("[frozen]") for r in rows)
    assert all("no frozen CLIP baseline: the regions' features come from" in r.note for r in rows if r.metric == "R@1")
