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


def parquet_parts(meta) -> tuple[int, int, int]:
    """(rows, data bytes, dictionary bytes) of a Parquet file's metadata."""
    data = dic = 0
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for i in range(rg.num_columns):
            c = rg.column(i)
            d = (c.data_page_offset - c.dictionary_page_offset) if c.has_dictionary_page and c.dictionary_page_offset is not None else 0
            dic += d
            data += c.total_compressed_size - d
    return meta.num_rows, data, dic


def parquet_growth(*profiles: tuple[int, int, int, int]) -> dict:
    """How a table's Parquet bytes grow with its rows, from files of the same content at two or
    three row counts: each ``(rows, file bytes, data-page bytes, dictionary bytes)``, ascending.
    A row costs less in more rows (dictionaries fill, zstd finds repeats); how much less depends on
    the content, so two laws are fitted: the marginal bytes per row (linear: a row's cost settles,
    as for text held in dictionaries) and a power of the rows (repeats keep paying, as for the
    same floats recurring). Given three files, the law that predicts the largest from the two
    smaller ones better is kept; both are fitted on the two largest. The footer is fixed."""
    (r1, _, p1, d1), (r2, f2, p2, d2) = profiles[-2:]
    v1, v2 = p1 + d1, p2 + d2
    per_row = (v2 - v1) / (r2 - r1) if r2 > r1 else v2 / max(1, r2)
    exp = math.log(v2 / v1) / math.log(r2 / r1) if v1 > 0 and v2 > 0 and r2 > r1 else 1.0
    law = "linear"
    if len(profiles) >= 3:
        (q0, _, a0, b0), (q1, _, a1, b1), (q2, _, a2, b2) = profiles[-3:]
        w0, w1, w2 = a0 + b0, a1 + b1, a2 + b2
        if w0 > 0 and q1 > q0:
            linear = w1 + (q2 - q1) * (w1 - w0) / (q1 - q0)
            power = w1 * (q2 / q1) ** (math.log(w1 / w0) / math.log(q1 / q0))
            law = "power" if abs(power - w2) < abs(linear - w2) else "linear"
    return {"pages": v2, "rows": r2, "small_pages": v1, "small_rows": r1, "per_row": max(0.0, per_row),
            "exp": min(1.0, max(0.0, exp)), "law": law, "fixed": f2 - v2}


def grown_bytes(g: dict, rows: float) -> int:
    """Bytes of one Parquet file of ``rows`` rows of a table profiled by :func:`parquet_growth`:
    from the largest file by its law (or, below the smaller file's rows, at that file's bytes per row)."""
    if rows < g["small_rows"]:
        return int(g["fixed"] + g["small_pages"] * rows / max(1, g["small_rows"]))
    if g.get("law") == "power":
        return int(g["fixed"] + g["pages"] * (rows / max(1, g["rows"])) ** g["exp"])
    return int(g["fixed"] + g["pages"] + (rows - g["rows"]) * g["per_row"])


def overhead(units: int, files_per_unit: int) -> int:
    return FIXED_OVERHEAD + units * (UNIT_STATE + MANIFEST_PER_FILE * files_per_unit)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# ------------------------------------------------------------------ the artifacts
def samples(size, cfg, measured: dict | None = None) -> ArtifactSize:
    """``measured``: per table ``rows_per_image``, ``per_row`` and ``base`` bytes of a unit, from
    ingest's worker on the dataset's first records (:func:`pipeline.sizing.calibrate.ingest`);
    without it, bytes per row measured on the demo's artifacts."""
    s = size.sample
    units = unit_rows(size.images, cfg.shard_size)
    n_units = len(units)
    if measured:
        rows, b = {}, {}
        for name, t in measured.items():
            rows[name] = round(t["rows_per_image"] * size.images) if name != "captions" else size.captions
            b[name] = sum(grown_bytes(t, r * rows[name] / max(1, size.images)) for r in units)
        rows = {"samples": size.images, "captions": size.captions, **{k: v for k, v in rows.items() if k not in ("samples", "captions")}}
        b["overhead"] = overhead(n_units, len(rows))
        return ArtifactSize("samples", rows, b, exact_rows=size.exact and set(rows) <= {"samples", "captions"},
                            notes=["Parquet bytes per row: ingest's worker on the dataset's first records (measured)"])
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


