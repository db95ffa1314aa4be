"""The concept-token cache (encode-concepts): full membership against a brute-force reference, the
CLIP worker's output through the loader (tokens, mask, pooled, pooled-only), and bad input."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pytest

from pipeline.concepts.concept_tokens import membership
from pipeline.concepts.normalize import Normalizer
from pipeline.io.artifacts import ArtifactWriter

pytestmark = pytest.mark.usefixtures("one_thread")


def test_membership_matches_brute_force():
    caps = ["A red circle, and a blue square.", "Blue-square on the left", "a RED  circle", "circle red", "",
            "red circle and blue"]
    sids = [1, 1, 2, 3, 4, 5]
    vocab = ["red circle", "blue square", "circle", "red circle and blue", "square on the", "circle red", "green"]
    ids = np.arange(10, 10 + len(vocab))
    cid, sid = membership(sids, caps, ids, vocab, Normalizer(), n_max=4)
    got = set(zip(cid.tolist(), sid.tolist()))
    want = set()
    for s, t in zip(sids, caps):
        words = re.findall(r"[^\W_]+(?:'[^\W_]+)*", t.lower())
        for k, v in zip(ids, vocab):
            vw = v.split()
            if any(words[i:i + len(vw)] == vw for i in range(len(words))):
                want.add((int(k), s))
    assert got == want
    assert (12, 3) in got and (10, 3) not in got  # "circle red" contains circle, not "red circle"
    assert list(zip(cid, sid)) == sorted(zip(cid, sid))  # sorted, unique


def _vocab_artifact(out, texts):
    w = ArtifactWriter(out, "concepts", "mine-concepts", {"n_max": 5})
    u = w.unit_writer("vocab", "fp")
    u.write_table("vocab", pa.table({"concept_id": pa.array(np.arange(len(texts)) * 3, pa.int64()), "text": texts,
                                     "n": pa.array([len(t.split()) for t in texts], pa.int32()),
                                     "df": pa.array([2 + k for k in range(len(texts))], pa.int32())}))
    u.commit()
    w.finalize(["vocab"])
    return [str(p) for p in (out / "concepts" / "vocab").glob("*.parquet")]


@pytest.mark.parametrize("pooled_only", [False, True])
def test_worker_and_loader(tmp_path, pooled_only):
    from pipeline.loaders.concept_tokens import ConceptTokens
    from pipeline.stages.encode_concepts import ConceptTokenWorker, write_membership

    texts = ["red circle", "a small blue square on the left", "dog", "man riding a horse"]
    vocab_paths = _vocab_artifact(tmp_path, texts)
    aw = ArtifactWriter(tmp_path, "concept_tokens", "encode-concepts", {"max_tokens": 16, "pooled_only": pooled_only})
    worker = ConceptTokenWorker("tiny-random", "cpu", 1, 2, 16, pooled_only, False)
    res = worker({"vocab_paths": vocab_paths, "range": [0, 3], "min_df": 3, "artifact_dir": str(aw.dir),
                  "stage": "encode-concepts", "unit": "00000", "fingerprint": "x"})
    assert res["stats"]["concepts"] == 3  # df >= 3: concept ids 3, 6, 9
    m = aw.unit_writer("membership", "fp")
    write_membership(m, [3, 3, 6], [7, 8, 8])
    m.commit()
    aw.finalize(["00000", "membership"], extra={"pooled_only": pooled_only})
    ct = ConceptTokens(tmp_path / "concept_tokens")
    assert len(ct) == 3
    rows = ct.rows([0, 3, 6, 9, 12])
    assert rows.tolist() == [-1, 0, 1, 2, -1]
    g = ct.gather(rows[rows >= 0])
    assert g["pooled"].dtype == np.float16 and g["pooled"].shape == (int((rows >= 0).sum()), 24)
    if pooled_only:
        assert "tokens" not in g
    else:
        assert g["tokens"].dtype == np.float16 and g["tokens"].shape[2] == 32
        n = g["mask"].sum(1)
        assert (n >= 3).all()  # BOS, >= 1 word piece, EOS
        assert not np.any(g["tokens"][~g["mask"]])  # zero beyond the mask
        # the same text through the adapter's encoder gives the stored states (fp16)
        from pipeline.models.clip import encode_texts, load_clip

        model, _, tok, _ = load_clip("tiny-random")
        o = encode_texts(model, tok, [ct.art.read("index")["text"].to_pylist()[0]], 16)
        np.testing.assert_allclose(g["pooled"][0].astype(np.float32), o["text_embed"][0].numpy(), atol=2e-3)
    mem = ct.membership(np.array([7, 8, 9]))
    assert mem.contains([3, 3, 6, 6], [7, 9, 8, 7]).tolist() == [True, False, True, False]
    assert mem.members_of(3).tolist() == [7, 8]


def test_empty_vocab_is_a_clear_error(tmp_path):
    from pipeline.config import load_manifest
    from pipeline.stage import RunContext, StageError
    from pipeline.stages import encode_concepts

    w = ArtifactWriter(tmp_path, "samples", "ingest", {})
    u = w.unit_writer("00000", "fp")
    u.write_table("captions", pa.table({"caption_id": pa.array([1], pa.int64()), "sample_id": pa.array([1], pa.int64()),
                                        "text": ["a dog"]}))
    u.commit()
    w.finalize(["00000"])
    _vocab_artifact(tmp_path, [])
    ctx = RunContext(load_manifest(None, [f"output={tmp_path}", "models.clip=tiny-random"]))
    with pytest.raises(StageError, match="empty concept vocabulary"):
        encode_concepts.run(ctx, encode_concepts.Config())


def test_missing_artifact_is_a_clear_error(tmp_path):
    from pipeline.loaders.concept_tokens import ConceptTokens, ConceptTokensMissing

    with pytest.raises(ConceptTokensMissing, match="pipeline run encode-concepts"):
        ConceptTokens(tmp_path / "concept_tokens")
