"""One base for the frozen-image-encoder stages' Ray actors (clip tokens, image groups, regions).

Like datatrove's ``PipelineStep``, :class:`ImageActor` owns what every image stage does the same
way, and a stage keeps only what is its paper's:

* the base loads the model once per actor (torch threads, device), reads the unit's slice
  (:func:`~pipeline.stages._image_units.unit_records`), decodes its images a batch ahead with the
  error policy (an unreadable image is the unit's ``unreadable_image`` error; a sample the model
  fails on is isolated by :func:`pipeline.stage.isolate_failures` and recorded as
  ``model_failed``), writes the unit's WebDataset shard and tables atomically, and commits the
  unit with its counts and timings;
* a stage says how its model is loaded (:meth:`ImageActor.load`), how decoded images become the
  model's input (:meth:`ImageActor.prepare`), the model call on a batch (:meth:`ImageActor.encode`,
  one output per sample), and, when a sample's fields need the whole unit (CLIP's captions are
  encoded across the unit), :meth:`ImageActor.complete`; Parquet tables beside the shard come
  from :meth:`ImageActor.tables`.

:func:`run_image_stage` is the driver side the image stages share: their parameters, the
artifact writer, the actor pool, ``_manifest.json`` and the summary.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import pyarrow as pa

from pipeline.io.wds import ShardWriter, sample_key
from pipeline.models.device import resolve_device
from pipeline.stage import RunContext, isolate_failures, run_units, unit_writer
from pipeline.stages._image_units import IMAGE_UNITS, ImagePlan, decoded_batches, image_writer, open_images, unit_records


def f16_list(arr: np.ndarray) -> pa.Array:
    """Rows of a 2-D array as a Parquet ``list<float16>[width]`` column."""
    arr = np.ascontiguousarray(arr, dtype=np.float16)
    return pa.FixedSizeListArray.from_arrays(pa.array(arr.reshape(-1), type=pa.float16()), arr.shape[1])


IMAGES_SCHEMA = "sample_id int64, shard string, image_embed list<float16>[P]"  # the ``images`` table


def images_table(done: list[tuple[dict, dict]], shard: str, width: int) -> pa.Table:
    """The ``images`` table of a unit: sample_id, its shard, and the sample's ``image_embed.npy``
    (so a global index reads embeddings without opening shards)."""
    emb = np.stack([f["image_embed.npy"] for _, f in done]) if done else np.zeros((0, width), np.float16)
    return pa.table(
        {
            "sample_id": pa.array([r["sample_id"] for r, _ in done], pa.int64()),
            "shard": pa.array([shard] * len(done), pa.string()),
            "image_embed": f16_list(emb),
        }
    )


@contextmanager
def timed(times: dict, key: str):
    """Add the seconds the block takes to ``times[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[key] = times.get(key, 0.0) + time.perf_counter() - t0


class ImageActor:
    """A Ray actor of an image stage: constructed once per actor (model load), called once per
    unit (one output shard). ``encode_stat`` names the model-time entry of the unit's stats."""

    encode_stat = "encode_s"

    def __init__(self, spec: str, device: str, threads: int, batch_size: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.batch_size = batch_size
        self.load(spec, resolve_device(device))

    # --- what a stage says -----------------------------------------------------------------------

    def load(self, spec: str, device: str) -> None:
        """Load the stage's model (once per actor)."""
        raise NotImplementedError

    def prepare(self, images: list):
        """The model's input for a batch of decoded PIL images (default: the images themselves)."""
        return images

    def encode(self, records: list[dict], inputs) -> list:
        """The model call on one batch: one output per record, in order (a sample's fields, unless
        :meth:`complete` makes them). Raising isolates the failing samples."""
        raise NotImplementedError

    def complete(self, done: list[tuple[dict, object]], stats: dict) -> list[tuple[dict, dict]]:
        """``(record, fields)`` of every kept sample of the unit from ``(record, output)``; may add
        to ``stats``. Default: the outputs are the fields."""
        return done

    def tables(self, done: list[tuple[dict, dict]], shard: str) -> dict[str, pa.Table]:
        """Parquet tables written beside the shard (``shard``: its path in the artifact)."""
        return {}

    # --- what every image stage does the same way ------------------------------------------------

    def decode(self, records: list[dict]):
        kept, images, failed = open_images(records)
        return kept, (self.prepare(images) if images else None), failed

    def __call__(self, payload: dict) -> dict:
        w = unit_writer(payload)
        times = {"decode_s": 0.0, self.encode_stat: 0.0}
        done = []
        for kept, inputs in decoded_batches(w, unit_records(payload), self.batch_size, self.decode, times):
            with timed(times, self.encode_stat):
                kept, out = isolate_failures(w, kept, inputs, self.encode)
            if out is not None:
                done.extend(zip(kept, out))
        stats = {"rows": len(done)}
        done = self.complete(done, stats)
        with timed(times, "write_s"):
            path = w.shard_path()
            with ShardWriter(path) as sw:
                for r, fields in done:
                    sw.write(sample_key(r["sample_id"]), fields)
            w.record_shard(path, sw.count)
            for name, table in self.tables(done, str(path.relative_to(w.dir))).items():
                w.write_table(name, table)
        stats["rejected"] = len(w.errors)
        stats.update({k: round(v, 4) for k, v in times.items()})
        res = w.commit(stats)
        return {"unit": res.unit, "stats": res.stats}


def run_image_stage(
    ctx: RunContext, cfg, *, artifact: str, stage: str, plan: ImagePlan, actor: type, models: dict,
    constructor_kwargs: dict, extra: dict | None = None, schema: dict | None = None,
) -> tuple[dict, dict]:
    """Run an image stage's actors over its planned units (``cfg.num_cpus`` each, torch threads to
    match) and write its ``_manifest.json``. Returns the manifest and the summary every image
    stage reports (samples stored, errors, path); the stage adds its own counts."""
    params = cfg.model_dump(mode="json", exclude={"enabled", "num_cpus", "device"})
    for key, default in getattr(cfg, "fingerprint_omits_default", {}).items():
        if params.get(key) == default:  # an option added later: its default leaves earlier artifacts' fingerprints as they were
            params.pop(key)
    params["limit"] = ctx.limit
    writer = image_writer(ctx, artifact, stage, params, plan, models=models)
    names = run_units(
        ctx,
        writer,
        plan.units,
        actor,
        split=IMAGE_UNITS,  # a unit whose worker dies is retried sample by sample (pipeline/crashes.py)
        actor=True,
        num_cpus=cfg.num_cpus,
        constructor_kwargs=dict(constructor_kwargs, threads=int(round(cfg.num_cpus))),
        total_rows=plan.rows,
    )
    m = writer.finalize(names, extra=extra, schema=schema)
    summary = {"samples": m["tables"].get("shards", {}).get("rows", 0), "errors": m["errors"]["rows"], "path": str(writer.location)}
    return m, summary
