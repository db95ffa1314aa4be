"""extract-visual-tokens with the testbed instrument (``models.sam: scene-oracle``,
``models.predicate_encoder: scene-oracle``): each tangible token is the oracle's object vector of
its ground-truth instance (seeded noise, projected to the width), the image feature the oracle's
pooled scene embedding, each intangible token a fixed vector per predicate name; provenance says
testbed instrument; the oracle needs the ground-truth segmenter."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.io.artifacts import Artifact
from pipeline.loaders.visual_tokens import iter_samples
from pipeline.models.relations import PredicateEncoder, oracle_predicate_vectors
from pipeline.models.scene_oracle import SceneOracle, objects_of
from pipeline.models.segmenter import OracleSegmenter
from pipeline.stage import RunContext, StageError, run_stage
from pipeline.visual_tokens.project import project
from tests.conftest import make_manifest

ORACLE = ["models.sam=scene-oracle", "models.predicate_encoder=scene-oracle", "dataset.synthetic.corrupt_images=0",
          "dataset.synthetic.empty_captions=0", "dataset.synthetic.n_images=24", "stages.ingest.shard_size=12",
          "stages.extract_visual_tokens.shard_size=12", "stages.extract_visual_tokens.width=48"]


def _scene(colour_a, shape_a, colour_b, shape_b):
    rows = [{"instance_id": 11, "category": shape_a, "box": [2.0, 2.0, 10.0, 10.0], "mask_rle": None},
            {"instance_id": 12, "category": shape_b, "box": [20.0, 4.0, 30.0, 14.0], "mask_rle": None}]
    scene = [{"instance_id": 12, "category": shape_b, "box": [20.0, 4.0, 30.0, 14.0], "attributes": {"color": colour_b}},
             {"instance_id": 11, "category": shape_a, "box": [2.0, 2.0, 10.0, 10.0], "attributes": {"color": colour_a}}]
    return rows, scene


def test_oracle_segmenter_tokens_are_object_vectors():
    o = SceneOracle()
    seg = OracleSegmenter(width=48, seed=3)
    im = np.zeros((32, 40, 3), np.uint8)
    rows, scene = _scene("red", "circle", "blue", "square")
    (s,) = seg.segment([im], [rows], scenes=[scene], sample_ids=[7])
    assert s.instance_ids.tolist() == [11, 12] and s.masks.shape == (2, 32, 40) and s.masks[0, 2:10, 2:10].all()
    objs = objects_of(sorted(scene, key=lambda r: r["instance_id"]))
    want = project(o.object_vectors(objs, o.sample_rng(7)), 48, 3)
    np.testing.assert_allclose(s.embeddings, want, rtol=1e-6)
    np.testing.assert_allclose(s.image_feature, o.image(objs, 40.0, 32.0, 7)[1], rtol=1e-6)
    # the same objects in another image: the same vectors up to the noise; other objects: far
    (t,) = seg.segment([im], [rows], scenes=[_scene("red", "circle", "green", "star")[1]], sample_ids=[8])
    near = np.linalg.norm(s.embeddings[0] - t.embeddings[0])
    far = np.linalg.norm(s.embeddings[1] - t.embeddings[1])
    assert near < far
    with pytest.raises(ValueError, match="scene rows"):
        seg.segment([im], [rows])


def test_oracle_predicate_vectors_fixed_per_name():
    names = ["left of", "over", "in front of"]
    v = PredicateEncoder("scene-oracle", 48).encode(names)
    assert v.shape == (3, 48)
    np.testing.assert_array_equal(v[1], oracle_predicate_vectors(["over"], 48)[0])
    cos = (v @ v.T) / np.outer(np.linalg.norm(v, axis=1), np.linalg.norm(v, axis=1))
    assert np.abs(cos - np.eye(3)).max() < 0.6


def test_stage_writes_oracle_tokens(tmp_path, ray_session):
    m = make_manifest(tmp_path, ORACLE)
    run_stage("ingest", RunContext(m))
    run_stage("extract-visual-tokens", RunContext(m))
    art = Artifact(f"{m.output}/visual_tokens")
    man = art.manifest
    assert man["models"]["sam"]["testbed_instrument"] is True and man["models"]["sam"]["spec"] == "scene-oracle"
    assert man["models"]["predicate_encoder"]["testbed_instrument"] is True
    assert man["embedding"]["segmenter_feature"] == "scene-oracle"
    samples = Artifact(f"{m.output}/samples")
    inst = samples.read("instances", ["sample_id", "instance_id", "category", "box", "attributes"]).to_pylist()
    o = SceneOracle()
    n = 0
    for f in art.files("shards"):
        for s in iter_samples(f):
            meta = s["meta.json"]
            rows = sorted((r for r in inst if r["sample_id"] == meta["sample_id"]), key=lambda r: r["instance_id"])
            assert meta["instance_ids"] == [r["instance_id"] for r in rows]
            if not rows:
                continue
            want = project(o.object_vectors(objects_of(rows), o.sample_rng(meta["sample_id"])), 48, 0)
            np.testing.assert_allclose(s["tangible.npy"].astype(np.float32), want, atol=2e-3)
            np.testing.assert_allclose(s["intangible.npy"].astype(np.float32),
                                       oracle_predicate_vectors(meta["predicates"], 48), atol=2e-3)
            assert s["image_feature.npy"].shape == (o.proj,)
            n += 1
    assert n >= 20
    m2 = make_manifest(tmp_path, ORACLE + ["stages.extract_visual_tokens.segmenter=sam"])
    with pytest.raises(StageError, match="segmenter: annotations"):
        run_stage("extract-visual-tokens", RunContext(m2))
