"""Frozen CLIP patch and text tokens per sample (ConceptOT Sec. 2.1, App. G.1) -> `clip_tokens`.

Model: ``models.clip`` (any HF CLIP id/folder, ``tiny-random``, ``base-random``), see
:mod:`pipeline.models.clip` for exactly which activations are taken. Images are prepared by the
model's own image processor; texts are truncated to ``max_text_tokens`` (48, BOS/EOS included).

Artifact layout (``<output>/clip_tokens/``)::

    shards/<unit>.tar          WebDataset, one sample per key = sample_id zero-padded to 12 digits
    images/images-<unit>.parquet     sample_id int64, shard string, image_embed list<float16>[P]
    captions/captions-<unit>.parquet caption_id int64, sample_id int64, n_tokens int32, text_embed list<float16>[P]

Fields of each WebDataset sample (C = number of the sample's captions, M = the longest caption's
valid-token count within this sample, N = patches, d_v / d_t = vision / text width, P = joint
projection width; all in ``_manifest.json`` ``schema`` and ``dims``)::

    patch_tokens.npy   float16 [N, d_v]   vision encoder last hidden state, CLS dropped (row-major patch grid)
    image_embed.npy    float16 [P]        pooled projected image embedding (not L2-normalised)
    text_tokens.npy    float16 [C, M, d_t] text encoder last hidden state (final LN), zero beyond the mask
    text_mask.npy      bool    [C, M]     True on valid tokens (BOS .. EOS)
    text_embed.npy     float16 [C, P]     EOS-pooled projected caption embedding (not normalised)
    caption_ids.npy    int64   [C]        caption_id of each row, ascending
    token_ids.npy      int32   [C, M]     tokenizer ids (0 beyond the mask)
    token_offsets.npy  int32   [C, M, 2]  character span of each token in the caption text ([0,0] for BOS/EOS/pad)

With ``project_tokens: true`` the tokens are in the joint space instead (d_v = d_t = P). With
``token_precision: int8`` ``patch_tokens.npy`` and ``text_tokens.npy`` are int8 beside a float16 scale
per token (``patch_tokens_scale.npy`` [N], ``text_tokens_scale.npy`` [C, M]); every reader through
:mod:`pipeline.io.shards` gets the float16 values back (:mod:`pipeline.io.quant`).
Read shards back into padded training batches with :mod:`pipeline.loaders.clip_tokens`.
"""

from __future__ import annotations

import time
from typing import ClassVar, Literal

import numpy as np
import pyarrow as pa
from pydantic import Field

from pipeline.io.quant import quantize_fields
from pipeline.models.device import device_field
from pipeline.stage import RunContext, StageConfig, model_key
from pipeline.stages._image_actor import IMAGES_SCHEMA, ImageActor, f16_list, images_table, run_image_stage
from pipeline.stages._image_units import plan_image_units

NAME = "extract-clip-tokens"
READS = ["samples"]
WRITES = ["clip_tokens"]


class Config(StageConfig):
    # ~0.55 MB per sample for ViT-B/16 (196x768 + 5 captions x ~16x512, fp16): 256 samples ~ 140 MB shards.
    shard_size: int = Field(256, ge=1, description="samples per output shard (bounds shard bytes; unit of resume)")
    batch_size: int = Field(32, ge=1, description="images per encoder forward pass (batched across samples)")
    text_batch_size: int = Field(128, ge=1, description="captions per text forward pass")
    max_text_tokens: int = Field(48, ge=2, le=77, description="ConceptOT App. G.1: M <= 48 (BOS/EOS included)")
    project_tokens: bool = Field(
        False,
        description="store tokens after the projection (joint space, FILIP-style) instead of the encoder outputs "
        "(App. G.1: 768-d patches, 512-d text tokens)",
    )
    token_precision: Literal["float16", "int8"] = Field(
        "float16",
        description="patch_tokens and text_tokens on disk: float16, or int8 with a float16 scale per token "
        "(<field>_scale.npy; about half the bytes, error <= 1/254 of each token's largest value; readers get "
        "float16 back, pipeline/io/quant.py)",
    )
    num_cpus: float = Field(1.0, gt=0, description="CPUs per encoder actor (torch threads)")
    device: str = device_field()
    # float16 tokens are what every clip_tokens artifact written before the option held: unchanged fingerprint
    fingerprint_omits_default: ClassVar[dict] = {"token_precision": "float16"}


