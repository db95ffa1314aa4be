"""Frozen CLIP encodings of the C3 concept vocabulary, and each concept's full membership -> `concept_tokens`.

Input for the C3 trainer (``train run c3``, Song et al. 2024 Sec. 3.3), which fuses concept tokens
with the cached image tokens and never loads a text encoder. Model: ``models.clip``, the same CLIP
(and the same activations, :mod:`pipeline.models.clip`) as ``extract-clip-tokens``; the trainer
refuses a `concept_tokens` whose CLIP weights differ from its `clip_tokens`'.

Artifact layout (``<output>/concept_tokens/``), one unit per ``encode_unit`` concepts::

    index/index-<unit>.parquet    concept_id int64, n_tokens int32 (valid tokens BOS .. EOS, a prefix), text string
    pooled/pooled-<unit>.npy      float16 [U, P]      EOS-pooled projected embedding (not normalised)
    tokens/tokens-<unit>.npy      float16 [U, M, d_t] last hidden state after the final LayerNorm, zero
                                  beyond n_tokens (absent with pooled_only); M = the unit's longest concept
    membership/membership-membership.parquet   concept_id int64, sample_id int64: every sample one of whose
                                  captions contains the concept (sorted; rebuilt from the normalised captions)

Only concepts with ``df >= min_df`` are encoded (and get membership rows); the trainer skips, and
counts, concept rows without an encoding. Cost: ~2 x M x d_t bytes per concept for tokens (16 KiB
at ViT-B, M = 16) + 2 x P pooled (1 KiB); BENCHMARKS.md has the measured figures.
Membership uses the miner's own normalisation (read from the `concepts` manifest: case, Unicode
form, token pattern, N), so "contains" means exactly what mining meant.
"""

from __future__ import annotations

import logging

import pyarrow as pa
from pydantic import Field

from pipeline.stage import RunContext, StageConfig, StageError, model_key, run_units, unit_writer
from pipeline.models.device import device_field, resolve_device

log = logging.getLogger("pipeline")

NAME = "encode-concepts"
READS = ["concepts", "samples"]
WRITES = ["concept_tokens"]

INDEX_SCHEMA = pa.schema([("concept_id", pa.int64()), ("n_tokens", pa.int32()), ("text", pa.string())])
MEMBERSHIP_SCHEMA = pa.schema([("concept_id", pa.int64()), ("sample_id", pa.int64())])
MEMBERSHIP_UNIT = "membership"


class Config(StageConfig):
    min_df: int = Field(2, ge=2, description="encode only concepts whose df (samples containing it) is at least this "
                        "(2 = every mined concept); bounds the cache on large vocabularies")
    pooled_only: bool = Field(False, description="store only the pooled embedding (P fp16 values per concept), no "
                              "token states: the trainer then fuses a single concept token")
    max_tokens: int = Field(16, ge=2, le=77, description="CLIP text tokens per concept, BOS/EOS included (concepts are "
                            "<= N words; 16 fits 5 words of common sub-word lengths)")
    project_tokens: bool = Field(False, description="tokens through the text projection (as extract-clip-tokens' "
                                 "project_tokens; must match clip_tokens)")
    membership: bool = Field(True, description="write the membership table (the trainer needs it for negatives)")
    encode_unit: int = Field(50_000, ge=1, description="concepts per unit (Ray actor work item, unit of resume)")
    batch_size: int = Field(256, ge=1, description="concept texts per text-tower forward pass")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per encoder actor (torch threads)")
    device: str = device_field()


def _vocab(path_list, min_df: int) -> pa.Table:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    t = pa.concat_tables([pq.read_table(p, columns=["concept_id", "text", "n", "df"]) for p in path_list])
    t = t.sort_by("concept_id")
    return t.filter(pc.greater_equal(t["df"], min_df)) if min_df > 2 else t


def write_encoded(w, concept_ids, texts, enc: dict) -> None:
    """One unit's files: ``pooled`` (and ``tokens`` unless absent from ``enc``) .npy, ``index`` table.
    ``enc`` as :func:`pipeline.concepts.concept_tokens.encode_concepts` returns it."""
    from pipeline.concepts.concept_tokens import save_npy_atomic

    n = len(enc["n_tokens"])
    for table in ("pooled", "tokens"):
        if table in enc:
            p = w.dir / table / f"{table}-{w.unit}.npy"
            save_npy_atomic(p, enc[table])
            w.record_shard(p, n, table=table)
    w.write_table("index", pa.table({"concept_id": pa.array(concept_ids, pa.int64()),
                                     "n_tokens": pa.array(enc["n_tokens"], pa.int32()),
                                     "text": pa.array(texts, pa.string())}).cast(INDEX_SCHEMA))


def write_membership(w, concept_ids, sample_ids) -> None:
    w.write_table("membership", pa.table({"concept_id": pa.array(concept_ids, pa.int64()),
                                          "sample_id": pa.array(sample_ids, pa.int64())}).cast(MEMBERSHIP_SCHEMA))


