"""Detector regions per sample: boxes, scores, labels, ROI features (InfoGround Sec. 2.5) -> `regions`.

``backend: detector`` runs ``models.detector`` (see :mod:`pipeline.models.detector`: torchvision
Faster R-CNN from a local weights file, ``tiny-random``, or detectron2) and keeps the
``max_boxes`` (30, the paper's maximum) top-scoring boxes; ``backend: annotations`` takes the
ground-truth boxes of the samples' ``instances`` table instead and pools the same detector's
box-head features for them (up to ``max_boxes``, in instance order). ``models.detector:
clip-pool:<CLIP folder>`` (``backend: annotations`` only) pools those boxes from a CLIP vision tower's
projected patch grid instead of a detector's box head (the pixels testbed's choice: no detector is
trained here).

``models.detector: scene-oracle`` (the testbed instrument of :mod:`pipeline.models.scene_oracle`,
generated dataset only, ``backend: annotations`` only): each ground-truth box's ROI feature is the
oracle's object vector (colour + shape embedding + the sample's seeded noise) instead of a
detector's box-head output; no detector is loaded.

``backend: sam``: class-agnostic boxes from a segmenter, no ground truth: ``models.sam`` (e.g. the SAM folder
``train run sam-segmenter`` exports) runs its automatic mask generator (:meth:`pipeline.models.sam.SamModel.generate`,
unchanged, with the AMG options of ``stages.extract_visual_tokens``: the same masks that stage's ``segmenter:
sam`` makes); each mask's tight box (x1, y1 exclusive, as the annotations' boxes) is a region, scored by SAM's
predicted IoU, the ``max_boxes`` best kept; ``models.detector`` pools their features (``clip-pool:<CLIP>``:
the trained CLIP's projected patch grid, :mod:`pipeline.models.clip_grid`; any detector's ``pool`` works).

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

from typing import Literal

import numpy as np
from pydantic import Field

from pipeline.models.device import device_field
from pipeline.stage import RunContext, StageConfig, StageError, model_key
from pipeline.stages._image_actor import ImageActor, run_image_stage
from pipeline.stages._image_units import plan_image_units

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
    backend: Literal["detector", "annotations", "sam"] = Field(
        "detector", description="detector boxes, ground-truth boxes from `instances`, or the boxes of models.sam's automatic masks")
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


class RegionWorker(ImageActor):
    """Ray actor: loads the detector once, then finds (or pools) the regions of whole units."""

    def __init__(self, spec: str, device: str, threads: int, batch_size: int, backend: str, max_boxes: int, score_thresh, min_size,
                 sam: str | None = None, amg: dict | None = None):
        self.backend, self.max_boxes, self.score_thresh, self.min_size = backend, max_boxes, score_thresh, min_size
        self.sam_spec, self.amg = sam, amg or {}
        super().__init__(spec, device, threads, batch_size)

    def load(self, spec: str, device: str) -> None:
        from pipeline.models.detector import load_detector
        from pipeline.models.scene_oracle import SceneOracle, is_oracle

        self.oracle = SceneOracle() if is_oracle(spec) else None
        if self.oracle is not None:
            return
        self.det = load_detector(spec, device, score_thresh=self.score_thresh, min_size=self.min_size, max_boxes=self.max_boxes)
        if self.backend == "sam":
            from pipeline.models.sam import SamModel

            self.sam = SamModel(self.sam_spec, device=device)

    def sam_boxes(self, images: list) -> list[tuple[np.ndarray, np.ndarray]]:
        """(boxes [R, 4] xyxy with x1, y1 exclusive, scores [R] decreasing) of each image's automatic masks."""
        enc = self.sam.encode([np.asarray(im.convert("RGB")) for im in images])
        out = []
        for b in range(len(images)):
            g = self.sam.generate(enc.embeddings[b : b + 1], enc.input_sizes[b], enc.original_sizes[b], **self.amg)
            boxes = g["boxes"].numpy().astype(np.float32).reshape(-1, 4) + np.asarray([0, 0, 1, 1], np.float32)
            scores = g["scores"].numpy().astype(np.float32)
            order = np.argsort(-scores, kind="stable")[: self.max_boxes]
            out.append((boxes[order], scores[order]))
        return out

    def encode(self, kept: list[dict], images: list) -> list[dict]:
        """The fields of each image of a batch. An image the model cannot take (e.g. 1x300,
        resized to a zero-width side) raises: the base rejects it alone and retries the batch."""
        results = []
        if self.backend == "detector":
            for im, reg in zip(images, self.det.detect(images)):
                fields = {
                    "boxes.npy": reg.boxes.astype(np.float32),
                    "scores.npy": reg.scores.astype(np.float32),
                    "labels.npy": reg.labels.astype(np.int64),
                    "features.npy": reg.features.astype(np.float16),
                    "image_size.npy": np.asarray(im.size, np.int32),
                }
                results.append(fields)
            return results
        if self.backend == "sam":
            found = self.sam_boxes(images)
            feats = self.det.pool(images, [b for b, _ in found])
            for im, (b, sc), f in zip(images, found, feats):
                results.append({"boxes.npy": b, "scores.npy": sc, "labels.npy": np.full(len(b), -1, np.int64),
                                "features.npy": f.astype(np.float16), "image_size.npy": np.asarray(im.size, np.int32)})
            return results
        gts = [r["instances"] for r in kept]
        boxes = [np.asarray(g["boxes"][: self.max_boxes], np.float32).reshape(-1, 4) for g in gts]
        feats = self._oracle_features(kept, boxes) if self.oracle is not None else self.det.pool(images, boxes)
        for im, g, b, f in zip(images, gts, boxes, feats):
            n = len(b)  # 0 for a sample without annotations: stored with R = 0
            fields = {
                "boxes.npy": b,
                "scores.npy": np.ones(n, np.float32),
                "labels.npy": np.full(n, -1, np.int64),
                "features.npy": f.astype(np.float16),
                "instance_ids.npy": np.asarray(g["instance_ids"][:n], np.int64),
                "categories.json": list(g["categories"][:n]),
                "image_size.npy": np.asarray(im.size, np.int32),
            }
            results.append(fields)
        return results

    def _oracle_features(self, kept: list[dict], boxes: list[np.ndarray]) -> list[np.ndarray]:
        """scene-oracle: each box's feature is its object's vector (the scene's instances, in the
        same instance_id order as the boxes) plus the sample's seeded noise."""
        from pipeline.models.scene_oracle import objects_of

        out = []
        for r, b in zip(kept, boxes):
            objs = objects_of(r["scene"])[: len(b)]
            out.append(self.oracle.object_vectors(objs, self.oracle.sample_rng(r["sample_id"])))
        return out

    def complete(self, done, stats):
        stats["boxes"] = sum(len(f["boxes.npy"]) for _, f in done)
        return done


