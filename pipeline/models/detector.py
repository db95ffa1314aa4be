"""Detector adapter: region boxes, scores, labels and ROI features (InfoGround Sec. 2.5).

InfoGround uses "a maximum of 30 top scoring bounding boxes per image with 2048 dimensional
ROI-pooled region features" from a Faster R-CNN. Backends behind one interface,
:class:`RegionExtractor` (``detect(images)`` and ``pool(images, boxes)``):

* ``torchvision`` -- specs ``torchvision:<arch>:<weights file>`` (a torchvision Faster R-CNN
  architecture such as ``fasterrcnn_resnet50_fpn_v2`` and a local state-dict file; no hub),
  ``torchvision:<arch>:random`` (random weights of that size, for benchmarks) and ``tiny-random``
  (``fasterrcnn_mobilenet_v3_large_fpn`` with ``weights=None, weights_backbone=None``, 5 classes,
  128 px input, 150 proposals, seeded). ROI features are the box head's output (TwoMLPHead / conv-fc head,
  1024-d) for the *final* boxes: after detection the features are re-pooled at the returned
  boxes, so each feature row describes exactly the stored box.
* ``detectron2`` -- ``detectron2:<config yaml>:<weights file>``; imported only when used (the GPU
  image installs it). Features from ``roi_heads.box_head`` re-pooled at the final boxes, the
  same contract (e.g. 2048-d for the bottom-up-attention R101-C4 model the paper used).
* ``clip-pool:<clip spec>`` -- no detector: the features of *given* boxes (``backend: annotations``)
  averaged from a CLIP's projected patch grid (:mod:`pipeline.models.clip_grid`). InfoGround's
  detector is not reachable offline and none is trained here (issue 36); this is the stated
  fallback: the boxes are the ground truth, the features a real encoder's. ``detect`` raises.
* ``annotations`` -- not a separate model: :meth:`RegionExtractor.pool` with ground-truth boxes
  gives their features from the same detector's backbone and box head.

Boxes are in original image pixels, ``[x0, y0, x1, y1]``. With random weights a detector's scores
are near uniform over classes, so ``tiny-random`` sets the score threshold to 0 and uses few
classes; otherwise the model's defaults hold (torchvision: 0.05, NMS 0.5).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.models.clip import RANDOM_SEED, _seeded_init
from pipeline.models.clip_grid import PREFIX as CLIP_POOL
from pipeline.models.clip_grid import clip_spec_of
from pipeline.models.provenance import model_record, state_dict_hash, weights_hash

TINY_CLASSES = 5
MAX_BOXES = 30  # InfoGround Sec. 2.5


@dataclass
class Regions:
    boxes: np.ndarray  # float32 [R, 4], original image pixels
    scores: np.ndarray  # float32 [R]
    labels: np.ndarray  # int64 [R]
    features: np.ndarray  # float32 [R, D]


def parse_spec(spec: str) -> tuple[str, str | None, str | None]:
    spec = spec.strip()
    if spec.lower() == "tiny-random":
        return "tiny-random", None, None
    backend, _, rest = spec.partition(":")
    if backend == CLIP_POOL:
        return CLIP_POOL, None, clip_spec_of(spec)
    if backend not in ("torchvision", "detectron2"):
        raise ValueError(f"detector spec {spec!r}: expected tiny-random, torchvision:<arch>:<weights>, "
                         "detectron2:<config>:<weights> or clip-pool:<CLIP folder>")
    arch, _, weights = rest.partition(":")
    return backend, arch or None, weights or None


def load_detector(spec: str, device: str = "cpu", score_thresh: float | None = None, min_size: int | None = None, max_boxes: int = MAX_BOXES):
    backend, arch, weights = parse_spec(spec)
    if backend == CLIP_POOL:
        return ClipRoiExtractor(spec, device)
    if backend == "detectron2":
        return Detectron2Extractor(spec, arch, weights, device, score_thresh, max_boxes)
    return TorchvisionExtractor(spec, arch, weights, device, score_thresh, min_size, max_boxes)


class RegionExtractor:
    dim: int
    record: dict
    categories: list[str] | None = None

    def detect(self, images: list) -> list[Regions]:  # PIL images
        raise NotImplementedError

    def pool(self, images: list, boxes: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError


class TorchvisionExtractor(RegionExtractor):
    def __init__(self, spec, arch, weights, device, score_thresh, min_size, max_boxes):
        import torchvision
        from torchvision.models import detection

        self.max_boxes = max_boxes
        if arch is None:  # tiny-random
            # proposal counts of torchvision's mobilenet "320" low-res preset: the box head runs per proposal
            kwargs = dict(
                weights=None,
                weights_backbone=None,
                num_classes=TINY_CLASSES,
                min_size=128,
                max_size=128,
                rpn_pre_nms_top_n_test=150,
                rpn_post_nms_top_n_test=150,
            )
            kwargs["box_score_thresh"] = 0.0 if score_thresh is None else score_thresh
            self.model = _seeded_init(lambda: detection.fasterrcnn_mobilenet_v3_large_fpn(**kwargs))
            self.record = model_record("detector", spec, random_weights=True, weights_sha256=state_dict_hash(self.model), seed=RANDOM_SEED)
            self.categories = [f"class{i}" for i in range(TINY_CLASSES)]
        else:
            builder = getattr(detection, arch, None)
            if builder is None or not arch.startswith(("fasterrcnn", "maskrcnn", "keypointrcnn")):
                raise ValueError(f"torchvision detector {arch!r}: not a Faster R-CNN family builder in torchvision.models.detection")
            kwargs = dict(weights=None, weights_backbone=None, num_classes=91)
            if score_thresh is not None:
                kwargs["box_score_thresh"] = score_thresh
            if min_size is not None:
                kwargs.update(min_size=min_size)
            self.model = _seeded_init(lambda: builder(**kwargs))
            random = weights in (None, "random")
            if not random:
                state = torch.load(weights, map_location="cpu", weights_only=True)
                self.model.load_state_dict(state.get("model", state) if isinstance(state, dict) else state)
            self.record = model_record(
                "detector", spec, random_weights=random, weights_sha256=state_dict_hash(self.model) if random else weights_hash([weights])
            )
            try:  # COCO names of the torchvision checkpoints (offline metadata)
                self.categories = list(detection.FasterRCNN_ResNet50_FPN_V2_Weights.COCO_V1.meta["categories"])
            except Exception:  # pragma: no cover
                self.categories = None
        self.model.roi_heads.detections_per_img = max(self.model.roi_heads.detections_per_img, max_boxes)
        self.model.eval().to(device)
        self.device = device
        self.dim = self.model.roi_heads.box_head(torch.zeros(1, *self._pool_shape(), device=device)).shape[-1]
        self.record.update(feature_dim=int(self.dim), backend="torchvision", torchvision=torchvision.__version__)

    def _pool_shape(self):
        pool = self.model.roi_heads.box_roi_pool
        size = pool.output_size if isinstance(pool.output_size, (tuple, list)) else (pool.output_size, pool.output_size)
        return (self.model.backbone.out_channels, *size)

    def _prepare(self, images):
        import torchvision.transforms.functional as TF

        tensors = [TF.to_tensor(im).to(self.device) for im in images]
        orig = [t.shape[-2:] for t in tensors]
        image_list, _ = self.model.transform(tensors)
        features = self.model.backbone(image_list.tensors)
        return image_list, features, orig

    def _box_features(self, features, boxes_t: list[torch.Tensor], image_sizes) -> torch.Tensor:
        pooled = self.model.roi_heads.box_roi_pool(features, boxes_t, image_sizes)
        return self.model.roi_heads.box_head(pooled)

    @staticmethod
    def _scale(boxes: torch.Tensor, src, dst) -> torch.Tensor:
        """Boxes from image size ``src`` (h, w) to ``dst`` (h, w)."""
        ry, rx = dst[0] / src[0], dst[1] / src[1]
        return boxes * torch.tensor([rx, ry, rx, ry], dtype=boxes.dtype, device=boxes.device)

    @torch.no_grad()
    def detect(self, images) -> list[Regions]:
        image_list, features, orig = self._prepare(images)
        proposals, _ = self.model.rpn(image_list, features)
        dets, _ = self.model.roi_heads(features, proposals, image_list.image_sizes)
        # keep the top max_boxes (roi_heads already sorted by score after per-class NMS)
        boxes_t = []
        for d in dets:
            order = torch.argsort(d["scores"], descending=True, stable=True)[: self.max_boxes]
            for k in d:
                d[k] = d[k][order]
            boxes_t.append(d["boxes"])
        feats = self._box_features(features, boxes_t, image_list.image_sizes).split([len(b) for b in boxes_t])
        out = []
        for d, f, size_t, size_o in zip(dets, feats, image_list.image_sizes, orig):
            out.append(
                Regions(
                    boxes=self._scale(d["boxes"], size_t, size_o).float().cpu().numpy(),
                    scores=d["scores"].float().cpu().numpy(),
                    labels=d["labels"].cpu().numpy().astype(np.int64),
                    features=f.float().cpu().numpy(),
                )
            )
        return out

    @torch.no_grad()
    def pool(self, images, boxes: list[np.ndarray]) -> list[np.ndarray]:
        """Box-head features of given boxes (original pixels), e.g. ground-truth annotations."""
        image_list, features, orig = self._prepare(images)
        boxes_t = [
            self._scale(torch.as_tensor(np.asarray(b, np.float32).reshape(-1, 4), device=self.device), so, st)
            for b, so, st in zip(boxes, orig, image_list.image_sizes)
        ]
        feats = self._box_features(features, boxes_t, image_list.image_sizes)
        return [f.float().cpu().numpy() for f in feats.split([len(b) for b in boxes_t])]


def proposes_boxes(spec: str) -> bool:
    """False for a backend that only pools given boxes (``clip-pool``)."""
    return parse_spec(spec)[0] != CLIP_POOL


class ClipRoiExtractor(RegionExtractor):
    """Given boxes' features averaged from a CLIP's projected patch grid (:mod:`pipeline.models.clip_grid`)."""

    def __init__(self, spec: str, device: str):
        from pipeline.models.clip_grid import ClipGrid

        self.grid = ClipGrid(spec, "detector", device)
        self.dim, self.record = self.grid.dim, self.grid.record

    def detect(self, images) -> list[Regions]:
        raise ValueError("detector clip-pool pools given boxes only: set stages.extract_regions.backend: annotations")

    def pool(self, images, boxes: list[np.ndarray]) -> list[np.ndarray]:
        grid, _ = self.grid.grid(images)
        return self.grid.roi_pool(grid, boxes, [im.size for im in images])


class Detectron2Extractor(RegionExtractor):  # pragma: no cover - needs detectron2 (GPU image)
    """detectron2 GeneralizedRCNN: final boxes from the standard inference path, features from
    ``roi_heads.box_head`` re-pooled at those boxes (``box_pooler`` on the ``in_features`` maps;
    for Res5ROIHeads the res5 head output averaged, as bottom-up-attention does)."""

    def __init__(self, spec, config, weights, device, score_thresh, max_boxes):
        try:
            from detectron2.checkpoint import DetectionCheckpointer
            from detectron2.config import get_cfg
            from detectron2.modeling import build_model
        except ImportError as e:
            raise RuntimeError("detector backend detectron2 is not installed (it is in the GPU image, docker/)") from e
        if not config or not weights:
            raise ValueError("detectron2 spec: detectron2:<config yaml>:<weights file>")
        cfg = get_cfg()
        cfg.merge_from_file(config)
        cfg.MODEL.WEIGHTS = weights
        cfg.MODEL.DEVICE = device
        if score_thresh is not None:
            cfg.MODEL.ROI_HEADS.SCORE_THRESH_TEST = score_thresh
        cfg.TEST.DETECTIONS_PER_IMAGE = max(cfg.TEST.DETECTIONS_PER_IMAGE, max_boxes)
        self.cfg, self.max_boxes, self.device = cfg, max_boxes, device
        self.model = build_model(cfg).eval()
        DetectionCheckpointer(self.model).load(weights)
        self.record = model_record("detector", spec, random_weights=False, weights_sha256=weights_hash([weights]), backend="detectron2")
        self.dim = None
        self.categories = None

    def _inputs(self, images):
        fmt = self.cfg.INPUT.FORMAT
        from detectron2.data import transforms as T

        aug = T.ResizeShortestEdge([self.cfg.INPUT.MIN_SIZE_TEST] * 2, self.cfg.INPUT.MAX_SIZE_TEST)
        inputs = []
        for im in images:
            arr = np.asarray(im.convert("RGB"))
            if fmt == "BGR":
                arr = arr[:, :, ::-1]
            h, w = arr.shape[:2]
            t = aug.get_transform(arr).apply_image(arr)
            inputs.append({"image": torch.as_tensor(np.ascontiguousarray(t.transpose(2, 0, 1))), "height": h, "width": w})
        return inputs

    def _box_features(self, features, boxes):
        from detectron2.structures import Boxes

        heads = self.model.roi_heads
        feats = [features[f] for f in heads.in_features]
        if hasattr(heads, "box_pooler"):
            x = heads.box_pooler(feats, [Boxes(b) for b in boxes])
            x = heads.box_head(x)
        else:  # Res5ROIHeads
            x = heads._shared_roi_transform(feats, [Boxes(b) for b in boxes])
            x = x.mean(dim=[2, 3])
        return x.split([len(b) for b in boxes])

    @torch.no_grad()
    def detect(self, images) -> list[Regions]:
        inputs = self._inputs(images)
        batched = self.model.preprocess_image(inputs)
        features = self.model.backbone(batched.tensor)
        proposals, _ = self.model.proposal_generator(batched, features, None)
        instances, _ = self.model.roi_heads(batched, features, proposals, None)
        boxes = []
        for inst in instances:
            order = torch.argsort(inst.scores, descending=True)[: self.max_boxes]
            boxes.append(inst.pred_boxes.tensor[order])
            inst._kept = order
        feats = self._box_features(features, boxes)
        out = []
        for inst, b, f, inp, size in zip(instances, boxes, feats, inputs, batched.image_sizes):
            ry, rx = inp["height"] / size[0], inp["width"] / size[1]
            scale = torch.tensor([rx, ry, rx, ry], device=b.device)
            out.append(
                Regions(
                    boxes=(b * scale).float().cpu().numpy(),
                    scores=inst.scores[inst._kept].float().cpu().numpy(),
                    labels=inst.pred_classes[inst._kept].cpu().numpy().astype(np.int64),
                    features=f.float().cpu().numpy(),
                )
            )
        return out

    @torch.no_grad()
    def pool(self, images, boxes):
        inputs = self._inputs(images)
        batched = self.model.preprocess_image(inputs)
        features = self.model.backbone(batched.tensor)
        scaled = []
        for b, inp, size in zip(boxes, inputs, batched.image_sizes):
            ry, rx = size[0] / inp["height"], size[1] / inp["width"]
            scaled.append(torch.as_tensor(np.asarray(b, np.float32).reshape(-1, 4), device=self.device) * torch.tensor([rx, ry, rx, ry], device=self.device))
        return [f.float().cpu().numpy() for f in self._box_features(features, scaled)]
