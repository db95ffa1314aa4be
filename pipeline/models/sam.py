"""Segment Anything (the ``segment-anything`` package): loading, batched encoding, prompting, AMG.

Specs accepted by :func:`load_sam`:

* ``vit_h:/path/sam_vit_h_4b8939.pth`` (also ``vit_l:``, ``vit_b:``): the package's own
  ``sam_model_registry[type](checkpoint=path)`` loader; a bare path whose file name contains
  ``vit_h``/``vit_l``/``vit_b`` works too;
* ``vit_b:random`` (``vit_l:``, ``vit_h:``): that registry model with ``checkpoint=None`` and seeded
  random weights (recorded random; the compatibility matrix, tests/test_compat_matrix.py);
* ``tiny-random``: a SAM of the same architecture built from the package's modules
  (ImageEncoderViT 256 px, patch 16, 64-d, 4 blocks with global attention at 1 and 3, window 4;
  PromptEncoder/MaskDecoder/TwoWayTransformer at width 64) with seeded random weights. SAM
  initialises its absolute position embedding to zeros (a trained checkpoint overwrites it); the
  random model draws it from N(0, 0.02) instead so that its features are not translation invariant;
* a folder with ``sam_config.json`` and ``sam.pth`` (:mod:`pipeline.models.sam_checkpoint`; what ``train run
  sam-segmenter`` exports): segment-anything's ``_build_sam`` with the architecture from the config, the
  weights loaded strictly as the registry loads them; the record says trained here (``random_weights``
  false, ``trained_here``: the job, its data and run folder from ``training.json``).

What this module adds to the package:

* :meth:`SamModel.encode` runs the image encoder on a *batch* of images (the package's predictor
  takes one at a time) and also returns the image feature I of Kalibhat et al. Sec. 4.1: the
  average-pooled output of several encoder layers, concatenated. Default layers: the ViT blocks
  with global attention (SAM's four "stage ends", [7, 15, 23, 31] for vit_h) plus the neck output,
  the closest analogue of "each layer" of SEEM's U-Net-like backbone. Pooling covers only the
  grid cells of the image, not SAM's zero padding.
* :meth:`SamModel.decode` runs the prompt encoder and mask decoder and also returns the mask
  decoder's output *mask token* of each predicted mask (a forward hook on the two-way
  transformer; the token is what the hypernetwork MLP turns into that mask).
* :meth:`SamModel.generate` is the automatic mask generator of ``SamAutomaticMaskGenerator``
  (points grid, predicted-IoU and stability filters, box NMS; one crop layer) on precomputed
  embeddings, keeping each mask's decoder token (``min_mask_region_area``: its small-region clean-up, with scipy in
  place of OpenCV: :func:`pipeline.masks.remove_small_regions`), followed by Relate-Anything's deduplication
  (masks sorted by area, a mask dropped when its IoU with a kept one is > 0.8) and a score
  threshold on the predicted IoU (Kalibhat et al.: 0.9 on the segmenter's score).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.models.provenance import is_tiny_random, model_record, state_dict_hash, weights_hash

RANDOM_SEED = 0
RANDOM_CHECKPOINT = "random"  # models.sam: vit_b:random -- segment-anything's registry model, seeded random weights
TINY = dict(img_size=256, patch=16, dim=64, depth=4, heads=2, global_attn=(1, 3), window=4, prompt_dim=64)
SAM_GLOBAL_ATTN = {"vit_h": [7, 15, 23, 31], "vit_l": [5, 11, 17, 23], "vit_b": [2, 5, 8, 11]}


TINY_ARCH = dict(
    img_size=TINY["img_size"], patch_size=TINY["patch"], encoder_embed_dim=TINY["dim"], encoder_depth=TINY["depth"],
    encoder_num_heads=TINY["heads"], encoder_global_attn_indexes=list(TINY["global_attn"]), window_size=TINY["window"],
    prompt_embed_dim=TINY["prompt_dim"], mask_in_chans=4, decoder_depth=2, decoder_mlp_dim=128, decoder_num_heads=2,
    iou_head_depth=3, iou_head_hidden_dim=64, num_multimask_outputs=3,
    pixel_mean=[123.675, 116.28, 103.53], pixel_std=[58.395, 57.12, 57.375],
)


def build_tiny_sam():
    from pipeline.models.sam_checkpoint import build_sam

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        sam = build_sam(TINY_ARCH)
        torch.nn.init.normal_(sam.image_encoder.pos_embed, std=0.02)
        return sam.eval()


def load_sam(spec: str):
    """(Sam in eval mode, its global-attention block indexes, provenance record) for a ``models.sam`` spec
    (module docstring): ``tiny-random``, a SAM folder (:mod:`pipeline.models.sam_checkpoint`), ``vit_b:random``
    or a released checkpoint through ``sam_model_registry``."""
    from pipeline.models.sam_checkpoint import WEIGHTS, is_sam_folder, load_sam_folder

    if is_tiny_random(spec):
        sam = build_tiny_sam()
        rec = model_record("sam", spec, random_weights=True, weights_sha256=state_dict_hash(sam), seed=RANDOM_SEED)
        return sam, list(TINY["global_attn"]), rec
    if is_sam_folder(spec):
        folder = Path(spec.strip()).expanduser()
        sam, arch, training = load_sam_folder(folder)
        rec = model_record("sam", spec, random_weights=False, weights_sha256=weights_hash([folder / WEIGHTS]),
                           architecture=arch, trained_here={k: training.get(k) for k in ("job", "trained_on", "run_dir",
                                                                                          "weights_state_sha256")})
        return sam, list(arch["encoder_global_attn_indexes"]), rec
    from segment_anything import sam_model_registry

    kind, path = parse_spec(spec)
    global_attn = SAM_GLOBAL_ATTN["vit_h" if kind == "default" else kind]
    if path == RANDOM_CHECKPOINT:  # the released architecture, seeded random weights (sizing, the compatibility matrix)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(RANDOM_SEED)
            sam = sam_model_registry[kind](checkpoint=None).eval()
        return sam, global_attn, model_record("sam", spec, random_weights=True, weights_sha256=None, seed=RANDOM_SEED)
    if not Path(path).is_file():
        raise FileNotFoundError(f"SAM checkpoint {path} not found (models.sam = {spec!r})")
    sam = sam_model_registry[kind](checkpoint=path).eval()
    return sam, global_attn, model_record("sam", spec, random_weights=False, weights_sha256=weights_hash([path]))


def parse_spec(spec: str) -> tuple[str, str]:
    """``"vit_b:path"`` or a path naming its type -> (type, path)."""
    spec = spec.strip()
    m = re.match(r"^(vit_[hlb]|default):(.+)$", spec)
    if m:
        return m.group(1), m.group(2)
    m = re.search(r"vit_[hlb]", Path(spec).name)
    if m:
        return m.group(0), spec
    raise ValueError(f"SAM spec {spec!r}: expected 'tiny-random', a SAM folder (sam_config.json + sam.pth, train run "
                     "sam-segmenter), 'vit_h:/path/ckpt.pth' or a checkpoint named sam_vit_[hlb]_*.pth")


def _select(t: torch.Tensor, multimask: bool) -> torch.Tensor:
    return t[:, 1:] if multimask else t[:, :1]


@dataclass
class Encoded:
    embeddings: torch.Tensor  # [B, C, h, w] neck output (what the mask decoder reads)
    image_features: np.ndarray  # [B, D_I] float32, pooled layers concatenated
    input_sizes: list[tuple[int, int]]  # resized (h, w) before padding
    original_sizes: list[tuple[int, int]]


class SamModel:
    def __init__(self, spec: str, device: str = "cpu", feature_layers: list[int] | None = None):
        self.spec = spec
        self.sam, global_attn, self.record = load_sam(spec)
        self.device = torch.device(device)
        self.sam.to(self.device)
        from segment_anything.utils.transforms import ResizeLongestSide

        enc = self.sam.image_encoder
        self.img_size = enc.img_size
        self.patch = enc.patch_embed.proj.kernel_size[0]
        self.transform = ResizeLongestSide(self.img_size)
        self.feature_layers = list(global_attn if feature_layers is None else feature_layers)
        depth = len(enc.blocks)
        for i in self.feature_layers:
            if not -depth <= i < depth:
                raise ValueError(f"SAM feature layer {i} out of range for a {depth}-block encoder")
        self.embed_dim = enc.neck[0].out_channels  # prompt/decoder width (256 for released SAMs)
        self.token_dim = self.sam.mask_decoder.transformer_dim
        self.image_feature_dim = len(self.feature_layers) * enc.pos_embed.shape[-1] + self.embed_dim
        self.record.update(image_feature_dim=self.image_feature_dim, token_dim=self.token_dim, feature_layers=self.feature_layers)
        self._captured: dict[int, torch.Tensor] = {}
        for i in self.feature_layers:
            enc.blocks[i].register_forward_hook(partial(self._capture, i % depth))
        self._tokens: torch.Tensor | None = None
        self.sam.mask_decoder.transformer.register_forward_hook(self._capture_tokens)

    # ------------------------------------------------------------------ hooks
    def _capture(self, idx, _module, _inp, out):
        self._captured[idx] = out  # [B, h, w, C] (channels last inside the ViT)

    def _capture_tokens(self, _module, _inp, out):
        hs = out[0]
        n = self.sam.mask_decoder.num_mask_tokens
        self._tokens = hs[:, 1 : 1 + n, :]

    # ------------------------------------------------------------------ encoder
    @torch.no_grad()
    def encode(self, images: list[np.ndarray]) -> Encoded:
        """RGB uint8 arrays [H, W, 3] -> embeddings for the whole batch in one encoder call."""
        xs, input_sizes, orig = [], [], []
        for im in images:
            resized = self.transform.apply_image(im)
            input_sizes.append(resized.shape[:2])
            orig.append(im.shape[:2])
            t = torch.as_tensor(resized, device=self.device).permute(2, 0, 1).contiguous()
            xs.append(self.sam.preprocess(t[None].float())[0])  # normalise, pad to img_size
        x = torch.stack(xs)
        self._captured.clear()
        emb = self.sam.image_encoder(x)  # [B, C, h, w]
        depth = len(self.sam.image_encoder.blocks)
        feats = []
        for b, (h, w) in enumerate(input_sizes):
            gh, gw = -(-h // self.patch), -(-w // self.patch)  # grid cells covering the image
            parts = [self._captured[i % depth][b, :gh, :gw, :].mean(dim=(0, 1)) for i in self.feature_layers]
            parts.append(emb[b, :, :gh, :gw].mean(dim=(1, 2)))
            feats.append(torch.cat(parts))
        return Encoded(emb, torch.stack(feats).float().cpu().numpy(), [tuple(s) for s in input_sizes], [tuple(s) for s in orig])

    # ------------------------------------------------------------------ decoder
    @torch.no_grad()
    def decode(self, embedding: torch.Tensor, *, points=None, boxes=None, multimask: bool):
        """Prompt one image's embedding [1, C, h, w]; returns low-res logits [N, K, 4h, 4w],
        predicted IoU [N, K] and the decoder mask tokens [N, K, C] (K = 3 multimask, else 1)."""
        sparse, dense = self.sam.prompt_encoder(points=points, boxes=boxes, masks=None)
        self._tokens = None
        low, iou = self.sam.mask_decoder(
            image_embeddings=embedding,
            image_pe=self.sam.prompt_encoder.get_dense_pe(),
            sparse_prompt_embeddings=sparse,
            dense_prompt_embeddings=dense,
            multimask_output=multimask,
        )
        return low, iou, _select(self._tokens, multimask)

    def upscale(self, low: torch.Tensor, input_size, original_size) -> torch.Tensor:
        """Low-res logits [N, h, w] -> logits at the original image size [N, H, W]."""
        if low.shape[0] == 0:
            return low.new_zeros((0, *original_size))
        return self.sam.postprocess_masks(low[:, None], tuple(input_size), tuple(original_size))[:, 0]

    @torch.no_grad()
    def box_prompts(self, embedding, boxes_xyxy: np.ndarray, input_size, original_size):
        """Masks, IoU and decoder tokens for given boxes (single-mask output, as SAM does for boxes)."""
        if len(boxes_xyxy) == 0:
            z = torch.zeros(0)
            return z.new_zeros((0, *original_size), dtype=torch.bool), z, z.new_zeros((0, self.token_dim))
        b = self.transform.apply_boxes(np.asarray(boxes_xyxy, dtype=np.float64), original_size)
        low, iou, tok = self.decode(embedding, boxes=torch.as_tensor(b, dtype=torch.float, device=self.device), multimask=False)
        masks = self.upscale(low[:, 0], input_size, original_size) > self.sam.mask_threshold
        return masks, iou[:, 0], tok[:, 0]

    # ------------------------------------------------------------------ mask pooling
    @torch.no_grad()
    def mask_pool(self, embedding: torch.Tensor, masks: torch.Tensor, input_size) -> torch.Tensor:
        """Average of the neck features [C, h, w] under each mask ([N, H, W] at original size) -> [N, C].

        The mask is resized as the image was (longest side -> img_size), zero-padded like it and
        area-pooled onto the feature grid, so each feature cell is weighted by the fraction of its
        patch the mask covers. An empty mask gets a zero vector.
        """
        n = masks.shape[0]
        if n == 0:
            return embedding.new_zeros((0, embedding.shape[1]))
        h, w = input_size
        m = F.interpolate(masks[:, None].float(), size=(h, w), mode="area")  # exact coverage fractions
        m = F.pad(m, (0, self.img_size - w, 0, self.img_size - h))
        weights = F.avg_pool2d(m, self.patch)[:, 0]  # [N, gh, gw]
        num = torch.einsum("nhw,chw->nc", weights, embedding[0])
        den = weights.sum(dim=(1, 2)).clamp_min(1e-8)[:, None]
        return num / den

    # ------------------------------------------------------------------ automatic mask generator
    @torch.no_grad()
    def generate(
        self,
        embedding: torch.Tensor,
        input_size,
        original_size,
        *,
        points_per_side: int = 32,
        points_per_batch: int = 64,
        pred_iou_thresh: float = 0.88,
        stability_score_thresh: float = 0.95,
        stability_score_offset: float = 1.0,
        box_nms_thresh: float = 0.7,
        dedup_iou: float = 0.8,
        score_threshold: float = 0.9,
        min_mask_area: int = 1,
        min_mask_region_area: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Automatic masks for one image: masks [N, H, W] bool, boxes [N, 4] xyxy, scores [N]
        (predicted IoU), stability [N], tokens [N, C], ordered by area (largest first)."""
        from segment_anything.utils.amg import batched_mask_to_box, build_point_grid, calculate_stability_score
        from torchvision.ops import batched_nms

        H, W = original_size
        pts = build_point_grid(points_per_side) * np.array([W, H])[None, :]
        keep_masks, keep_iou, keep_stab, keep_tok = [], [], [], []
        thr = self.sam.mask_threshold
        for s in range(0, len(pts), points_per_batch):
            p = pts[s : s + points_per_batch]
            tp = torch.as_tensor(self.transform.apply_coords(p, original_size), dtype=torch.float, device=self.device)
            labels = torch.ones(tp.shape[0], dtype=torch.int, device=self.device)
            low, iou, tok = self.decode(embedding, points=(tp[:, None, :], labels[:, None]), multimask=True)
            low, iou, tok = low.flatten(0, 1), iou.flatten(0, 1), tok.flatten(0, 1)
            ok = iou > pred_iou_thresh if pred_iou_thresh > 0 else torch.ones_like(iou, dtype=torch.bool)
            low, iou, tok = low[ok], iou[ok], tok[ok]
            if low.shape[0] == 0:
                continue
            logits = self.upscale(low, input_size, original_size)
            stab = calculate_stability_score(logits, thr, stability_score_offset)
            ok = stab >= stability_score_thresh if stability_score_thresh > 0 else torch.ones_like(stab, dtype=torch.bool)
            masks = logits[ok] > thr
            keep_masks.append(masks.cpu())
            keep_iou.append(iou[ok].cpu())
            keep_stab.append(stab[ok].cpu())
            keep_tok.append(tok[ok].cpu())
        if not keep_masks:
            return _empty(H, W, self.token_dim)
        masks, iou, stab, tok = (torch.cat(x) for x in (keep_masks, keep_iou, keep_stab, keep_tok))
        area = masks.flatten(1).sum(1)
        ok = area >= max(1, min_mask_area)
        masks, iou, stab, tok, area = masks[ok], iou[ok], stab[ok], tok[ok], area[ok]
        if masks.shape[0] == 0:
            return _empty(H, W, self.token_dim)
        boxes = batched_mask_to_box(masks).float()
        keep = batched_nms(boxes, iou.float(), torch.zeros(len(boxes)), iou_threshold=box_nms_thresh)
        keep = keep[iou[keep] >= score_threshold]
        masks, iou, stab, tok, area, boxes = masks[keep], iou[keep], stab[keep], tok[keep], area[keep], boxes[keep]
        if min_mask_region_area > 0 and masks.shape[0]:
            keep, masks, boxes = _small_regions(masks, min_mask_region_area, box_nms_thresh)
            iou, stab, tok, area = iou[keep], stab[keep], tok[keep], masks.flatten(1).sum(1)
        order = dedup_by_area(masks, area, dedup_iou)
        return {
            "masks": masks[order],
            "boxes": boxes[order],
            "scores": iou[order],
            "stability": stab[order],
            "tokens": tok[order],
        }


