"""extract-regions: detector boxes equal torchvision's standard inference, ROI features equal an
independent re-pooling (FPN level rule + roi_align + box head) of the stored boxes; annotations
backend; stage on Ray with the synthetic dataset (slow)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.io.artifacts import Artifact
from pipeline.io.wds import iter_shard
from tests.test_clip_tokens import folder_records, make_image_folder


def run_in_process(out_dir, records, backend="detector", shard_size=3):
    from pipeline.io.artifacts import ArtifactWriter
    from pipeline.stages import extract_regions as st
    from pipeline.stages._image_units import image_units

    worker = st.RegionWorker("tiny-random", "cpu", 1, 1, backend, 30, None, None)
    writer = ArtifactWriter(out_dir, "regions", st.NAME, {"backend": backend}, models={"detector": worker.det.record})
    names = []
    for name, unit_input, payload in image_units(records, shard_size):
        fp = writer.unit_fingerprint(name, unit_input)
        worker(dict(payload, artifact_dir=str(writer.dir), stage=st.NAME, unit=name, fingerprint=fp))
        names.append(name)
    writer.finalize(names, schema=st.SCHEMA)
    return Artifact(writer.dir), worker.det


def reference_pool(det, image, boxes_orig: np.ndarray) -> np.ndarray:
    """Box-head features of boxes (original pixels), pooled without MultiScaleRoIAlign: FPN
    level by Eq. 1 of the FPN paper (k = floor(4 + log2(sqrt(wh)/224)), clamped), roi_align on
    that level at its stride."""
    import torchvision.transforms.functional as TF
    from torchvision.ops import roi_align

    model = det.model
    with torch.no_grad():
        t = TF.to_tensor(image)
        il, _ = model.transform([t])
        feats = model.backbone(il.tensors)
        pool = model.roi_heads.box_roi_pool
        maps = [v for k, v in feats.items() if k in pool.featmap_names]  # as MultiScaleRoIAlign filters
        h, w = il.image_sizes[0]
        sy, sx = h / t.shape[-2], w / t.shape[-1]
        b = torch.as_tensor(boxes_orig, dtype=torch.float32) * torch.tensor([sx, sy, sx, sy])
        scales = [2.0 ** round(math.log2(m.shape[-2] / h)) for m in maps]
        k_min, k_max = -math.log2(scales[0]), -math.log2(scales[-1])
        out = torch.zeros((len(b), maps[0].shape[1], *pool.output_size))
        area = ((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])).sqrt()
        lvl = torch.clamp(torch.floor(4 + torch.log2(area / 224) + 1e-6), k_min, k_max).long() - int(k_min)
        for i in range(len(b)):
            level = int(lvl[i])
            out[i] = roi_align(maps[level], [b[i : i + 1]], pool.output_size, scales[level], pool.sampling_ratio)[0]
        return model.roi_heads.box_head(out).numpy()


@pytest.fixture(scope="module")
def detector_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("regions")
    records = folder_records(make_image_folder(tmp / "imgs"))
    art, det = run_in_process(tmp / "out", records)
    return records, art, det


def test_detections_match_torchvision_and_features_repool(detector_run):
    import torchvision.transforms.functional as TF

    from pipeline.readers.images import open_image

    records, art, det = detector_run
    stored = {int(s["__key__"]): s for p in art.files("shards") for s in iter_shard(p)}
    good = [r for r in records if not r["image"].endswith("f.jpg")]
    assert sorted(stored) == [r["sample_id"] for r in good]
    assert [e["reason"] for e in art.errors().to_pylist()] == ["unreadable_image"]
    for r in good:
        s = stored[r["sample_id"]]
        img = open_image(r["image"])
        assert s["image_size.npy"].tolist() == list(img.size)
        n = len(s["boxes.npy"])
        assert 0 < n <= 30 and s["features.npy"].shape == (n, det.dim) and s["features.npy"].dtype == np.float16
        assert s["boxes.npy"].dtype == np.float32 and s["labels.npy"].dtype == np.int64
        with torch.no_grad():
            ref = det.model([TF.to_tensor(img)])[0]  # torchvision's standard inference path
        np.testing.assert_allclose(s["boxes.npy"], ref["boxes"][:n].numpy(), rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(s["scores.npy"], ref["scores"][:n].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(s["labels.npy"], ref["labels"][:n].numpy())
        assert (np.diff(s["scores.npy"]) <= 0).all()
        assert (s["boxes.npy"][:, 2] <= img.size[0] + 1e-3).all() and (s["boxes.npy"][:, 3] <= img.size[1] + 1e-3).all()
        feats = reference_pool(det, img, s["boxes.npy"])
        np.testing.assert_allclose(s["features.npy"].astype(np.float32), feats, rtol=1e-2, atol=1e-2)
        # and the features tell boxes apart: a shuffled assignment does not match
        if n > 1 and not np.allclose(feats[0], feats[-1], atol=1e-2):
            assert not np.allclose(s["features.npy"][0].astype(np.float32), feats[-1], rtol=1e-2, atol=1e-2)


def test_annotations_backend_pools_ground_truth(tmp_path):
    from pipeline.readers.images import open_image

    records = folder_records(make_image_folder(tmp_path / "imgs"))[:3]
    rng = np.random.default_rng(0)
    for r in records:
        w, h = open_image(r["image"]).size
        k = int(r["sample_id"])  # 0, 1, 2 boxes
        x0 = rng.uniform(0, w / 2, k)
        y0 = rng.uniform(0, h / 2, k)
        boxes = np.stack([x0, y0, x0 + rng.uniform(4, w / 2, k), y0 + rng.uniform(4, h / 2, k)], 1).astype(np.float32).reshape(-1, 4)
        r["instances"] = {"instance_ids": list(range(100, 100 + k)), "boxes": boxes.tolist(), "categories": ["cube", "ball"][:k]}
    art, det = run_in_process(tmp_path / "out", records, backend="annotations")
    stored = {int(s["__key__"]): s for p in art.files("shards") for s in iter_shard(p)}
    assert sorted(stored) == [0, 1, 2]
    for r in records:
        s = stored[r["sample_id"]]
        k = r["sample_id"]
        assert s["boxes.npy"].shape == (k, 4) and s["features.npy"].shape == (k, det.dim)
        np.testing.assert_allclose(s["boxes.npy"], np.array(r["instances"]["boxes"], np.float32).reshape(-1, 4))
        assert s["instance_ids.npy"].tolist() == r["instances"]["instance_ids"]
        assert s["categories.json"] == r["instances"]["categories"]
        assert (s["scores.npy"] == 1).all() and (s["labels.npy"] == -1).all()
        if k:
            feats = reference_pool(det, open_image(r["image"]), s["boxes.npy"])
            np.testing.assert_allclose(s["features.npy"].astype(np.float32), feats, rtol=1e-2, atol=1e-2)


def test_detector_spec_errors():
    from pipeline.models.detector import load_detector, parse_spec

    assert parse_spec("torchvision:fasterrcnn_resnet50_fpn_v2:/w.pth") == ("torchvision", "fasterrcnn_resnet50_fpn_v2", "/w.pth")
    with pytest.raises(ValueError):
        parse_spec("yolo:v8")
    with pytest.raises(ValueError):
        load_detector("torchvision:resnet50:random")


@pytest.mark.slow
def test_stage_on_ray_synthetic_both_backends(tmp_path, ray_session):
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    ov = ["ray.actors=1", "dataset.synthetic.n_images=6", "dataset.synthetic.corrupt_images=0", "dataset.synthetic.empty_captions=0"]
    m = make_manifest(tmp_path, ov)
    run_stage("ingest", RunContext(m))
    s1 = run_stage("extract-regions", RunContext(m))
    assert s1["samples"] == 6 and s1["boxes"] > 0
    art = Artifact(tmp_path / "run" / "regions")
    assert art.manifest["random_weights"] == ["detector"]
    markers = {p.name: p.stat().st_mtime_ns for p in (art.dir / "_state").glob("*.json")}
    run_stage("extract-regions", RunContext(m))
    assert {p.name: p.stat().st_mtime_ns for p in (art.dir / "_state").glob("*.json")} == markers
    m2 = make_manifest(tmp_path, ov + ["stages.extract_regions.backend=annotations"])
    s2 = run_stage("extract-regions", RunContext(m2))
    inst = Artifact(tmp_path / "run" / "samples").read("instances").to_pylist()
    assert s2["boxes"] == sum(1 for _ in inst)


def test_clip_pool_box_is_the_mean_of_the_patches_it_covers(tmp_path):
    """clip-pool: a box on patch borders (in the processor's resized, centre-cropped frame) gets
    exactly the mean of the CLIP's projected patch tokens it covers (brute force over the grid),
    on a non-square image (the crop offset is part of the mapping); it cannot propose boxes."""
    from PIL import Image

    from pipeline.models import clip as clip_adapter
    from pipeline.models.detector import load_detector, parse_spec, proposes_boxes

    det = load_detector("clip-pool:tiny-random")
    assert parse_spec("clip-pool:/m/clip") == ("clip-pool", None, "/m/clip") and not proposes_boxes("clip-pool:x")
    with pytest.raises(ValueError, match="clip-pool:<CLIP"):
        parse_spec("clip-pool:")
    grid = det.grid
    assert det.record["random_weights"] and det.record["backend"] == "clip-pool" and det.dim == grid.clip.config.projection_dim
    rng = np.random.default_rng(0)
    W, H = 96, 64  # shortest side 64 -> scale s = size / 64, crop offset left = (96 s - size) / 2
    im = Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8))
    size, p, g = grid.image_size, grid.patch, grid.g
    s = size / H
    left = (round(W * s) - size) // 2
    tokens = clip_adapter.encode_images(grid.clip, clip_adapter.preprocess_images(grid.processor, [im]), project_tokens=True)
    want_grid = tokens["patch_tokens"][0].float().numpy().reshape(g, g, -1)  # row-major: [row, col, D]
    cells = [(0, 0, 1, 1), (1, 0, 3, 2), (0, 0, g, g), (g - 2, 1, g, g)]  # (row0, col0, row1, col1)
    boxes = np.array([[(c0 * p + left) / s, r0 * p / s, (c1 * p + left) / s, r1 * p / s] for r0, c0, r1, c1 in cells], np.float32)
    got = det.pool([im], [boxes])[0]
    want = np.stack([want_grid[r0:r1, c0:c1].reshape(-1, want_grid.shape[-1]).mean(0) for r0, c0, r1, c1 in cells])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(got[0], got[1], atol=1e-3)
    assert det.pool([im], [np.zeros((0, 4), np.float32)])[0].shape == (0, det.dim)
    with pytest.raises(ValueError, match="backend: annotations"):
        det.detect([im])