class ConceptTokenWorker:
    """Ray actor: loads CLIP once, encodes one range of the (min_df-filtered) vocabulary per call."""

    def __init__(self, spec: str, device: str, threads: int, batch_size: int, max_tokens: int, pooled_only: bool,
                 project_tokens: bool):
        import torch

        from pipeline.models.clip import load_clip

        torch.set_num_threads(max(1, threads))
        self.model, _, self.tokenizer, _ = load_clip(spec, resolve_device(device))
        self.batch, self.max_tokens, self.pooled_only, self.project = batch_size, max_tokens, pooled_only, project_tokens

    def __call__(self, payload: dict) -> dict:
        from pipeline.concepts.concept_tokens import encode_concepts

        a, b = payload["range"]
        vocab = _vocab(payload["vocab_paths"], payload["min_df"]).slice(a, b - a)
        enc = encode_concepts(self.model, self.tokenizer, vocab.column("text").to_pylist(), self.max_tokens, self.batch,
                              self.pooled_only, self.project)
        w = unit_writer(payload)
        write_encoded(w, vocab.column("concept_id"), vocab.column("text"), enc)
        res = w.commit({"concepts": len(enc["n_tokens"])})
        return {"unit": res.unit, "stats": res.stats}


def run(ctx: RunContext, cfg: Config) -> dict:
    import polars as pl

    from pipeline.concepts.concept_tokens import membership
    from pipeline.concepts.normalize import Normalizer
    from pipeline.models.clip import load_clip
    from pipeline.models.provenance import cached_info

    concepts = ctx.artifact("concepts")
    samples = ctx.artifact("samples")
    try:
        vocab_files = [str(f) for f in concepts.files("vocab")]
    except KeyError:
        raise StageError(f"{concepts.dir}: the concepts artifact has no vocab table; rerun `pipeline run mine-concepts{ctx.args}`") from None
    vocab = _vocab(vocab_files, cfg.min_df)
    U = vocab.num_rows
    if U == 0:
        raise StageError(f"{concepts.dir}: empty concept vocabulary (no concept with df >= {cfg.min_df}): nothing to "
                         "encode; mine more captions or lower stages.encode_concepts.min_df")
    from pipeline.models.scene_oracle import is_oracle, require_generated

    spec = ctx.manifest.models.clip
    if is_oracle(spec):  # the testbed instrument: the generated dataset only, refused before any work
        require_generated(ctx.manifest, "clip")
    with model_key("models.clip", spec):  # cached: a rerun with nothing to do loads no model
        record = cached_info(ctx.output, "clip", {"clip": spec}, lambda: load_clip(spec)[3])
    dims = {k: record[k] for k in ("text_dim", "projection_dim")}
    if cfg.project_tokens:
        dims["text_dim"] = dims["projection_dim"]
    params = cfg.model_dump(mode="json", exclude={"enabled", "num_cpus", "device", "encode_unit", "batch_size"})
    writer = ctx.writer("concept_tokens", NAME, params,
                        inputs={"concepts": concepts.fingerprint, "samples": samples.fingerprint}, models={"clip": record})
    units = []
    for i, a in enumerate(range(0, U, cfg.encode_unit)):
        b = min(U, a + cfg.encode_unit)
        units.append((f"{i:05d}", [a, b], {"vocab_paths": vocab_files, "range": [a, b], "min_df": cfg.min_df}))
    names = [u[0] for u in units]
    live = set(names) | ({MEMBERSHIP_UNIT} if cfg.membership else set())
    run_units(ctx, writer, units, ConceptTokenWorker, actor=True, num_cpus=cfg.num_cpus,
              constructor_kwargs=dict(spec=spec, device=cfg.device, threads=int(round(cfg.num_cpus)),
                                      batch_size=cfg.batch_size, max_tokens=cfg.max_tokens,
                                      pooled_only=cfg.pooled_only, project_tokens=cfg.project_tokens),
              total_rows=U, live=live)
    stats: dict = {}
    if cfg.membership:
        mp = concepts.manifest.get("parameters", {})
        norm = Normalizer(lowercase=mp.get("lowercase", True), unicode_form=mp.get("unicode_form", "NFKC"),
                          token_pattern=mp.get("token_pattern", Normalizer.token_pattern))
        n_max = int(mp.get("n_max", 5))
        fp = writer.unit_fingerprint(MEMBERSHIP_UNIT, [norm.lowercase, norm.unicode_form, norm.token_pattern, n_max])
        if not writer.is_done(MEMBERSHIP_UNIT, fp):
            caps = pl.scan_parquet([str(f) for f in samples.files("captions")]).select("sample_id", "text").collect()
            cid, sid = membership(caps["sample_id"].to_numpy(), caps["text"], vocab.column("concept_id").to_numpy(),
                                  vocab.column("text").to_pylist(), norm, n_max)
            w = writer.unit_writer(MEMBERSHIP_UNIT, fp)
            write_membership(w, cid, sid)
            w.commit({"membership_rows": len(cid)})
        names.append(MEMBERSHIP_UNIT)
    m = writer.finalize(names, extra={"dims": dims, "pooled_only": cfg.pooled_only},
                        schema={"index": str(INDEX_SCHEMA), "pooled": "float16 [U, P] .npy per unit",
                                "tokens": "float16 [U, M, d_t] .npy per unit (zero beyond n_tokens)",
                                "membership": str(MEMBERSHIP_SCHEMA)})
    stats.update({"concepts": m["tables"].get("index", {}).get("rows", 0),
                  "membership_rows": m["tables"].get("membership", {}).get("rows", 0), "path": str(writer.location)})
    return stats
