"""``models.sam: clip-pool:<CLIP>`` (pipeline/models/clip_grid.py): the pixels testbed's tangible tokens are a
CLIP's projected patch grid averaged under the ground-truth masks, and I the CLIP's image embedding.

Against a brute force over the grid: a mask that is a union of whole patches (in the processor's resized and
centre-cropped frame, on a non-square image) gets exactly the mean of those patches; a mask covering part of a
patch weighs that patch by the share it covers. Through the stage: the tokens written are those vectors
projected to ``width``, the image feature is the CLIP's image embedding, and the stage refuses the spec
where it would have to propose masks or prompt a decoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch


@pytest.fixture(scope="module")
def enc():
    from pipeline.models.clip_grid import ClipMaskEncoder

    return ClipMaskEncoder("clip-pool:tiny-random")


def _grid_brute(enc, image: np.ndarray) -> np.ndarray:
    from PIL import Image

    from pipeline.models import clip as clip_adapter

    pv = clip_adapter.preprocess_images(enc.processor, [Image.fromarray(image)])
    tokens = clip_adapter.encode_images(enc.clip, pv, project_tokens=True)["patch_tokens"][0].float().numpy()
    return tokens.reshape(enc.g, enc.g, -1)  # [row, col, D]


def test_mask_pool_is_the_coverage_weighted_mean_of_patches(enc):
    rng = np.random.default_rng(1)
    H, W = 64, 96  # landscape: the crop trims the left and right
    image = rng.integers(0, 255, (H, W, 3), dtype=np.uint8)
    grid = _grid_brute(enc, image)
    size, p, g = enc.image_size, enc.patch, enc.g
    s = size / H
    left = (round(W * s) - size) // 2
    assert left > 0
    # masks built in the crop frame at the processor's scale, drawn back at the original size
    assert float(s).is_integer() or (1 / s).is_integer()

    def mask_of_cells(cells):
        m = np.zeros((H, W), bool)
        for r, c in cells:
            x0, y0 = (c * p + left) / s, r * p / s
            m[int(round(y0)) : int(round(y0 + p / s)), int(round(x0)) : int(round(x0 + p / s))] = True
        return m

    sets = [[(0, 0)], [(1, 2), (1, 3), (2, 2)], [(r, c) for r in range(g) for c in range(g)]]
    masks = torch.from_numpy(np.stack([mask_of_cells(c) for c in sets] + [np.zeros((H, W), bool)]))
    e = enc.encode([image])
    assert e.image_features.shape == (1, enc.dim) and e.embeddings.shape == (1, enc.dim, g, g)
    got = enc.mask_pool(e.embeddings, masks, e.input_sizes[0]).numpy()
    want = [grid[[r for r, _ in c], [k for _, k in c]].mean(0) for c in sets]
    np.testing.assert_allclose(got[:3], np.stack(want), rtol=1e-4, atol=1e-5)
    assert np.abs(got[3]).max() == 0  # an empty mask: zeros
    # half of one patch and all of another: weights 0.5 and 1
    half = mask_of_cells([(1, 1)])
    x0 = int(round((1 * p + left) / s))
    half[:, x0 + int(round(p / s / 2)) :] = False
    half |= mask_of_cells([(2, 3)])
    got = enc.mask_pool(e.embeddings, torch.from_numpy(half[None]), e.input_sizes[0]).numpy()[0]
    np.testing.assert_allclose(got, (0.5 * grid[1, 1] + grid[2, 3]) / 1.5, rtol=1e-4, atol=1e-5)


def test_stage_writes_projected_clip_pools_and_refuses_what_it_cannot_do(tmp_path, ray_session):
    from pipeline.io.artifacts import Artifact
    from pipeline.io.wds import iter_shard
    from pipeline.models.segmenter import annotation_masks
    from pipeline.readers.images import open_image
    from pipeline.stage import RunContext, StageError, run_stage
    from pipeline.visual_tokens.project import project
    from tests.conftest import make_manifest

    ov = ["dataset.synthetic.n_images=6", "dataset.synthetic.corrupt_images=0", "models.sam=clip-pool:tiny-random",
          "stages.extract_visual_tokens.segmenter=annotations", "stages.extract_visual_tokens.relations=annotations",
          "stages.extract_visual_tokens.embedding=mask_pool", "stages.extract_visual_tokens.width=24"]
    m = make_manifest(tmp_path, ov)
    run_stage("ingest", RunContext(m))
    summary = run_stage("extract-visual-tokens", RunContext(m))
    assert summary["samples"] == 6 and summary["errors"] == 0
    art = Artifact(tmp_path / "run" / "visual_tokens")
    rec = art.manifest["models"]["sam"]
    assert rec["backend"] == "clip-pool" and rec["random_weights"] is True and rec["clip"]["spec"] == "tiny-random"
    from pipeline.models.clip_grid import ClipMaskEncoder

    enc = ClipMaskEncoder("clip-pool:tiny-random")
    from pipeline.loaders.samples import find_image_root
    from pipeline.loaders.samples import resolve_ref

    root = find_image_root(tmp_path / "run" / "samples", m)
    samples = {r["sample_id"]: r for r in Artifact(tmp_path / "run" / "samples").read("samples").to_pylist()}
    inst = Artifact(tmp_path / "run" / "samples").read("instances").to_pylist()
    checked = 0
    for path in art.files("shards"):
        for s in iter_shard(path):
            meta = s["meta.json"]
            sid = meta["sample_id"]
            image = np.asarray(open_image(resolve_ref(samples[sid]["image"], root)))
            rows = sorted([r for r in inst if r["sample_id"] == sid], key=lambda r: r["instance_id"])
            rows = [r for r in rows if r["instance_id"] in meta["instance_ids"]]
            masks, _ = annotation_masks(rows, *image.shape[:2])
            e = enc.encode([image])
            pooled = enc.mask_pool(e.embeddings, torch.from_numpy(masks), e.input_sizes[0]).numpy()
            np.testing.assert_allclose(s["tangible.npy"].astype(np.float32), project(pooled, 24, 0), rtol=2e-2, atol=2e-2)
            np.testing.assert_allclose(s["image_feature.npy"].astype(np.float32), e.image_features[0], rtol=2e-2, atol=2e-2)
            checked += len(rows)
    assert checked > 0
    for bad in (["stages.extract_visual_tokens.embedding=decoder_token"], ["stages.extract_visual_tokens.segmenter=sam"]):
        with pytest.raises(StageError, match="clip-pool"):
            run_stage("extract-visual-tokens", RunContext(make_manifest(tmp_path / "bad", ov + bad)))


def test_clip_pool_embedding_pools_the_clip_under_the_sams_own_masks(tmp_path, ray_session):
    """``embedding: clip_pool``: SAM proposes the masks (segmenter: sam), the tokens are models.clip's grid pooled
    under the masks the stage wrote and I is the CLIP's image embedding, against the pooling recomputed here; the
    provenance names both models; the embedding info that relation checkpoints are checked against names the CLIP;
    and the spec combinations that cannot work are refused naming the key."""
    from pipeline.io.artifacts import Artifact
    from pipeline.io.wds import iter_shard
    from pipeline.loaders.samples import find_image_root, resolve_ref
    from pipeline.masks import rle_decode
    from pipeline.models.clip_grid import ClipMaskEncoder
    from pipeline.readers.images import open_image
    from pipeline.stage import RunContext, StageError, run_stage
    from pipeline.visual_tokens.project import project
    from tests.conftest import make_manifest

    ov = ["dataset.synthetic.n_images=5", "dataset.synthetic.corrupt_images=0", "models.sam=tiny-random", "models.clip=tiny-random",
          "stages.extract_visual_tokens.segmenter=sam", "stages.extract_visual_tokens.relations=geometric",
          "stages.extract_visual_tokens.embedding=clip_pool", "stages.extract_visual_tokens.width=24",
          "stages.extract_visual_tokens.points_per_side=4", "stages.extract_visual_tokens.points_per_batch=8",
          # a random SAM's predicted IoU / stability mean nothing: keep every mask
          "stages.extract_visual_tokens.pred_iou_thresh=-100", "stages.extract_visual_tokens.stability_score_thresh=0",
          "stages.extract_visual_tokens.score_threshold=-100"]
    m = make_manifest(tmp_path, ov)
    run_stage("ingest", RunContext(m))
    summary = run_stage("extract-visual-tokens", RunContext(m))
    assert summary["samples"] == 5 and summary["errors"] == 0
    art = Artifact(tmp_path / "run" / "visual_tokens")
    recs = art.manifest["models"]
    assert recs["sam"]["spec"] == "tiny-random" and recs["features"]["backend"] == "clip-pool"
    assert recs["features"]["clip"]["spec"] == "tiny-random"
    emb = art.manifest["embedding"]
    assert emb["embedding"] == "clip_pool" and emb["features"] == "clip-pool:tiny-random" and emb["segmenter_feature"] == "clip-pool"
    enc = ClipMaskEncoder("clip-pool:tiny-random")
    assert art.manifest["dims"]["image_feature"] == enc.dim
    root = find_image_root(tmp_path / "run" / "samples", m)
    samples = {r["sample_id"]: r for r in Artifact(tmp_path / "run" / "samples").read("samples").to_pylist()}
    checked = 0
    for path in art.files("shards"):
        for s in iter_shard(path):
            meta = s["meta.json"]
            image = np.asarray(open_image(resolve_ref(samples[meta["sample_id"]]["image"], root)))
            masks = np.stack([rle_decode(r) for r in s["masks.json"]]) if s["masks.json"] else np.zeros((0, *image.shape[:2]), bool)
            assert set(meta["instance_ids"]) <= {-1}  # proposed by SAM, not the annotations
            e = enc.encode([image])
            np.testing.assert_allclose(s["image_feature.npy"].astype(np.float32), e.image_features[0], rtol=2e-2, atol=2e-2)
            if len(masks):
                pooled = enc.mask_pool(e.embeddings, torch.from_numpy(masks), e.input_sizes[0]).numpy()
                np.testing.assert_allclose(s["tangible.npy"].astype(np.float32), project(pooled, 24, 0), rtol=2e-2, atol=2e-2)
            checked += len(masks)
    assert checked > 0
    bad = [(["models.sam=clip-pool:tiny-random"], "clip-pool"), (["models.sam=scene-oracle"], "clip_pool")]
    for extra, match in bad:
        with pytest.raises(StageError, match=match):
            run_stage("extract-visual-tokens", RunContext(make_manifest(tmp_path / "bad", ov + extra)))


def test_clip_pool_on_the_annotations_equals_the_clip_pool_sam_spec(tmp_path, ray_session):
    """The two spellings of "ground-truth masks, CLIP features" write the same tokens: ``embedding: clip_pool`` with
    ``segmenter: annotations`` (no SAM is loaded: models.sam names a folder that does not exist) and the older
    ``models.sam: clip-pool:<CLIP>`` with ``embedding: mask_pool``."""
    from pipeline.io.artifacts import Artifact
    from pipeline.io.wds import iter_shard
    from pipeline.stage import RunContext, run_stage
    from tests.conftest import make_manifest

    base = ["dataset.synthetic.n_images=4", "dataset.synthetic.corrupt_images=0", "models.clip=tiny-random",
            "stages.extract_visual_tokens.segmenter=annotations", "stages.extract_visual_tokens.relations=annotations",
            "stages.extract_visual_tokens.width=24"]
    out = {}
    for name, ov in {"new": ["models.sam=vit_b:/nonexistent/sam.pth", "stages.extract_visual_tokens.embedding=clip_pool"],
                     "old": ["models.sam=clip-pool:tiny-random", "stages.extract_visual_tokens.embedding=mask_pool"]}.items():
        m = make_manifest(tmp_path / name, base + ov)
        run_stage("ingest", RunContext(m))
        assert run_stage("extract-visual-tokens", RunContext(m))["errors"] == 0
        art = Artifact(tmp_path / name / "run" / "visual_tokens")
        out[name] = {s["meta.json"]["sample_id"]: s for p in art.files("shards") for s in iter_shard(p)}
    assert out["new"].keys() == out["old"].keys() and len(out["new"]) == 4
    for sid, s in out["new"].items():
        for f in ("tangible.npy", "image_feature.npy", "boxes.npy"):
            np.testing.assert_array_equal(s[f], out["old"][sid][f])
