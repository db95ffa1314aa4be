"""Hand-made `samples`, `visual_tokens` and `clip_tokens` artifacts for the visual-tokens job tests
(no Ray, no models): the two shard artifacts have different shard sizes and sample orders, and a
few samples are bad on purpose (``BAD``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from pipeline.io.artifacts import ArtifactWriter, unit_name
from pipeline.io.wds import ShardWriter, sample_key
from pipeline.visual_tokens.graph import build_graph

D_TOK, D_IMG, D_TXT, P = 16, 12, 16, 8
# sample_id -> what is wrong with it (context_length 12 in the tests)
BAD = {3: "too_few_tangible", 5: "over_context_length", 8: "no_captions", 11: "not_in_clip_tokens"}


def _vt_sample(sid: int, g) -> dict:
    V = 0 if BAD.get(sid) == "too_few_tangible" else 14 if BAD.get(sid) == "over_context_length" else int(g.integers(1, 5))
    S = np.zeros((V, V, 3), np.float32)
    for _ in range(V // 2):
        a, b = g.choice(V, 2, replace=False)
        S[a, b, g.integers(3)] = 1
    gr = build_graph(np.ones(V), S, g.uniform(0, 50, (V, 4)) if V else np.zeros((0, 4)))
    return {"tangible.npy": g.normal(size=(V, D_TOK)).astype(np.float16),
            "intangible.npy": g.normal(size=(len(gr.predicates), D_TOK)).astype(np.float16),
            "image_feature.npy": g.normal(size=D_IMG).astype(np.float16), "ranks.npy": gr.ranks,
            "meta.json": {"sample_id": sid}}


def _ct_sample(sid: int, g) -> dict:
    C = 0 if BAD.get(sid) == "no_captions" else 2
    M = 6
    mask = np.zeros((C, M), bool)
    for c in range(C):
        mask[c, : int(g.integers(3, M + 1))] = True
    return {"patch_tokens.npy": g.normal(size=(4, 10)).astype(np.float16), "image_embed.npy": g.normal(size=P).astype(np.float16),
            "text_tokens.npy": (g.normal(size=(C, M, D_TXT)) * mask[..., None]).astype(np.float16), "text_mask.npy": mask,
            "text_embed.npy": g.normal(size=(C, P)).astype(np.float16),
            "caption_ids.npy": np.arange(C, dtype=np.int64) + 100 * sid}


def _shards(out: Path, name: str, stage: str, ids, size: int, make, params: dict, extra: dict) -> None:
    w = ArtifactWriter(out, name, stage, params)
    units = []
    for u, s0 in enumerate(range(0, len(ids), size)):
        un = unit_name(u)
        units.append(un)
        uw = w.unit_writer(un, "fp")
        with ShardWriter(uw.shard_path()) as sw:
            for sid in ids[s0:s0 + size]:
                sw.write(sample_key(sid), make(sid, np.random.default_rng([sid, len(name)])))
        uw.record_shard(uw.shard_path(), sw.count)
        uw.commit()
    w.finalize(units, extra=extra)


def write_vt_artifacts(out: Path, n: int = 40) -> list[int]:
    """<out>/samples (split: every 5th test), <out>/visual_tokens (shards of 7, reversed order) and
    <out>/clip_tokens (shards of 10, ascending; sample 11 left out). Returns the sample ids."""
    out = Path(out)
    ids = list(range(1, n + 1))
    sw = ArtifactWriter(out, "samples", "ingest", {"planted": True})
    w = sw.unit_writer(unit_name(0), "fp")
    w.write_table("samples", pa.table({
        "sample_id": pa.array(ids, pa.int64()), "source_id": [f"{i:012d}" for i in ids],
        "image": [f"/nonexistent/{i:012d}.jpg" for i in ids], "width": [64] * n, "height": [64] * n,
        "split": ["test" if i % 5 == 0 else "train" for i in ids]}))
    w.commit()
    sw.finalize([unit_name(0)])
    _shards(out, "visual_tokens", "extract-visual-tokens", ids[::-1], 7, _vt_sample, {},
            {"dims": {"width": D_TOK, "image_feature": D_IMG, "context_length": 77}, "predicates": ["a", "b", "c"]})
    _shards(out, "clip_tokens", "extract-clip-tokens", [i for i in ids if BAD.get(i) != "not_in_clip_tokens"], 10,
            _ct_sample, {"max_text_tokens": 6, "project_tokens": False}, {"dims": {"vision_dim": 10, "text_dim": D_TXT}})
    return ids