def negatives(size, cfg, dim: int, pos: list[list[str]], measured: dict | None = None) -> ArtifactSize:
    """``pos``: the universal POS tags of each sampled caption (spaCy, as the stage tags them).
    ``measured``: per table ``per_row`` and ``base`` bytes of a unit, from the stage's worker on
    the first captions (:func:`pipeline.sizing.calibrate.negatives`); else the demo's bytes per row."""
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
    b = {"shards": tar_bytes(_mean(per), size.images, cfg.shard_size),
         "negatives": int(nouns * DEMO_ROW_BYTES["negatives"] * cfg.keep / 25),
         "words": int(words * DEMO_ROW_BYTES["words"]) + units * 2500, "overhead": overhead(units, 3)}
    notes = ["nouns and words per caption tagged by spaCy on the sampled captions (estimate)"]
    for table, rows in (("negatives", nouns), ("words", words)):
        if measured and table in measured:
            b[table] = sum(grown_bytes(measured[table], rows * r / max(1, size.images)) for r in unit_rows(size.images, cfg.shard_size))
    if measured:
        notes.append("Parquet bytes per row: the stage's worker on the first captions (measured)")
    return ArtifactSize("negatives", {"shards": size.images, "negatives": nouns, "words": words}, b,
                        exact_rows=False, notes=notes)


