"""Held-out mask recall of a segmenter against ground-truth instance masks, and the no-learning baseline.

Per ground-truth instance its *best IoU*: the largest IoU of any predicted mask of its image with it (0
when the image has no prediction). Reported: **mask recall at IoU 0.5** (the share of instances whose best
IoU is >= 0.5) and **mean best IoU**, each with its 95% interval clustered by image
(:mod:`train.eval.intervals`: Wilson on the effective n for the recall, the cluster bootstrap for the mean),
and the paired difference to the baseline on the same instances. Boxes the same way (box IoU of xyxy
boxes; the regions' **box recall at IoU 0.5**).

Baseline (no learning): connected components of non-background colour. The background colour is the
per-channel median of the image's one-pixel border (the generated scenes place every object inside the
image, at least its radius from the edge, so the border is background; a patterned background varies
around it); a pixel is foreground when its RGB distance from that colour exceeds ``tau``; the components
are ``scipy.ndimage.label`` of the foreground (8-connectivity), those under ``min_area`` pixels dropped.
``tau`` is the one number chosen, on *training* images only (:func:`fit_tau`: the grid value with the
highest mask recall there).
"""

from __future__ import annotations

import numpy as np

TAU_GRID = (10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0, 100.0)


def mask_ious(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """IoU matrix [G, P] of bool masks gt [G, H, W] and pred [P, H, W] (one matrix product)."""
    g = gt.reshape(len(gt), int(np.prod(gt.shape[1:]))).astype(np.float32)
    p = pred.reshape(len(pred), int(np.prod(pred.shape[1:]))).astype(np.float32)
    inter = g @ p.T
    union = g.sum(1)[:, None] + p.sum(1)[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 0.0)


def box_ious(pred: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """IoU matrix [G, P] of xyxy boxes (torchvision.ops.box_iou)."""
    import torch
    from torchvision.ops import box_iou

    if not len(gt) or not len(pred):
        return np.zeros((len(gt), len(pred)))
    return box_iou(torch.as_tensor(np.asarray(gt, np.float64).reshape(-1, 4)),
                   torch.as_tensor(np.asarray(pred, np.float64).reshape(-1, 4))).numpy()


def best_iou(iou: np.ndarray) -> np.ndarray:
    """Per ground-truth row its best IoU over the predictions (0 without any)."""
    return iou.max(1) if iou.shape[1] else np.zeros(iou.shape[0])


def background_colour(image: np.ndarray) -> np.ndarray:
    """Per-channel median of the one-pixel border of an RGB image [H, W, 3]."""
    border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]]).astype(np.float32)
    return np.median(border, axis=0)


def components(image: np.ndarray, tau: float, min_area: int = 16) -> np.ndarray:
    """The baseline's masks [N, H, W] bool: 8-connected components of the pixels farther than ``tau`` (RGB
    distance) from the background colour, each of at least ``min_area`` pixels."""
    from scipy import ndimage

    fg = np.linalg.norm(image.astype(np.float32) - background_colour(image), axis=-1) > tau
    lab, n = ndimage.label(fg, structure=np.ones((3, 3), bool))
    if n == 0:
        return np.zeros((0, *fg.shape), bool)
    areas = np.bincount(lab.ravel(), minlength=n + 1)
    keep = [i for i in range(1, n + 1) if areas[i] >= min_area]
    return lab[None] == np.asarray(keep, lab.dtype)[:, None, None] if keep else np.zeros((0, *fg.shape), bool)


def masks_to_boxes(masks: np.ndarray) -> np.ndarray:
    """Tight xyxy boxes (x1, y1 exclusive) of non-empty bool masks [N, H, W]."""
    out = np.zeros((len(masks), 4), np.float32)
    for k, m in enumerate(masks):
        ys, xs = np.nonzero(m.any(1))[0], np.nonzero(m.any(0))[0]
        if len(ys):
            out[k] = (xs[0], ys[0], xs[-1] + 1, ys[-1] + 1)
    return out


def fit_tau(images: list[np.ndarray], gts: list[np.ndarray], min_area: int = 16, grid=TAU_GRID) -> float:
    """The ``tau`` of :data:`TAU_GRID` with the highest mask recall at 0.5 on these (training) images."""
    def recall(t):
        b = np.concatenate([best_iou(mask_ious(components(im, t, min_area), g)) for im, g in zip(images, gts) if len(g)])
        return float((b >= 0.5).mean())

    scores = [recall(t) for t in grid]
    return float(grid[int(np.argmax(scores))])


def summarize(best: list[np.ndarray], image_ids, prefix: str, baseline: list[np.ndarray] | None = None) -> dict:
    """Recall at 0.5 and mean best IoU (percent) with 95% intervals clustered by image; with ``baseline``
    (the same instances' best IoUs under the baseline) the paired differences."""
    from train.eval.intervals import interval, mean, paired_difference, proportion

    clusters = np.concatenate([np.full(len(b), i) for b, i in zip(best, image_ids)]) if best else np.zeros(0)
    y = np.concatenate(best) if best else np.zeros(0)
    rec, miou = proportion(y >= 0.5, clusters), mean(y, clusters)
    out = {f"{prefix}_instances": int(len(y)), f"{prefix}_images": int(len(best)),
           f"{prefix}_recall50": 100 * rec.value, f"{prefix}_mean_best_iou": 100 * miou.value}
    out[f"{prefix}_recall50_ci"] = list(interval(rec, 100))
    out[f"{prefix}_mean_best_iou_ci"] = list(interval(miou, 100))
    if baseline is not None:
        yb = np.concatenate(baseline) if baseline else np.zeros(0)
        d, lo, hi = paired_difference(rec, proportion(yb >= 0.5, clusters), 100)
        out[f"{prefix}_recall50_minus_baseline"] = [d, lo, hi]
        d, lo, hi = paired_difference(miou, mean(yb, clusters), 100)
        out[f"{prefix}_mean_best_iou_minus_baseline"] = [d, lo, hi]
    return out
