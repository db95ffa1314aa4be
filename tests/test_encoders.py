"""The frozen-encoder jobs (clip-encoder, mlm-encoder): trained on the training split only, exported as hub-layout
folders that plain ``from_pretrained`` loads, and the exactness check: the pipeline's adapter on the exported
folder reproduces the training-time model's embeddings of every held-out image and caption (cosine >= 0.9999).

The jobs run at toy sizes for a few steps on the small testbed's samples (100 generated images): these tests are
about the contract (what is trained on, what is written, what loads), not about learning (tests/test_encoders_slow.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

TINY_CLIP = ["image_size=32", "patch_size=8", "vision_width=32", "vision_layers=1", "text_width=32", "text_layers=1",
             "heads=2", "projection_dim=16", "max_steps=3", "batch_size=16", "benchmarks_at_end=false"]
TINY_MLM = ["width=32", "layers=1", "heads=2", "max_steps=3", "batch_size=16", "benchmarks_at_end=false"]


def with_options(manifest_path: Path, job: str, sets: list[str]) -> Path:
    """A copy of the manifest whose ``train.<job>`` section holds ``sets`` (key=value): the manifest's own
    configuration of the job, so its export goes to ``<output>/encoders/<name>`` (train/cli.py, export_placement)."""
    import yaml

    key = job.replace("-", "_")
    m = yaml.safe_load(Path(manifest_path).read_text())
    m.setdefault("train", {})[key] = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in sets)}
    out = Path(manifest_path).with_name(f"{Path(manifest_path).stem}-{key}.yaml")
    out.write_text(yaml.safe_dump(m, sort_keys=False))
    return out


def _train(manifest_path: Path, job: str, sets: list[str], run_dir: Path):
    """Build the job as `train run` does (``sets`` in the manifest's train section) and train it in this process;
    returns (job, final metrics)."""
    from train.cli import build_job
    from train.loop import train

    key = job.replace("-", "_")
    _, _, _, j = build_job(job, with_options(manifest_path, job, sets), [f"train.{key}.run_dir={run_dir}"])
    return j, train(j, progress=False)


@pytest.fixture
def clip_run(testbed_copy, tmp_path):
    out, mp = testbed_copy
    job, res = _train(mp, "clip-encoder", TINY_CLIP, tmp_path / "clip-run")
    return out, mp, job, res


def test_output_template_in_model_specs(tmp_path):
    from pipeline.config import load_manifest

    m = load_manifest(Path("manifests/pixels-gt.yaml"), [f"output={tmp_path}/x"])
    assert m.models.clip == f"{tmp_path}/x/encoders/clip"
    assert m.models.mlm == m.models.word_encoder == f"{tmp_path}/x/encoders/mlm"
    assert "scene-oracle" not in json.dumps(m.models.model_dump())  # the pixels testbed has no oracle anywhere
    # a spec without the template is untouched
    assert load_manifest(Path("manifests/tiny.yaml"), [f"output={tmp_path}/y"]).models.clip == "tiny-random"


def test_clip_encoder_trains_on_the_train_split_only(clip_run):
    out, _, job, _ = clip_run
    c = job.corpus
    trained = set(c.sample_ids[job.train_idx].tolist())
    held = set(c.sample_ids[job.eval_idx].tolist())
    assert trained and held and not trained & held
    assert set(c.splits[job.train_idx]) == {"train"}
    # every caption a training batch can draw belongs to a training image
    assert set(c.caption_sample[np.concatenate(job.pools)].tolist()) <= trained
    batch = next(iter(job.batches(0, 0)))
    assert batch["pixel_values"].shape[1:] == (3, 32, 32)


def test_clip_export_loads_without_project_code_and_matches_the_training_model(clip_run):
    """The exported folder: plain transformers loads it; the pipeline's adapter on it gives the training-time
    model's embeddings (heldout_embeddings.npz) for every held-out image and caption."""
    import torch
    from transformers import AutoProcessor, CLIPModel

    from pipeline.models.clip import encode_images, encode_texts, load_clip, preprocess_images
    from pipeline.readers.images import open_image

    out, _, job, res = clip_run
    folder = out / "encoders" / "clip"
    assert {"config.json", "model.safetensors", "preprocessor_config.json", "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    assert json.loads((folder / "training.json").read_text())["trained_on"]["splits"] == ["train"]
    plain = CLIPModel.from_pretrained(str(folder)).eval()
    proc = AutoProcessor.from_pretrained(str(folder))
    assert proc.tokenizer("a red circle")["input_ids"][0] == 49406  # CLIP's BPE: SOT first
    assert res["export_min_cos_image"] >= 0.9999 and res["export_min_cos_text"] >= 0.9999

    saved = np.load(job.run_dir / "heldout_embeddings.npz")
    model, processor, tok, record = load_clip(str(folder))
    assert record["random_weights"] is False
    c = job.corpus
    refs = {int(s): c.images[i] for i, s in enumerate(c.sample_ids.tolist())}
    img = encode_images(model, preprocess_images(processor, [open_image(refs[int(s)]) for s in saved["sample_ids"]]))["image_embed"]
    texts = dict(zip(c.caption_ids.tolist(), c.texts))
    txt = encode_texts(model, tok, [texts[int(i)] for i in saved["caption_ids"]])["text_embed"]

    def cos(a, b):
        a, b = torch.as_tensor(a).float(), torch.as_tensor(b).float()
        return torch.nn.functional.cosine_similarity(a, b, dim=-1)

    assert len(saved["sample_ids"]) == len(job.eval_idx) and len(saved["caption_ids"]) >= len(job.eval_idx)
    assert cos(img, saved["image_embed"]).min() >= 0.9999
    assert cos(txt, saved["text_embed"]).min() >= 0.9999
    # and plain transformers (the processor it exported, no adapter) agrees as well
    with torch.no_grad():
        pv = proc(images=[open_image(refs[int(saved["sample_ids"][0])])], return_tensors="pt")["pixel_values"]
        e = plain.get_image_features(pixel_values=pv)
    e = e if isinstance(e, torch.Tensor) else e.pooler_output
    assert cos(e, saved["image_embed"][:1]).min() >= 0.9999


def test_clip_encoder_rows_have_chance_and_intervals(clip_run):
    _, _, job, _ = clip_run
    from train.loop import load_model_for_eval

    model, _ = load_model_for_eval(job, job.run_dir / "checkpoints" / "final.pt")
    rows = {r.metric: r for r in job.job_metrics(model, job.run_dir / "eval" / "x")}
    assert set(rows) == {"i2t_R@1", "t2i_R@1", "zeroshot_colour", "zeroshot_shape"}
    n_img = len(job.eval_idx)
    assert rows["i2t_R@1"].n == n_img
    assert rows["i2t_R@1"].chance == pytest.approx(100.0 / n_img, rel=0.3)  # 5 captions each of n_img images
    assert rows["zeroshot_colour"].chance > 100.0 / 12 - 1e-9  # at least one right colour per image
    for r in rows.values():
        assert r.ci_low <= r.value <= r.ci_high
    # a re-evaluation of the same weights leaves the export untouched (its mtimes key the stages' fingerprints)
    from train.encoders import export_folder

    folder = job.export_path
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert export_folder(folder, model, job.processor, job.tokenizer, provenance={}) is False
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_clip_encoder_control_exports_elsewhere_and_shuffles_pairs(testbed_copy, tmp_path):
    out, mp = testbed_copy
    from train.cli import build_job

    _, _, _, job = build_job("clip-encoder", with_options(mp, "clip-encoder", TINY_CLIP + ["control=shuffled"]), [])
    assert job.export_path == out / "encoders" / "clip-shuffled"
    own = [job.corpus.caption_sample[p[0]] for p in job.pools]
    moved = np.mean([o != s for o, s in zip(own, job.corpus.sample_ids[job.train_idx])])
    assert moved > 0.9


def test_mlm_encoder_export_loads_as_the_pipeline_mlm(testbed_copy, tmp_path):
    import torch
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from pipeline.models.mlm import load_mlm, load_word_encoder

    out, mp = testbed_copy
    job, res = _train(mp, "mlm-encoder", TINY_MLM, tmp_path / "mlm-run")
    folder = out / "encoders" / "mlm"
    # the chance level, recomputed here: the training captions' most frequent token (by collections.Counter
    # over the tokenizer's own word pieces), and how often the held-out masked positions hold it
    from collections import Counter

    words = Counter(t for seq in job.train_seqs for t in seq[1:-1].tolist())
    assert job.prior_token == words.most_common(1)[0][0]
    truths = [int(seq[p]) for seq, pos in zip(job.eval_seqs, job.eval_pos) for p in np.atleast_1d(pos)]
    assert res["masked_tokens"] == len(truths) > 0
    assert res["masked_token_acc_chance"] == pytest.approx(100.0 * np.mean([t == job.prior_token for t in truths]))
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert tok("a red circle")["input_ids"] == job.tokenizer("a red circle")["input_ids"]
    assert len(tok) == 30522 and tok.mask_token_id is not None
    plain = AutoModelForMaskedLM.from_pretrained(str(folder)).eval()
    lm = load_mlm(str(folder))
    assert lm.record["random_weights"] is False
    enc = tok(["a small red circle to the left of a blue square"], return_tensors="pt")
    with torch.no_grad():
        a = plain(**enc).logits
        b = lm.head(lm.encoder(**enc).last_hidden_state)
        w = load_word_encoder(str(folder)).model(**enc).last_hidden_state
        h = plain.bert(**enc).last_hidden_state
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(w, h, atol=1e-5)
    # held-out captions only in the evaluation: no training caption is scored
    held = set(job.corpus.sample_ids[np.isin(job.corpus.splits, ["val", "test"])].tolist())
    assert set(job.eval_image.tolist()) <= held


TINY_GROUPVIT = ["image_size=32", "patch_size=8", "vision_width=32", "vision_layers=3", "depths=[1,1,1]", "group_tokens=[8,4]",
                 "text_width=32", "text_layers=1", "heads=2", "projection_dim=16", "projection_intermediate_dim=32", "max_steps=3",
                 "batch_size=16", "benchmarks_at_end=false"]


def test_group_iou_against_brute_force():
    from train.jobs.groupvit_encoder.job import best_ious, upsample

    rng = np.random.default_rng(0)
    lab = upsample(rng.integers(0, 4, size=(4, 4)), (16, 16))
    assert lab.shape == (16, 16) and (lab[:4, :4] == lab[0, 0]).all()
    masks = [rng.random((16, 16)) < 0.3, np.zeros((16, 16), bool)]
    masks[1][2:9, 3:12] = True
    got = best_ious(lab, masks, 4)
    for m, g in zip(masks, got):
        want = max(((lab == k) & m).sum() / ((lab == k) | m).sum() for k in range(4) if ((lab == k) | m).any())
        assert g == pytest.approx(want)
    # one group: IoU = the mask's share of the image
    assert best_ious(np.zeros((16, 16), np.int64), masks[1:], 1)[0] == pytest.approx(masks[1].mean())


def test_no_learning_partitions_grid_and_kmeans():
    from train.jobs.groupvit_encoder.job import best_ious, grid_labels, kmeans_labels, patch_colours, upsample

    g = grid_labels(8, 8)  # 2 x 4 blocks of 4 x 2 patches
    assert sorted(np.unique(g).tolist()) == list(range(8)) and (np.bincount(g.reshape(-1)) == 8).all()
    assert (g[:4, :2] == 0).all() and (g[4:, 6:] == 7).all()
    # a planted two-colour image: a red square on grey; k-means on its patch colours recovers the square exactly
    img = np.full((3, 32, 32), 0.5)
    img[:, 8:24, 8:24] = np.asarray([1.0, 0.0, 0.0])[:, None, None]
    cols = patch_colours(img, 4)
    assert cols.shape == (16, 3) and np.allclose(cols[5], [1, 0, 0]) and np.allclose(cols[0], 0.5)
    lab = upsample(kmeans_labels(cols, 2, seed=0).reshape(4, 4), (32, 32))
    mask = np.zeros((32, 32), bool)
    mask[8:24, 8:24] = True
    assert best_ious(lab, [mask], 2)[0] == pytest.approx(1.0)
    assert best_ious(upsample(grid_labels(4, 2), (32, 32)), [mask], 2)[0] == pytest.approx(128 / 640)  # a half: 128 of its 512 px in the 256-px mask


def test_groupvit_encoder_exports_what_the_stage_and_text_groups_load(testbed_copy, tmp_path):
    import torch
    from transformers import GroupViTModel

    from pipeline.models.groupvit import encode_groups, load_groupvit
    from pipeline.readers.images import open_image
    from train.jobs.text_groups.tokenizer import load_tokenizer

    out, mp = testbed_copy
    job, res = _train(mp, "groupvit-encoder", TINY_GROUPVIT, tmp_path / "gv-run")
    folder = out / "encoders" / "groupvit"
    assert res["export_min_cos_image"] >= 0.9999
    GroupViTModel.from_pretrained(str(folder))
    model, proc, record = load_groupvit(str(folder))
    assert record["random_weights"] is False and record["n_groups"] == 4
    saved = np.load(job.run_dir / "heldout_embeddings.npz")
    refs = {int(s): job.corpus.images[i] for i, s in enumerate(job.corpus.sample_ids.tolist())}
    pv = proc(images=[open_image(refs[int(s)]) for s in saved["sample_ids"]], return_tensors="pt")["pixel_values"]
    got = encode_groups(model, pv)
    assert torch.nn.functional.cosine_similarity(got["image_embed"].float(), torch.as_tensor(saved["image_embed"]), dim=-1).min() >= 0.9999
    assert got["assign"].shape[1:] == (4, 16)
    tok, rec = load_tokenizer(str(folder))  # text-groups takes the folder's tokenizer: CLIP's BPE
    assert "models.groupvit folder" in rec["source"]
    rows = {r.metric: r for r in job.job_metrics(_final_model(job), tmp_path)}
    g = rows["group_mask_iou"]
    assert g.unit == "fraction" and 0 <= g.chance <= 1 and g.n > 0 and g.ci_low <= g.value <= g.ci_high
    for key in ("one_group", "random", "grid", "kmeans"):  # the no-learning partitions, on the same images
        b = rows[f"group_mask_iou_{key}"]
        assert b.baseline_for == "held_out/group_mask_iou" and b.n == g.n and b.ci_low <= b.value <= b.ci_high, key
        assert len(b.est.y) == len(g.est.y) == g.n
    assert rows["group_mask_iou"].chance == pytest.approx(max(rows["group_mask_iou_one_group"].value,
                                                              rows["group_mask_iou_random"].value))


def _final_model(job):
    from train.loop import load_model_for_eval

    return load_model_for_eval(job, job.run_dir / "checkpoints" / "final.pt")[0]


def test_mlm_loss_is_bert_for_masked_lm_loss():
    """The job applies the vocabulary head at the masked positions only; the loss is BertForMaskedLM's own."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from train.jobs.mlm_encoder.job import MlmEncoderJob

    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=32)).eval()
    ids = torch.randint(5, 100, (3, 7))
    labels = torch.full_like(ids, -100)
    labels[0, 2], labels[2, 5], labels[2, 6] = ids[0, 2], ids[2, 5], ids[2, 6]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    got, _ = MlmEncoderJob.loss(None, m, batch)
    assert float(got) == pytest.approx(float(m(**batch).loss), rel=1e-5)


def test_groupvit_multi_label_loss_against_a_loop():
    """GroupViT's multi-label contrastive loss (Xu et al. 2022, Sec. 3.2) against a per-row loop in plain Python, and
    the caption nouns it prompts (plurals mapped back; colour words and 'shapes' are not nouns of objects)."""
    import math

    import torch

    from train.jobs.groupvit_encoder.job import caption_nouns, multi_label_loss

    assert caption_nouns("Two red circles, a blue star and a circle on a beige background.") == ["circle", "star"]
    assert caption_nouns("Three shapes: two green shapes and a red shape.") == []
    g = torch.Generator().manual_seed(0)
    img = torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=-1)
    prm = torch.nn.functional.normalize(torch.randn(3, 8, generator=g), dim=-1)
    y = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 0], [1, 1, 0]], dtype=torch.bool)  # image 1 names no noun
    scale = torch.tensor(7.0)
    got = float(multi_label_loss(img, prm, y, scale))
    s = (scale * img @ prm.T).tolist()
    i2p = [-math.log(sum(math.exp(s[i][p]) for p in range(3) if y[i, p]) / sum(math.exp(v) for v in s[i]))
           for i in range(4) if y[i].any()]
    p2i = [-math.log(sum(math.exp(s[i][p]) for i in range(4) if y[i, p]) / sum(math.exp(s[i][p]) for i in range(4)))
           for p in range(3)]
    assert got == pytest.approx(sum(i2p) / len(i2p) + sum(p2i) / len(p2i), rel=1e-5)


def test_groupvit_multi_label_trains_on_its_captions_nouns(testbed_copy, tmp_path):
    """multi_label: true: every step's batch carries one prompt per shape noun of its captions, labelled by the
    captions that name it, and the logged loss adds the multi-label term (positive: a softmax share below 1)."""
    out, mp = testbed_copy
    job, res = _train(mp, "groupvit-encoder", [*TINY_GROUPVIT, "multi_label=true", "log_every=1"], tmp_path / "gv-ml")
    batch = next(iter(job.batches(0, 0)))
    from train.jobs.groupvit_encoder.job import caption_nouns

    texts = job.tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True)
    vocab = sorted({n for t in texts for n in caption_nouns(t)})
    assert batch["prompt_ids"].shape[0] == len(vocab) > 0
    assert batch["prompt_labels"].tolist() == [[n in caption_nouns(t) for n in vocab] for t in texts]
    logged = [json.loads(x) for x in (job.run_dir / "metrics.jsonl").read_text().splitlines()]
    ml = [x["multi_label_loss"] for x in logged if x.get("kind") == "train" and "multi_label_loss" in x]
    assert ml and all(v > 0 for v in ml)


def test_clip_hard_batches_partition_the_epoch_and_group_colour_sets():
    """``hard_batches``: every image at most once an epoch, ``n // batch`` batches; the hard share holds images whose
    colour sets agree (far fewer distinct sets a batch than random batches); 0 is the plain permutation (CLIP's)."""
    from train.jobs.clip_encoder.job import epoch_batches

    rng = np.random.default_rng(0)
    keys = [tuple(sorted(set(rng.choice(12, rng.integers(1, 4)).tolist()))) for _ in range(1000)]
    for frac in (0.0, 0.5, 1.0):
        b = epoch_batches(keys, 32, frac, np.random.default_rng([7, 1]))
        flat = np.concatenate(b)
        assert len(b) == 1000 // 32 and len(flat) == 31 * 32 and len(set(flat.tolist())) == len(flat)
    plain = epoch_batches(keys, 32, 0.0, np.random.default_rng([7, 1]))
    perm = np.random.default_rng([7, 1]).permutation(1000)
    assert all((x == perm[i * 32 : (i + 1) * 32]).all() for i, x in enumerate(plain))
    hard = epoch_batches(keys, 32, 1.0, np.random.default_rng([7, 1]))
    first = lambda bs: np.mean([len({keys[i][0] for i in x}) for x in bs])  # distinct first colours a batch
    assert first(hard) <= 2.0 < 8.0 < first(plain), (first(hard), first(plain))
    half = epoch_batches(keys, 32, 0.5, np.random.default_rng([7, 1]))
    assert sum(len({keys[i][0] for i in x}) <= 3 for x in half) == round(0.5 * 31)  # the hard half; a random batch has ~9


def test_clip_grouped_hard_batches_keep_twins_together_and_mix_the_rest():
    """``hard_order: grouped``: with keys that come in pairs (the corpus's twins share their colour set), both of a pair
    land in one batch (but at a batch's edge), and a batch otherwise holds as many distinct first colours as a random
    one (the sorted order's batches share theirs)."""
    from train.jobs.clip_encoder.job import epoch_batches

    rng = np.random.default_rng(1)
    base = [tuple(sorted(set(rng.choice(12, rng.integers(1, 4)).tolist()) | {100 + g})) for g in range(500)]
    keys = [base[i // 2] for i in range(1000)]  # image 2g and 2g+1: twins (the 100+g colour makes every pair's set unique)
    g = epoch_batches(keys, 32, 1.0, np.random.default_rng([7, 1]), "grouped")
    flat = np.concatenate(g)
    assert len(g) == 31 and len(set(flat.tolist())) == len(flat) == 31 * 32
    where = {int(i): k for k, x in enumerate(g) for i in x}
    apart = sum(where.get(2 * p) != where.get(2 * p + 1) for p in range(500) if 2 * p in where and 2 * p + 1 in where)
    assert apart <= len(g)  # at most one pair cut by each batch boundary
    together = sum(where.get(2 * p) == where.get(2 * p + 1) is not None for p in range(500))
    assert together >= 450  # 500 pairs less the 8 images an epoch leaves out and the pairs cut at the edges
    first = lambda bs: np.mean([len({keys[i][0] for i in x}) for x in bs])
    s = epoch_batches(keys, 32, 1.0, np.random.default_rng([7, 1]), "sorted")
    assert first(s) <= 2.0 < 6.0 < first(g), (first(s), first(g))


def test_clip_shape_probe_reads_every_object_of_the_split(clip_run):
    """benchmarks/clip_shape_probe.py on the tiny CLIP export: one crop per object of the split (the instances table's
    count), each crop the square around its box; the linear probe recovers a planted label and not a shuffled one;
    the prompt separation is the mean off-diagonal cosine of the text embeddings, computed by hand."""
    from PIL import Image

    from benchmarks.clip_shape_probe import linear_probe, objects, probe, prompt_separation, square_crop
    from pipeline.config import load_manifest
    from pipeline.models.clip import encode_texts, load_clip
    from train.job import open_artifact

    out, mp, job, _ = clip_run
    m = load_manifest(mp, [])
    art = open_artifact(m, "samples", "samples")
    split = dict(zip(*(art.read("samples", ["sample_id", "split"]).to_pydict().values())))
    n_val = sum(split[s] == "val" for s in art.read("instances", ["sample_id"]).to_pydict()["sample_id"])
    assert len(objects(m, "samples", "val")) == n_val > 0
    crop = square_crop(Image.new("RGB", (100, 100)), (10, 20, 30, 60))  # 40 px tall: 40 * 1.5 = 60 px square
    assert crop.size == (60, 60)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 5, 300)
    planted = np.eye(5)[y] + 0.1 * rng.normal(size=(300, 5))
    assert linear_probe(planted[:200], y[:200], planted[200:], y[200:]) == 1.0
    assert linear_probe(planted[:200], rng.permutation(y[:200]), planted[200:], y[200:]) < 0.5
    model, _, tok, _ = load_clip(str(Path(out) / "encoders" / "clip"))
    e = encode_texts(model, tok, ["a photo of a circle.", "a photo of a star.", "a photo of a ring."])["text_embed"].numpy()
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    assert prompt_separation(model, tok, ["circle", "star", "ring"]) == pytest.approx(
        (e[0] @ e[1] + e[0] @ e[2] + e[1] @ e[2]) / 3, abs=1e-5)
    r = probe(m, str(Path(out) / "encoders" / "clip"), "samples", "val", probe_train=200)
    assert r["objects"] == n_val and r["zero_shot_crops"]["all"][2] == n_val and r["probe_train"] == 200