def table_growth(table) -> dict | None:
    """:func:`parquet_growth` of an in-memory table written as the pipeline writes it (zstd), from
    its first quarter, half and the whole."""
    if table is None or table.num_rows < 16:
        return None
    import pyarrow.parquet as pq

    def profile(t) -> tuple[int, int, int, int]:
        buf = io.BytesIO()
        pq.write_table(t, buf, compression="zstd")
        rows, data, dic = parquet_parts(pq.read_metadata(io.BytesIO(buf.getvalue())))
        return rows, len(buf.getvalue()), data, dic

    n = table.num_rows
    return parquet_growth(profile(table.slice(0, n // 4)), profile(table.slice(0, n // 2)), profile(table))


def partners_at_scale(table, factor: float, seed: int = 0):
    """The mined sample's concept rows with their partner ids spread over a dataset ``factor`` times
    the sample's (each id i to a uniform draw in [i f, (i + 1) f), so lists stay ascending): partners
    are other samples containing the concept, drawn over the whole dataset, and wider ids compress
    worse (on the generated captions 12.0 bytes a row at 40k images, 17.3 at 200k; this gives 16.8
    from either a 5,000- or a 40,000-record sample; the rest is the partner lists filling up as df
    grows, 4.7 to 4.9 partners a row)."""
    import numpy as np
    import pyarrow as pa

    if factor <= 1:
        return table
    p = table["partners"].combine_chunks()
    vals = p.values.to_numpy()
    spread = np.floor((vals + np.random.default_rng(seed).random(len(vals))) * factor).astype(np.int64)
    i = table.schema.get_field_index("partners")
    return table.set_column(i, table.schema.field(i), pa.ListArray.from_arrays(p.offsets, pa.array(spread, p.type.value_type)))


def concepts(size, cfg, text_dim: int, mined: dict) -> ArtifactSize:
    """``mined``: :func:`mined_sample` (the miner over the caption sample). Concept and vocabulary
    rows are sized by writing the mined tables; embeddings as random float16 rows (incompressible)."""
    rows = min(cfg.k2, mined["per_sample"]) * size.images
    vocab = mined["vocab"]
    units = len(unit_rows(size.images, cfg.shard_size))
    emb = parquet_bytes(fixed_width_table({"concept_id": ("int64", 0), "embedding": ("float16", text_dim)}, vocab),
                        vocab, cfg.encode_unit)
    table = mined.get("concepts_table")
    if table is not None and not mined.get("exact") and mined.get("records"):
        table = partners_at_scale(table, size.images / mined["records"])
    return ArtifactSize("concepts", {"concepts": int(rows), "vocab": vocab, "hard_negatives": vocab}, {
        "concepts": (sum(grown_bytes(cg, rows * r / max(1, size.images)) for r in unit_rows(size.images, cfg.shard_size))
                     if (cg := table_growth(table)) else int(rows * (DEMO_ROW_BYTES["concepts"] + 4 * cfg.k1))),
        "vocab": grown_bytes(vg, vocab) if (vg := table_growth(mined.get("vocab_table"))) else int(vocab * DEMO_ROW_BYTES["vocab"]),
        "embeddings": emb if cfg.hard_negatives else 0,
        "hard_negatives": int(vocab * DEMO_ROW_BYTES["hard_negatives"] * cfg.hard_negatives_k / 10) if cfg.hard_negatives else 0,
        "overhead": overhead(units, 1) + 3 * 2000,
    }, exact_rows=False, notes=["concept rows and vocabulary: the miner over the caption sample" +
                                ("" if mined.get("exact") else ", vocabulary extrapolated by Heaps' law fitted on it (estimate)")])


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


def index(size, cfg, p: int, measured: dict | None = None) -> ArtifactSize:
    """``measured``: each table's :func:`parquet_growth` from the stage's search on the CLIP
    calibration unit's embeddings (:func:`pipeline.sizing.calibrate.index_tables`); without it,
    random rows of the schema (ids drawn below the dataset's rows, incompressible scores)."""
    from pipeline.stages.build_index import default_nlist, resolve_kind

    n, c, k = size.images, size.captions, cfg.k
    kind = {side: resolve_kind(rows, cfg.index, cfg.flat_max) for side, rows in (("images", n), ("captions", c))}  # the stage's rule
    b = {"faiss": 0}
    for side, rows in (("images", n), ("captions", c)):
        b["faiss"] += 2 * rows * p * 4 + rows * 8 + 2 * 128 + 200  # .faiss + .npy (float32) + ids
        if kind[side] == "ivf":
            nlist = cfg.nlist or default_nlist(rows)
            b["faiss"] += rows * 8 + nlist * p * 4 + rows * 8  # ids inside the IVF lists, centroids, assignment
    b["faiss"] += c * 8 + 128  # captions_owner.npy
    units_i, units_c = len(unit_rows(n, cfg.query_chunk)), len(unit_rows(c, cfg.query_chunk))
    b["image_negatives"] = parquet_bytes(fixed_width_table({"sample_id": ("int64", 0), "caption_ids": ("int64", k),
                                                            "scores": ("float32", k)}, c), n, cfg.query_chunk)
    b["caption_negatives"] = parquet_bytes(fixed_width_table({"caption_id": ("int64", 0), "sample_id": ("int64", 0),
                                                              "image_ids": ("int64", k), "scores": ("float32", k)}, n), c, cfg.query_chunk)
    notes = []
    if measured:
        for table, rows in (("image_negatives", n), ("caption_negatives", c)):
            if table in measured:
                b[table] = sum(grown_bytes(measured[table], r) for r in unit_rows(rows, cfg.query_chunk))
        notes.append("negatives tables: the stage's search on the CLIP calibration's embeddings, grown by the law fitted on them (measured)")
    b["overhead"] = overhead(units_i + units_c, 1)
    return ArtifactSize("index", {"image_negatives": n, "caption_negatives": c}, b, exact_rows=size.exact,
                        notes=[f"images: {kind['images']} index, captions: {kind['captions']} index", *notes])


def mined_sample(size, cfg) -> dict:
    """The C3 miner itself (:func:`pipeline.concepts.mining.mine`, the stage's parameters) over the
    caption sample (``size.text_sample``: up to 40,000 records, the whole dataset below that):
    concept rows per sample, the vocabulary (texts, df) and membership rows per sample, and the
    mined tables. Beyond the sample the vocabulary grows as Heaps' law with the exponent of the
    sample's last doubling (mined on its first half and on all of it), held constant: the exponent
    falls as a finite word list's n-gram space fills (on the generated captions 0.79 per doubling
    at 1k records, 0.66 at 10k, 0.51 at 40k, 0.44 at 200k), so holding it is an upper bound that
    is tight for a large sample (the 200k rehearsal: +6% from 40,000 records; a trend fitted on
    the exponent and extrapolated undershot by 14%, from 5,000 records overshot by 61%). The
    exponent is capped at 1 (linear growth: on 4,345 real COCO captions it stays at 0.97-1.06
    from 500 captions on) and the vocabulary at the concept rows (each entry is some sample's).
    Concept rows per sample keep their growth per doubling, up to K2 (estimates)."""
    from pipeline.concepts.mining import mine
    params = cfg.mining_params()
    recs = size.text_sample or size.sample
    if not any(r.captions for r in recs):
        return {"per_sample": 0.0, "vocab": 0, "texts": [], "membership_per_sample": 0.0}

    def run(rs):
        sids = [i for i, r in enumerate(rs) for _ in r.captions]
        return mine(sids, [c for r in rs for c in r.captions], params)

    n = len(recs)
    concepts, vocab = run(recs)
    out = {"per_sample": concepts.num_rows / n, "vocab": vocab.num_rows, "texts": vocab["text"].to_pylist(),
           "membership_per_sample": float(vocab["df"].to_numpy().sum()) / n, "exact": size.images <= n, "records": n,
           "concepts_table": concepts, "vocab_table": vocab}
    if size.images > n and n >= 16:
        c2, v2 = run(recs[: n // 2])
        # per doubling, at n/2 .. n; at most 1: a small sample grows faster than linearly (n-grams reach
        # df >= 2 as captions arrive: 1.04-1.19 on 125-2,000 COCO captions), which no dataset sustains
        exponent = min(1.0, max(0.0, math.log2(max(1, vocab.num_rows) / max(1, v2.num_rows))))
        doublings = math.log2(size.images / n)
        grow = max(0.0, concepts.num_rows / n - c2.num_rows / (n // 2))  # concept rows per sample, per doubling
        per_sample = min(float(cfg.k2), out["per_sample"] + grow * doublings)
        # every concept of the vocabulary is some sample's concept: at most the concept rows
        vocab_est = min(vocab.num_rows * 2 ** (exponent * doublings), per_sample * size.images)
        out.update(vocab=int(round(vocab_est)), heaps_exponent=exponent, per_sample=per_sample)
    return out


def dumps(a: ArtifactSize) -> dict:
    return json.loads(json.dumps({"artifact": a.artifact, "rows": a.rows, "bytes": a.bytes, "total_bytes": a.total,
                                  "exact_rows": a.exact_rows, "notes": a.notes}))
