"""Frozen GroupViT final-stage image groups per sample (text-groups Sec. 2.1.2, 4.1) -> `image_groups`.

Model: ``models.groupvit`` (HF id/folder, ``tiny-random``, ``base-random``); what is taken is
described in :mod:`pipeline.models.groupvit`. Images are prepared by the model's processor.
``scene-oracle`` (the generated dataset only; a testbed instrument, :mod:`pipeline.models.scene_oracle`):
the same fields from the scene's ground truth (:func:`pipeline.models.groupvit.oracle_groups`: one
group per object, background groups of noise, the patch assignment from the object boxes).

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


class OracleGroupWorker(GroupWorker):
    """Ray actor of ``scene-oracle``: the scene's objects (attached ``scene``) become the groups."""

    def load(self, spec: str, device: str) -> None:
        from pipeline.models.scene_oracle import SceneOracle

        self.oracle = SceneOracle()

    def prepare(self, images):
        return [im.size for im in images]

    def encode(self, records, sizes):
        from pipeline.models.groupvit import oracle_groups
        from pipeline.models.scene_oracle import objects_of

        out = []
        for r, (w, h) in zip(records, sizes):
            f = oracle_groups(self.oracle, objects_of(r["scene"]), r.get("width") or w, r.get("height") or h, r["sample_id"])
            out.append({f"{k}.npy": v.astype(np.float16) for k, v in f.items()})
        return out

    def tables(self, done, shard):
        return {"images": images_table(done, shard, self.oracle.proj)}


def _run_oracle(ctx: RunContext, cfg: Config, spec: str) -> dict:
    from pipeline.models import scene_oracle
    from pipeline.models.groupvit import oracle_dims

    scene_oracle.require_generated(ctx.manifest, "groupvit")
    oracle = scene_oracle.SceneOracle()
    plan = plan_image_units(ctx, cfg.shard_size, attach=("scene",))
    dims = oracle_dims(oracle, ctx.manifest.dataset.synthetic.image_size)
    record = scene_oracle.record("groupvit", params=oracle.params(), **dims)
    _, summary = run_image_stage(
        ctx, cfg, artifact="image_groups", stage=NAME, plan=plan, actor=OracleGroupWorker, models={"groupvit": record},
        constructor_kwargs=dict(spec=spec, device=cfg.device, batch_size=cfg.batch_size), extra={"dims": dims}, schema=SCHEMA,
    )
    return summary


def run(ctx: RunContext, cfg: Config) -> dict:
    from pipeline.models.groupvit import load_groupvit
    from pipeline.models.provenance import cached_info
    from pipeline.models.scene_oracle import is_oracle

    spec = ctx.manifest.models.groupvit
    if is_oracle(spec):
        return _run_oracle(ctx, cfg, spec)
    plan = plan_image_units(ctx, cfg.shard_size)
    with model_key("models.groupvit", spec):  # cached: a rerun with nothing to do loads no model
        record = cached_info(ctx.output, "groupvit", {"groupvit": spec}, lambda: load_groupvit(spec)[2])
    dims = {k: record[k] for k in ("image_size", "patch_size", "grid", "n_patches", "n_groups", "group_dim", "projection_dim")}
    _, summary = run_image_stage(
        ctx, cfg, artifact="image_groups", stage=NAME, plan=plan, actor=GroupWorker, models={"groupvit": record},
        constructor_kwargs=dict(spec=spec, device=cfg.device, batch_size=cfg.batch_size), extra={"dims": dims}, schema=SCHEMA,
    )
    return summary
