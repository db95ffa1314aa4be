"""extract-visual-tokens end to end.

* ``annotations`` segmenter + relations on the generated dataset: stored instances, masks,
  boxes, triplets, 4-NN and ranks equal the ground truth (triplets mapped into PSG by a mapping
  spelled out independently here; 4-NN and ranks from the brute-force reference of
  test_visual_tokens_graph), intangible tokens equal the text encoder's embeddings.
* tiny-random SAM on real image files (greyscale, RGBA, tiny, huge, undecodable), errors.parquet,
  resume after a unit is lost, loader padding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from pipeline.io.artifacts import Artifact
from pipeline.loaders.visual_tokens import TOKEN_PAD, VisualTokenBatches, collate, iter_samples
from pipeline.masks import rle_decode
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest
from tests.test_visual_tokens_graph import ref_graph

# synthetic predicate -> (psg56+left predicate, subject/object swapped), written out independently
# (generated data: predicates auto -> psg56+left, so left/right keep their direction)
EXPECTED_MAP = {
    "left of": ("left of", False),
    "right of": ("left of", True),
    "above": ("over", False),
    "below": ("over", True),
    "in front of": ("in front of", False),
    "behind": ("in front of", True),
}


def _samples(art: Artifact) -> dict[int, dict]:
    return {s["meta.json"]["sample_id"]: s for f in art.files("shards") for s in iter_samples(f)}


@pytest.fixture(scope="module")
def gt_run(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("vt_gt")
    m = make_manifest(
        tmp,
        [
            "dataset.synthetic.n_images=12",
            "dataset.synthetic.max_objects=6",
            "dataset.synthetic.corrupt_images=0",
            "stages.ingest.shard_size=10",
            "stages.extract_visual_tokens.shard_size=6",
            "stages.extract_visual_tokens.segmenter=annotations",
            "stages.extract_visual_tokens.relations=annotations",
        ],
    )
    run_stage("ingest", RunContext(m))
    summary = run_stage("extract-visual-tokens", RunContext(m))
    return m, summary


def test_annotations_match_ground_truth(gt_run):
    m, summary = gt_run
    samples_art = Artifact(f"{m.output}/samples")
    art = Artifact(f"{m.output}/visual_tokens")
    got = _samples(art)
    inst = samples_art.read("instances").to_pylist()
    rels = samples_art.read("relations").to_pylist()
    sids = sorted(r["sample_id"] for r in samples_art.read("samples").to_pylist())
    assert sorted(got) == sids and summary["errors"] == 0
    vocab = art.manifest["predicates"]
    assert len(vocab) == 57 and vocab[0] == "over" and vocab[56] == "left of"
    n_checked_triplets = 0
    for sid in sids:
        s = got[sid]
        meta = s["meta.json"]
        gi = sorted((r for r in inst if r["sample_id"] == sid), key=lambda r: r["instance_id"])
        assert meta["instance_ids"] == [r["instance_id"] for r in gi]
        np.testing.assert_allclose(s["boxes.npy"], np.array([r["box"] for r in gi], np.float32).reshape(-1, 4))
        for rle, r in zip(s["masks.json"], gi):
            np.testing.assert_array_equal(rle_decode(rle), rle_decode(json.loads(r["mask_rle"])))
        # triplets = ground-truth relations mapped into PSG (duplicates merged)
        pos = {r["instance_id"]: k for k, r in enumerate(gi)}
        expected = set()
        for r in rels:
            if r["sample_id"] != sid:
                continue
            name, swap = EXPECTED_MAP[r["predicate"]]
            a, b = pos[r["subject"]], pos[r["object"]]
            expected.add((b, a, name) if swap else (a, b, name))
        names = meta["predicates"]
        stored = {(a, b, names[c]) for a, b, c in s["triplets.npy"].tolist()}
        assert stored == expected
        assert len(stored) == len(s["triplets.npy"])  # no duplicate rows
        assert names == sorted(set(names), key=vocab.index) and [vocab[i] for i in meta["predicate_ids"]] == names
        n_checked_triplets += len(stored)
        # 4-NN and ranks: brute-force reference fed the same graph (ground-truth scores = 1)
        V, C = len(gi), len(vocab)
        S = np.zeros((V, V, C), np.float32)
        for a, b, name in expected:
            S[a, b, vocab.index(name)] = 1.0
        keep, trip, preds, knn, A = ref_graph(np.ones(V), S, s["boxes.npy"])
        assert keep == list(range(V))
        assert s["knn.npy"].tolist() == knn
        np.testing.assert_array_equal(s["ranks.npy"], A)
        assert s["ranks.npy"].shape == (1 + V + len(names),) * 2
        assert s["tangible.npy"].shape == (V, 512) and s["tangible.npy"].dtype == np.float16
        assert s["image_feature.npy"].shape == (art.manifest["dims"]["image_feature"],)
    assert n_checked_triplets > 30


def test_intangible_tokens_are_predicate_text_embeddings(gt_run):
    from pipeline.models.relations import PredicateEncoder

    m, _ = gt_run
    art = Artifact(f"{m.output}/visual_tokens")
    enc = PredicateEncoder("tiny-random", 512).encode(art.manifest["predicates"])
    for s in list(_samples(art).values())[:5]:
        ids = s["meta.json"]["predicate_ids"]
        np.testing.assert_allclose(s["intangible.npy"].astype(np.float32), enc[ids], atol=2e-3, rtol=2e-3)
    assert art.manifest["random_weights"] == ["predicate_encoder", "sam"] or set(art.manifest["random_weights"]) == {"sam", "predicate_encoder"}


def test_loader_pads_tokens_types_ranks(gt_run):
    m, _ = gt_run
    art = Artifact(f"{m.output}/visual_tokens")
    by_id = _samples(art)
    batches = list(VisualTokenBatches(art.dir, batch_size=6, context_length=77, graph=True))
    assert sum(len(b["sample_id"]) for b in batches) == len(by_id)
    b = batches[0]
    assert b["tokens"].shape[1:] == (77, 512) and b["ranks"].shape[1:] == (77, 77)
    for i, sid in enumerate(b["sample_id"].tolist()):
        s = by_id[sid]
        V, U = len(s["tangible.npy"]), len(s["intangible.npy"])
        T = 1 + V + U
        types = b["type_ids"][i].numpy()
        assert types[0] == 0 and (types[1 : 1 + V] == 1).all() and (types[1 + V : T] == 2).all() and (types[T:] == TOKEN_PAD).all()
        np.testing.assert_array_equal(b["tokens"][i, 1 : 1 + V].numpy(), s["tangible.npy"])
        np.testing.assert_array_equal(b["tokens"][i, 1 + V : T].numpy(), s["intangible.npy"])
        assert not b["tokens"][i, 0].any() and not b["tokens"][i, T:].any()
        np.testing.assert_array_equal(b["ranks"][i, :T, :T].numpy(), s["ranks.npy"])
        assert int(b["ranks"][i].sum()) == int(s["ranks.npy"].sum())  # padding all zero
        assert b["pad_mask"][i].sum().item() == 77 - T
        trip = b["triplets"][i].numpy()
        assert trip.shape == s["triplets.npy"].shape
    with pytest.raises(ValueError, match="context_length"):
        collate([by_id[sid] for sid in b["sample_id"].tolist()], context_length=2)


# ------------------------------------------------------------------ SAM on real files, bad images, resume
@pytest.fixture(scope="module")
def sam_run(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("vt_sam")
    m = make_manifest(
        tmp,
        [
            "dataset.synthetic.n_images=9",
            "dataset.synthetic.corrupt_images=1",
            "stages.ingest.verify_images=none",  # let the broken file through to this stage
            "stages.extract_visual_tokens.segmenter=sam",
            "stages.extract_visual_tokens.relations=geometric",
            "stages.extract_visual_tokens.shard_size=3",
            "stages.extract_visual_tokens.batch_size=2",
            "stages.extract_visual_tokens.points_per_side=4",
            "stages.extract_visual_tokens.points_per_batch=8",
            # a random SAM's predicted IoU / stability mean nothing: keep every mask
            "stages.extract_visual_tokens.pred_iou_thresh=-100",
            "stages.extract_visual_tokens.stability_score_thresh=0",
            "stages.extract_visual_tokens.score_threshold=-100",
            "stages.extract_visual_tokens.embedding=mask_pool",
            "stages.extract_visual_tokens.max_pixels=40000",
        ],
    )
    run_stage("ingest", RunContext(m))
    from pipeline.loaders.samples import image_resolver

    resolve = image_resolver(f"{m.output}/samples", m)  # samples.image is relative to the dataset's image root
    samples = sorted(Artifact(f"{m.output}/samples").read("samples").to_pylist(), key=lambda r: r["sample_id"])
    for r in samples:
        r["image"] = resolve(r["image"])
    rng = np.random.default_rng(1)
    kinds = {}
    from pipeline.readers.images import open_image

    def opens(ref):
        try:
            open_image(ref)
            return True
        except Exception:
            return False

    good = [r for r in samples if opens(r["image"])]  # leave the generator's corrupt file alone
    # rewrite some files: greyscale, RGBA, too small, too large (max_pixels 40000)
    for r, (kind, size, mode) in zip(good[1:5], [("grey", (96, 80), "L"), ("rgba", (100, 64), "RGBA"), ("tiny", (5, 40), "RGB"), ("huge", (300, 200), "RGB")]):
        ch = {"L": 1, "RGBA": 4, "RGB": 3}[mode]
        arr = rng.integers(0, 255, (size[1], size[0], ch), dtype=np.uint8)
        Image.fromarray(arr.squeeze(-1) if ch == 1 else arr, mode).save(r["image"], format="PNG")
        kinds[r["sample_id"]] = kind
    summary = run_stage("extract-visual-tokens", RunContext(m))
    return m, summary, kinds


@pytest.mark.slow
def test_sam_end_to_end_and_bad_images(sam_run):
    m, summary, kinds = sam_run
    art = Artifact(f"{m.output}/visual_tokens")
    errors = art.errors().to_pylist()
    reasons = {e["sample_id"]: e["reason"] for e in errors}
    inv = {v: k for k, v in kinds.items()}
    assert reasons[inv["tiny"]] == "image_too_small"
    assert reasons[inv["huge"]] == "image_too_large"
    assert "unreadable_image" in reasons.values()  # the generator's corrupt file
    assert len(errors) == 3
    got = _samples(art)
    assert inv["grey"] in got and inv["rgba"] in got and len(got) == 9 - 3
    assert art.manifest["models"]["sam"]["random_weights"] is True
    total_v = 0
    for sid, s in got.items():
        meta = s["meta.json"]
        V = len(s["tangible.npy"])
        total_v += V
        assert s["boxes.npy"].shape == (V, 4) and len(s["masks.json"]) == V and s["knn.npy"].shape == (V, 4)
        for rle, box in zip(s["masks.json"], s["boxes.npy"]):
            mk = rle_decode(rle)
            assert mk.shape == (meta["height"], meta["width"]) and mk.any()
            ys, xs = np.nonzero(mk)  # SAM boxes are the masks' tight boxes (inclusive max)
            assert [xs.min(), ys.min(), xs.max(), ys.max()] == box.tolist()
        # geometric relations: every ordered pair has exactly one predicate before mapping; left/right
        # both map to `beside`, so at most V (V - 1) triplets
        assert len(s["triplets.npy"]) <= V * (V - 1)
        assert s["ranks.npy"].shape[0] == 1 + V + len(meta["predicates"]) <= 77
    assert total_v > 0
    assert summary["post_over_model"] is not None


@pytest.mark.slow
def test_resume_redoes_only_the_lost_unit(sam_run):
    m, _, _ = sam_run
    art_dir = m.output + "/visual_tokens"
    before = {s["path"]: s["sha256"] for s in Artifact(art_dir).manifest["shards"]}
    import os

    lost = sorted(before)[1]
    unit = os.path.basename(lost).split(".")[0]
    mtimes = {p: os.stat(f"{art_dir}/{p}").st_mtime_ns for p in before if p != lost}
    os.remove(f"{art_dir}/{lost}")  # as if the run was killed while this unit was being written
    os.remove(f"{art_dir}/_state/{unit}.json")
    run_stage("extract-visual-tokens", RunContext(m))
    after = {s["path"]: s["sha256"] for s in Artifact(art_dir).manifest["shards"]}
    assert after == before  # redone unit is byte-identical (deterministic)
    assert {p: os.stat(f"{art_dir}/{p}").st_mtime_ns for p in mtimes} == mtimes  # the others were skipped
