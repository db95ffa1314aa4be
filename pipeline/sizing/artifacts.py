"""Bytes on disk of each stage's artifact, from the model shapes and the dataset's per-image counts.

WebDataset shards are sized exactly from their layout: each field is ``np.save``'s bytes (its
header computed by numpy for the real shape and dtype) or the JSON the stage writes, in a tar member
of a 512-byte header plus its data rounded up to 512 bytes; a tar ends with 1024 zero bytes and is
padded to a 10,240-byte record. Per-image shapes (captions, caption tokens, instances, relations,
nouns) are taken for each record of the dataset's sample and averaged, so the block rounding is
that of real records. Parquet tables of fixed-width columns are sized by writing a few hundred
random rows with the pipeline's own writer (zstd) and scaling per unit file; tables whose content
is text (captions, mined concepts, negative candidates) use per-row bytes measured on the demo's
artifacts (600 generated images, ``pipeline run all --manifest manifests/demo.yaml``) and are
marked ``estimate`` — they are a few percent of a run's bytes. Each artifact also holds
``_manifest.json``, ``_state/`` (a marker per unit), ``errors/`` and a README.
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import dataclass, field

import numpy as np

TAR_BLOCK, TAR_RECORD = 512, 10240
UNIT_STATE = 1042  # _state/<unit>.json
FIXED_OVERHEAD = 12_000  # README.txt, _cache.json, errors/errors.parquet, _manifest.json's head
MANIFEST_PER_FILE = 190  # a shard list entry in _manifest.json
# Parquet bytes per row of text tables, measured on the demo's artifacts (see the module docstring)
DEMO_ROW_BYTES = {"samples": 26, "instances": 65, "phrases": 13, "relations": 7.5, "negatives": 667, "words": 7.1,
                  "concepts": 8.0, "vocab": 12.3, "hard_negatives": 58, "membership": 1.6}


@dataclass
class ArtifactSize:
    artifact: str
    rows: dict[str, int]  # table (or "shards") -> rows
    bytes: dict[str, int]  # part -> bytes
    exact_rows: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return int(sum(self.bytes.values()))


# ------------------------------------------------------------------ containers
@functools.cache
def npy_bytes(shape: tuple, dtype: str) -> int:
    """Bytes ``np.save`` writes for an array of this shape and dtype."""
    buf = io.BytesIO()
    d = np.dtype(dtype)
    np.lib.format.write_array_header_1_0(buf, {"descr": np.lib.format.dtype_to_descr(d), "fortran_order": False,
                                               "shape": tuple(int(s) for s in shape)})
    return len(buf.getvalue()) + int(np.prod(shape, dtype=np.int64)) * d.itemsize


def member(nbytes: int) -> int:
    return TAR_BLOCK + math.ceil(nbytes / TAR_BLOCK) * TAR_BLOCK


def sample_bytes(fields: list[int]) -> int:
    return sum(member(n) for n in fields)


def unit_rows(rows: int, shard_size: int) -> list[int]:
    full, rest = divmod(rows, shard_size)
    return [shard_size] * full + ([rest] if rest else [])


def tar_bytes(per_sample: float, rows: int, shard_size: int) -> int:
    return sum(math.ceil((per_sample * r + 2 * TAR_BLOCK) / TAR_RECORD) * TAR_RECORD for r in unit_rows(rows, shard_size))


def parquet_bytes(make, rows: int, shard_size: int | None) -> int:
    """Bytes of one Parquet file per unit of ``make(n)`` tables (random rows of the real schema):
    written at each unit's row count up to :data:`PARQUET_EXACT_ROWS`, extrapolated linearly from
    two sizes beyond."""
    import pyarrow.parquet as pq

    @functools.cache
    def size(n: int) -> int:
        buf = io.BytesIO()
        pq.write_table(make(n), buf, compression="zstd")
        return len(buf.getvalue())

    def unit(r: int) -> float:
        if r <= PARQUET_EXACT_ROWS:
            return size(r)
        k = PARQUET_EXACT_ROWS // 2
        return size(2 * k) + (size(2 * k) - size(k)) / k * (r - 2 * k)

    units = unit_rows(rows, shard_size) if shard_size else [rows]
    return int(sum(unit(r) for r in units))


PARQUET_EXACT_ROWS = 4096


def fixed_width_table(columns: dict[str, tuple[str, int]], id_range: int):
    """``make(n)`` for a table of columns: name -> (dtype, list width; 0: scalar; -1: the shard
    path). Integer scalars are ascending ids; integer lists ids drawn below ``id_range`` (the
    dataset's rows: their entropy is what zstd leaves); floats are random (incompressible)."""
    import pyarrow as pa

    def make(n: int):
        rng = np.random.default_rng(0)
        cols = {}
        for name, (dtype, width) in columns.items():
            if width == -1:
                cols[name] = pa.array(["shards/00000.tar"] * n)
            elif width == 0:
                cols[name] = pa.array(np.arange(n).astype(dtype) if "int" in dtype else rng.random(n).astype(dtype))
            else:
                flat = (rng.standard_normal(n * width).astype(dtype) if "float" in dtype
                        else rng.integers(0, max(2, id_range), n * width).astype(dtype))
                cols[name] = pa.FixedSizeListArray.from_arrays(pa.array(flat), width)
        return pa.table(cols)

    return make


def overhead(units: int, files_per_unit: int) -> int:
    return FIXED_OVERHEAD + units * (UNIT_STATE + MANIFEST_PER_FILE * files_per_unit)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------ the artifacts
def samples(size, cfg) -> ArtifactSize:
    s = size.sample
    n_units = len(unit_rows(size.images, cfg.shard_size))
    per_img = {k: _mean(getattr(r, k) for r in s) for k in ("instances", "phrases", "relations")}
    cap_chars = _mean(len(c) for r in s for c in r.captions)
    rows = {"samples": size.images, "captions": size.captions}
    b = {"samples": int(size.images * (DEMO_ROW_BYTES["samples"] + 0.3 * _mean(r.path_chars for r in s))),
         "captions": int(size.captions * (0.35 * cap_chars + 6))}
    for k in ("instances", "phrases", "relations"):
        if per_img[k]:
            rows[k] = round(per_img[k] * size.images)
            b[k] = int(rows[k] * DEMO_ROW_BYTES[k] + (0.5 * _mean(r.mask_bytes for r in s) * size.images if k == "instances" else 0))
    b["overhead"] = overhead(n_units, len(rows)) + n_units * 1500 * len(rows)  # Parquet footers
    return ArtifactSize("samples", rows, b, exact_rows=size.exact and set(rows) <= {"samples", "captions"},
                        notes=["Parquet of text: bytes per row measured on the demo (estimate)"])


def clip_tokens(size, cfg, shape, caption_tokens) -> ArtifactSize:
    n, dv, dt, p = shape["n_patches"], shape["vision_dim"], shape["text_dim"], shape["projection_dim"]
    if cfg.project_tokens:
        dv = dt = p
    per = []
    for r in size.sample:
        c = len(r.captions)
        m = max((caption_tokens(t, cfg.max_text_tokens) for t in r.captions), default=0)
        if getattr(cfg, "token_precision", "float16") == "int8":  # int8 values + a float16 scale per token
            tokens = [npy_bytes((n, dv), "int8"), npy_bytes((n,), "float16"), npy_bytes((c, m, dt), "int8"),
                      npy_bytes((c, m), "float16")]
        else:
            tokens = [npy_bytes((n, dv), "float16"), npy_bytes((c, m, dt), "float16")]
        per.append(sample_bytes(tokens + [
            npy_bytes((p,), "float16"), npy_bytes((c, m), "bool"), npy_bytes((c, p), "float16"), npy_bytes((c,), "int64"),
            npy_bytes((c, m), "int32"), npy_bytes((c, m, 2), "int32"),
        ]))
    per_sample = _mean(per)
    units = len(unit_rows(size.images, cfg.shard_size))
    caps_per_unit = math.ceil(cfg.shard_size * size.captions_per_image)
    return ArtifactSize("clip_tokens", {"shards": size.images, "images": size.images, "captions": size.captions}, {
        "shards": tar_bytes(per_sample, size.images, cfg.shard_size),
        "images": parquet_bytes(fixed_width_table({"sample_id": ("int64", 0), "shard": ("str", -1), "image_embed": ("float16", p)}, size.images),
                                size.images, cfg.shard_size),
        "captions": parquet_bytes(fixed_width_table({"caption_id": ("int64", 0), "sample_id": ("int64", 0), "n_tokens": ("int32", 0),
                                                     "text_embed": ("float16", p)}, size.images), size.captions, caps_per_unit),
        "overhead": overhead(units, 3),
    }, exact_rows=size.exact)


def image_groups(size, cfg, shape) -> ArtifactSize:
    k, d, p, n = shape["n_groups"], shape["group_dim"], shape["projection_dim"], shape["n_patches"]
    per_sample = sample_bytes([npy_bytes((k, d), "float16"), npy_bytes((k, p), "float16"), npy_bytes((p,), "float16"),
                               npy_bytes((k, n), "float16")])
    units = len(unit_rows(size.images, cfg.shard_size))
    return ArtifactSize("image_groups", {"shards": size.images, "images": size.images}, {
        "shards": tar_bytes(per_sample, size.images, cfg.shard_size),
        "images": parquet_bytes(fixed_width_table({"sample_id": ("int64", 0), "shard": ("str", -1), "image_embed": ("float16", p)}, size.images),
                                size.images, cfg.shard_size),
        "overhead": overhead(units, 2),
    }, exact_rows=size.exact)


def regions(size, cfg, shape) -> ArtifactSize:
    d, notes, per = shape["feature_dim"], [], []
    ann = cfg.backend == "annotations"
    if not ann:
        notes.append(f"detector boxes: max_boxes ({cfg.max_boxes}) per image, an upper bound")
    for r in size.sample:
        nb = min(r.instances, cfg.max_boxes) if ann else cfg.max_boxes
        fields = [npy_bytes((nb, 4), "float32"), npy_bytes((nb,), "float32"), npy_bytes((nb,), "int64"),
                  npy_bytes((nb, d), "float16"), npy_bytes((2,), "int32")]
        if ann:
            fields += [npy_bytes((nb,), "int64"), 2 + nb * 11]  # instance_ids, categories.json
        per.append(sample_bytes(fields))
    units = len(unit_rows(size.images, cfg.shard_size))
    return ArtifactSize("regions", {"shards": size.images},
                        {"shards": tar_bytes(_mean(per), size.images, cfg.shard_size), "overhead": overhead(units, 1)},
                        exact_rows=size.exact, notes=notes)


def visual_tokens(size, cfg, shape, dataset_kind: str) -> ArtifactSize:
    from pipeline.visual_tokens.predicates import PredicateMapper, default_vocabulary, resolve_vocabulary

    w, di, per, notes = cfg.width, shape["image_feature_dim"], [], []
    ann = cfg.segmenter == "annotations"
    spec = default_vocabulary(dataset_kind) if cfg.predicates == "auto" else cfg.predicates
    mapper = PredicateMapper(resolve_vocabulary(spec), cfg.predicate_map)
    if not ann:
        notes.append(f"SAM masks: |T| = context_length ({cfg.context_length}) tangible tokens per image, an upper bound")
    for r in size.sample:
        if ann:
            v = min(r.instances, cfg.context_length - 1)
            mapped = [m for m in map(mapper, r.predicates) if m is not None] if cfg.relations == "annotations" else []
            u = min(len({i for i, _ in mapped}), cfg.context_length - 1 - v)  # each distinct predicate one token
            e = len(mapped)
            mask_json = int(r.mask_bytes * 1.05) + 40 * v
        else:
            v, u, e, mask_json = cfg.context_length - 1, 0, 0, 400 * (cfg.context_length - 1)
        t = 1 + v + u
        per.append(sample_bytes([
            npy_bytes((v, w), "float16"), npy_bytes((u, w), "float16"), npy_bytes((di,), "float16"),
            npy_bytes((v, 4), "float32"), mask_json, npy_bytes((e, 3), "int32"), npy_bytes((e,), "float32"),
            npy_bytes((v, 4), "int32"), npy_bytes((t, t), "uint8"), 260 + 45 * v + 14 * u,
        ]))
    units = len(unit_rows(size.images, cfg.shard_size))
    return ArtifactSize("visual_tokens", {"shards": size.images},
                        {"shards": tar_bytes(_mean(per), size.images, cfg.shard_size), "overhead": overhead(units, 1)},
                        exact_rows=size.exact, notes=notes)


def negatives(size, cfg, dim: int, pos: list[list[str]]) -> ArtifactSize:
    """``pos``: the universal POS tags of each sampled caption (spaCy, as the stage tags them)."""
    noun_tags = set(cfg.noun_pos) | ({"PROPN"} if cfg.include_propn else set())
    feat_tags = set(cfg.feature_pos) | ({"PROPN"} if cfg.include_propn else set())
    k = cfg.negative_feature_k if cfg.negative_features != "none" else 0
    per, nouns_per_caption, it = [], [], iter(pos)
    for r in size.sample:
        tags = [next(it, []) for _ in r.captions]
        n_nouns = [sum(t in noun_tags for t in c) for c in tags]
        nouns_per_caption += n_nouns
        wcount = sum(sum(t in feat_tags for t in c) for c in tags)
        sets = sum(n_nouns) if cfg.negative_features == "all" else sum(1 for n in n_nouns if n) if k else 0
        fields = [npy_bytes((wcount, dim), "float16"), 30 + 14 * wcount]
        if sum(n_nouns):
            fields += [npy_bytes((sets, k, dim), "float16"), 60 + 22 * sum(n_nouns)]
        per.append(sample_bytes(fields))
    nouns = round(_mean(nouns_per_caption) * size.captions)
    words = round(_mean(sum(t in feat_tags for t in c) for c in pos) * size.captions) if pos else 0
    units = len(unit_rows(size.images, cfg.shard_size))
    return ArtifactSize("negatives", {"shards": size.images, "negatives": nouns, "words": words}, {
        "shards": tar_bytes(_mean(per), size.images, cfg.shard_size),
        "negatives": int(nouns * DEMO_ROW_BYTES["negatives"] * cfg.keep / 25),
        "words": int(words * DEMO_ROW_BYTES["words"]) + units * 2500,
        "overhead": overhead(units, 3),
    }, exact_rows=False, notes=["nouns and words per caption tagged by spaCy on the sampled captions (estimate)"])


def concepts(size, cfg, text_dim: int, mined: dict) -> ArtifactSize:
    """``mined``: :func:`mined_sample` (the miner over the sampled records)."""
    rows = min(cfg.k2, mined["per_sample"]) * size.images
    vocab = mined["vocab"]
    units = len(unit_rows(size.images, cfg.shard_size))
    return ArtifactSize("concepts", {"concepts": int(rows), "vocab": vocab, "hard_negatives": vocab}, {
        "concepts": int(rows * (DEMO_ROW_BYTES["concepts"] + 4 * cfg.k1)),
        "vocab": int(vocab * DEMO_ROW_BYTES["vocab"]),
        "embeddings": npy_bytes((vocab, text_dim), "float16"),
        "hard_negatives": int(vocab * DEMO_ROW_BYTES["hard_negatives"] * cfg.hard_negatives_k / 10),
        "overhead": overhead(units, 1) + 3 * 2000,
    }, exact_rows=False, notes=["concept rows and vocabulary: the miner over the sampled records" +
                                ("" if mined.get("exact") else ", vocabulary scaled by Heaps' law (estimate)")])


def concept_tokens(mined: dict, size, cfg, shape, tokens) -> ArtifactSize:
    """``tokens(text, cap)``: CLIP tokens of a concept text (the unit pads to its longest)."""
    p, dt = shape["projection_dim"], shape["text_dim"]
    vocab = mined["vocab"]
    m = max((tokens(t, cfg.max_tokens) for t in mined["texts"]), default=2)
    membership = int(round(mined["membership_per_sample"] * size.images))
    units = max(1, math.ceil(vocab / cfg.encode_unit))
    tok = 0 if cfg.pooled_only else sum(npy_bytes((r, m, dt), "float16") for r in unit_rows(vocab, cfg.encode_unit))
    return ArtifactSize("concept_tokens", {"index": vocab, "membership": membership}, {
        "tokens": tok, "pooled": sum(npy_bytes((r, p), "float16") for r in unit_rows(vocab, cfg.encode_unit)),
        "index": units * 1500 + vocab * 10, "membership": int(membership * DEMO_ROW_BYTES["membership"]) + 1500,
        "overhead": overhead(units, 4),
    }, exact_rows=False, notes=["vocabulary and membership from mine-concepts' estimate"])


def index(size, cfg, p: int) -> ArtifactSize:
    n, c, k = size.images, size.captions, cfg.k
    ivf = cfg.index == "ivf" or (cfg.index == "auto" and max(n, c) > cfg.flat_max)
    b = {"faiss": 0}
    for rows in (n, c):
        b["faiss"] += 2 * rows * p * 4 + rows * 8 + 2 * 128 + 200  # .faiss + .npy (float32) + ids
        if ivf:
            nlist = cfg.nlist or min(int(4 * math.sqrt(rows)), rows // 39)
            b["faiss"] += rows * 8 + nlist * p * 4 + rows * 8  # ids inside the IVF lists, centroids, assignment
    b["faiss"] += c * 8 + 128  # captions_owner.npy
    units_i, units_c = len(unit_rows(n, cfg.query_chunk)), len(unit_rows(c, cfg.query_chunk))
    b["image_negatives"] = parquet_bytes(fixed_width_table({"sample_id": ("int64", 0), "caption_ids": ("int64", k),
                                                            "scores": ("float32", k)}, c), n, cfg.query_chunk)
    b["caption_negatives"] = parquet_bytes(fixed_width_table({"caption_id": ("int64", 0), "sample_id": ("int64", 0),
                                                              "image_ids": ("int64", k), "scores": ("float32", k)}, n), c, cfg.query_chunk)
    b["overhead"] = overhead(units_i + units_c, 1)
    return ArtifactSize("index", {"image_negatives": n, "caption_negatives": c}, b, exact_rows=size.exact,
                        notes=["IVF index" if ivf else "flat index"])


def mined_sample(size, cfg) -> dict:
    """The C3 miner itself (:func:`pipeline.concepts.mining.mine`, the stage's parameters) over the
    sampled records: concept rows per sample, the vocabulary (texts, df) and membership rows per
    sample. On the whole dataset more n-grams are shared (df >= 2), so rows per sample grow
    towards K2 and the vocabulary grows; it is scaled by Heaps' law with exponent 0.5 (an estimate)."""
    from pipeline.concepts.mining import mine
    params = cfg.mining_params()
    sids = [i for i, r in enumerate(size.sample) for _ in r.captions]
    texts = [c for r in size.sample for c in r.captions]
    if not texts:
        return {"per_sample": 0.0, "vocab": 0, "texts": [], "membership_per_sample": 0.0}
    concepts, vocab = mine(sids, texts, params)
    n = max(1, len(size.sample))
    scale = math.sqrt(max(1.0, size.images / n))
    df = vocab["df"].to_numpy()
    return {"per_sample": concepts.num_rows / n, "vocab": int(round(vocab.num_rows * scale)),
            "texts": vocab["text"].to_pylist(), "membership_per_sample": float(df.sum()) / n,
            "exact": size.images == n}


def dumps(a: ArtifactSize) -> dict:
    return json.loads(json.dumps({"artifact": a.artifact, "rows": a.rows, "bytes": a.bytes, "total_bytes": a.total,
                                  "exact_rows": a.exact_rows, "notes": a.notes}))
