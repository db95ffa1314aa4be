"""C3 concept mining: n-gram concepts shared across samples, partner samples, hard negatives.

Song et al. 2024 (C3), Sec. 3.2 and Algorithm 1; semantics and every open choice are documented in
:mod:`pipeline.concepts.mining` (exact whole-dataset inverted index; ``subset_size`` reproduces the
paper's random subset D_s).  Output, the ``concepts`` artifact:

* ``concepts``: sample_id, concept_id, partners list<int64> (sample ids of up to K1 other samples
  containing the concept), up to K2 rows per sample in mining order (longest first);
* ``vocab``: concept_id, text (normalised words joined by spaces), n, df (samples containing it);
* ``hard_negatives``: concept_id, negatives list<int32> (concept ids, nearest first), scores
  list<float32> (cosine): nearest other concepts by a text encoder (FAISS), excluding concepts
  that contain or are contained in it.  They feed MCP's type-2 negatives.

Work: the driver tokenises the captions and builds the exact n-gram index (O(tokens) int32
arrays, written to ``_index/`` and memory-mapped by the workers); Ray workers then mine disjoint
sample ranges (one unit = ``shard_size`` samples, the unit of resume); the driver writes ``vocab``;
Ray actors embed the vocabulary; the driver runs the FAISS search.  Results do not depend on the
number of workers or the shard size (counter-based random draws keyed by seed, sample, concept).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl
import pyarrow as pa
from pydantic import Field

from pipeline.concepts import mining as M
from pipeline.io.atomic import fingerprint
from pipeline.models.device import Precision, device_field, fingerprinted, precision_field
from pipeline.stage import RunContext, StageConfig, StageError, run_units, unit_writer

log = logging.getLogger("pipeline")

NAME = "mine-concepts"
READS = ["samples"]
WRITES = ["concepts"]

CONCEPTS_SCHEMA = pa.schema([("sample_id", pa.int64()), ("concept_id", pa.int64()), ("partners", pa.list_(pa.int64()))])
VOCAB_SCHEMA = pa.schema([("concept_id", pa.int64()), ("text", pa.string()), ("n", pa.int32()), ("df", pa.int32())])
HARD_NEG_SCHEMA = pa.schema([("concept_id", pa.int64()), ("negatives", pa.list_(pa.int32())), ("scores", pa.list_(pa.float32()))])
VOCAB_UNIT, HARD_NEG_UNIT = "vocab", "hard-negatives"


class Config(StageConfig):
    shard_size: int = Field(20_000, ge=1, description="samples per concepts shard (unit of resume and of Ray work)")
    n_max: int = Field(5, ge=1, le=16, description="N: n-grams for n in [1, N] (paper: 5)")
    k1: int = Field(5, ge=1, description="K1: partner samples per concept (paper: 5)")
    k2: int = Field(80, ge=1, description="K2: concepts per sample (paper: 80)")
    seed: int = Field(0, ge=0, description="seed of the partner draws (and of D_s)")
    subset_size: int | None = Field(None, ge=1, description="null: exact index over the whole dataset; S: the paper's random subset D_s of S samples per candidate")
    coverage: Literal["contained", "none"] = Field("contained", description="contained: skip a candidate lying inside a concept already accepted for the sample (longer covers shorter); none: Algorithm 1 verbatim")
    skip_stopword_only: bool = Field(True, description="skip candidates made only of stopwords")
    skip_stopword_edge: bool = Field(False, description="not in the paper: skip candidates whose first or last word is a stopword ('in the center of the', 'a red circle'), so the phrase inside ('red circle') is the concept (a phrase-boundary filter for templated captions; docs/jobs/c3.md, Testbed)")
    stopwords: str | list[str] = Field("nltk", description="nltk (179 function words) | spacy | none | a list of words")
    lowercase: bool = Field(True, description="lower-case captions before tokenising")
    unicode_form: Literal["NFC", "NFKC", "NFD", "NFKD"] | None = Field("NFKC", description="Unicode normalisation (null: none)")
    token_pattern: str = Field(M.MiningParams.token_pattern, description="regex of a token; everything else separates tokens")
    chunk_samples: int = Field(50_000, ge=1, description="samples per in-memory selection chunk inside a unit")
    hard_negatives: bool = Field(True, description="compute the hard_negatives table")
    hard_negatives_k: int = Field(10, ge=1, description="negatives kept per concept")
    hard_negatives_index: Literal["auto", "flat", "hnsw"] = Field("auto", description="FAISS index: flat (exact), hnsw (approximate), auto = flat up to hard_negatives_flat_max concepts")
    hard_negatives_flat_max: int = Field(200_000, ge=1)
    hard_negatives_min_df: int = Field(2, ge=2, description="only concepts with at least this df get (and serve as) hard negatives; 2 = all. Bounds the encoder pass on very large vocabularies")
    text_encoder: str | None = Field(None, description="encoder of the concept texts; null: models.text_encoder (default the packaged MiniLM)")
    encode_batch: int = Field(256, ge=1)
    encode_unit: int = Field(100_000, ge=1, description="concepts per embedding unit (Ray actor work item)")
    torch_threads: int = Field(1, ge=1, description="torch threads per embedding actor")
    device: str = device_field()  # the text encoder's actors (hard negatives); num_gpus reserves their GPUs
    precision: Precision = precision_field()

    def mining_params(self) -> M.MiningParams:
        return M.MiningParams(
            n_max=self.n_max, k1=self.k1, k2=self.k2, seed=self.seed, subset_size=self.subset_size,
            coverage=self.coverage, skip_stopword_only=self.skip_stopword_only, skip_stopword_edge=self.skip_stopword_edge,
            stopwords=self.stopwords if isinstance(self.stopwords, str) else tuple(self.stopwords),
            lowercase=self.lowercase, unicode_form=self.unicode_form, token_pattern=self.token_pattern,
            chunk_samples=self.chunk_samples,
        )


# ----------------------------------------------------------------------------------------------- workers


def _params_from(payload: dict) -> M.MiningParams:
    p = dict(payload["params"])
    if isinstance(p.get("stopwords"), list):
        p["stopwords"] = tuple(p["stopwords"])
    return M.MiningParams(**p)


def mine_unit(payload: dict) -> dict:
    """Mine one range of samples [a, b) (indices into the index's ascending sample ids)."""
    params = _params_from(payload)
    idx = M.load_index(payload["index_dir"], mmap=True)
    a, b = payload["range"]
    parts = []
    for s in range(a, b, params.chunk_samples):
        sel = M.select_range(idx, s, min(b, s + params.chunk_samples), params)
        parts.append(M.concepts_table(idx, sel, params))
    table = pa.concat_tables(parts).cast(CONCEPTS_SCHEMA) if parts else CONCEPTS_SCHEMA.empty_table()
    w = unit_writer(payload)
    w.write_table("concepts", table)
    n_with = int(pl.from_arrow(table.select(["sample_id"]))["sample_id"].n_unique()) if table.num_rows else 0
    res = w.commit({"rows": table.num_rows, "samples": b - a, "samples_without_concepts": (b - a) - n_with})
    return {"unit": res.unit, "stats": res.stats}


class EmbedWorker:
    """Ray actor: loads the text encoder once, embeds one range of vocabulary texts per call and
    writes table ``embeddings`` (concept_id, embedding fixed_size_list<float16>[d], L2-normalised)."""

    def __init__(self, spec: str, batch: int, torch_threads: int, device: str = "cpu", precision: str = "auto"):
        from pipeline.models.text_encoder import TextEncoder

        self.enc = TextEncoder(spec, torch_threads=torch_threads, device=device, precision=precision)
        self.batch = batch

    def __call__(self, payload: dict) -> dict:
        import pyarrow.parquet as pq

        a, b = payload["range"]
        vocab = _hn_vocab(payload["vocab_path"], payload["min_df"]).slice(a, b - a)
        emb = self.enc.encode(vocab.column("text").to_pylist(), batch_size=self.batch).astype(np.float16)
        table = pa.table({"concept_id": vocab.column("concept_id"),
                          "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.reshape(-1)), emb.shape[1])})
        w = unit_writer(payload)
        w.write_table("embeddings", table)
        res = w.commit({"rows": len(emb)})
        return {"unit": res.unit, "stats": res.stats}


def _hn_vocab(vocab_path, min_df: int) -> pa.Table:
    """The vocabulary rows that take part in hard-negative mining (concept_id order)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pq.read_table(vocab_path, columns=["concept_id", "text", "df"])
    return t.filter(pc.greater_equal(t["df"], min_df)) if min_df > 2 else t


def read_embeddings(paths) -> np.ndarray:
    import pyarrow.parquet as pq

    parts = []
    for p in paths:
        col = pq.read_table(p, columns=["embedding"]).column("embedding").combine_chunks()
        parts.append(np.asarray(col.values).reshape(len(col), col.type.list_size))
    return np.concatenate(parts) if parts else np.zeros((0, 0), np.float16)


# ----------------------------------------------------------------------------------------------- driver


def _read_captions(ctx: RunContext, samples) -> pl.DataFrame:
    try:
        files = [str(f) for f in samples.files("captions")]
    except KeyError:
        raise StageError("samples artifact has no captions table") from None
    if not files:
        raise StageError("samples artifact has no captions")
    df = (pl.scan_parquet(files).select("caption_id", "sample_id", "text")
          .sort("sample_id", "caption_id").collect())
    if ctx.limit is not None:
        keep = df["sample_id"].unique(maintain_order=True).head(ctx.limit)
        df = df.filter(pl.col("sample_id").is_in(keep.implode()))
    return df


def run(ctx: RunContext, cfg: Config) -> dict:
    samples = ctx.artifact("samples")
    mp = cfg.mining_params()
    caps = _read_captions(ctx, samples)
    sample_ids = caps["sample_id"].unique(maintain_order=True).to_numpy()
    if len(sample_ids) == 0:
        raise StageError("samples artifact has no captions")

    records = {}
    enc_spec = cfg.text_encoder or ctx.manifest.models.text_encoder
    if cfg.hard_negatives:
        from pipeline.models.provenance import cached_info
        from pipeline.models.text_encoder import TextEncoder

        # cached: a rerun with nothing to do loads no model
        records["text_encoder"] = cached_info(ctx.output, "text_encoder", {"text_encoder": enc_spec}, lambda: TextEncoder(enc_spec).record)
    params = {**cfg.model_dump(mode="json"), "limit": ctx.limit, "text_encoder": enc_spec if cfg.hard_negatives else None}
    for k in ("enabled", "chunk_samples", "encode_batch", "encode_unit", "torch_threads"):
        params.pop(k, None)  # do not change the result
    params = fingerprinted(params, cfg.device, cfg.precision, cfg.num_gpus)  # device: where; precision: only if not fp32
    writer = ctx.writer("concepts", NAME, params, inputs={"samples": samples.fingerprint}, models=records)

    ranges = [(a, min(a + cfg.shard_size, len(sample_ids))) for a in range(0, len(sample_ids), cfg.shard_size)]
    mine_names = [f"{i:05d}" for i in range(len(ranges))]
    mine_fps = [writer.unit_fingerprint(n, [int(sample_ids[a]), int(sample_ids[b - 1]), b - a]) for n, (a, b) in zip(mine_names, ranges)]
    all_done = all(writer.is_done(n, fp) for n, fp in zip(mine_names, mine_fps))
    index_dir = writer.dir / "_index"

    def saved_index():
        """The whole-dataset index, built once, saved for the workers and memory-mapped from disk
        (the driver does not keep a second in-memory copy while the workers run)."""
        if not (index_dir / "index.json").is_file():
            shutil.rmtree(index_dir, ignore_errors=True)
            built = M.prepare(caps["sample_id"].to_numpy(), caps["text"], mp,
                              progress=lambda msg: log.info("mine-concepts: %s", msg))
            shutil.rmtree(index_dir.with_name("_index.tmp"), ignore_errors=True)
            M.save_index(built, index_dir.with_name("_index.tmp"))
            del built
            index_dir.with_name("_index.tmp").rename(index_dir)
        return M.load_index(index_dir, mmap=True)

    # 1. mine sample ranges on Ray workers
    state = writer.dir / "_state"
    live = set(mine_names) | {VOCAB_UNIT, HARD_NEG_UNIT} | {p.stem for p in state.glob("emb-*.json")}
    if not all_done:
        shutil.rmtree(index_dir, ignore_errors=True)  # may be from other data or parameters
        saved_index()
    payload = {"index_dir": str(index_dir), "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in mp.__dict__.items()}}
    units = [(n, [int(sample_ids[a]), int(sample_ids[b - 1]), b - a], dict(payload, range=[a, b])) for n, (a, b) in zip(mine_names, ranges)]
    run_units(ctx, writer, units, mine_unit, total_rows=len(sample_ids), live=live)
    concept_shas = [f["sha256"] for f in _unit_files(writer, mine_names)]

    # 2. vocabulary of the concepts used
    vocab_fp = writer.unit_fingerprint(VOCAB_UNIT, concept_shas)
    if not writer.is_done(VOCAB_UNIT, vocab_fp):
        cids = pl.scan_parquet([str(writer.local_file(f["path"])) for f in _unit_files(writer, mine_names)]).select("concept_id").unique().collect()
        vocab = M.vocab_table(saved_index(), cids["concept_id"].to_numpy()).cast(VOCAB_SCHEMA)
        w = writer.unit_writer(VOCAB_UNIT, vocab_fp)
        w.write_table("vocab", vocab)
        w.commit({"vocab": vocab.num_rows})
    shutil.rmtree(index_dir, ignore_errors=True)
    del caps
    names = mine_names + [VOCAB_UNIT]
    vocab_path = writer.local_file(_unit_files(writer, [VOCAB_UNIT])[0]["path"])

    # 3. hard negatives: embed on Ray actors, search with FAISS in the driver
    extra = {}
    if cfg.hard_negatives:
        import pyarrow.parquet as pq

        vocab = _hn_vocab(vocab_path, cfg.hard_negatives_min_df)
        U = vocab.num_rows
        vsha = _unit_files(writer, [VOCAB_UNIT])[0]["sha256"]
        emb_units = []
        for i, a in enumerate(range(0, max(U, 1), cfg.encode_unit)):
            b = min(U, a + cfg.encode_unit)
            emb_units.append((f"emb-{i:05d}", [vsha, a, b, cfg.hard_negatives_min_df],
                              {"vocab_path": str(vocab_path), "range": [a, b], "min_df": cfg.hard_negatives_min_df}))
        emb_names = [u[0] for u in emb_units]
        live |= set(emb_names)
        run_units(ctx, writer, emb_units, EmbedWorker, actor=True, num_cpus=cfg.torch_threads,
                  constructor_kwargs={"spec": enc_spec, "batch": cfg.encode_batch, "torch_threads": cfg.torch_threads,
                                      "device": cfg.device, "precision": cfg.precision},
                  total_rows=U, live=live)
        names += emb_names
        emb_files = _unit_files(writer, emb_names)
        hn_fp = writer.unit_fingerprint(HARD_NEG_UNIT, [f["sha256"] for f in emb_files])
        if not writer.is_done(HARD_NEG_UNIT, hn_fp):
            from pipeline.concepts.hard_negatives import mine_hard_negatives, token_matrix

            emb = read_embeddings([writer.local_file(f["path"]) for f in emb_files]).astype(np.float32)
            toks = token_matrix(vocab.column("text").to_pylist(), cfg.n_max)
            nb, sc, kind = mine_hard_negatives(emb, toks, k=cfg.hard_negatives_k, index=cfg.hard_negatives_index,
                                               flat_max=cfg.hard_negatives_flat_max)
            cid = vocab.column("concept_id").to_numpy()
            if len(cid) and cid.max() >= 2**31:
                raise StageError("concept ids exceed int32; hard_negatives.negatives is list<int32> by contract")
            valid = nb >= 0
            offs = np.concatenate([[0], np.cumsum(valid.sum(1))]).astype(np.int32)
            table = pa.table({
                "concept_id": pa.array(cid, pa.int64()),
                "negatives": pa.ListArray.from_arrays(pa.array(offs), pa.array(cid[nb[valid]].astype(np.int32))),
                "scores": pa.ListArray.from_arrays(pa.array(offs), pa.array(sc[valid], pa.float32())),
            }).cast(HARD_NEG_SCHEMA)
            w = writer.unit_writer(HARD_NEG_UNIT, hn_fp)
            w.write_table("hard_negatives", table)
            w.commit({"hard_negative_index": kind})
        names.append(HARD_NEG_UNIT)
        extra["hard_negatives"] = {"k": cfg.hard_negatives_k, "encoder": enc_spec,
                                   "embedding_dim": pq.read_schema(writer.local_file(emb_files[0]["path"])).field("embedding").type.list_size
                                   if emb_files else None}
    m = writer.finalize(names, schema={"concepts": str(CONCEPTS_SCHEMA), "vocab": str(VOCAB_SCHEMA),
                                       "hard_negatives": str(HARD_NEG_SCHEMA),
                                       "embeddings": "concept_id int64, embedding fixed_size_list<float16>[d] (L2-normalised)"},
                        extra=extra)
    return {
        "samples": len(sample_ids),
        "concept_rows": m["tables"].get("concepts", {}).get("rows", 0),
        "vocab": m["tables"].get("vocab", {}).get("rows", 0),
        "path": str(writer.location),
    }


def _unit_files(writer, names: list[str]) -> list[dict]:
    import json

    files = []
    for n in names:
        m = writer.marker(n)  # fetched from the store when a worker on another node wrote it
        if m is None:
            raise RuntimeError(f"concepts: unit {n} has no completion marker")
        files.extend(m["files"])
    return files


def inspect_view(artifact, n: int) -> str:
    """Concepts as text: a few samples with their concepts and partners, and hard negatives."""
    vocab = pl.from_arrow(artifact.read("vocab"))
    text = dict(zip(vocab["concept_id"].to_list(), vocab["text"].to_list()))
    con = pl.from_arrow(artifact.read("concepts"))
    lines = [f"{vocab.height} concepts; by n: " + ", ".join(f"n={r['n']}: {r['len']}" for r in vocab.group_by("n").len().sort("n").to_dicts())]
    for sid in con["sample_id"].unique(maintain_order=True).head(n).to_list():
        rows = con.filter(pl.col("sample_id") == sid)
        lines.append(f"sample {sid}: {rows.height} concepts")
        for r in rows.head(8).to_dicts():
            lines.append(f"  {text[r['concept_id']]!r}  (df {vocab.filter(pl.col('concept_id') == r['concept_id'])['df'][0]}) partners {r['partners']}")
    if "hard_negatives" in artifact.tables():
        hn = pl.from_arrow(artifact.read("hard_negatives")).head(n)
        lines.append("hard negatives:")
        for r in hn.to_dicts():
            negs = ", ".join(f"{text[c]!r} {s:.2f}" for c, s in zip(r["negatives"][:5], r["scores"][:5]))
            lines.append(f"  {text[r['concept_id']]!r} -> {negs}")
    return "\n".join(lines)
