"""Frozen GroupViT final-stage image groups per sample (text-groups Sec. 2.1.2, 4.1) -> `image_groups`.

Model: ``models.groupvit`` (HF id/folder, ``tiny-random``, ``base-random``); what is taken is
described in :mod:`pipeline.models.groupvit`. Images are prepared by the model's processor.

Artifact layout (``<output>/image_groups/``)::

    shards/<unit>.tar                   WebDataset, key = sample_id zero-padded to 12 digits
    images/images-<unit>.parquet        sample_id int64, shard string, image_embed list<float16>[P]

Fields of each sample (K final groups, d group width, P joint width, N = h*w patches; ``dims`` in
``_manifest.json`` gives K, d, P, grid [h, w])::

    groups.npy            float16 [K, d]   final group tokens (after the final LayerNorm)
    groups_projected.npy  float16 [K, P]   each group through the visual projection head
    image_embed.npy       float16 [P]      GroupViT's pooled, projected image embedding (not normalised)
    assign.npy            float16 [K, N]   soft patch-to-group assignment (each column sums to 1),
                                           row-major over the [h, w] patch grid
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
from pipeline.stages.extract_clip_tokens import _f16_list

NAME = "extract-image-groups"
READS = ["samples"]
WRITES = ["image_groups"]

SCHEMA = {
    "groups.npy": "float16 [K, d]",
    "groups_projected.npy": "float16 [K, P]",
    "image_embed.npy": "float16 [P]",
    "assign.npy": "float16 [K, N]",
    "images": "sample_id int64, shard string, image_embed list<float16>[P]",
}


class Config(StageConfig):
    shard_size: int = Field(1000, ge=1, description="samples per output shard (~10 kB/sample for the released model)")
    batch_size: int = Field(32, ge=1, description="images per forward pass")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per encoder actor (torch threads)")
    device: str = device_field()


def _np16(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float16)


class GroupWorker:
    def __init__(self, spec: str, device: str, threads: int, batch_size: int):
        import torch

        from pipeline.models.groupvit import load_groupvit

        torch.set_num_threads(max(1, threads))
        self.model, self.processor, self.record = load_groupvit(spec, resolve_device(device))
        self.batch_size = batch_size

    def _decode(self, records):
        kept, images, failed = open_images(records)
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"] if images else None
        return kept, pixels, failed

    def __call__(self, payload: dict) -> dict:
        from pipeline.models.groupvit import encode_groups

        w = unit_writer(payload)
        t_enc = 0.0
        times = {"decode_s": 0.0}
        results = []
        for kept, pixels in decoded_batches(w, unit_records(payload), self.batch_size, self._decode, times):
            t0 = time.perf_counter()
            kept, out = isolate_failures(w, kept, pixels, lambda _r, px: {k: _np16(v) for k, v in encode_groups(self.model, px).items()})
            if out is None:
                continue
            t_enc += time.perf_counter() - t0
            for i, r in enumerate(kept):
                results.append((r["sample_id"], {f"{k}.npy": v[i] for k, v in out.items()}))
        t0 = time.perf_counter()
        path = w.shard_path()
        with ShardWriter(path) as sw:
            for sid, fields in results:
                sw.write(sample_key(sid), fields)
        w.record_shard(path, sw.count)
        p = self.model.config.projection_dim
        emb = np.stack([f["image_embed.npy"] for _, f in results]) if results else np.zeros((0, p), np.float16)
        w.write_table(
            "images",
            pa.table(
                {
                    "sample_id": pa.array([sid for sid, _ in results], pa.int64()),
                    "shard": pa.array([str(path.relative_to(w.dir))] * len(results), pa.string()),
                    "image_embed": _f16_list(emb),
                }
            ),
        )
        t_write = time.perf_counter() - t0
        res = w.commit(
            {"rows": len(results), "rejected": len(w.errors), "decode_s": round(times["decode_s"], 4), "encode_s": round(t_enc, 4), "write_s": round(t_write, 4)}
        )
        return {"unit": res.unit, "stats": res.stats}


def run(ctx: RunContext, cfg: Config) -> dict:
    from pipeline.models.groupvit import load_groupvit
    from pipeline.models.provenance import cached_info

    spec = ctx.manifest.models.groupvit
    plan = plan_image_units(ctx, cfg.shard_size)
    with model_key("models.groupvit", spec):  # cached: a rerun with nothing to do loads no model
        record = cached_info(ctx.output, "groupvit", {"groupvit": spec}, lambda: load_groupvit(spec)[2])
    params = cfg.model_dump(mode="json", exclude={"enabled", "num_cpus", "device"})
    params["limit"] = ctx.limit
    writer = image_writer(ctx, "image_groups", NAME, params, plan, models={"groupvit": record})
    names = run_units(
        ctx,
        writer,
        plan.units,
        GroupWorker,
        split=IMAGE_UNITS,
        actor=True,
        num_cpus=cfg.num_cpus,
        constructor_kwargs=dict(spec=spec, device=cfg.device, threads=int(round(cfg.num_cpus)), batch_size=cfg.batch_size),
        total_rows=plan.rows,
    )
    dims = {k: record[k] for k in ("image_size", "patch_size", "grid", "n_patches", "n_groups", "group_dim", "projection_dim")}
    m = writer.finalize(names, extra={"dims": dims}, schema=SCHEMA)
    return {"samples": m["tables"].get("shards", {}).get("rows", 0), "errors": m["errors"]["rows"], "path": str(writer.location)}
