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

import numpy as np
from pydantic import Field

from pipeline.models.device import device_field
from pipeline.stage import RunContext, StageConfig, model_key
from pipeline.stages._image_actor import IMAGES_SCHEMA, ImageActor, images_table, run_image_stage
from pipeline.stages._image_units import plan_image_units

NAME = "extract-image-groups"
READS = ["samples"]
WRITES = ["image_groups"]


class Config(StageConfig):
    shard_size: int = Field(1000, ge=1, description="samples per output shard (~10 kB/sample for the released model)")
    batch_size: int = Field(32, ge=1, description="images per forward pass")
    num_cpus: float = Field(1.0, gt=0, description="CPUs per encoder actor (torch threads)")
    device: str = device_field()


SCHEMA = {
    "groups.npy": "float16 [K, d]",
    "groups_projected.npy": "float16 [K, P]",
    "image_embed.npy": "float16 [P]",
    "assign.npy": "float16 [K, N]",
    "images": IMAGES_SCHEMA,
}


def _np16(t) -> np.ndarray:
    return t.detach().float().cpu().numpy().astype(np.float16)


class GroupWorker(ImageActor):
    """Ray actor: loads GroupViT once, then encodes whole units (one output shard each)."""

    def load(self, spec: str, device: str) -> None:
        from pipeline.models.groupvit import load_groupvit

        self.model, self.processor, self.record = load_groupvit(spec, device)

    def prepare(self, images):
        return self.processor(images=images, return_tensors="pt")["pixel_values"]

    def encode(self, records, pixels):
        from pipeline.models.groupvit import encode_groups

        out = {k: _np16(v) for k, v in encode_groups(self.model, pixels).items()}
        return [{f"{k}.npy": v[i] for k, v in out.items()} for i in range(len(records))]

    def tables(self, done, shard):
        return {"images": images_table(done, shard, self.model.config.projection_dim)}


def run(ctx: RunContext, cfg: Config) -> dict:
    from pipeline.models.groupvit import load_groupvit
    from pipeline.models.provenance import cached_info

    spec = ctx.manifest.models.groupvit
    plan = plan_image_units(ctx, cfg.shard_size)
    with model_key("models.groupvit", spec):  # cached: a rerun with nothing to do loads no model
        record = cached_info(ctx.output, "groupvit", {"groupvit": spec}, lambda: load_groupvit(spec)[2])
    dims = {k: record[k] for k in ("image_size", "patch_size", "grid", "n_patches", "n_groups", "group_dim", "projection_dim")}
    _, summary = run_image_stage(
        ctx, cfg, artifact="image_groups", stage=NAME, plan=plan, actor=GroupWorker, models={"groupvit": record},
        constructor_kwargs=dict(spec=spec, device=cfg.device, batch_size=cfg.batch_size), extra={"dims": dims}, schema=SCHEMA,
    )
    return summary
