"""sam-segmenter, reduced (a few minutes): trained through `train run sam-segmenter` on a small generated corpus,
exported, loaded by pipeline.models.sam.load_sam as trained (not random), then run by the real stages on the
testbed's images: extract-visual-tokens with ``segmenter: sam`` stores exactly the masks SamModel.generate gives
for the image, and extract-regions with ``backend: sam`` stores exactly those masks' boxes.

Expectation fixed before running (what the reduced setting provably achieves, not a quality bar: the full run's
numbers are in BENCHMARKS.md): 20 training images (the manifest's twins: 12 pairs, split by pair), 60 steps of 4, so
the model can only begin to fit its training masks; asserted are the training loss falling (the last logged below
the first), the export loading with every tensor equal (export_max_abs_weight_diff 0), the held-out evaluation's
accounting (it scored every ground-truth instance of the first ``eval_images`` held-out images, counted here from the
samples artifact; each recall is a whole number of those instances; the paired difference is the two recalls'
difference; each interval holds its value), and the stages' outputs equal to the direct path (every AMG option
the manifest sets), with AMG filters off so that there are masks to compare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(1800)]  # 600 s hit at load ~30 on 2 cores (ingests, training, two stages)

REPO = Path(__file__).resolve().parents[1]
AMG_OFF = {"points_per_side": 4, "pred_iou_thresh": 0.0, "stability_score_thresh": 0.0, "score_threshold": -1.0e9}


def _cli(*args, module="pipeline.cli", timeout=900):
    r = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def test_trained_segmenter_through_the_stages(tmp_path):
    m = yaml.safe_load((REPO / "manifests" / "pixels.yaml").read_text())
    m["output"] = str(tmp_path / "p")
    m["ray"] = {"address": None, "num_cpus": 2, "object_store_memory": 134217728}
    m["dataset"]["synthetic"]["n_images"] = 10
    m["corpus"]["n_images"] = 24
    m["corpus"]["heldout"] = 0.5  # twins: 2 -> 12 pairs, split by pair: 20 training images, 4 held out
    m["eval"] = {"benchmarks": []}
    m["models"]["predicate_encoder"] = "tiny-random"     # no CLIP is trained here: the masks and boxes do not use it
    m["models"]["clip"] = "tiny-random"                  # (embedding: clip_pool pools it under SAM's masks)
    m["models"]["detector"] = "clip-pool:tiny-random"
    m["stages"]["extract_visual_tokens"].update(AMG_OFF)
    m["stages"]["extract_visual_tokens"]["relations"] = "geometric"  # the relation encoder: tests/test_relation_encoder_slow.py
    del m["models"]["relation_head"]
    m["train"]["sam_segmenter"].update(max_steps=60, batch_size=4, log_every=10, eval_images=4)
    path = tmp_path / "nogt.yaml"
    path.write_text(yaml.safe_dump(m, sort_keys=False))
    _cli("run", "ingest", "-m", str(path), "--corpus")
    _cli("run", "ingest", "-m", str(path))
    _cli("run", "sam-segmenter", "-m", str(path), "--no-progress", module="train.cli")

    from pipeline.models.sam import SamModel, load_sam

    folder = tmp_path / "p" / "encoders" / "sam"
    _, _, rec = load_sam(str(folder))
    assert rec["random_weights"] is False and rec["trained_here"]["job"] == "sam-segmenter"
    assert rec["trained_here"]["trained_on"]["splits"] == ["train"]
    run = next((tmp_path / "p" / "train" / "sam-segmenter").iterdir())
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in logged if x.get("kind") == "train"]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    res = json.loads((run / "eval" / "final" / "sam_segmenter_metrics.json").read_text())
    assert res["export_max_abs_weight_diff"] == 0.0
    from pipeline.config import load_manifest
    from pipeline.io.artifacts import Artifact

    samples = Artifact(tmp_path / "p" / "corpus" / "samples")
    rows = samples.read("samples").to_pylist()  # the job's order: the artifact's
    held = [r["sample_id"] for r in rows if r["split"] in m["train"]["sam_segmenter"].get("eval_splits", ["val", "test"])]
    assert len(held) >= 4
    n_inst = sum(1 for r in samples.read("instances").to_pylist() if r["sample_id"] in set(held[:4]))
    for prefix in ("mask", "box", "baseline_mask", "baseline_box"):
        assert res[f"{prefix}_images"] == 4 and res[f"{prefix}_instances"] == n_inst > 0, (prefix, res)
        hits = res[f"{prefix}_recall50"] * n_inst / 100
        assert abs(hits - round(hits)) < 1e-6, (prefix, hits)
        lo, hi = res[f"{prefix}_recall50_ci"]
        assert lo <= res[f"{prefix}_recall50"] <= hi
    for prefix in ("mask", "box"):
        d = res[f"{prefix}_recall50_minus_baseline"][0]
        assert abs(d - (res[f"{prefix}_recall50"] - res[f"baseline_{prefix}_recall50"])) < 1e-9

    _cli("run", "extract-visual-tokens", "-m", str(path))
    _cli("run", "extract-regions", "-m", str(path))
    from pipeline.loaders.regions import RegionsReader
    from pipeline.loaders.visual_tokens import iter_samples, shard_paths
    from pipeline.masks import rle_decode
    from pipeline.readers.images import open_image
    from train.encoders import load_corpus
    from pipeline.stages.extract_visual_tokens import amg_options

    man = load_manifest(path)
    corpus = load_corpus(man, "samples")
    sm = SamModel(str(folder))
    regions = RegionsReader(tmp_path / "p" / "regions")
    n_masks = 0
    for p in shard_paths(tmp_path / "p" / "visual_tokens"):
        for s in iter_samples(p):
            sid = int(s["meta.json"]["sample_id"])
            im = np.asarray(open_image(corpus.images[list(corpus.sample_ids).index(sid)]).convert("RGB"))
            enc = sm.encode([im])
            g = sm.generate(enc.embeddings[:1], enc.input_sizes[0], enc.original_sizes[0],
                            **amg_options(man.stages.extract_visual_tokens))  # every AMG option the stages ran
            got = np.stack([rle_decode(r) for r in s["masks.json"]]) if s["masks.json"] else np.zeros((0, *im.shape[:2]), bool)
            assert np.array_equal(got, g["masks"].numpy()), sid
            n_masks += len(got)
            want = g["boxes"].numpy() + np.array([0, 0, 1, 1])
            want = want[np.argsort(-g["scores"].numpy(), kind="stable")][:30]
            assert np.allclose(regions.get(sid)["boxes"], want), sid
    assert n_masks > 0
