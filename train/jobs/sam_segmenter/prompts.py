"""Prompt simulation of SAM's training (Kirillov et al. 2023, App. A "Training algorithm"), for one image's
instances at once (``masks`` [K, H, W] bool, numpy; coordinates (x, y) in the model's input pixels).

* the first prompt of each mask: with probability ``box_prob`` (SAM: 1/2) its box, else one foreground point
  drawn uniformly from the mask. The box is the mask's tight box (x0, y0, x1 + 1, y1 + 1) with each coordinate
  moved by Gaussian noise of standard deviation ``box_noise_frac`` (SAM: 10%) of the box's side, clipped to
  ``box_noise_max`` pixels (SAM: 20 px at 1024; the option is in this model's input pixels) and to the image;
* each later point: drawn uniformly from the *error region* of the previous prediction (false negatives and
  false positives together); a foreground point (label 1) when it falls in a false negative, a background
  point (label 0) in a false positive. A prediction with no error adds a padding point (label -1, SAM's
  "not a point" embedding), so every prompt of a round has the same number of points.
"""

from __future__ import annotations

import numpy as np


def mask_boxes(masks: np.ndarray) -> np.ndarray:
    """Tight boxes [K, 4] (x0, y0, x1 + 1, y1 + 1) of non-empty masks [K, H, W]."""
    ys = masks.any(2)
    xs = masks.any(1)
    out = np.zeros((len(masks), 4), np.float32)
    for k in range(len(masks)):
        y, x = np.nonzero(ys[k])[0], np.nonzero(xs[k])[0]
        out[k] = (x[0], y[0], x[-1] + 1, y[-1] + 1)
    return out


def uniform_pixel(region: np.ndarray, rng: np.random.Generator) -> tuple[float, float] | None:
    """A pixel (x, y) drawn uniformly from a bool [H, W] region; None when it is empty."""
    idx = np.flatnonzero(region)
    if not len(idx):
        return None
    i = int(idx[rng.integers(len(idx))])
    return float(i % region.shape[1]), float(i // region.shape[1])


def noisy_boxes(boxes: np.ndarray, rng: np.random.Generator, frac: float, max_px: float, size: tuple[int, int]) -> np.ndarray:
    """Each coordinate + N(0, (frac * side)^2), the noise clipped to +-max_px, the box to the image (H, W)."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    side = np.stack([w, h, w, h], 1)
    noise = np.clip(rng.normal(0.0, 1.0, b.shape) * frac * side, -max_px, max_px)
    out = b + noise
    H, W = size
    out[:, [0, 2]] = np.clip(out[:, [0, 2]], 0, W)
    out[:, [1, 3]] = np.clip(out[:, [1, 3]], 0, H)
    x0, x1 = np.minimum(out[:, 0], out[:, 2]), np.maximum(out[:, 0], out[:, 2])
    y0, y1 = np.minimum(out[:, 1], out[:, 3]), np.maximum(out[:, 1], out[:, 3])
    return np.stack([x0, y0, x1, y1], 1).astype(np.float32)


def first_prompts(masks: np.ndarray, rng: np.random.Generator, box_prob: float, box_noise_frac: float,
                  box_noise_max: float) -> dict:
    """``{"is_box": bool [K], "points": float32 [K, 1, 2], "boxes": float32 [K, 4]}``: each mask's first
    prompt (a point for ``~is_box``, a noisy box for ``is_box``; the other field is unused for it)."""
    K = len(masks)
    is_box = rng.random(K) < box_prob
    points = np.zeros((K, 1, 2), np.float32)
    for k in range(K):
        points[k, 0] = uniform_pixel(masks[k], rng)
    boxes = noisy_boxes(mask_boxes(masks), rng, box_noise_frac, box_noise_max, masks.shape[1:])
    return {"is_box": is_box, "points": points, "boxes": boxes}


def error_points(pred: np.ndarray, masks: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One new point per mask from the error region of ``pred`` (bool [K, H, W]) against ``masks``:
    (points float32 [K, 2], labels int64 [K]: 1 in a false negative, 0 in a false positive, -1 no error)."""
    K = len(masks)
    pts = np.zeros((K, 2), np.float32)
    lab = np.full(K, -1, np.int64)
    for k in range(K):
        fn = masks[k] & ~pred[k]
        p = uniform_pixel(fn | (pred[k] & ~masks[k]), rng)
        if p is None:
            continue
        pts[k] = p
        lab[k] = 1 if fn[int(p[1]), int(p[0])] else 0
    return pts, lab
