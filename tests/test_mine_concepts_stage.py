"""`pipeline run mine-concepts` end to end on the demo manifest: output equals the in-process
miner, the Ray split does not change results, hard negatives equal a brute-force search, resume."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from pipeline.concepts import mining as M
from pipeline.concepts.hard_negatives import mine_hard_negatives, related, token_matrix
from pipeline.io.artifacts import Artifact
from pipeline.stage import RunContext, run_stage
from tests.conftest import make_manifest


def test_hard_negatives_match_brute_force():
    rng = np.random.default_rng(0)
    words = ["red", "bus", "a", "on", "street", "dog", "big"]
    texts = sorted({" ".join(rng.choice(words, rng.integers(1, 4))) for _ in range(300)})
    emb = rng.normal(size=(len(texts), 16)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    toks = token_matrix(texts, 5)
    k = 6
    nb, sc, kind = mine_hard_negatives(emb, toks, k=k, index="flat", margin=1)  # tiny margin: forces re-search
    assert kind == "flat"
    split = [t.split(" ") for t in texts]

    def contains(a, b):
        return any(a[j:j + len(b)] == b for j in range(len(a) - len(b) + 1))

    sim = emb @ emb.T
    for i in range(len(texts)):
        allowed = [j for j in range(len(texts)) if j != i and not contains(split[i], split[j]) and not contains(split[j], split[i])]
        best = sorted(allowed, key=lambda j: -sim[i, j])[:k]
        got = [j for j in nb[i] if j >= 0]
        assert len(got) == min(k, len(allowed))
        np.testing.assert_allclose(sc[i, :len(got)], sim[i, best], rtol=1e-5, atol=1e-5)
        assert set(got) <= set(allowed)
    q, c = np.repeat(np.arange(len(texts)), 3), rng.integers(0, len(texts), 3 * len(texts))
    assert related(toks[q], toks[c]).tolist() == [contains(split[a], split[b]) or contains(split[b], split[a]) for a, b in zip(q, c)]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, ray_session):
    tmp = tmp_path_factory.mktemp("mc")
    ov = ["dataset.synthetic.n_images=40", "stages.ingest.shard_size=20", "stages.mine_concepts.shard_size=7",
          "models.text_encoder=tiny-random"]
    m = make_manifest(tmp, ov)
    run_stage("ingest", RunContext(m))
    summary = run_stage("mine-concepts", RunContext(m))
    return tmp, ov, m, summary


def _mtimes(d):
    return {p.name: p.stat().st_mtime_ns for p in d.rglob("*.parquet") if p.parent != d}  # shards, not errors.parquet


@pytest.mark.slow
def test_stage_equals_in_process_miner_and_brute_force(demo_run):
    tmp, ov, m, summary = demo_run
    out = tmp / "run"
    art = Artifact(out / "concepts")
    caps = pl.from_arrow(Artifact(out / "samples").read("captions")).sort("sample_id", "caption_id")
    concepts, vocab = M.mine(caps["sample_id"].to_numpy(), caps["text"], M.MiningParams())
    got = art.read("concepts")
    assert art.manifest["units"] > 3  # several units, run by 2 Ray workers
    assert got.to_pylist() == concepts.to_pylist()
    # and the brute-force reference, on every sample of the generated (synthetic scene) dataset
    from pipeline.concepts.reference import mine_reference
    from tests.test_concepts_mining import check_properties

    samples = [(int(sid), list(g["text"])) for (sid,), g in caps.group_by("sample_id", maintain_order=True)]
    rows, ref_vocab = mine_reference(samples, M.MiningParams())
    assert list(zip(got["sample_id"].to_pylist(), got["concept_id"].to_pylist(), got["partners"].to_pylist())) == \
        [(s_, c_, list(p_)) for s_, c_, p_ in rows]
    assert {r["concept_id"]: (r["text"], r["n"], r["df"]) for r in art.read("vocab").to_pylist()} == ref_vocab
    check_properties(samples, got, art.read("vocab"), M.MiningParams())
    assert art.read("vocab").to_pylist() == vocab.to_pylist()
    assert summary["concept_rows"] == concepts.num_rows > 100
    # random-weight provenance is recorded
    assert "text_encoder" in art.manifest["random_weights"]
    # hard negatives: exact search over the stored embeddings, related concepts excluded
    from pipeline.stages.mine_concepts import read_embeddings

    emb = read_embeddings(art.files("embeddings")).astype(np.float32)
    hn = art.read("hard_negatives").to_pylist()
    voc = art.read("vocab").to_pylist()
    assert [r["concept_id"] for r in hn] == [v["concept_id"] for v in voc]
    row_of = {v["concept_id"]: i for i, v in enumerate(voc)}
    texts = [v["text"].split(" ") for v in voc]
    sim = emb @ emb.T
    for i in range(0, len(voc), 17):
        negs = [row_of[c] for c in hn[i]["negatives"]]
        assert len(negs) == 10 and i not in negs
        for j in negs:
            a, b = texts[i], texts[j]
            assert not any(a[s:s + len(b)] == b for s in range(len(a) - len(b) + 1))
            assert not any(b[s:s + len(a)] == a for s in range(len(b) - len(a) + 1))
        np.testing.assert_allclose(hn[i]["scores"], sim[i, negs], rtol=1e-3, atol=1e-3)
        assert np.all(np.diff(hn[i]["scores"]) <= 1e-6)  # nearest first


@pytest.mark.slow
def test_stage_resume_force_and_readable_inspect(demo_run):
    tmp, ov, m, _ = demo_run
    d = tmp / "run" / "concepts"
    before = _mtimes(d)
    first = Artifact(d).manifest
    first_rows = Artifact(d).read("concepts").to_pylist()
    run_stage("mine-concepts", RunContext(m))
    assert _mtimes(d) == before  # complete: nothing rewritten
    victim = d / "concepts" / "concepts-00002.parquet"
    victim.unlink()
    run_stage("mine-concepts", RunContext(m))
    after = _mtimes(d)
    assert victim.exists() and after[victim.name] != before[victim.name]
    assert {k: v for k, v in after.items() if k != victim.name} == {k: v for k, v in before.items() if k != victim.name}
    assert [s["sha256"] for s in Artifact(d).manifest["shards"]] == [s["sha256"] for s in first["shards"]]
    # another shard size: other units, same content
    m2 = make_manifest(tmp, ov + ["stages.mine_concepts.shard_size=1000"])
    run_stage("mine-concepts", RunContext(m2, force=True))
    art = Artifact(d)
    assert art.manifest["units"] == 1 + 1 + 1 + 1  # one concepts unit, vocab, one embedding unit, hard negatives
    assert art.read("concepts").to_pylist() == first_rows
    from pipeline.io.inspect import describe

    text = describe(art, 3, lambda v, w: str(v)[:w])
    assert "sample " in text and "hard negatives:" in text
    assert any(len(line.split("'")) > 2 and " " in line.split("'")[1] for line in text.splitlines())  # multi-word concepts shown as text


@pytest.mark.slow
def test_hard_negatives_min_df(demo_run):
    tmp, ov, _, _ = demo_run
    m = make_manifest(tmp, ov + ["stages.mine_concepts.hard_negatives_min_df=3"])
    run_stage("mine-concepts", RunContext(m))
    art = Artifact(tmp / "run" / "concepts")
    df = {v["concept_id"]: v["df"] for v in art.read("vocab").to_pylist()}
    hn = art.read("hard_negatives").to_pylist()
    assert [r["concept_id"] for r in hn] == [c for c, d in df.items() if d >= 3]
    assert all(df[c] >= 3 for r in hn for c in r["negatives"])


def test_hard_negatives_hnsw_recall_and_exclusions():
    rng = np.random.default_rng(1)
    texts = [f"w{i} w{i + 1}" if i % 3 else f"w{i}" for i in range(2000)]
    emb = rng.normal(size=(len(texts), 24)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    toks = token_matrix(texts, 5)
    exact, _, _ = mine_hard_negatives(emb, toks, k=10, index="flat")
    approx, sc, kind = mine_hard_negatives(emb, toks, k=10, index="auto", flat_max=100)
    assert kind == "hnsw"
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact, approx)])
    assert recall > 0.9
    q = np.repeat(np.arange(len(texts)), 10)
    c = approx.reshape(-1)
    assert (c >= 0).all() and (c != q).all() and not related(toks[q], toks[c]).any()
