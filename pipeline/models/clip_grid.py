"""A CLIP vision tower as a dense feature grid, for the slots whose model is not available here.

``clip-pool:<clip spec>`` (any :func:`pipeline.models.clip.load_clip` spec: a hub-layout folder,
``tiny-random``) can stand in two model slots where no checkpoint is reachable and none is trained
here (issue 36: the pixels testbed trains a CLIP, not a detector or a segmenter):

* ``models.detector`` with ``extract-regions`` ``backend: annotations``: each given box's feature is
  the grid averaged inside the box (:meth:`ClipGrid.roi_pool`; InfoGround's detector features);
* ``models.sam`` with ``extract-visual-tokens`` ``segmenter: annotations, embedding: mask_pool``: each
  ground-truth mask's embedding is the grid averaged under the mask, the image feature I the CLIP's
  image embedding (:class:`ClipMaskEncoder`, the interface the segmenter reads of SAM).
  Masks at the original size and a CLIP at 64 px: the pooling is by area, so a mask's weight per
  patch is the share of that patch it covers.

The boxes and masks are the dataset's ground truth; only the features come from the CLIP. The grid:
the image through the checkpoint's own processor (shortest side resized to the tower's size, centre
crop), the tower's patch tokens after its final layer norm and ``visual_projection`` (the joint
image-text space, ``projection_dim`` wide), in row-major patch order. A box or mask is mapped
through the same resize and crop; a box on patch borders, or a mask that is a union of whole
patches, gets exactly the mean of its patches (tests/test_regions.py, tests/test_visual_tokens_clip.py).
Neither slot can propose instances: the stages refuse ``clip-pool`` without ground truth. Under masks that a
segmenter proposes, the same pooling is ``extract-visual-tokens``' ``embedding: clip_pool`` (``models.sam`` a SAM,
this class built from ``models.clip`` in the ``features`` role).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

PREFIX = "clip-pool"


def is_clip_pool(spec: str | None) -> bool:
    return isinstance(spec, str) and spec.strip().startswith(PREFIX + ":")


def clip_spec_of(spec: str) -> str:
    rest = spec.strip()[len(PREFIX) + 1 :].strip()
    if not rest:
        raise ValueError(f"model spec {spec!r}: expected clip-pool:<CLIP checkpoint folder or preset>")
    return rest


class ClipGrid:
    """Loads the CLIP once; :meth:`grid` gives the projected patch grid and the image embedding."""

    def __init__(self, spec: str, role: str, device: str = "cpu"):
        from pipeline.models import clip as clip_adapter
        from pipeline.models.provenance import model_record

        self.clip, self.processor, _, clip_record = clip_adapter.load_clip(clip_spec_of(spec), device)
        if getattr(self.clip, "is_scene_oracle", False):
            raise ValueError(f"models.{role}: clip-pool:scene-oracle is not a CLIP; use models.{role}: scene-oracle")
        v = self.clip.config.vision_config
        self.image_size, self.patch = int(v.image_size), int(v.patch_size)
        self.g, self.dim = self.image_size // self.patch, int(self.clip.config.projection_dim)
        self.record = model_record(role, spec, random_weights=clip_record["random_weights"],
                                   weights_sha256=clip_record["weights_sha256"], backend=PREFIX, feature_dim=self.dim,
                                   clip=clip_record)

    @torch.no_grad()
    def grid(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """PIL images or RGB uint8 arrays -> (grid [B, D, g, g], image embedding [B, D]), float32."""
        from PIL import Image

        from pipeline.models import clip as clip_adapter

        pil = [im if isinstance(im, Image.Image) else Image.fromarray(np.asarray(im, np.uint8)) for im in images]
        out = clip_adapter.encode_images(self.clip, clip_adapter.preprocess_images(self.processor, pil), project_tokens=True)
        tokens = out["patch_tokens"].float()
        return tokens.transpose(1, 2).reshape(len(pil), -1, self.g, self.g), out["image_embed"].float()

    def frame(self, width: int, height: int) -> tuple[float, int, int, int, int]:
        """The processor's geometry for a ``width`` x ``height`` image: (scale, resized w, resized h, left, top)."""
        s = self.image_size / min(width, height)
        w, h = round(width * s), round(height * s)
        return s, w, h, (w - self.image_size) // 2, (h - self.image_size) // 2

    def crop_boxes(self, boxes: np.ndarray, width: int, height: int) -> np.ndarray:
        """Boxes in original pixels -> pixels of the processor's output, clipped to it."""
        s, _, _, left, top = self.frame(width, height)
        b = np.asarray(boxes, np.float32).reshape(-1, 4) * s - np.asarray([left, top, left, top], np.float32)
        return np.clip(b, 0, self.image_size)

    def roi_pool(self, grid: torch.Tensor, boxes: list[np.ndarray], sizes: list[tuple[int, int]]) -> list[np.ndarray]:
        """Per image, the grid averaged inside each box ([R, D]); ``sizes`` are the images' (width, height)."""
        from torchvision.ops import roi_align

        rois = [torch.as_tensor(self.crop_boxes(b, *wh), device=grid.device) for b, wh in zip(boxes, sizes)]
        if sum(len(r) for r in rois) == 0:
            return [np.zeros((0, self.dim), np.float32) for _ in rois]
        # adaptive sampling (one sample per patch a box spans), aligned: a box on patch borders samples patch centres
        pooled = roi_align(grid, rois, output_size=1, spatial_scale=1.0 / self.patch, sampling_ratio=-1, aligned=True)
        return [f.cpu().numpy() for f in pooled.flatten(1).split([len(r) for r in rois])]

    def mask_weights(self, masks: torch.Tensor) -> torch.Tensor:
        """Masks [N, H, W] at the original size -> the share of each patch they cover [N, g, g] (resized as the
        image was, by area, then centre-cropped)."""
        n, height, width = masks.shape
        _, w, h, left, top = self.frame(width, height)
        m = F.interpolate(masks[:, None].float(), size=(h, w), mode="area")
        m = m[:, :, top : top + self.image_size, left : left + self.image_size]
        return F.avg_pool2d(m, self.patch)[:, 0]

    def pool_masks(self, grid: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
        """One image's grid [D, g, g] averaged under each mask [N, H, W] -> [N, D]; an empty mask (or one outside
        the crop) gets a zero vector."""
        if masks.shape[0] == 0:
            return grid.new_zeros((0, grid.shape[0]))
        weights = self.mask_weights(masks.to(grid.device))
        num = torch.einsum("nhw,chw->nc", weights, grid)
        return num / weights.sum(dim=(1, 2)).clamp_min(1e-8)[:, None]


class ClipMaskEncoder(ClipGrid):
    """What :class:`pipeline.models.segmenter.AnnotationSegmenter` reads of a SAM, from a CLIP: ``encode`` (the
    grid as the "embedding", the image embedding as the image feature I) and ``mask_pool``. Mask-pool embedding
    only: there is no mask decoder to prompt."""

    def __init__(self, spec: str, device: str = "cpu", role: str = "sam"):
        super().__init__(spec, role, device)
        self.record.update(image_feature_dim=self.dim, token_dim=self.dim,
                           tangible="CLIP projected patch grid averaged under the ground-truth mask" if role == "sam"
                           else "CLIP projected patch grid averaged under each mask of the segmenter",
                           image_feature="CLIP image embedding")

    def encode(self, images: list[np.ndarray]):
        from pipeline.models.sam import Encoded

        grid, embed = self.grid(images)
        sizes = [tuple(np.asarray(im).shape[:2]) for im in images]
        return Encoded(grid, embed.cpu().numpy(), sizes, sizes)

    def box_prompts(self, *_a, **_k):
        raise ValueError("models.sam: clip-pool has no mask decoder: set stages.extract_visual_tokens.embedding: mask_pool")

    def mask_pool(self, embedding: torch.Tensor, masks: torch.Tensor, input_size) -> torch.Tensor:
        """SAM's signature: one image's grid [1, D, g, g], masks [N, H, W] at the original size."""
        return self.pool_masks(embedding[0], masks)
