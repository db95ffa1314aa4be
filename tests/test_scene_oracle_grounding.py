"""scene-oracle in the stages infoground reads: the negatives miner's word and in-context negative
features are the oracle's span vectors, the oracle is refused as a masked LM, extract-regions
refuses it off the generated dataset or without ground-truth boxes, and the infoground control's
region permutation is a seeded permutation of the training images."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest


def test_miner_features_are_the_oracles_span_vectors():
    from pipeline.models.mlm import SpanEncoder, load_mlm, load_word_encoder
    from pipeline.models.spacy_tagger import Tagger
    from pipeline.negatives.core import MinerOptions, NegativeMiner

    we = load_word_encoder("scene-oracle")
    assert isinstance(we, SpanEncoder) and we.record["testbed_instrument"] is True
    miner = NegativeMiner(load_mlm("tiny-random"), we, MinerOptions(keep=5, top_k=8, negative_feature_k=5,
                                                                      include_propn=True))
    caps = [(0, 1, "A red circle left of a blue square."), (1, 2, "The small green star.")]
    res = miner.mine(caps, Tagger().tag([c[2] for c in caps]))
    o = we.oracle
    for r in res:
        assert len(r.words) and r.features.shape == (len(r.words), o.d_t)
        for w, f in zip(r.words, r.features):
            np.testing.assert_allclose(f, o.span_vector(r.text, w.start, w.end), rtol=1e-6)
        for n in r.nouns:
            assert n.neg_features.shape == (len(n.candidates[:5]), o.d_t) and n.neg_valid.all()
            c = n.candidates[0]
            text = r.text[: n.word.start] + c + r.text[n.word.end:]
            np.testing.assert_allclose(n.neg_features[0], o.span_vector(text, n.word.start, n.word.start + len(c)), rtol=1e-6)
    # the binding lives in the features: "circle" after "red" differs from "circle" after "blue"
    assert not np.allclose(o.span_vector("a red circle", 6, 12), o.span_vector("a blue circle", 7, 13))


def test_oracle_is_no_masked_lm():
    from pipeline.models.mlm import load_mlm

    with pytest.raises(ValueError, match="not a masked LM"):
        load_mlm("scene-oracle")


def test_extract_regions_refuses_the_oracle_off_the_testbed(tmp_path):
    from pipeline.config import load_manifest
    from pipeline.errors import StageError
    from pipeline.stages import extract_regions

    for sets, match in ((["dataset.kind=coco"], "dataset.kind is 'coco'"),
                        ([], "backend: annotations")):
        m = load_manifest(None, [f"output={tmp_path}", "models.detector=scene-oracle", *sets])
        ctx = SimpleNamespace(manifest=m)
        with pytest.raises(StageError, match=match):
            extract_regions.run(ctx, extract_regions.Config(backend="detector"))


def test_control_permutes_the_training_images():
    from train.jobs.infoground.batches import shuffled_regions

    ids = [5, 3, 9, 1, 7, 11]
    a, b = shuffled_regions(ids, 0), shuffled_regions(list(reversed(ids)), 0)
    assert a == b and sorted(a) == sorted(ids) and sorted(a.values()) == sorted(ids)
    assert any(k != v for k, v in a.items()) and a != shuffled_regions(ids, 1)
