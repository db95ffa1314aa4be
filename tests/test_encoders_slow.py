"""The pixels testbed, reduced (a few minutes): a CLIP trained from pixels on the pretraining corpus's training split
(manifest ``corpus:``, never a testbed image) learns what the generated scenes hold (held-out zero-shot colour and
retrieval on the corpus's own held-out split above chance by their 95% intervals), and `extract-clip-tokens`, pointed
at the exported folder through ``{output}`` in manifests/pixels-gt.yaml, writes for the testbed's images exactly the
embeddings plain ``CLIPModel.from_pretrained`` computes from the folder; a masked LM trained on the corpus's
training captions beats the unigram prior on its held-out captions, and `negative-captions` on its export proposes
context-preserving negatives (a shape noun's MLM probability goes to shape words more than a random MLM's does)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.testbed_reduced import run_stages, train_run

pytestmark = [pytest.mark.slow, pytest.mark.heavy]

REPO = Path(__file__).resolve().parents[1]
# held out: the reduced corpus's val + test (80 images; manifests/pixels-gt.yaml reports its test split only). Zero-shot
# shape is not asserted: not above chance in any reduced setting tried on a 2000-image corpus (docs/jobs/encoders.md, "What
# was tried": 300 steps of width 64 at 64 px / 8 px and 128 px / 16 px patches, 33.5% and 31.5% against chance 29.5%,
# the 95% intervals' lower bounds 27.3 and 25.5)
SMALL_MLM = dict(width=64, layers=2, heads=2, batch_size=32, max_steps=300, lr=2e-3, eval_splits=["val", "test"])
SMALL_CLIP = dict(image_size=32, patch_size=8, vision_width=64, vision_layers=2, text_width=64, text_layers=1, heads=2,
                  projection_dim=64, batch_size=32, max_steps=250, lr=1e-3, eval_splits=["val", "test"])


def pixels_manifest(tmp_path: Path, n_images: int = 400) -> Path:
    """manifests/pixels-gt.yaml with ``n_images`` testbed images (held-out 0.4) and as many corpus images (held-out 0.2)
    under ``tmp_path``, its benchmarks left out."""
    m = yaml.safe_load((REPO / "manifests" / "pixels-gt.yaml").read_text())
    m["output"] = str(tmp_path / "pixels")
    m["ray"] = {"address": None, "num_cpus": 2, "object_store_memory": 134217728}
    m["dataset"]["synthetic"]["n_images"] = n_images
    m["corpus"]["n_images"] = n_images
    m["eval"] = {"benchmarks": []}
    m["train"]["clip_encoder"] = {**m["train"]["clip_encoder"], **SMALL_CLIP}  # samples_artifact: corpus/samples kept
    m["train"]["mlm_encoder"] = {**m["train"]["mlm_encoder"], **SMALL_MLM}
    path = tmp_path / "pixels-small.yaml"
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    return path


def _ingest_both(mp: Path) -> None:
    """The testbed and the corpus ingested (``pipeline run ingest`` and ``--corpus``); they share no image."""
    from pipeline.config import corpus_manifest, load_manifest
    from pipeline.stage import RunContext, run_stage
    from train.encoders import images_in_common

    m = load_manifest(mp, [])
    run_stage("ingest", RunContext(m))
    run_stage("ingest", RunContext(corpus_manifest(m)))
    common = images_in_common(m, "samples", "corpus/samples")
    assert common["ids"] == [] and common["pixels"] == [] and min(common["n"]) > 0, common


def test_clip_from_pixels_learns_and_the_stage_reads_its_export(tmp_path, ray_session):
    from transformers import AutoProcessor, CLIPModel

    from pipeline.config import load_manifest
    from pipeline.loaders.clip_tokens import read_shard, shard_paths
    from pipeline.readers.images import open_image
    from train.encoders import load_corpus

    mp = pixels_manifest(tmp_path)
    m = yaml.safe_load(mp.read_text())
    _ingest_both(mp)
    rows, wall = train_run(mp, "clip-encoder", tmp_path / "clip")
    out = Path(m["output"])
    trained = json.loads((out / "encoders" / "clip" / "training.json").read_text())["trained_on"]
    assert trained["samples_artifact"] == "corpus/samples" and trained["images"] == 320, trained  # the corpus's train split
    for metric in ("zeroshot_colour", "i2t_R@1"):
        r = rows[("clip-encoder", "held_out", metric)]
        assert r["ci_low"] > r["chance"], (metric, r)

    run_stages(mp, ["extract-clip-tokens"])
    man = json.loads((out / "clip_tokens" / "_manifest.json").read_text())
    assert man["models"]["clip"]["random_weights"] is False and man["models"]["clip"]["spec"] == str(out / "encoders" / "clip")
    # the reference: plain transformers on the exported folder, on the first 32 testbed images (never trained on)
    testbed = load_corpus(load_manifest(mp, []), "samples")
    model, proc = CLIPModel.from_pretrained(out / "encoders" / "clip").eval(), AutoProcessor.from_pretrained(out / "encoders" / "clip")
    import torch

    with torch.no_grad():
        pv = proc(images=[open_image(r) for r in testbed.images[:32]], return_tensors="pt")["pixel_values"]
        ref = model.get_image_features(pixel_values=pv)
    ref = getattr(ref, "pooler_output", ref).numpy()
    want = dict(zip(testbed.sample_ids[:32].tolist(), ref))
    seen = 0
    for p in shard_paths(out / "clip_tokens"):
        for s in read_shard(p, fields=("image_embed",)):
            if s["sample_id"] in want:
                a, b = np.asarray(s["image_embed"], np.float32), want[s["sample_id"]]
                assert float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) >= 0.9999
                seen += 1
    assert seen == len(want) > 0


def test_mlm_from_captions_learns_and_negative_captions_reads_its_export(tmp_path, ray_session):
    """Calibration (2026-11-27, this reduced manifest, seed 0): held-out masked-token accuracy (see the assert's
    message) well above the unigram prior; on the full pixels testbed the shape share of p is 0.519 against 0.249
    of the candidates (tiny-random's MLM: 0.372 against 0.365, runs/testbed)."""
    mp = pixels_manifest(tmp_path)
    out = Path(yaml.safe_load(mp.read_text())["output"])
    _ingest_both(mp)
    rows, wall = train_run(mp, "mlm-encoder", tmp_path / "mlm")
    assert json.loads((tmp_path / "mlm" / "config.json").read_text())["samples_artifact"] == "corpus/samples"
    r = rows[("mlm-encoder", "held_out", "masked_token_acc")]
    assert r["ci_low"] > r["chance"], r
    run_stages(mp, ["negative-captions"])
    man = json.loads((out / "negatives" / "_manifest.json").read_text())
    assert man["models"]["mlm"]["random_weights"] is False and man["models"]["mlm"]["spec"] == str(out / "encoders" / "mlm")
    from benchmarks.negatives_context import shape_mass

    r = shape_mass(out / "negatives")
    assert r["mass"] > r["share"] + 0.1, r
