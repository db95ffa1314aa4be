"""negative-captions as a stage: tables, feature shards, errors, loader, resume, noun vocabulary.

The fast tests run the stage's own driver and worker code in-process (``map_units`` replaced by
a local loop, the same calls one Ray actor makes); the slow one runs the demo manifest on Ray.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from pipeline.io.artifacts import Artifact, ArtifactWriter
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest

LONG = "A dog and a cat " * 40 + "near a tree."
SAMPLES = {  # sample_id -> captions (caption ids assigned in order)
    0: ["A man rides a red bike down the street.", "   "],
    1: ["Red and very big.", "Un café près de la tour Eiffel with a naïve dog."],
    2: [LONG],
    3: ["Two kids fly a kite on the beach.", "A woman holds an umbrella in the rain."],
}


def write_samples(out):
    from pipeline.stages.ingest import CAPTIONS_SCHEMA, SAMPLES_SCHEMA

    w = ArtifactWriter(out, "samples", "ingest", {"test": True})
    names, cid = [], 0
    for u, sids in enumerate([[0, 1], [2, 3]]):
        name = f"{u:05d}"
        uw = w.unit_writer(name, w.unit_fingerprint(name, sids))
        samples, caps = [], []
        for s in sids:
            samples.append({"sample_id": s, "source_id": str(s), "image": None, "width": 8, "height": 8, "split": "train"})
            for t in SAMPLES[s]:
                caps.append({"caption_id": cid, "sample_id": s, "text": t})
                cid += 1
        uw.write_table("samples", pa.Table.from_pylist(samples, schema=SAMPLES_SCHEMA))
        uw.write_table("captions", pa.Table.from_pylist(caps, schema=CAPTIONS_SCHEMA))
        uw.commit({"rows": len(samples)})
        names.append(name)
    w.finalize(names)


@pytest.fixture
def local_units(monkeypatch):
    """Run units in-process; records which units ran."""
    ran: list[str] = []
    cache: dict = {}

    def local_map(units, fn, *, ray_cfg=None, actor=False, constructor_kwargs=None, **kw):
        if actor:
            key = json.dumps(constructor_kwargs, sort_keys=True, default=str)
            if key not in cache:
                cache[key] = fn(**(constructor_kwargs or {}))
            fn = cache[key]
        for u in units:
            ran.append(u.get("unit", "task"))
            yield json.loads(json.dumps(fn(json.loads(json.dumps(u)))))

    import pipeline.runtime
    import pipeline.stage

    monkeypatch.setattr(pipeline.stage, "map_units", local_map)
    monkeypatch.setattr(pipeline.runtime, "map_units", local_map)
    monkeypatch.setattr(pipeline.stage, "ensure_ray", lambda cfg: {})
    return ran


OV = [
    "models.mlm=tiny-random",
    "models.word_encoder=tiny-random",
    "stages.negative_captions.shard_size=1",
    "stages.negative_captions.max_tokens=32",
    "stages.negative_captions.negative_feature_k=3",
    "stages.negative_captions.negative_features=all",
]


@pytest.fixture
def stage_run(tmp_path, local_units):
    m = make_manifest(tmp_path, OV)
    write_samples(m.output)
    summary = run_stage("negative-captions", RunContext(m))
    return m, summary, Artifact(tmp_path / "run" / "negatives"), local_units


def test_tables_shards_errors_and_loader(stage_run):
    from pipeline.loaders.negatives import NegativesReader, load_word_features, pick_nouns

    m, summary, art, ran = stage_run
    assert len(ran) == 4 and summary["captions"] == 7
    errs = {(e["caption_id"], e["reason"]) for e in art.errors().to_pylist()}
    assert errs == {(1, "empty_caption"), (2, "no_noun"), (4, "caption_truncated")}
    err = next(e for e in art.errors().to_pylist() if e["reason"] == "empty_caption")
    assert err["sample_id"] == 0
    assert art.manifest["random_weights"] == ["mlm", "word_encoder"]
    assert art.manifest["feature_dim"] == 32

    reader = NegativesReader(art.dir)
    neg, words = reader.negatives(), reader.words()
    texts = {cid: t for cid, t in enumerate(t for s in sorted(SAMPLES) for t in SAMPLES[s])}
    for r in neg.iter_rows(named=True):
        assert texts[r["caption_id"]][r["start"] : r["end"]] == r["noun"]
        assert len(r["candidates"]) == 25 and len(r["rejected"]) == 5
        assert r["noun"].lower() not in r["candidates"]
        np.testing.assert_allclose(r["score"], np.array(r["p"]) / np.array(r["q"]), rtol=1e-9)
        assert r["feature_row"] >= 0
    assert {"man", "bike", "street", "dog", "kids", "kite", "beach", "woman", "umbrella", "rain"} <= set(neg["noun"])
    assert "tree" not in set(neg.filter(neg["caption_id"] == 4)["noun"])  # truncated away
    feats = load_word_features(art.dir)
    assert set(feats) == {0, 1, 2, 3}
    for sid, f in feats.items():
        assert f.word_features.dtype == np.float16 and f.word_features.shape[1] == 32
        ws = words.filter(words["sample_id"] == sid)
        assert len(ws) == len(f.word_caption_id)
        np.testing.assert_array_equal(ws["feature_row"].to_numpy(), np.arange(len(ws)))
        np.testing.assert_array_equal(ws["caption_id"].to_numpy(), f.word_caption_id)
        np.testing.assert_array_equal(ws["word_index"].to_numpy(), f.word_index)
        ns = neg.filter(neg["sample_id"] == sid)
        if len(ns):
            assert f.neg_features.shape == (len(ns), 3, 32) and f.neg_features.dtype == np.float16
            np.testing.assert_array_equal(ns["feature_row"].to_numpy(), np.arange(len(ns)))
            np.testing.assert_array_equal(ns["word_index"].to_numpy(), f.neg_word_index)
            assert (f.neg_count == 3).all() and f.neg_valid.all()
    # random access == streaming
    g = reader.get(3)
    np.testing.assert_array_equal(g.word_features, feats[3].word_features)
    np.testing.assert_array_equal(g.neg_features, feats[3].neg_features)
    assert reader.get(99) is None
    # stored features == the miner's, to fp16 precision
    from pipeline.models.mlm import load_mlm
    from pipeline.models.spacy_tagger import Tagger
    from pipeline.negatives.core import MinerOptions, NegativeMiner

    text = SAMPLES[3][0]
    r = NegativeMiner(load_mlm("tiny-random"), None, MinerOptions(negative_feature_k=3)).mine([(5, 3, text)], Tagger().tag([text]))[0]
    rows = feats[3].word_caption_id == 5
    np.testing.assert_allclose(feats[3].word_features[rows].astype(np.float32), r.features, atol=2e-3, rtol=2e-3)
    assert [n.candidates for n in r.nouns] == neg.filter(neg["caption_id"] == 5)["candidates"].to_list()
    # reproducible per-caption noun choice for the trainer
    a, b, c = pick_nouns(neg, 0, 0), pick_nouns(neg, 0, 0), pick_nouns(neg, 0, 1)
    assert a.equals(b) and a["caption_id"].n_unique() == a.height == neg["caption_id"].n_unique()
    assert not a.equals(c) or a.height < 3


def test_rerun_skips_and_deleted_shard_is_redone(stage_run):
    m, _, art, ran = stage_run
    n0 = len(ran)
    run_stage("negative-captions", RunContext(m))
    assert len(ran) == n0  # every unit complete: nothing recomputed
    shards = sorted(art.files("shards"))
    data = shards[2].read_bytes()
    shards[2].unlink()
    run_stage("negative-captions", RunContext(m))
    assert ran[n0:] == [shards[2].stem]
    assert shards[2].read_bytes() == data  # byte-identical redo
    # a changed option redoes everything
    m2 = make_manifest(art.dir.parent.parent, OV + ["stages.negative_captions.keep=20"])
    run_stage("negative-captions", RunContext(m2))
    assert len(ran) == n0 + 1 + 4
    neg = Artifact(art.dir).read("negatives").to_pylist()
    assert all(len(r["candidates"]) == 20 for r in neg)


def test_noun_vocabulary_restriction(tmp_path, local_units):
    m = make_manifest(tmp_path, OV + ["stages.negative_captions.restrict_to_noun_vocab=true",
                                      "stages.negative_captions.top_k=4", "stages.negative_captions.keep=2"])
    write_samples(m.output)
    run_stage("negative-captions", RunContext(m))
    art = Artifact(tmp_path / "run" / "negatives")
    vocab = set(json.loads((art.dir / "noun_vocab.json").read_text()))
    assert {"man", "bike", "dog", "kite", "kids", "kid", "umbrella"} <= vocab and "red" not in vocab
    for r in art.read("negatives").to_pylist():
        assert set(r["candidates"]) | set(r["rejected"]) <= vocab
        assert r["noun"].lower() not in r["candidates"] + r["rejected"]


@pytest.mark.slow
def test_demo_manifest_on_ray(tmp_path, ray_session):
    m = make_manifest(tmp_path, ["dataset.synthetic.n_images=6", "ray.actors=1"])
    run_stage("ingest", RunContext(m))
    s = run_stage("negative-captions", RunContext(m))
    art = Artifact(tmp_path / "run" / "negatives")
    assert s["nouns"] > 0 and art.manifest["feature_dim"] == 384
    assert art.manifest["random_weights"] == ["mlm"]  # the MiniLM word encoder is real
    from pipeline.loaders.negatives import load_word_features

    feats = load_word_features(art.dir)
    assert all(f.word_features.shape[1] == 384 for f in feats.values())
    state = art.dir / "_state"
    before = {p.name: p.stat().st_mtime_ns for p in state.glob("*.json")}
    run_stage("negative-captions", RunContext(m))
    assert before == {p.name: p.stat().st_mtime_ns for p in state.glob("*.json")}
