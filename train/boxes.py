"""Box overlap, once for every job and the harness (x0, y0, x1, y1 boxes)."""

from __future__ import annotations

import numpy as np


def _area(x: np.ndarray, plus_one: bool) -> np.ndarray:
    e = 1.0 if plus_one else 0.0
    return np.clip(x[..., 2] - x[..., 0] + e, 0, None) * np.clip(x[..., 3] - x[..., 1] + e, 0, None)


def box_iou(a: np.ndarray, b: np.ndarray, plus_one: bool = False) -> np.ndarray:
    """IoU [len(a), len(b)] of every box of ``a`` against every box of ``b``.

    ``plus_one``: integer-pixel boxes whose corners are both inside (width = x1 - x0 + 1), the
    convention of the InfoGround reference code (and of Detectron/VOC); off: continuous boxes."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    e = 1.0 if plus_one else 0.0
    iw = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]) + e, 0, None)
    ih = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]) + e, 0, None)
    inter = iw * ih
    union = _area(a, plus_one)[:, None] + _area(b, plus_one)[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def box_iou_rows(a: np.ndarray, b: np.ndarray, plus_one: bool = False) -> np.ndarray:
    """Row-wise IoU [B] of a [B, 4] and b [B, 4] (box i of a against box i of b)."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    e = 1.0 if plus_one else 0.0
    iw = np.clip(np.minimum(a[:, 2], b[:, 2]) - np.maximum(a[:, 0], b[:, 0]) + e, 0, None)
    ih = np.clip(np.minimum(a[:, 3], b[:, 3]) - np.maximum(a[:, 1], b[:, 1]) + e, 0, None)
    inter = iw * ih
    union = _area(a, plus_one) + _area(b, plus_one) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)