SCHEMA = {
    "patch_tokens.npy": "float16 [N, d_v]",
    "image_embed.npy": "float16 [P]",
    "text_tokens.npy": "float16 [C, M, d_t]",
    "text_mask.npy": "bool [C, M]",
    "text_embed.npy": "float16 [C, P]",
    "caption_ids.npy": "int64 [C]",
    "token_ids.npy": "int32 [C, M]",
    "token_offsets.npy": "int32 [C, M, 2]",
    "images": IMAGES_SCHEMA,
    "captions": "caption_id int64, sample_id int64, n_tokens int32, text_embed list<float16>[P]",
}


INT8_FIELDS = ("patch_tokens.npy", "text_tokens.npy")
INT8_SCHEMA = {
    "patch_tokens.npy": "int8 [N, d_v] (token_precision int8; read back float16 = value x scale)",
    "patch_tokens_scale.npy": "float16 [N]",
    "text_tokens.npy": "int8 [C, M, d_t] (token_precision int8)",
    "text_tokens_scale.npy": "float16 [C, M]",
}


class ClipTokenWorker(ImageActor):
    """Ray actor: loads CLIP once, then encodes whole units (one output shard each)."""

    encode_stat = "encode_image_s"

    def __init__(self, spec: str, device: str, threads: int, batch_size: int, text_batch_size: int, max_text_tokens: int,
                 project_tokens: bool, token_precision: str = "float16"):
        self.text_batch_size, self.max_text_tokens, self.project_tokens = text_batch_size, max_text_tokens, project_tokens
        self.token_precision = token_precision
        super().__init__(spec, device, threads, batch_size)

    def load(self, spec: str, device: str) -> None:
        from pipeline.models.clip import load_clip

        self.model, self.processor, self.tokenizer, self.record = load_clip(spec, device)

    def prepare(self, images):
        from pipeline.models.clip import preprocess_images

        if self.processor is None:  # scene-oracle: the image is decoded (the error policy holds) but not used
            return images
        return preprocess_images(self.processor, images)

    def encode(self, records, pixels):
        from pipeline.models.clip import encode_images

        if getattr(self.model, "is_scene_oracle", False):  # the testbed instrument reads the scene, not the pixels
            return self.model.encode_records(records)

        out = encode_images(self.model, pixels, self.project_tokens)
        patches = out["patch_tokens"].float().cpu().numpy().astype(np.float16)
        pooled = out["image_embed"].float().cpu().numpy().astype(np.float16)
        return list(zip(patches, pooled))

    def _encode_texts(self, texts: list[str]) -> dict[str, np.ndarray]:
        """All captions of the unit, in batches sorted by length (less padding, same result: the
        text tower is causal, so pad positions never influence valid ones)."""
        from pipeline.models.clip import encode_texts

        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        tokens, embeds, masks, ids, offsets = [None] * len(texts), [None] * len(texts), [None] * len(texts), [None] * len(texts), [None] * len(texts)
        for s in range(0, len(order), self.text_batch_size):
            idx = order[s : s + self.text_batch_size]
            batch = [texts[i] for i in idx]
            out = encode_texts(self.model, self.tokenizer, batch, self.max_text_tokens, self.project_tokens, return_offsets=True)
            off_all = out["offsets"].cpu().numpy().astype(np.int32)
            tok = out["text_tokens"].float().cpu().numpy().astype(np.float16)
            emb = out["text_embed"].float().cpu().numpy().astype(np.float16)
            msk = out["text_mask"].cpu().numpy()
            tid = out["input_ids"].cpu().numpy().astype(np.int32)
            for j, i in enumerate(idx):
                n = int(msk[j].sum())
                tokens[i], embeds[i], masks[i], ids[i] = tok[j, :n], emb[j], n, tid[j, :n]
                offsets[i] = off_all[j, :n]
        return {"tokens": tokens, "embeds": embeds, "lengths": masks, "ids": ids, "offsets": offsets}

    def complete(self, done, stats):
        """The unit's captions, encoded together, padded per sample to its longest caption."""
        t0 = time.perf_counter()
        flat = [text for r, _ in done for _, text in r["captions"]]
        txt = self._encode_texts(flat) if flat else None
        d_t = self.model.config.projection_dim if self.project_tokens else self.model.config.text_config.hidden_size
        samples, pos = [], 0
        for r, (patches, pooled) in done:
            c = len(r["captions"])
            rows = range(pos, pos + c)
            pos += c
            lens = [txt["lengths"][i] for i in rows] if c else []
            m = max(lens, default=0)
            tokens = np.zeros((c, m, d_t), np.float16)
            mask = np.zeros((c, m), bool)
            ids = np.zeros((c, m), np.int32)
            offs = np.zeros((c, m, 2), np.int32)
            for j, i in enumerate(rows):
                n = lens[j]
                tokens[j, :n], mask[j, :n], ids[j, :n], offs[j, :n] = txt["tokens"][i], True, txt["ids"][i], txt["offsets"][i]
            embeds = np.stack([txt["embeds"][i] for i in rows]) if c else np.zeros((0, pooled.shape[0]), np.float16)
            fields = {
                "patch_tokens.npy": patches,
                "image_embed.npy": pooled,
                "text_tokens.npy": tokens,
                "text_mask.npy": mask,
                "text_embed.npy": embeds,
                "caption_ids.npy": np.array([cid for cid, _ in r["captions"]], np.int64),
                "token_ids.npy": ids,
                "token_offsets.npy": offs,
            }
            if self.token_precision == "int8":
                fields = quantize_fields(fields, INT8_FIELDS)
            samples.append((r, fields))
        stats.update(captions=len(flat), encode_text_s=round(time.perf_counter() - t0, 4))
        return samples

    def tables(self, done, shard):
        p_dim = self.model.config.projection_dim
        caps = [(r["sample_id"], cid) for r, f in done for cid in f["caption_ids.npy"].tolist()]
        n_tokens = [int(n) for _, f in done for n in f["text_mask.npy"].sum(axis=1)]
        cap_emb = np.concatenate([f["text_embed.npy"] for _, f in done]) if caps else np.zeros((0, p_dim), np.float16)
        captions = pa.table(
            {
                "caption_id": pa.array([cid for _, cid in caps], pa.int64()),
                "sample_id": pa.array([sid for sid, _ in caps], pa.int64()),
                "n_tokens": pa.array(n_tokens, pa.int32()),
                "text_embed": f16_list(cap_emb),
            }
        )
        return {"images": images_table(done, shard, p_dim), "captions": captions}


