"""Detector regions per sample: boxes, scores, labels, ROI features (InfoGround Sec. 2.5) -> `regions`.

``backend: detector`` runs ``models.detector`` (see :mod:`pipeline.models.detector`: torchvision
Faster R-CNN from a local weights file, ``tiny-random``, or detectron2) and keeps the
``max_boxes`` (30, the paper's maximum) top-scoring boxes; ``backend: annotations`` takes the
ground-truth boxes of the samples' ``instances`` table instead and pools the same detector's
box-head features for them (up to ``max_boxes``, in instance order).

Fields of each WebDataset sample (R regions, D feature width, in ``_manifest.json`` ``dims``)::

    boxes.npy         float32 [R, 4]  x0, y0, x1, y1 in original image pixels (float32: fp16
                                      cannot hold pixel coordinates of large images exactly)
    scores.npy        float32 [R]     detection scores, decreasing (annotations: 1.0)
    labels.npy        int64   [R]     detector class index (annotations: -1)
    features.npy      float16 [R, D]  box-head ROI features of exactly these boxes
    instance_ids.npy  int64   [R]     annotations only: the instances' instance_id
    categories.json   list[str]       annotations only: each box's category
    image_size.npy    int32   [2]     width, height of the decoded image

Class names of detector labels, when known, are in ``_manifest.json`` ``categories``.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.io.wds import ShardWriter, sample_key
from pipeline.models.device import device_field, resolve_device
from pipeline.stage import RunContext, StageConfig, isolate_failures, model_key, run_units, unit_writer
from pipeline.stages._image_units import IMAGE_UNITS, decoded_batches, image_writer, open_images, plan_image_units, unit_records

NAME = "extract-regions"
READS = ["samples"]
WRITES = ["regions"]

SCHEMA = {
    "boxes.npy": "float32 [R, 4] (x0, y0, x1, y1 original pixels)",
    "scores.npy": "float32 [R]",
    "labels.npy": "int64 [R]",
    "features.npy": "float16 [R, D]",
    "instance_ids.npy": "int64 [R] (annotations backend)",
    "categories.json": "list[str] [R] (annotations backend)",
    "image_size.npy": "int32 [2] (width, height)",
}


class Config(StageConfig):
    backend: Literal["detector", "annotations"] = Field("detector", description="detector boxes, or ground-truth boxes from `instances`")
    max_boxes: int = Field(30, ge=1, description="InfoGround Sec. 2.5: at most 30 top-scoring boxes per image")
    score_thresh: float | None = Field(None, ge=0, le=1, description="detection score threshold; null: the model's default")
    min_size: int | None = Field(None, ge=32, description="torchvision: shorter side the detector resizes to; null: its default (800)")
    shard_size: int = Field(500, ge=1, description="samples per shard (~60 kB/sample at 30 x 1024 fp16)")
    # 1: a padded batch changes the conv features near the bottom/right image border (torchvision
    # pads images to the batch's largest), so regions would depend on the batch's composition;
    # on CPU batching gains little for a detector.
    batch_size: int = Field(1, ge=1, description="images per detector forward pass")
    num_cpus: float = Field(1.0, gt=0)
    device: str = device_field()


class RegionWorker:
    def __init__(self, spec: str, device: str, threads: int, batch_size: int, backend: str, max_boxes: int, score_thresh, min_size):
        import torch

        from pipeline.models.detector import load_detector

        torch.set_num_threads(max(1, threads))
        self.det = load_detector(spec, resolve_device(device), score_thresh=score_thresh, min_size=min_size, max_boxes=max_boxes)
        self.batch_size, self.backend, self.max_boxes = batch_size, backend, max_boxes

    def _decode(self, records):
        kept, images, failed = open_images(records)
        return kept, images, failed

    def _run(self, kept: list[dict], images: list) -> list[tuple[dict, tuple, dict]]:
        """Regions of one batch: ``(record, image size, fields)`` per image."""
        results = []
        if self.backend == "detector":
            for r, im, reg in zip(kept, images, self.det.detect(images)):
                fields = {
                    "boxes.npy": reg.boxes.astype(np.float32),
                    "scores.npy": reg.scores.astype(np.float32),
                    "labels.npy": reg.labels.astype(np.int64),
                    "features.npy": reg.features.astype(np.float16),
                }
                results.append((r, im.size, fields))
            return results
        gts = [r["instances"] for r in kept]
        boxes = [np.asarray(g["boxes"][: self.max_boxes], np.float32).reshape(-1, 4) for g in gts]
        feats = self.det.pool(images, boxes)
        for r, im, g, b, f in zip(kept, images, gts, boxes, feats):
            n = len(b)  # 0 for a sample without annotations: stored with R = 0
            fields = {
                "boxes.npy": b,
                "scores.npy": np.ones(n, np.float32),
                "labels.npy": np.full(n, -1, np.int64),
                "features.npy": f.astype(np.float16),
                "instance_ids.npy": np.asarray(g["instance_ids"][:n], np.int64),
                "categories.json": list(g["categories"][:n]),
            }
            results.append((r, im.size, fields))
        return results

    def __call__(self, payload: dict) -> dict:
        w = unit_writer(payload)
        t_enc = 0.0
        times = {"decode_s": 0.0}
        results = []
        for kept, images in decoded_batches(w, unit_records(payload), self.batch_size, self._decode, times):
            t0 = time.perf_counter()
            # an image the model cannot take (e.g. 1x300, resized to a zero-width side) is rejected
            # alone: the shared policy retries the batch without it
            kept, out = isolate_failures(w, kept, images, self._run)
            if out is not None:
                results.extend(out)
            t_enc += time.perf_counter() - t0
        t0 = time.perf_counter()
        path = w.shard_path()
        with ShardWriter(path) as sw:
            for r, size, fields in results:
                fields["image_size.npy"] = np.asarray(size, np.int32)
                sw.write(sample_key(r["sample_id"]), fields)
        w.record_shard(path, sw.count)
        t_write = time.perf_counter() - t0
        boxes = sum(len(f["boxes.npy"]) for _, _, f in results)
        res = w.commit(
            {
                "rows": len(results),
                "boxes": boxes,
                "rejected": len(w.errors),
                "decode_s": round(times["decode_s"], 4),
                "encode_s": round(t_enc, 4),
                "write_s": round(t_write, 4),
            }
        )
        return {"unit": res.unit, "stats": res.stats}


def run(ctx: RunContext, cfg: Config) -> dict:
    from types import SimpleNamespace

    from pipeline.models.detector import load_detector
    from pipeline.models.provenance import cached_info

    spec = ctx.manifest.models.detector
    plan = plan_image_units(ctx, cfg.shard_size, ("boxes",) if cfg.backend == "annotations" else (),
                            missing_hint="use backend: detector")
    def probe() -> dict:
        det = load_detector(spec, score_thresh=cfg.score_thresh, min_size=cfg.min_size, max_boxes=cfg.max_boxes)
        return {"record": det.record, "dim": det.dim, "categories": det.categories}

    with model_key("models.detector", spec):  # cached: a rerun with nothing to do loads no model
        det = SimpleNamespace(**cached_info(ctx.output, "detector", {"detector": spec}, probe, score_thresh=cfg.score_thresh,
                                            min_size=cfg.min_size, max_boxes=cfg.max_boxes))
    params = cfg.model_dump(mode="json", exclude={"enabled", "num_cpus", "device"})
    params["limit"] = ctx.limit
    writer = image_writer(ctx, "regions", NAME, params, plan, models={"detector": det.record})
    names = run_units(
        ctx,
        writer,
        plan.units,
        RegionWorker,
        split=IMAGE_UNITS,
        actor=True,
        num_cpus=cfg.num_cpus,
        constructor_kwargs=dict(
            spec=spec,
            device=cfg.device,
            threads=int(round(cfg.num_cpus)),
            batch_size=cfg.batch_size,
            backend=cfg.backend,
            max_boxes=cfg.max_boxes,
            score_thresh=cfg.score_thresh,
            min_size=cfg.min_size,
        ),
        total_rows=plan.rows,
    )
    extra = {"dims": {"feature_dim": det.dim, "max_boxes": cfg.max_boxes}, "backend": cfg.backend, "categories": det.categories}
    m = writer.finalize(names, extra=extra, schema=SCHEMA)
    return {
        "samples": m["tables"].get("shards", {}).get("rows", 0),
        "boxes": m["stats"].get("boxes", 0),
        "errors": m["errors"]["rows"],
        "path": str(writer.location),
    }
