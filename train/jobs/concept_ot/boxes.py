"""Boxes and the CLIP patch grid (Sec. 2.6 box prediction; box-restricted scoring).

CLIP's image processor resizes the shortest edge to the model's input size and centre-crops a
square, so the ``side x side`` patch grid of the ``clip_tokens`` artifact covers the centre square
of side ``min(W, H)`` of the original image: patch (r, c) spans x in
[x0 + c * m / side, x0 + (c + 1) * m / side], y likewise, with m = min(W, H),
x0 = (W - m) / 2, y0 = (H - m) / 2 (pixel coordinates of the original image; patches are
row-major, as the vision tower emits them).

Box prediction from a heatmap h [side * side] (Sec. 2.6: "thresholding the heatmap and taking the
enclosing patch envelope"): keep the patches with h >= threshold * max(h) (threshold 0.5 by
default: the paper gives no value), and predict the smallest box enclosing the kept patches.
"""

from __future__ import annotations

import numpy as np


def patch_edges(width: np.ndarray, height: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(x edges [B, side + 1], y edges [B, side + 1]) of the patch grid in original pixels."""
    w = np.asarray(width, np.float64).reshape(-1)
    h = np.asarray(height, np.float64).reshape(-1)
    m = np.minimum(w, h)
    t = np.arange(side + 1, dtype=np.float64) / side
    xs = ((w - m) / 2)[:, None] + m[:, None] * t[None, :]
    ys = ((h - m) / 2)[:, None] + m[:, None] * t[None, :]
    return xs, ys


def box_patch_mask(boxes: np.ndarray, width: np.ndarray, height: np.ndarray, side: int) -> np.ndarray:
    """bool [B, side * side]: the patches that overlap each box (x0, y0, x1, y1) by a positive area.
    A box overlapping no patch (outside the centre square) keeps the patch nearest to its centre."""
    b = np.asarray(boxes, np.float64).reshape(-1, 4)
    xs, ys = patch_edges(width, height, side)
    col = (xs[:, 1:] > b[:, 0:1]) & (xs[:, :-1] < b[:, 2:3])  # [B, side]
    row = (ys[:, 1:] > b[:, 1:2]) & (ys[:, :-1] < b[:, 3:4])
    mask = (row[:, :, None] & col[:, None, :]).reshape(len(b), side * side)
    empty = ~mask.any(1)
    if empty.any():
        cx, cy = (b[empty, 0] + b[empty, 2]) / 2, (b[empty, 1] + b[empty, 3]) / 2
        mid_x, mid_y = (xs[empty, 1:] + xs[empty, :-1]) / 2, (ys[empty, 1:] + ys[empty, :-1]) / 2
        c = np.abs(mid_x - cx[:, None]).argmin(1)
        r = np.abs(mid_y - cy[:, None]).argmin(1)
        mask[np.flatnonzero(empty), r * side + c] = True
    return mask


def heatmap_boxes(heat: np.ndarray, width: np.ndarray, height: np.ndarray, side: int,
                  threshold: float = 0.5) -> np.ndarray:
    """float [B, 4] predicted boxes: envelope of the patches with heat >= threshold * max(heat) (per
    row); a heatmap that is all zeros / not finite predicts the whole patch grid."""
    h = np.asarray(heat, np.float64).reshape(-1, side, side)
    h = np.where(np.isfinite(h), h, -np.inf)
    mx = h.reshape(len(h), -1).max(1)
    keep = h >= (threshold * mx)[:, None, None]
    flat = ~np.isfinite(mx) | (mx <= 0)
    keep[flat] = True
    rows, cols = keep.any(2), keep.any(1)  # [B, side]
    r0, r1 = rows.argmax(1), side - 1 - rows[:, ::-1].argmax(1)
    c0, c1 = cols.argmax(1), side - 1 - cols[:, ::-1].argmax(1)
    xs, ys = patch_edges(width, height, side)
    i = np.arange(len(h))
    return np.stack([xs[i, c0], ys[i, r0], xs[i, c1 + 1], ys[i, r1 + 1]], 1)


def random_patch_boxes(n: int, width: np.ndarray, height: np.ndarray, side: int, seed: int = 0) -> np.ndarray:
    """A chance baseline: per item, a patch-aligned box with rows r0 <= r1 and columns c0 <= c1 drawn
    uniformly among all such boxes (seeded)."""
    rng = np.random.default_rng(seed)
    pairs = np.array([(a, b) for a in range(side) for b in range(a, side)])
    r = pairs[rng.integers(0, len(pairs), n)]
    c = pairs[rng.integers(0, len(pairs), n)]
    xs, ys = patch_edges(width, height, side)
    i = np.arange(n)
    return np.stack([xs[i, c[:, 0]], ys[i, r[:, 0]], xs[i, c[:, 1] + 1], ys[i, r[:, 1] + 1]], 1)
