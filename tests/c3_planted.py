"""A planted C3 testbed: `samples` + `clip_tokens` from :mod:`tests.cot_planted` (objects =
colour-shape pairs; an object's patches carry E_v[colour] + E_v[shape], so binding is visible only
at the patch level; pooled embeddings carry a weak bag of words), `concepts` mined from the
captions by the real miner (:func:`pipeline.concepts.mining.mine`) with explicit settings, hard
negatives by the real FAISS search (:func:`pipeline.concepts.hard_negatives.mine_hard_negatives`)
over bag-of-word-vector embeddings (a stand-in for MiniLM: "red circle" lies near "red square"
and "blue circle"), and `concept_tokens` written through the encode-concepts stage's writers with
the planted text encoder (:meth:`Planted.text`) in place of CLIP's, membership by the real
:func:`pipeline.concepts.concept_tokens.membership`.
"""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import numpy as np
import pyarrow as pa

from pipeline.concepts import mining as M
from pipeline.concepts.concept_tokens import membership
from pipeline.concepts.hard_negatives import mine_hard_negatives, token_matrix
from pipeline.concepts.normalize import Normalizer
from pipeline.io.artifacts import Artifact, ArtifactWriter
from pipeline.stages.encode_concepts import write_encoded, write_membership
from tests import cot_planted
from tests.cot_planted import Planted, write_planted

# The generated captions' concepts under the paper's coverage rule are mostly longer phrases;
# the test mines every n-gram explicitly (coverage: none), N = 3.
MINING = M.MiningParams(n_max=3, k1=5, k2=80, seed=0, coverage="none")


def planted_encode(pl_, texts: list[str], pooled_only: bool = False) -> dict:
    enc = [pl_.text(t) for t in texts]
    n = np.array([len(t) for t, _ in enc], np.int32)
    out = {"n_tokens": n, "pooled": np.stack([e for _, e in enc]).astype(np.float16)}
    if not pooled_only:
        tok = np.zeros((len(enc), int(n.max()), pl_.d_t), np.float16)
        for k, (t, _) in enumerate(enc):
            tok[k, : len(t)] = t
        out["tokens"] = tok
    return out


class C3Planted(Planted):
    """Captions as real ones describe objects: every object "a <colour> <shape>", joined by "and"
    ("a red circle and a blue square"), so "a red" means a red object, as in real captions.
    Neither cot_planted's "picture" filler (a word no image shows) nor a leading stopword filler
    ("there is", "with") is written: their n-grams ("with red", "there is red", "is red circle")
    hold when the *first* object named is red and the filler was drawn, which no image shows: 130
    of the 285 two- and three-word concepts of 400 images (now 131 multi-word concepts in all,
    of 143). The concepts that depend on the order objects are named in ("circle and",
    "and a blue") remain, as in real captions."""

    def caption(self, objs):
        return " and ".join(f"a {c} {s}" for c, s in objs)


def write_c3_planted(out: Path, n_images: int = 240, seed: int = 0, mining: M.MiningParams = MINING,
                     pooled_only: bool = False, drop_encoded: int = 0, planted_cls=None, **kw):
    """Write samples, clip_tokens, concepts, concept_tokens under ``out``; returns the Planted."""
    out = Path(out)
    with mock.patch.object(cot_planted, "Planted", planted_cls or C3Planted):
        pl_ = write_planted(out, n_images=n_images, seed=seed, **kw)
    caps = Artifact(out / "samples").read("captions")
    sids, texts = caps["sample_id"].to_numpy(), caps["text"].to_pylist()
    concepts, vocab = M.mine(sids, texts, mining)
    cw = ArtifactWriter(out, "concepts", "mine-concepts", dict(mining.__dict__))
    w = cw.unit_writer("00000", "fp")
    w.write_table("concepts", concepts)
    w.commit()
    w = cw.unit_writer("vocab", "fp")
    w.write_table("vocab", vocab)
    w.commit()
    vtext = vocab["text"].to_pylist()
    cid = vocab["concept_id"].to_numpy()
    names = ["00000", "vocab"]
    if vtext:
        _hard_negatives(cw, pl_, vtext, cid, mining.n_max)
        names.append("hard-negatives")
    cw.finalize(names)
    # concept_tokens (the encode-concepts layout); drop_encoded: leave the last k concepts unencoded
    keep = len(vtext) - drop_encoded
    tw = ArtifactWriter(out, "concept_tokens", "encode-concepts", {"max_tokens": 16, "pooled_only": pooled_only},
                        inputs={"concepts": Artifact(out / "concepts").fingerprint})
    names = ["membership"]
    if keep > 0:
        w = tw.unit_writer("00000", "fp")
        write_encoded(w, cid[:keep], vtext[:keep], planted_encode(pl_, vtext[:keep], pooled_only))
        w.commit()
        names.insert(0, "00000")
    w = tw.unit_writer("membership", "fp")
    norm = Normalizer(mining.lowercase, mining.unicode_form, mining.token_pattern)
    mc, ms = membership(sids, texts, cid[:keep], vtext[:keep], norm, mining.n_max)
    write_membership(w, mc, ms)
    w.commit()
    tw.finalize(names, extra={"dims": {"text_dim": pl_.d_t, "projection_dim": pl_.P}, "pooled_only": pooled_only})
    return pl_


def _hard_negatives(cw, pl_, vtext, cid, n_max):
    emb = np.stack([np.mean([pl_.Et[pl_.word[x]] for x in t.split() if x in pl_.word] or [np.zeros(pl_.d_t)], 0)
                    for t in vtext])
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-9)
    nb, sc, _ = mine_hard_negatives(emb.astype(np.float32), token_matrix(vtext, n_max), k=10)
    valid = nb >= 0
    offs = np.concatenate([[0], np.cumsum(valid.sum(1))]).astype(np.int32)
    w = cw.unit_writer("hard-negatives", "fp")
    w.write_table("hard_negatives", pa.table({
        "concept_id": pa.array(cid, pa.int64()),
        "negatives": pa.ListArray.from_arrays(pa.array(offs), pa.array(cid[nb[valid]].astype(np.int32))),
        "scores": pa.ListArray.from_arrays(pa.array(offs), pa.array(sc[valid], pa.float32()))}))
    w.commit()