def _small_regions(masks: torch.Tensor, min_area: int, nms_thresh: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SamAutomaticMaskGenerator.postprocess_small_regions: fill each mask's holes and drop its islands under
    ``min_area`` pixels, then box NMS preferring the masks left unchanged (score 1, changed 0), as SAM does.
    Returns (indices kept, the cleaned masks kept, their boxes)."""
    from segment_anything.utils.amg import batched_mask_to_box
    from torchvision.ops import batched_nms

    from pipeline.masks import remove_small_regions

    clean, scores = [], []
    for m in masks.cpu().numpy():
        m, holes = remove_small_regions(m, min_area, "holes")
        m, islands = remove_small_regions(m, min_area, "islands")
        clean.append(torch.as_tensor(m))
        scores.append(float(not (holes or islands)))
    clean = torch.stack(clean)
    boxes = batched_mask_to_box(clean).float()
    keep = batched_nms(boxes, torch.as_tensor(scores), torch.zeros(len(clean)), iou_threshold=nms_thresh)
    return keep, clean[keep], boxes[keep]


def _empty(H, W, c):
    return {
        "masks": torch.zeros((0, H, W), dtype=torch.bool),
        "boxes": torch.zeros((0, 4)),
        "scores": torch.zeros(0),
        "stability": torch.zeros(0),
        "tokens": torch.zeros((0, c)),
    }


def mask_iou_matrix(masks: torch.Tensor) -> torch.Tensor:
    """Pairwise IoU of binary masks [N, H, W] -> [N, N] (one matrix product)."""
    flat = masks.flatten(1).float()
    inter = flat @ flat.T
    area = flat.sum(1)
    union = area[:, None] + area[None, :] - inter
    return torch.where(union > 0, inter / union.clamp_min(1), torch.zeros_like(inter))


def dedup_by_area(masks: torch.Tensor, area: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """Relate-Anything's ``sort_and_deduplicate``: sort by area (largest first; ties keep the
    earlier mask first) and drop a mask whose IoU with an already kept one is > threshold.
    Returns indices of the kept masks in that order."""
    n = masks.shape[0]
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    order = torch.as_tensor(np.argsort(-area.cpu().numpy(), kind="stable"))
    iou = mask_iou_matrix(masks[order]).cpu().numpy()
    dup = iou > iou_threshold
    keep = np.zeros(n, dtype=bool)
    for i in range(n):  # greedy and sequential by definition; each step is a vector test
        keep[i] = not (dup[i, :i] & keep[:i]).any()
    return order[torch.as_tensor(keep)]
