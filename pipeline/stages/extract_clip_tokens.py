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

With ``project_tokens: true`` the tokens are in the joint space instead (d_v = d_t = P).
Read shards back into padded training batches with :mod:`pipeline.loaders.clip_tokens`.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
from pydantic import Field

from pipeline.io.wds import ShardWriter, sample_key
from pipeline.models.device import device_field, resolve_device
from pipeline.stage import RunContext, StageConfig, isolate_failures, model_key, run_units, unit_writer
from pipeline.stages._image_units import IMAGE_UNITS, decoded_batches, image_writer, open_images, plan_image_units, unit_records

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
    num_cpus: float = Field(1.0, gt=0, description="CPUs per encoder actor (torch threads)")
    device: str = device_field()


SCHEMA = {
    "patch_tokens.npy": "float16 [N, d_v]",
    "image_embed.npy": "float16 [P]",
    "text_tokens.npy": "float16 [C, M, d_t]",
    "text_mask.npy": "bool [C, M]",
    "text_embed.npy": "float16 [C, P]",
    "caption_ids.npy": "int64 [C]",
    "token_ids.npy": "int32 [C, M]",
    "token_offsets.npy": "int32 [C, M, 2]",
    "images": "sample_id int64, shard string, image_embed list<float16>[P]",
    "captions": "caption_id int64, sample_id int64, n_tokens int32, text_embed list<float16>[P]",
}


def _f16_list(arr: np.ndarray) -> pa.Array:
    arr = np.ascontiguousarray(arr, dtype=np.float16)
    return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1), type=pa.float16()), arr.shape[1])


class ClipTokenWorker:
    """Ray actor: loads CLIP once, then encodes whole units (one output shard each)."""

    def __init__(self, spec: str, device: str, threads: int, batch_size: int, text_batch_size: int, max_text_tokens: int, project_tokens: bool):
        import torch

        from pipeline.models.clip import load_clip

        torch.set_num_threads(max(1, threads))
        self.model, self.processor, self.tokenizer, self.record = load_clip(spec, resolve_device(device))
        self.batch_size, self.text_batch_size = batch_size, text_batch_size
        self.max_text_tokens, self.project_tokens = max_text_tokens, project_tokens

    def _decode(self, records):
        from pipeline.models.clip import preprocess_images

        kept, images, failed = open_images(records)
        pixels = preprocess_images(self.processor, images) if images else None
        return kept, pixels, failed

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

    def __call__(self, payload: dict) -> dict:
        from pipeline.models.clip import encode_images

        w = unit_writer(payload)
        t_img = t_txt = t_write = 0.0
        times = {"decode_s": 0.0}
        encoded: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        kept_records = []
        for kept, pixels in decoded_batches(w, unit_records(payload), self.batch_size, self._decode, times):
            t0 = time.perf_counter()
            kept, out = isolate_failures(w, kept, pixels, lambda _r, px: encode_images(self.model, px, self.project_tokens))
            if out is None:
                continue
            patches = out["patch_tokens"].float().cpu().numpy().astype(np.float16)
            pooled = out["image_embed"].float().cpu().numpy().astype(np.float16)
            t_img += time.perf_counter() - t0
            for k, r in enumerate(kept):
                encoded[r["sample_id"]] = (patches[k], pooled[k])
                kept_records.append(r)
        t0 = time.perf_counter()
        flat = [(r["sample_id"], cid, text) for r in kept_records for cid, text in r["captions"]]
        txt = self._encode_texts([f[2] for f in flat]) if flat else None
        t_txt = time.perf_counter() - t0

        t0 = time.perf_counter()
        d_t = self.model.config.projection_dim if self.project_tokens else self.model.config.text_config.hidden_size
        path = w.shard_path()
        img_rows = {"sample_id": [], "embed": []}
        cap_rows = {"caption_id": [], "sample_id": [], "n_tokens": [], "embed": []}
        pos = 0
        with ShardWriter(path) as sw:
            for r in kept_records:
                sid = r["sample_id"]
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
                p_dim = encoded[sid][1].shape[0]
                embeds = np.stack([txt["embeds"][i] for i in rows]) if c else np.zeros((0, p_dim), np.float16)
                sw.write(
                    sample_key(sid),
                    {
                        "patch_tokens.npy": encoded[sid][0],
                        "image_embed.npy": encoded[sid][1],
                        "text_tokens.npy": tokens,
                        "text_mask.npy": mask,
                        "text_embed.npy": embeds,
                        "caption_ids.npy": np.array([cid for cid, _ in r["captions"]], np.int64),
                        "token_ids.npy": ids,
                        "token_offsets.npy": offs,
                    },
                )
                img_rows["sample_id"].append(sid)
                img_rows["embed"].append(encoded[sid][1])
                for j, (cid, _) in enumerate(r["captions"]):
                    cap_rows["caption_id"].append(cid)
                    cap_rows["sample_id"].append(sid)
                    cap_rows["n_tokens"].append(lens[j])
                    cap_rows["embed"].append(embeds[j])
        w.record_shard(path, sw.count)
        p_dim = self.model.config.projection_dim
        shard_rel = str(path.relative_to(w.dir))
        img_emb = np.stack(img_rows["embed"]) if img_rows["embed"] else np.zeros((0, p_dim), np.float16)
        cap_emb = np.stack(cap_rows["embed"]) if cap_rows["embed"] else np.zeros((0, p_dim), np.float16)
        w.write_table(
            "images",
            pa.table(
                {
                    "sample_id": pa.array(img_rows["sample_id"], pa.int64()),
                    "shard": pa.array([shard_rel] * len(img_rows["sample_id"]), pa.string()),
                    "image_embed": _f16_list(img_emb),
                }
            ),
        )
        w.write_table(
            "captions",
            pa.table(
                {
                    "caption_id": pa.array(cap_rows["caption_id"], pa.int64()),
                    "sample_id": pa.array(cap_rows["sample_id"], pa.int64()),
                    "n_tokens": pa.array(cap_rows["n_tokens"], pa.int32()),
                    "text_embed": _f16_list(cap_emb),
                }
            ),
        )
        t_write = time.perf_counter() - t0
        stats = {
            "rows": len(kept_records),
            "captions": len(flat),
            "rejected": len(w.errors),
            "decode_s": round(times["decode_s"], 4),
            "encode_image_s": round(t_img, 4),
            "encode_text_s": round(t_txt, 4),
            "write_s": round(t_write, 4),
        }
        res = w.commit(stats)
        return {"unit": res.unit, "stats": res.stats}