def run(ctx: RunContext, cfg: Config) -> dict:
    from types import SimpleNamespace

    from pipeline.models.detector import load_detector
    from pipeline.models.provenance import cached_info

    from pipeline.models import scene_oracle

    spec = ctx.manifest.models.detector
    oracle = scene_oracle.is_oracle(spec)
    if oracle:
        scene_oracle.require_generated(ctx.manifest, "detector")
        if cfg.backend != "annotations":
            raise StageError("models.detector: scene-oracle gives features of ground-truth boxes only: "
                             "set stages.extract_regions.backend: annotations")
    if oracle and cfg.backend == "sam":
        raise StageError("models.detector: scene-oracle gives features of ground-truth boxes only: "
                         "set stages.extract_regions.backend: annotations")
    if not oracle and cfg.backend == "detector":
        from pipeline.models.detector import proposes_boxes

        with model_key("models.detector", spec):  # a malformed spec: the same one-line error as a failed load
            if not proposes_boxes(spec):
                raise StageError(f"models.detector: {spec} pools given boxes only: set stages.extract_regions.backend: annotations")
    attach = (("boxes",) if cfg.backend == "annotations" else ()) + (("scene",) if oracle else ())
    plan = plan_image_units(ctx, cfg.shard_size, attach, missing_hint="use backend: detector")

    def probe() -> dict:
        if oracle:
            o = scene_oracle.SceneOracle()
            return {"record": scene_oracle.record("detector", params=o.params(), feature_dim=o.d_v), "dim": o.d_v,
                    "categories": None}
        det = load_detector(spec, score_thresh=cfg.score_thresh, min_size=cfg.min_size, max_boxes=cfg.max_boxes)
        return {"record": det.record, "dim": det.dim, "categories": det.categories}

    with model_key("models.detector", spec):  # cached: a rerun with nothing to do loads no model
        det = SimpleNamespace(**cached_info(ctx.output, "detector", {"detector": spec}, probe, score_thresh=cfg.score_thresh,
                                            min_size=cfg.min_size, max_boxes=cfg.max_boxes))
    records = {"detector": det.record}
    sam_kw = {}
    if cfg.backend == "sam":  # the segmenter's boxes: its record in the fingerprint, the visual-token stage's AMG options
        from pipeline.models.sam import SamModel
        from pipeline.stages.extract_visual_tokens import amg_options

        sspec = ctx.manifest.models.sam
        with model_key("models.sam", sspec):
            records["sam"] = cached_info(ctx.output, "sam", {"sam": sspec}, lambda: {"record": SamModel(sspec).record})["record"]
        sam_kw = dict(sam=sspec, amg=amg_options(ctx.manifest.stages.extract_visual_tokens))
        records["sam"]["amg"] = sam_kw["amg"]
    extra = {"dims": {"feature_dim": det.dim, "max_boxes": cfg.max_boxes}, "backend": cfg.backend, "categories": det.categories}
    m, summary = run_image_stage(
        ctx, cfg, artifact="regions", stage=NAME, plan=plan, actor=RegionWorker, models=records,
        constructor_kwargs=dict(spec=spec, device=cfg.device, batch_size=cfg.batch_size, backend=cfg.backend,
                                max_boxes=cfg.max_boxes, score_thresh=cfg.score_thresh, min_size=cfg.min_size, **sam_kw),
        extra=extra, schema=SCHEMA,
    )
    return {**summary, "boxes": m["stats"].get("boxes", 0)}
