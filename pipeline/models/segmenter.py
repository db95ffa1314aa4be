"""Segmenter adapters: images -> tangible instances (masks, boxes, scores, embeddings) + image feature.

Kalibhat et al. use SEEM (not installable from the registries). Here a segmenter is anything
implementing :class:`Segmenter`; two backends exist, and SEEM (or another model) is a new
subclass registered in :data:`SEGMENTERS`:

* ``sam``: SAM's automatic mask generator (:meth:`pipeline.models.sam.SamModel.generate`:
  points grid, predicted-IoU / stability filters, box NMS, RAM's IoU > 0.8 dedup, score
  threshold). Instance score = SAM's predicted IoU.
* ``annotations``: ground-truth masks and boxes of the samples artifact's ``instances`` table
  (COCO instances, the generated dataset). Instance score = 1. SAM still encodes the image,
  because the image feature and the embeddings come from the segmenter's encoder.
* ``models.sam: scene-oracle`` with ``annotations`` (:class:`OracleSegmenter`, the testbed
  instrument of :mod:`pipeline.models.scene_oracle`, generated dataset only): the same
  ground-truth masks and boxes, but no SAM: an instance's embedding is the oracle's object vector
  of that instance (``Ev[colour] + Ev[shape]`` plus noise drawn from ``sample_rng(sample_id)``) and
  the image feature is the oracle's pooled image embedding (a weak bag of the scene's colours and
  shapes plus noise, the one ``extract-clip-tokens`` stores as ``image_embed``).

Embedding of an instance (``embedding`` option):

* ``decoder_token``: SAM's mask-decoder output token of that mask (for ``annotations``: SAM
  prompted with the ground-truth box, single-mask output, as SAM does for box prompts);
* ``mask_pool``: SAM's image-encoder (neck) features averaged under the mask;
* ``clip_pool``: a CLIP's projected patch grid averaged under the mask (``features``, a
  :class:`pipeline.models.clip_grid.ClipMaskEncoder` of ``models.clip``), and the image feature I the
  CLIP's image embedding: the segmenter gives the masks, the CLIP what they contain. SEEM's mask
  embeddings carry the COCO classes it was trained on; a class-agnostic SAM's carry little of what an
  object is, and the token then says where an object is but hardly what (issue 46, docs/jobs/visual-tokens.md).

All three are then mapped to ``width`` (paper: 512) by :func:`pipeline.visual_tokens.project.project`.
The image feature I is SAM's pooled multi-layer encoder feature (see ``pipeline.models.sam``), or with
``clip_pool`` the CLIP's image embedding.
Images are encoded ``batch_size`` at a time in one encoder call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from pipeline.models.sam import SamModel
from pipeline.visual_tokens.project import project


EMBEDDINGS = ("decoder_token", "mask_pool", "clip_pool")


@dataclass
class Segmentation:
    masks: np.ndarray  # [V, H, W] bool
    boxes: np.ndarray  # [V, 4] float32 xyxy, pixels
    scores: np.ndarray  # [V] float32
    embeddings: np.ndarray  # [V, width] float32
    image_feature: np.ndarray  # [D_I] float32
    instance_ids: np.ndarray  # [V] int64 (dataset ids; -1 for predicted instances)
    categories: list = field(default_factory=list)


class Segmenter:
    name = "base"

    def __init__(self, sam: SamModel, *, embedding: str, width: int, seed: int = 0, features=None, **opts):
        if embedding not in EMBEDDINGS:
            raise ValueError(f"embedding must be one of {EMBEDDINGS}, got {embedding!r}")
        if (embedding == "clip_pool") != (features is not None):
            raise ValueError("embedding: clip_pool pools a CLIP's grid: pass features (a ClipMaskEncoder), and only then")
        self.sam, self.embedding, self.width, self.seed, self.opts = sam, embedding, width, seed, opts
        self.features = features

    def segment(self, images: list[np.ndarray], annotations: list[list[dict]] | None = None) -> list[Segmentation]:
        raise NotImplementedError

    def _encode(self, images):
        """(what the segmenter reads, what the embeddings and I are pooled from): one encoder call each per batch,
        one call in all where they are the same model."""
        enc = self.sam.encode(images)
        return enc, (enc if self.features is None or self.features is self.sam else self.features.encode(images))

    def _embed(self, feats, b: int, masks, tokens) -> np.ndarray:
        if self.embedding == "decoder_token":
            vec = tokens
        else:  # mask_pool (SAM's neck) or clip_pool (the CLIP's grid): the features under each mask
            emb = feats.embeddings[b : b + 1]
            vec = (self.features or self.sam).mask_pool(emb, masks.to(emb.device), feats.input_sizes[b])
        return project(vec.float().cpu().numpy().reshape(-1, vec.shape[-1]), self.width, self.seed)


class SamSegmenter(Segmenter):
    name = "sam"

    def segment(self, images, annotations=None):
        enc, feats = self._encode(images)
        out = []
        for b in range(len(images)):
            e = enc.embeddings[b : b + 1]
            g = self.sam.generate(e, enc.input_sizes[b], enc.original_sizes[b], **self.opts)
            v = len(g["scores"])
            out.append(
                Segmentation(
                    masks=g["masks"].numpy(),
                    boxes=g["boxes"].numpy().astype(np.float32),
                    scores=g["scores"].numpy().astype(np.float32),
                    embeddings=self._embed(feats, b, g["masks"], g["tokens"]),
                    image_feature=feats.image_features[b],
                    instance_ids=np.full(v, -1, dtype=np.int64),
                    categories=[None] * v,
                )
            )
        return out


def annotation_masks(rows: list[dict], h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """Ground-truth masks [V, H, W] and boxes [V, 4]; an instance without a mask gets its box filled."""
    from pipeline.masks import rle_decode

    masks = np.zeros((len(rows), h, w), dtype=bool)
    boxes = np.zeros((len(rows), 4), dtype=np.float32)
    for i, r in enumerate(rows):
        boxes[i] = np.asarray(r["box"], dtype=np.float32)
        rle = r.get("mask_rle")
        if rle:
            m = rle_decode(json.loads(rle) if isinstance(rle, str) else rle)
            if m.shape != (h, w):
                raise ValueError(f"instance {r['instance_id']}: mask {m.shape} does not match the image ({h}, {w})")
            masks[i] = m
        else:
            x0, y0, x1, y1 = np.round(boxes[i]).astype(int)
            masks[i, max(y0, 0) : max(y1, 0), max(x0, 0) : max(x1, 0)] = True
    return masks, boxes


class AnnotationSegmenter(Segmenter):
    name = "annotations"

    def segment(self, images, annotations=None):
        if annotations is None:
            raise ValueError("the annotations segmenter needs the samples artifact's instances table")
        enc, feats = self._encode(images)
        out = []
        for b, (im, rows) in enumerate(zip(images, annotations)):
            h, w = im.shape[:2]
            rows = sorted(rows, key=lambda r: r["instance_id"])
            masks, boxes = annotation_masks(rows, h, w)
            e = enc.embeddings[b : b + 1]
            tokens = None
            if self.embedding == "decoder_token":
                _, _, tokens = self.sam.box_prompts(e, boxes, enc.input_sizes[b], enc.original_sizes[b])
            out.append(
                Segmentation(
                    masks=masks,
                    boxes=boxes,
                    scores=np.ones(len(rows), dtype=np.float32),
                    embeddings=self._embed(feats, b, torch.from_numpy(masks), tokens),
                    image_feature=feats.image_features[b],
                    instance_ids=np.array([r["instance_id"] for r in rows], dtype=np.int64),
                    categories=[r.get("category") for r in rows],
                )
            )
        return out


class OracleSegmenter:
    """Ground-truth instances embedded by the scene oracle (``models.sam: scene-oracle``)."""

    name = "annotations"

    def __init__(self, *, width: int, seed: int = 0, oracle=None):
        from pipeline.models.scene_oracle import SceneOracle

        self.oracle = oracle or SceneOracle()
        self.width, self.seed = width, seed

    def segment(self, images, annotations=None, *, scenes=None, sample_ids=None):
        """``annotations``: each image's ``instances`` rows (masks); ``scenes``: its ``scene`` rows
        (category and attributes, same instance ids); ``sample_ids``: the seeds of the noise."""
        from pipeline.models.scene_oracle import objects_of

        if annotations is None or scenes is None or sample_ids is None:
            raise ValueError("the scene-oracle segmenter needs the instances and scene rows and the sample ids")
        o = self.oracle
        out = []
        for im, rows, scene, sid in zip(images, annotations, scenes, sample_ids):
            h, w = im.shape[:2]
            rows = sorted(rows, key=lambda r: r["instance_id"])
            by_id = {int(r["instance_id"]): r for r in scene}
            objs = objects_of([by_id[int(r["instance_id"])] for r in rows])
            masks, boxes = annotation_masks(rows, h, w)
            vec = o.object_vectors(objs, o.sample_rng(int(sid)))
            _, pooled = o.image(objects_of(scene), float(w), float(h), int(sid))
            out.append(
                Segmentation(
                    masks=masks,
                    boxes=boxes,
                    scores=np.ones(len(rows), dtype=np.float32),
                    embeddings=project(vec, self.width, self.seed) if len(rows) else np.zeros((0, self.width), np.float32),
                    image_feature=pooled.astype(np.float32),
                    instance_ids=np.array([r["instance_id"] for r in rows], dtype=np.int64),
                    categories=[r.get("category") for r in rows],
                )
            )
        return out


SEGMENTERS: dict[str, type[Segmenter]] = {"sam": SamSegmenter, "annotations": AnnotationSegmenter}


def make_segmenter(name: str, sam: SamModel, **kw) -> Segmenter:
    if name not in SEGMENTERS:
        raise ValueError(f"unknown segmenter {name!r}; known: {sorted(SEGMENTERS)}")
    return SEGMENTERS[name](sam, **kw)