def run(ctx: RunContext, cfg: Config) -> dict:
    from pipeline.models.clip import load_clip
    from pipeline.models.provenance import cached_info

    spec = ctx.manifest.models.clip
    plan = plan_image_units(ctx, cfg.shard_size, ("captions",))
    # Provenance and dims: computed by a model load once, then cached (a rerun with nothing to do
    # loads no model; see pipeline.models.provenance.cached_info).
    with model_key("models.clip", spec):
        record = cached_info(ctx.output, "clip", {"clip": spec}, lambda: load_clip(spec)[3])
    dims = {k: record[k] for k in ("image_size", "patch_size", "n_patches", "vision_dim", "text_dim", "projection_dim")}
    params = cfg.model_dump(mode="json", exclude={"enabled", "num_cpus", "device"})
    params["limit"] = ctx.limit
    writer = image_writer(ctx, "clip_tokens", NAME, params, plan, models={"clip": record})
    names = run_units(
        ctx,
        writer,
        plan.units,
        ClipTokenWorker,
        split=IMAGE_UNITS,
        actor=True,
        num_cpus=cfg.num_cpus,
        constructor_kwargs=dict(
            spec=spec,
            device=cfg.device,
            threads=int(round(cfg.num_cpus)),
            batch_size=cfg.batch_size,
            text_batch_size=cfg.text_batch_size,
            max_text_tokens=cfg.max_text_tokens,
            project_tokens=cfg.project_tokens,
        ),
        total_rows=plan.rows,
    )
    token_dims = dict(dims)
    if cfg.project_tokens:
        token_dims["vision_dim"] = token_dims["text_dim"] = dims["projection_dim"]
    m = writer.finalize(names, extra={"dims": token_dims}, schema=SCHEMA)
    return {
        "samples": m["tables"].get("shards", {}).get("rows", 0),
        "captions": m["tables"].get("captions", {}).get("rows", 0),
        "errors": m["errors"]["rows"],
        "path": str(writer.location),
    }