def run(ctx: RunContext, cfg: Config) -> dict:
    from pipeline.models.clip import load_clip
    from pipeline.models.provenance import cached_info

    from pipeline.models.scene_oracle import is_oracle, require_generated

    spec = ctx.manifest.models.clip
    oracle = is_oracle(spec)
    if oracle:
        require_generated(ctx.manifest, "clip")
    plan = plan_image_units(ctx, cfg.shard_size, ("captions", "scene") if oracle else ("captions",))
    # Provenance and dims: computed by a model load once, then cached (a rerun with nothing to do
    # loads no model; see pipeline.models.provenance.cached_info).
    with model_key("models.clip", spec):
        record = cached_info(ctx.output, "clip", {"clip": spec}, lambda: load_clip(spec)[3])
    dims = {k: record[k] for k in ("image_size", "patch_size", "n_patches", "vision_dim", "text_dim", "projection_dim")}
    token_dims = dict(dims)
    if cfg.project_tokens:
        token_dims["vision_dim"] = token_dims["text_dim"] = dims["projection_dim"]
    m, summary = run_image_stage(
        ctx, cfg, artifact="clip_tokens", stage=NAME, plan=plan, actor=ClipTokenWorker, models={"clip": record},
        constructor_kwargs=dict(spec=spec, device=cfg.device, batch_size=cfg.batch_size, text_batch_size=cfg.text_batch_size,
                                max_text_tokens=cfg.max_text_tokens, project_tokens=cfg.project_tokens,
                                token_precision=cfg.token_precision),
        extra={"dims": token_dims, "token_precision": cfg.token_precision},
        schema=SCHEMA if cfg.token_precision == "float16" else {**SCHEMA, **INT8_SCHEMA},
    )
    return {**summary, "captions": m["tables"].get("captions", {}).get("rows", 0)}
